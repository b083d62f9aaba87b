"""Triton compiles in worker processes (graphtune.ops._compile_pool), with the interpreter off.

Triton compiles for a GPU target without a GPU: the code generator, LLVM and ``ptxas`` (shipped
with Triton) all run on the CPU. Only the question "which GPU is this" needs a driver, so each
child process here installs a driver that answers it (an sm_90 target, device 0, stream 0) and
nothing else; the compiles, the worker processes, Triton's on-disk cache and the loads from it
are the real ones. Nothing is launched.

Each child compiles the same GEMM tactics in a fresh Triton cache: once with worker processes,
once with threads only (``GRAPHTUNE_COMPILE_PROCESSES=0``). With workers, this process must not
run Triton's code generator at all (it loads every binary from the on-disk cache), and the
binaries must be exactly those it compiles by itself. The wall times of both are printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Evaluated in a worker process: the torch and graphtune modules it has loaded.
LOADED_IN_WORKER = (
    "sorted(m for m in __import__('sys').modules if m.split('.')[0] in ('torch', 'graphtune'))"
)
NICENESS = "__import__('os').nice(0)"


def child(rows: list[int], k: int, n: int, device: str = "cpu", ahead: bool = False) -> dict:
    """In a fresh process without TRITON_INTERPRET: compile the one-kernel (no split-K) GEMM
    tactics of ``[m, k] x [n, k]`` for each ``m`` of ``rows`` up front (``prepare_all``), on the
    CPU through the target-only driver, or with ``device="cuda"`` through Triton's own driver.
    With ``ahead``, ``prepare_ahead`` hands them to the workers first and ``prepare_all`` then
    waits for those binaries."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compiler
    from triton.runtime.driver import driver

    class TargetOnlyDriver:  # what the JIT asks before it compiles; launching is never asked
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    if device == "cpu":
        driver.set_active(TargetOnlyDriver())
    generated = []
    make_ir = compiler.ASTSource.make_ir

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        generated.append(self.name)
        return make_ir(self, *args, **kwargs)

    compiler.ASTSource.make_ir = counting
    from graphtune.ops import _compile_pool
    from graphtune.ops.gemm import TritonGemmRunner

    runner = TritonGemmRunner(min_rows=1, compile_workers=2)
    work = []
    for m in rows:
        a = torch.zeros(m, k, dtype=torch.bfloat16, device=device)
        w = torch.zeros(n, k, dtype=torch.bfloat16, device=device)
        inputs = [a, w, None, None, False]
        work.append((inputs, [t for t in runner.tactics_for(inputs) if t["split_k"] == 1]))
    start = time.perf_counter()
    handed_over = runner.prepare_ahead(work) if ahead else None
    ahead_jobs = len(_compile_pool._AHEAD)
    runner.prepare_all(work)
    seconds = time.perf_counter() - start
    errors = [
        str(e) for inputs, tactics in work for e in runner.precompile(inputs, tactics).values() if e
    ]
    generated_by_precompile = len(generated)
    launchers_built_here = None
    if device == "cuda":  # the first launch loads the binary and its host launcher
        from triton.runtime import build

        builds = []
        real_build = build._build

        def counting_build(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            builds.append(name)
            return real_build(name, *args, **kwargs)

        build._build = counting_build
        try:
            inputs, tactics = work[0]
            runner.forward(inputs, tactic=tactics[0])
            torch.cuda.synchronize()
        finally:
            build._build = real_build
        launchers_built_here = len(builds)
    # Jobs a worker cannot do come back as failures (the caller then compiles in-process).
    bogus = [
        _compile_pool.CompileJob("no.such.module", "kernel", {}, {}, {}, {}, None, str(i))
        for i in range(_compile_pool.MIN_JOBS_TO_START)
    ]
    failed = _compile_pool.compile_in_workers(bogus).failed
    pool = _compile_pool._pool(start=False)
    worker_modules = [] if pool is None else pool.submit(eval, LOADED_IN_WORKER).result()
    worker_niceness = None if pool is None else pool.submit(eval, NICENESS).result()
    log = _compile_pool.job_log()
    _compile_pool.close_compile_workers()
    # While one thread captures, another thread's compile is its own (compiled, not captured).
    from graphtune.ops.activation import TritonSiluAndMulRunner

    def silu() -> None:
        TritonSiluAndMulRunner().launch(
            [torch.zeros(2, 64)], {"block": 32, "warps": 1}, warmup=True
        )

    before = len(generated)
    with _compile_pool.capturing() as captured:
        other = threading.Thread(target=silu)
        other.start()
        other.join()
    silu_compiled_alone = len(generated) - before == 1 and captured == []
    cache = Path(triton.knobs.cache.dir)
    cubins = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in cache.rglob("*.cubin"))
    return {
        "errors": errors,
        "binaries": runner.compiled,
        "seconds": seconds,
        "generated_here": generated_by_precompile,
        "compiled_in_workers": runner.compiled_in_workers,
        "pool_enabled": _compile_pool.enabled(),
        "bogus_failed": failed,
        "silu_compiled_alone": silu_compiled_alone,
        "cubins": cubins,
        "worker_modules": worker_modules,
        "worker_niceness": worker_niceness,
        "niceness": os.nice(0),
        "job_log": [
            [r.kind, r.name, r.error is None, r.finished >= r.started, r.pid != os.getpid()]
            for r in log
        ],
        "worker_launchers": sorted({str(r.launcher) for r in log if r.kind == "compile"}),
        "launchers_built_here": launchers_built_here,
        "handed_over": handed_over,
        "ahead_jobs": ahead_jobs,
        "ahead_left": len(_compile_pool._AHEAD),
    }


