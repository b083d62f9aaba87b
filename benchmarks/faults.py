"""Fault injection and soak on the GPU: nothing lost, nothing silent, serving never crashes.

Usage (from the repo root, on a CUDA machine)::

    PYTHONPATH=src python3 benchmarks/faults.py --out DIR [--quick] [--commit SHA]

What it does, in this order (the one check that could corrupt this process's CUDA context runs
last):

1. **Tactic faults in subprocess mode.** Tunes a Triton "scale by 2" op whose tactics include
   good kernels and deliberately faulting ones: a store with a huge offset (illegal address, a
   sticky CUDA error), ``tl.device_assert`` on an always-false condition (device-side assert; needs
   Triton's ``debug=True``), a tactic that hangs (killed at the per-tactic timeout), one that exits
   the worker, and one that raises. Tuning must complete, pick a good tactic and blocklist the
   crashing/hanging ones in the saved cache file, which ``cache verify`` must accept.
2. **Out of memory while capturing one size.** A graph runner whose step asks for far more memory
   than the GPU has at one capture size: the other sizes must replay correctly and ``release()``
   must return the reserved memory to the level before capture (within 2 MiB).
3. **A cache writer killed mid-save** (a child process ``os._exit`` s between the complete
   temporary file and the rename): the old file must load intact.
4. **Soak.** 20,000 decode steps (2,000 with ``--quick``) of the reference engine's ``tiny`` model
   (float32) with the live batch size drawn at random from 1..16 every step, through a
   ``CUDAGraphRunner`` and through an eager reference fed the same inputs padded exactly as the
   graph sees them. Every step's greedy tokens are compared on the device; the mismatch counter
   is read every 1,000 steps (no per-step host sync). Bounds: 0 token mismatches; reserved memory
   grows by at most max(1% of the post-warm-up value, 2 MiB) after 10% of the steps; the runner's
   ``replays + eager_calls == calls == steps``.
5. **Blocklist in a fresh in-process tuner**: loads the cache file and tunes the same runner in
   *this* process; every blocklisted tactic must be skipped (running the illegal-address one here
   would corrupt the context, which the final synchronize would reveal).

Writes ``faults-<gpu>.json`` (counts: faults injected, survived, entries lost, soak steps,
mismatches, memory growth; provenance) into ``--out``, prints a table, ends with one JSON line.
Exit 0 when every check passes and the result is in ``--out``, 1 otherwise (a failed check, or
the result went to the temporary folder), 2 without CUDA or for an ``--out`` that cannot be
written (checked before the checks run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningCache,
    TuningConfig,
    TuningPolicy,
    autotune,
    persist,
)
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.maintenance import verify_file
from graphtune.bench import gpu_slug, provenance, require_cuda_or_exit, write_json
from graphtune.cli._args import (
    Parser,
    check_script_output,
    non_negative_float,
    positive_int,
    report_written,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # reported by main(); the module must stay importable in the worker
    triton = None

MIB = 1 << 20

if triton is not None:

    @triton.jit
    def _scale_kernel(x_ptr, out_ptr, n, offset, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask)
        # offset is 0 for good tactics and ~2**40 elements for the illegal-address one.
        tl.store(out_ptr + idx + offset, x * 2.0, mask=mask)

    def _assert_body(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0)
        tl.device_assert(x != x, "graphtune fault injection: device-side assert")
        tl.store(out_ptr + idx, x * 2.0, mask=mask)

    try:  # device_assert only fires in debug mode
        _assert_kernel = triton.jit(debug=True)(_assert_body)
    except TypeError:
        _assert_kernel = triton.jit(_assert_body)

GOOD = [{"kernel": "scale", "block": 256}, {"kernel": "scale", "block": 1024}]
FAULTS = {
    "illegal address": {"kernel": "oob", "block": 256},
    "device assert": {"kernel": "assert", "block": 256},
    "hang": {"kernel": "hang"},
    "exit": {"kernel": "exit"},
    "raise": {"kernel": "raise"},
}
BLOCKLISTABLE = ("illegal address", "device assert", "hang", "exit")


class FaultyScale(TunableRunner):
    """``out = 2 * x`` with good and deliberately faulting tactics (module level: picklable)."""

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return [*GOOD, *FAULTS.values()]

    def forward(self, inputs: list, tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        x = inputs[0]
        if tactic == FALLBACK_TACTIC:
            return x * 2.0
        kind = tactic["kernel"]
        if kind == "hang":
            time.sleep(3600)
        if kind == "exit":
            os._exit(13)
        if kind == "raise":
            raise ValueError("this tactic refuses every shape")
        out = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, tactic["block"]),)
        if kind == "assert":
            _assert_kernel[grid](x, out, n, BLOCK=tactic["block"])
        else:
            offset = (1 << 40) if kind == "oob" else 0
            _scale_kernel[grid](x, out, n, offset, BLOCK=tactic["block"])
        return out


CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1024,)),), max_value=1024)


def tactic_faults(out: Path, device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Check 1: subprocess isolation survives every faulting tactic."""
    path = out / "faults-cache.json"
    path.unlink(missing_ok=True)
    x = torch.randn(1024, 1024, device=device)
    tuner = AutoTuner(
        isolation=Isolation("subprocess", timeout_s=timeout_s), policy=TuningPolicy(rounds=2)
    )
    start = time.perf_counter()
    # tune=True: this must tune; GRAPHTUNE_CACHE_ONLY (meant for serving) would make it look-ups.
    with autotune(path, tuner=tuner, tune=True):
        runner, tactic = tuner.choose_one("faults.scale", [FaultyScale()], CONFIG, [x])
    seconds = time.perf_counter() - start
    blocked = {json.dumps(b.tactic, sort_keys=True): b.reason for b in tuner.cache.blocklist()}
    outcome = {}
    for name, bad in FAULTS.items():
        reason = blocked.get(json.dumps(bad, sort_keys=True))
        outcome[name] = {"blocklisted": reason is not None, "reason": reason}
    report = verify_file(path)
    in_file = persist.load_file(path, strict=True)
    good_pick = tactic in GOOD or tactic == FALLBACK_TACTIC
    torch.testing.assert_close(runner.forward([x], tactic), x * 2.0)
    required = ("illegal address", "hang", "exit")
    ok = (
        good_pick
        and all(outcome[name]["blocklisted"] for name in required)
        and not outcome["raise"]["blocklisted"]
        and report.ok
        and len(in_file.blocklist) == len(tuner.cache.blocklist())
    )
    return {
        "ok": ok,
        "seconds": seconds,
        "pick": tactic,
        "faults": outcome,
        "device_assert_fired": outcome["device assert"]["blocklisted"],
        "failures": dict(tuner.stats.tactic_failures),
        "workers_started": tuner.stats.workers_started,
        "entries_tuned": len(tuner.cache),
        "entries_in_file": len(in_file.entries),
        "verify_problems": report.problems,
        "cache_file": str(path),
    }