def run_child(
    tmp_path: Path,
    processes: int,
    rows: list[int],
    k: int,
    n: int,
    device: str = "cpu",
    ahead: bool = False,
) -> dict:
    """:func:`child` in a fresh process with its own Triton cache and worker count."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        TRITON_CACHE_DIR=str(tmp_path / f"triton-{processes}-{ahead}"),
        GRAPHTUNE_COMPILE_PROCESSES=str(processes),
    )
    code = (
        "import json, sys; sys.path.insert(0, 'tests/cpu'); import test_compile_pool as t; "
        f"print(json.dumps(t.child({rows!r}, {k}, {n}, {device!r}, {ahead!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_workers_compile_and_this_process_only_loads_the_same_binaries(tmp_path) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.knobs")
    pooled = run_child(tmp_path, 2, [16], 64, 64)
    if not pooled["pool_enabled"]:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook (Triton < 3.4)")
    alone = run_child(tmp_path, 0, [16], 64, 64)
    assert pooled["errors"] == [] and alone["errors"] == []
    count = pooled["binaries"]
    assert alone["binaries"] == count >= 4  # one kernel per tactic (no split-K reduction)
    assert pooled["generated_here"] == 0  # every binary came from a worker, via the disk cache
    assert pooled["compiled_in_workers"] == count
    assert alone["generated_here"] == count and alone["compiled_in_workers"] == 0
    assert pooled["cubins"] == alone["cubins"] and len(alone["cubins"]) == count + 1  # + SiLU
    assert pooled["bogus_failed"] == 4 and alone["bogus_failed"] == 0  # no workers: not tried
    assert pooled["silu_compiled_alone"] and alone["silu_compiled_alone"]
    # A worker loads the kernel module from its file: neither torch nor graphtune.ops (whose
    # __init__ imports torch and every op) is imported there.
    loaded = pooled["worker_modules"]
    assert "graphtune.ops._kernels" in loaded and "graphtune._compile_worker" in loaded
    assert "torch" not in loaded and "graphtune.ops" not in loaded, loaded
    # The job log has one record per job the workers did (the GEMM binaries, then the bogus
    # jobs, which failed), each timed in a worker process.
    log = pooled["job_log"]
    assert [r[:3] for r in log if r[0] == "compile" and r[2]] == [
        ["compile", "gemm_kernel", True]
    ] * count
    assert sum(1 for r in log if r[0] == "compile" and not r[2]) == 4
    assert all(r[3] and r[4] for r in log) and alone["job_log"] == []
    # Workers compile at a lower CPU priority than the process that times kernels meanwhile.
    from graphtune._compile_worker import WORKER_NICENESS

    expected = min(19, pooled["niceness"] + WORKER_NICENESS)
    assert pooled["worker_niceness"] == expected > pooled["niceness"] or pooled["niceness"] == 19
    print(
        f"\n{count} GEMM binaries (sm_90, CPU): threads {alone['seconds']:.2f} s, "
        f"2 worker processes {pooled['seconds']:.2f} s (including their start)"
    )


def test_binaries_handed_over_ahead_are_waited_for_not_compiled_again(tmp_path) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.knobs")
    ahead = run_child(tmp_path, 2, [16], 64, 64, ahead=True)
    if not ahead["pool_enabled"]:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook (Triton < 3.4)")
    count = ahead["binaries"]
    assert ahead["handed_over"] is True and ahead["ahead_jobs"] == count >= 4
    assert ahead["errors"] == [] and ahead["generated_here"] == 0  # loaded, never generated
    assert ahead["compiled_in_workers"] == count  # prepare_all waited for the same jobs
    assert ahead["ahead_left"] == 0  # close_compile_workers forgets them
    alone = run_child(tmp_path, 0, [16], 64, 64, ahead=True)
    assert alone["handed_over"] is False and alone["ahead_jobs"] == 0  # no workers: up front
    assert alone["binaries"] == count and alone["generated_here"] == count


@pytest.mark.parametrize("value", ["x", "-1", "\u00b2"])
def test_a_compile_processes_value_that_is_not_a_count_is_named(monkeypatch, value) -> None:
    from graphtune import env
    from graphtune.errors import ConfigError

    monkeypatch.setenv("GRAPHTUNE_COMPILE_PROCESSES", value)
    with pytest.raises(ConfigError, match=f"GRAPHTUNE_COMPILE_PROCESSES={value!r}: must be"):
        env.compile_processes()
    monkeypatch.setenv("GRAPHTUNE_COMPILE_PROCESSES", "3")
    assert env.compile_processes() == 3


def test_a_pool_broken_before_the_batch_is_dropped_and_the_batch_compiled_here(monkeypatch):
    # A worker died while warming up: submit raises BrokenProcessPool. That pool was kept (and
    # compile workers were off for the rest of the process, with no word).
    from concurrent.futures.process import BrokenProcessPool

    from graphtune._compile_worker import CompileJob
    from graphtune.ops import _compile_pool

    class BrokenPool:
        shut = False

        def submit(self, *args, **kwargs):
            raise BrokenProcessPool("a worker died")

        def shutdown(self, **kwargs):
            self.shut = True

    broken = BrokenPool()
    monkeypatch.setattr(_compile_pool, "enabled", lambda: True)
    monkeypatch.setattr(_compile_pool, "_POOL", broken)
    jobs = [CompileJob("m", f"k{i}", {}, {}, {}, {}, None, f"id{i}") for i in range(4)]
    report = _compile_pool.compile_in_workers(jobs)
    assert report.compiled == 0  # the caller compiles them in-process
    assert broken.shut and _compile_pool._POOL is None  # a later batch starts fresh workers


# -- a worker that hangs --------------------------------------------------------------------------

# A kernel module whose import never ends in a worker (as a stuck code generator would): it
# writes the worker's pid to the file named after it, then sleeps far longer than any timeout.
HANGING_MODULE = "import os, time\nopen(__file__ + '.pid', 'w').write(str(os.getpid()))\n"
HANGING_MODULE += "time.sleep(300)\n"


def hanging_and_bogus_jobs(tmp_path: Path, tag: str) -> list:
    """One job whose worker hangs, then three that fail at once (no such module)."""
    from graphtune._compile_worker import CompileJob

    module = tmp_path / f"hanging_{tag}.py"
    module.write_text(HANGING_MODULE)
    hanging = CompileJob(
        f"hanging_{tag}", "kernel", {}, {}, {}, {}, None, f"hang-{tag}", str(module)
    )
    bogus = [
        CompileJob("no.such.module", "kernel", {}, {}, {}, {}, None, f"{tag}-{i}") for i in range(3)
    ]
    return [hanging, *bogus]


def use_workers_on_the_cpu(monkeypatch) -> None:
    """Worker processes on this CPU-only, interpreted test machine: no job here needs a GPU."""
    from graphtune.ops import _compile_pool, _triton

    monkeypatch.setenv("GRAPHTUNE_COMPILE_PROCESSES", "2")
    monkeypatch.setattr(_triton, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(_compile_pool, "_has_target", lambda: True)
    monkeypatch.setattr(_compile_pool, "_knobs", lambda: SimpleNamespace())  # no cache dir
    monkeypatch.setattr(_compile_pool, "_LAUNCHERS", set())
    monkeypatch.setattr(_compile_pool, "_BROKEN", None, raising=False)  # reset after the test


def test_a_hung_worker_times_out_breaks_the_pool_and_later_batches_compile_here(
    tmp_path, monkeypatch, caplog
) -> None:
    # A worker stuck in a job hung the tuning process for good: compile_in_workers waited for
    # every job without a limit (and so did closing the pool, and interpreter exit).
    pytest.importorskip("triton")
    from graphtune.ops import _compile_pool

    use_workers_on_the_cpu(monkeypatch)
    monkeypatch.setenv("GRAPHTUNE_COMPILE_TIMEOUT", "2")
    assert _compile_pool.enabled()
    jobs = hanging_and_bogus_jobs(tmp_path, "a")
    try:
        # Workers that have started (a loaded machine may take longer than the timeout to start
        # them), so that only the hanging job can time out.
        warmed = len(_compile_pool.job_log()) + _compile_pool.compile_processes()
        assert _compile_pool.start_compile_workers()
        deadline = time.monotonic() + 60
        while len(_compile_pool.job_log()) < warmed and time.monotonic() < deadline:
            time.sleep(0.05)
        with caplog.at_level("WARNING", logger=_compile_pool.__name__):
            started = time.monotonic()
            report = _compile_pool.compile_in_workers(jobs)
            seconds = time.monotonic() - started
        # The 2 s without progress, far below the default 300 s.
        assert seconds < 30 and _compile_pool.compile_timeout() == 2.0, seconds
        assert (report.jobs, report.compiled, report.failed, report.timed_out) == (4, 0, 4, 1)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("1 of 4 Triton compile jobs did not finish")
        assert "GRAPHTUNE_COMPILE_TIMEOUT" in warnings[0] and "in-process" in warnings[0]
        # The hung worker was killed (and reaped), not waited for; the pool is marked broken.
        pid = int((tmp_path / "hanging_a.py.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert _compile_pool.broken() is not None and not _compile_pool.enabled()
        assert _compile_pool._pool(start=False) is None
        # Later batches start no workers: the caller compiles them in-process (it compiles
        # every job in-process after the workers anyway, the timed-out ones included).
        later = hanging_and_bogus_jobs(tmp_path, "b")
        report = _compile_pool.compile_in_workers(later)
        assert (report.compiled, report.failed, report.timed_out) == (0, 0, 0)
        assert _compile_pool.compile_ahead(later) == 0
        assert _compile_pool.start_compile_workers() is False
        assert _compile_pool._pool(start=True) is None
        assert not (tmp_path / "hanging_b.py.pid").exists()
    finally:
        _compile_pool.close_compile_workers(grace_s=0.0)


# A kernel module whose import takes 1.5 s in a worker (a slow compile): the job then fails
# (no such kernel), which still is a job of the pool that finished.
SLOW_MODULE = "import time\ntime.sleep(1.5)\n"


def test_a_batch_behind_a_busy_pool_is_not_taken_for_a_hung_one(tmp_path, monkeypatch) -> None:
    # The timeout watched only the batch's own jobs: a batch queued behind jobs handed over
    # ahead that kept the one worker busy for longer than GRAPHTUNE_COMPILE_TIMEOUT (each
    # finishing well within it) was declared hung, and the healthy pool killed and disabled.
    pytest.importorskip("triton")
    from graphtune._compile_worker import CompileJob
    from graphtune.ops import _compile_pool

    use_workers_on_the_cpu(monkeypatch)
    monkeypatch.setenv("GRAPHTUNE_COMPILE_PROCESSES", "1")
    monkeypatch.setenv("GRAPHTUNE_COMPILE_TIMEOUT", "2")
    ahead = []
    for i in range(4):
        module = tmp_path / f"slow_{i}.py"
        module.write_text(SLOW_MODULE)
        ahead.append(
            CompileJob(f"slow_{i}", "kernel", {}, {}, {}, {}, None, f"slow-{i}", str(module))
        )
    batch = [
        CompileJob("no.such.module", "kernel", {}, {}, {}, {}, None, f"q-{i}") for i in range(2)
    ]
    try:
        warmed = len(_compile_pool.job_log()) + 1
        assert _compile_pool.start_compile_workers()
        deadline = time.monotonic() + 60
        while len(_compile_pool.job_log()) < warmed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _compile_pool.compile_ahead(ahead) == 4
        started = time.monotonic()
        report = _compile_pool.compile_in_workers(batch)
        seconds = time.monotonic() - started
        # Waited the 6 s of work ahead (three times the timeout), then got both results.
        assert seconds > 4, seconds
        assert (report.jobs, report.compiled, report.failed, report.timed_out) == (2, 0, 2, 0)
        assert _compile_pool.broken() is None and _compile_pool.enabled()
        assert _compile_pool._pool(start=False) is not None
        names = [result.name for result in _compile_pool.job_log()[-6:]]
        assert names == ["kernel"] * 6, names
    finally:
        _compile_pool.close_compile_workers(grace_s=0.0)


def test_a_runner_compiles_in_process_once_the_pool_is_broken(monkeypatch) -> None:
    pytest.importorskip("triton")
    import torch

    from graphtune.ops import _compile_pool
    from graphtune.ops.activation import TritonSiluAndMulRunner

    monkeypatch.setattr(_compile_pool, "_usable_here", lambda: True)
    monkeypatch.setattr(_compile_pool, "_BROKEN", "2 compile job(s) got no result within 1 s")
    runner = TritonSiluAndMulRunner()
    assert runner.prepare_ahead([([torch.zeros(2, 64)], [{"block": 32, "warps": 1}])]) is False
    inputs = [torch.zeros(4, 64)]
    tactics = [{"block": 32, "warps": 1}, {"block": 64, "warps": 1}]
    assert all(error is None for error in runner.precompile(inputs, tactics).values())
    assert runner.compiled_in_workers == 0 and _compile_pool._pool(start=False) is None


def test_interpreter_exit_does_not_wait_for_a_hung_worker(tmp_path) -> None:
    # The pool's jobs were joined at exit (concurrent.futures joins its pools before atexit
    # runs): a job handed over ahead that hung kept the process from ever exiting.
    pytest.importorskip("triton")
    module = tmp_path / "hanging_exit.py"
    module.write_text(HANGING_MODULE)
    code = f"""