def capture_oom(device: torch.device) -> dict[str, Any]:
    """Check 2: out of memory while capturing one size."""
    from graphtune.graphs import CUDAGraphRunner

    total = torch.cuda.get_device_properties(device).total_memory
    weight = torch.randn(256, 256, device=device)

    def step(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8 and torch.cuda.is_current_stream_capturing():
            torch.empty(2 * total, dtype=torch.uint8, device=device)  # cannot fit
        return torch.tanh(x @ weight)

    def cycle(fn: Any) -> tuple[list[int], list[Any], float]:
        runner = CUDAGraphRunner(fn, max_batch_size=16, capture_sizes=[1, 4, 8, 16], device=device)
        runner.capture(torch.randn(16, 256, device=device))
        captured = sorted(size for _, size in runner.captured_keys)
        failed = [r for r in runner.stats.records if not r.ok]
        max_err = 0.0
        for n in (1, 3, 4, 7, 12, 16):  # 7 pads to 8, the failed size: runs eagerly
            x = torch.randn(n, 256, device=device)
            max_err = max(max_err, (runner(x) - torch.tanh(x @ weight)).abs().max().item())
        runner.release()
        return captured, failed, max_err

    # One identical cycle without the fault first: the first GEMM on the capture stream and on
    # the default stream each allocate a cuBLAS workspace (32 MiB each on an H200) that torch
    # keeps for the process. That is not memory the runner failed to release.
    cycle(lambda x: torch.tanh(x @ weight))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    captured, failed, max_err = cycle(step)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved(device)
    ok = captured == [1, 4, 16] and len(failed) == 1 and max_err < 1e-4
    ok = ok and after - before <= 2 * MIB
    return {
        "ok": ok,
        "captured": captured,
        "failed_error": failed[0].error if failed else None,
        "max_abs_err": max_err,
        "reserved_before_mib": before / MIB,
        "reserved_after_release_mib": after / MIB,
    }


def _dying_writer(path: str) -> None:
    from graphtune.autotuner import CacheEntry, CacheKey, TuningCache, persist

    persist._after_temp_write = lambda tmp: os._exit(9)
    cache = TuningCache()
    cache.put(
        CacheKey("new", ("m.R",), ((1,),), ("float32",), "graph"), CacheEntry("m.R", 0, 1, 1.0, 1.0)
    )
    cache.save(path)


def killed_writer(out: Path) -> dict[str, Any]:
    """Check 3: a writer dying between temp write and rename leaves the old file intact."""
    path = out / "faults-cache.json"
    before = path.read_bytes()
    entries = len(persist.load(path, strict=True))
    proc = multiprocessing.get_context("spawn").Process(target=_dying_writer, args=(str(path),))
    proc.start()
    proc.join(300)
    after = persist.load(path, strict=True)
    lost = max(0, entries - len(after))
    ok = proc.exitcode == 9 and path.read_bytes() == before and lost == 0
    return {"ok": ok, "exitcode": proc.exitcode, "entries": entries, "lost": lost}


def soak(device: torch.device, steps: int, max_batch: int = 16, seed: int = 0) -> dict[str, Any]:
    """Check 4: graph runner vs eager reference for ``steps`` decode steps."""
    from graphtune.engine import Engine, load_model

    model = load_model("tiny", device=device, dtype=torch.float32, seed=seed)
    seq = 256
    graph = Engine(model, runner="graph", max_batch_size=max_batch, max_seq_len=seq)
    eager = Engine(model, runner="eager", max_batch_size=max_batch, max_seq_len=seq)
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(seed)
    last = torch.randint(0, vocab, (max_batch,), device=device, generator=gen)
    pos = torch.zeros(max_batch, dtype=torch.long, device=device)
    slots = torch.arange(max_batch, device=device)
    mismatches = torch.zeros((), dtype=torch.long, device=device)
    rng = random.Random(seed)
    warm = max(1, steps // 10)
    warm_reserved = warm_allocated = 0
    checks = []
    start = time.perf_counter()
    for i in range(steps):
        b = rng.randint(1, max_batch)
        tokens, positions, rows = last[:b], pos[:b], slots[:b]
        logits = graph.step(tokens, positions, rows)
        picked = logits.argmax(dim=-1)  # before the next replay overwrites the view
        padded, n, _ = graph.runner.padded_inputs(tokens, positions, rows)
        reference = eager.step(*padded)[:n].argmax(dim=-1)
        mismatches += (picked != reference).sum()
        last[:b] = reference
        nxt = pos[:b] + 1
        pos[:b] = torch.where(nxt >= seq, torch.zeros_like(nxt), nxt)  # wrap: a new request
        if i + 1 == warm:
            torch.cuda.synchronize(device)
            warm_reserved = torch.cuda.memory_reserved(device)
            warm_allocated = torch.cuda.memory_allocated(device)
        if (i + 1) % 1000 == 0 or i + 1 == steps:
            checks.append((i + 1, int(mismatches.item())))  # the periodic host read
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    growth = reserved - warm_reserved
    bound = max(0.01 * warm_reserved, 2 * MIB)
    stats = graph.stats
    consistent = stats.calls == steps and stats.replays + stats.eager_calls == steps
    result = {
        "ok": checks[-1][1] == 0 and growth <= bound and consistent,
        "steps": steps,
        "seconds": seconds,
        "us_per_step": 1e6 * seconds / steps,
        "mismatches": checks[-1][1],
        "mismatch_checks": checks[:: max(1, len(checks) // 10)],
        "reserved_after_warmup_mib": warm_reserved / MIB,
        "reserved_end_mib": reserved / MIB,
        "reserved_growth_mib": growth / MIB,
        "reserved_growth_bound_mib": bound / MIB,
        "allocated_growth_mib": (allocated - warm_allocated) / MIB,
        "runner_calls": stats.calls,
        "replays": stats.replays,
        "eager_calls": stats.eager_calls,
        "stats_consistent": consistent,
    }
    graph.release()
    return result


def blocklist_in_process(path: Path, device: torch.device, expected: int) -> dict[str, Any]:
    """Check 5: a fresh in-process tuner skips every blocklisted tactic."""
    cache = TuningCache()
    cache.load(path, strict=True)
    tuner = AutoTuner(cache=cache, policy=TuningPolicy(rounds=1))
    tuner.tuning_mode = True
    x = torch.randn(1024, 1024, device=device)
    _, tactic = tuner.choose_one("faults.scale.again", [FaultyScale()], CONFIG, [x])
    torch.cuda.synchronize(device)  # raises if a faulting tactic ran here after all
    skipped = tuner.stats.tactics_blocked
    return {"ok": skipped == expected, "skipped": skipped, "expected": expected, "pick": tactic}


def seconds(text: str) -> float:
    """``argparse`` type of ``--timeout``: a finite number of seconds > 0 (what ``Isolation``
    takes; it would refuse another only once the checks began)."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0 seconds, got 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--quick", action="store_true", help="2,000 soak steps instead of 20,000")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="soak steps, overriding --quick (default: 20,000, or 2,000 with --quick)",
    )
    parser.add_argument("--timeout", type=seconds, default=30.0, help="per-tactic timeout (s)")
    args = parser.parse_args(argv)
    device = require_cuda_or_exit("faults.py")
    if triton is None:
        print("error: faults.py needs triton for the faulting kernels", file=sys.stderr)
        return 2
    steps = args.steps or (2_000 if args.quick else 20_000)
    gpu_name = torch.cuda.get_device_name(device)
    target = args.out / f"faults-{gpu_slug(gpu_name)}.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"faults: tactic faults, capture OOM, killed writer, {steps}-step soak on {gpu_name}")
    # The cache file the checks write and kill writers over is scratch, not a result.
    work = Path(tempfile.mkdtemp(prefix="graphtune-faults-"))

    checks: dict[str, Any] = {}
    checks["tactic_faults"] = tactic_faults(work, device, args.timeout)
    checks["capture_oom"] = capture_oom(device)
    checks["killed_writer"] = killed_writer(work)
    checks["soak"] = soak(device, steps)
    expected = sum(1 for f in checks["tactic_faults"]["faults"].values() if f["blocklisted"])
    checks["blocklist_in_process"] = blocklist_in_process(
        work / "faults-cache.json", device, expected
    )

    tf = checks["tactic_faults"]
    # A tactic fault counts as injected when it happened (device_assert needs Triton's debug mode)
    # and as survived when tuning went on to a good pick with the fault handled as documented:
    # blocklisted if it crashed, hung or broke the context; counted but not blocklisted if it
    # only raised.
    injected = survived = 0
    for name, fault in tf["faults"].items():
        if name == "device assert" and not fault["blocklisted"]:
            continue  # did not fire here: not injected
        injected += 1
        handled = fault["blocklisted"] if name in BLOCKLISTABLE else not fault["blocklisted"]
        survived += int(handled and tf["ok"])
    injected += 2  # capture OOM, killed writer
    survived += int(checks["capture_oom"]["ok"]) + int(checks["killed_writer"]["ok"])
    lost = max(0, tf["entries_tuned"] - tf["entries_in_file"]) + checks["killed_writer"]["lost"]
    passed = all(c["ok"] for c in checks.values()) and lost == 0
    summary = {
        "faults_injected": injected,
        "faults_survived": survived,
        "entries_lost": lost,
        "soak_steps": checks["soak"]["steps"],
        "soak_mismatches": checks["soak"]["mismatches"],
        "soak_reserved_growth_mib": checks["soak"]["reserved_growth_mib"],
        "soak_us_per_step": checks["soak"]["us_per_step"],
        "device_assert_fired": tf["device_assert_fired"],
    }
    rows = [(k, "ok" if v["ok"] else "FAIL") for k, v in checks.items()]
    rows += [(k, v) for k, v in summary.items()]
    width = max(len(str(k)) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    payload = {
        "benchmark": "faults",
        "pass": passed,
        "summary": summary,
        "checks": checks,
        "provenance": provenance(args.commit, device),
    }
    path = write_json(target, payload)  # target, or the fallback file it went to instead
    print(json.dumps({"faults": summary, "pass": passed, "json": str(path)}))
    # Exit 1 also when the result went to the temporary folder: no file at target for a script.
    return 0 if report_written("--out", target, path) and passed else 1


if __name__ == "__main__":
    sys.exit(main())