import sys, time
from pathlib import Path
from types import SimpleNamespace
from graphtune.ops import _compile_pool, _triton
from graphtune._compile_worker import CompileJob
_triton.kernels_interpreted = lambda: False
_compile_pool._has_target = lambda: True
_compile_pool._knobs = lambda: SimpleNamespace()
job = CompileJob("hanging_exit", "kernel", {{}}, {{}}, {{}}, {{}}, None, "hang", {str(module)!r})
assert _compile_pool.compile_ahead([job]) == 1
pid_file = Path({str(module)!r} + ".pid")
while not pid_file.exists():  # the worker is in the job
    time.sleep(0.05)
print("exiting", flush=True)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), GRAPHTUNE_COMPILE_PROCESSES="1")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr[-4000:]
    assert seconds < 60, seconds  # the worker's start, then CLOSE_GRACE_S, then the kill
    pid = int((tmp_path / "hanging_exit.py.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("value", ["x", "0", "-1", "nan", "inf", "\u00b2", "1e999"])
def test_a_compile_timeout_that_is_not_a_positive_number_is_named(monkeypatch, value) -> None:
    from graphtune import env
    from graphtune.errors import ConfigError
    from graphtune.ops import _compile_pool

    monkeypatch.setenv("GRAPHTUNE_COMPILE_TIMEOUT", value)
    with pytest.raises(ConfigError, match=f"GRAPHTUNE_COMPILE_TIMEOUT={value!r}: must be"):
        env.compile_timeout()
    monkeypatch.setenv("GRAPHTUNE_COMPILE_TIMEOUT", " 2.5 ")
    assert env.compile_timeout() == 2.5 == _compile_pool.compile_timeout()
    monkeypatch.delenv("GRAPHTUNE_COMPILE_TIMEOUT")
    assert env.compile_timeout() is None
    assert _compile_pool.compile_timeout() == _compile_pool.COMPILE_TIMEOUT_S == 300.0
