"""Fault injection into tuning: tactics that raise, hang, crash or break the context, timers that
return garbage, and the blocklist that keeps a crashing tactic from being retried.

Subprocess tests start real ``spawn`` workers (about 3 s each on CPU), so the crash, hang and
blocklist checks share one tuning run.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
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
from graphtune.autotuner import isolation as iso
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.isolation import Isolation, check_time
from graphtune.autotuner.timing.base import Measurement
from graphtune.errors import ConfigError, TuningError

CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
INPUTS = [torch.ones(4, 2)]


class CostRunner(TunableRunner):
    """Module level (picklable). A tactic is a cost in us, or the name of a fault."""

    def __init__(self, tactics: list[Any]) -> None:
        self.tactics = tactics

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return list(self.tactics)

    def forward(self, inputs: list, tactic: Any = FALLBACK_TACTIC) -> Any:
        if tactic == "raise":
            raise RuntimeError("this tactic does not support the shape")
        if tactic in ("typeerror", "typeerror too"):
            raise TypeError("this shape needs a float16 input")
        if tactic == "exit":
            os._exit(7)
        if tactic == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if tactic == "hang":
            time.sleep(600)
        if isinstance(tactic, str) and tactic.startswith("time="):
            return float(tactic[5:])  # the timer reports this number verbatim (garbage times)
        return 50.0 if tactic == FALLBACK_TACTIC else float(tactic)


class ReportTimer:
    """Picklable timer: reports what ``fn`` returns, so tests choose each tactic's time."""

    name = "report"

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        value = fn(0)
        return Measurement(value, value, 0.0, 1, repeat, self.name)


class NoneTimer:
    name = "report"

    def measure(self, fn, *, warmup: int, repeat: int) -> Any:
        fn(0)
        return None


def tune(tactics: list[Any], **kwargs: Any) -> tuple[AutoTuner, tuple]:
    kwargs.setdefault("timer", ReportTimer())
    tuner = AutoTuner(**kwargs, policy=TuningPolicy(rounds=1, remeasure_top=0))
    tuner.tuning_mode = True
    try:
        runner = CostRunner(tactics)
        pick = tuner.choose_one("op", [runner], CONFIG, INPUTS)
    finally:
        tuner.close()
    return tuner, pick


# ---------------------------------------------------------------- garbage from the timer


@pytest.mark.parametrize("garbage", ["nan", "inf", "-inf", "-3", "0", "-0.0"])
def test_garbage_times_are_failures_never_picks(garbage: str, caplog) -> None:
    caplog.set_level(logging.WARNING)
    # The garbage tactic is listed first, so on a tie or a NaN comparison it would win.
    tuner, (_, tactic) = tune([f"time={garbage}", 9.0, 7.0])
    assert tactic == 7.0
    assert tuner.stats.tactic_failures == {"invalid time": 1}
    assert "invalid time" in caplog.text
    assert not tuner.cache.blocklist()  # a bad number is not a crash: not blocklisted


def test_timer_returning_no_measurement_is_counted() -> None:
    tuner, (_, tactic) = tune([FALLBACK_TACTIC, 7.0], timer=NoneTimer())
    assert tactic == FALLBACK_TACTIC
    assert tuner.stats.tactic_failures == {"invalid time": 2}  # -1 and 7.0


def test_check_time_contract() -> None:
    assert check_time(1.5) == 1.5
    for bad in (math.nan, math.inf, -1.0, 0.0, None, "x"):
        with pytest.raises(iso.TacticFailure, match="invalid time"):
            check_time(bad)


# ---------------------------------------------------------------- in-process faults


def test_raising_tactic_is_data_in_process() -> None:
    tuner, (_, tactic) = tune(["raise", 5.0, 6.0])
    assert tactic == 5.0
    assert tuner.stats.tactic_failures == {"RuntimeError": 1}
    assert not tuner.cache.blocklist()


def test_a_type_error_raised_inside_every_tactic_is_a_failed_profile_not_a_signature() -> None:
    # The forward takes graphtune's call, so the TypeError is the tactics' own: the profile
    # fails like any other (the fallback, not tried again here), and no ConfigError is raised.
    tuner, pick = tune(["typeerror", "typeerror too"])
    assert pick[1] == FALLBACK_TACTIC and len(tuner.failed_profiles) == 1
    assert tuner.stats.tactic_failures == {"TypeError": 2} and len(tuner.cache) == 0
    again = CostRunner(["typeerror", "typeerror too"])
    assert tuner.choose_one("op", [again], CONFIG, INPUTS) == (again, FALLBACK_TACTIC)


def test_corrupted_context_in_process_blocklists_and_stops(tmp_path, monkeypatch) -> None:
    """A sticky CUDA error cannot be recovered in-process: the tactic is blocklisted, tuning
    raises TuningError, autotune() still saves, and the next process skips the tactic."""
    path = tmp_path / "cache.json"
    calls = []

    def broken_after_raise(device: torch.device) -> str | None:
        calls.append(device)
        return "AcceleratorError: CUDA error: an illegal memory access was encountered"

    monkeypatch.setattr(iso, "context_error", broken_after_raise)
    tuner = AutoTuner(timer=ReportTimer(), policy=TuningPolicy(rounds=1, remeasure_top=0))
    with pytest.raises(TuningError, match="isolation='subprocess'"):
        with autotune(path, tuner=tuner):
            tuner.choose_one("op", [CostRunner([5.0, "raise", 6.0])], CONFIG, INPUTS)
    assert calls, "the executor must check the context after a failure"
    assert tuner.stats.tactic_failures == {"context corrupted": 1}
    saved = persist.load_file(path, strict=True)
    assert [(b.tactic, b.op) for b in saved.blocklist.values()] == [("raise", "op")]
    assert "illegal memory access" in next(iter(saved.blocklist.values())).reason

    monkeypatch.undo()
    fresh = AutoTuner(timer=ReportTimer(), policy=TuningPolicy(rounds=1, remeasure_top=0))
    with autotune(path, tuner=fresh):
        _, tactic = fresh.choose_one("op", [CostRunner([5.0, "raise", 6.0])], CONFIG, INPUTS)
    assert tactic == 5.0
    assert fresh.stats.tactics_blocked == 1 and not fresh.stats.tactic_failures


def test_blocklist_matches_tuple_and_list_spellings() -> None:
    cache = TuningCache()
    runner = CostRunner([])
    cache.block(iso_block(runner, (64, {"b": 1, "a": 2})))
    assert cache.blocked(runner_id(runner), [64, {"a": 2, "b": 1}]) is not None
    assert cache.blocked(runner_id(runner), [64, {"a": 2, "b": 3}]) is None
    assert cache.clear_blocklist() == 1 and not cache.blocklist()


def test_a_pick_of_a_blocked_tactic_is_never_served_and_tuning_picks_again() -> None:
    # A merged-in file, or a block after tuning, can leave an entry whose tactic is blocked: a
    # kernel that crashed once must not run in a serving process.
    tuner = AutoTuner(timer=ReportTimer(), policy=TuningPolicy(rounds=1, remeasure_top=0))
    runner = CostRunner([30.0, 10.0])
    tuner.tuning_mode = True
    assert tuner.choose_one("op", [runner], CONFIG, INPUTS)[1] == 10.0
    tuner.tuning_mode = False
    assert tuner.choose_one("op", [runner], CONFIG, INPUTS)[1] == 10.0  # memoised
    tuner.cache.block(iso_block(runner, 10.0))
    assert tuner.choose_one("op", [runner], CONFIG, INPUTS)[1] == FALLBACK_TACTIC  # a miss
    tuner.tuning_mode = True
    assert tuner.choose_one("op", [runner], CONFIG, INPUTS)[1] == 30.0  # tuned without it
    tuner.close()


def iso_block(runner: TunableRunner, tactic: Any):
    from graphtune.autotuner.entries import BlockedTactic

    return BlockedTactic(runner_id(runner), tactic, "crash: test")


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, message", [("threads", "not one of"), (3, "pass 'inprocess'")])
def test_isolation_argument_validation(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AutoTuner(isolation=value)
    assert AutoTuner(isolation=None).isolation == Isolation()
    assert AutoTuner(isolation="subprocess").isolation.mode == "subprocess"


@pytest.mark.parametrize("field", ["timeout_s", "start_timeout_s"])
@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5"])
def test_isolation_timeouts_validated(field: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        Isolation("subprocess", **{field: bad})


def test_unpicklable_runner_is_a_clear_config_error() -> None:
    class LocalRunner(CostRunner):  # defined in a function: pickle cannot import it
        pass

    # Checked before any worker starts, so these cost no process start.
    tuner = AutoTuner(isolation="subprocess", policy=TuningPolicy(rounds=1, remeasure_top=0))
    tuner.tuning_mode = True
    with pytest.raises(ConfigError, match=r"runner 0 \(.*LocalRunner\).*module top level"):
        tuner.choose_one("op", [LocalRunner([1.0])], CONFIG, INPUTS)
    assert tuner._executors.worker is not None and tuner._executors.worker.starts == 0
    with pytest.raises(ConfigError, match="the timer"):
        tune([5.0], isolation="subprocess", timer=LocalTimer())


class LocalTimer(ReportTimer):
    def __init__(self) -> None:
        self.clock = lambda: 0.0  # a lambda attribute makes it unpicklable


def test_describe_exit() -> None:
    from graphtune.autotuner.worker import describe_exit

    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(None) == "still running"


# ---------------------------------------------------------------- subprocess mode (real workers)


@pytest.mark.slow
def test_subprocess_survives_crash_hang_and_error_then_blocklist_skips(tmp_path) -> None:
    path = tmp_path / "cache.json"
    tactics = ["raise", 9.0, "segv", 4.0, "hang", "exit", 6.0]
    tuner = AutoTuner(
        timer=ReportTimer(),
        isolation=Isolation("subprocess", timeout_s=2.0),
        policy=TuningPolicy(rounds=2, remeasure_top=0),
    )
    start = time.perf_counter()
    with autotune(path, tuner=tuner):
        runner, tactic = tuner.choose_one("op", [CostRunner(tactics)], CONFIG, INPUTS)
    assert tactic == 4.0, "tuning must complete and pick the fastest good tactic"
    stats = tuner.stats
    assert stats.tactic_failures == {"RuntimeError": 1, "crash": 2, "timeout": 1}
    # first worker, then a fresh one after each of: segv, hang, exit
    assert stats.workers_started == 4
    # The hang costs its 2 s timeout, not forever; the bound leaves room for a loaded machine
    # (four worker starts with torch imports took over 60 s at a load average of 11).
    assert time.perf_counter() - start < 150
    blocked = {b.tactic: b.reason for b in tuner.cache.blocklist()}
    assert set(blocked) == {"segv", "hang", "exit"}, "a plain exception is not blocklisted"
    assert "SIGSEGV" in blocked["segv"] and "exit code 7" in blocked["exit"]
    assert "timeout" in blocked["hang"] and "2 s" in blocked["hang"]
    assert tuner._executors.worker is None, "autotune() stops the worker on exit"

    # The next process reads the blocklist from the file and never runs those tactics again:
    # proven by tuning in-process, where any of them would kill or hang this test.
    # Another op name, so nothing is answered from the cache entries: only the blocklist helps.
    again = AutoTuner(timer=ReportTimer(), policy=TuningPolicy(rounds=1, remeasure_top=0))
    again.cache.load(path, strict=True)
    again.tuning_mode = True
    _, tactic = again.choose_one("other op", [CostRunner(tactics)], CONFIG, INPUTS)
    assert tactic == 4.0
    assert again.stats.tactics_blocked == 3
    assert again.stats.tactic_failures == {"RuntimeError": 1}


def test_a_tactic_blocklisted_in_one_profile_is_not_run_in_the_next(monkeypatch) -> None:
    """All profiles are planned before any is timed: the blocklist is checked again per profile,
    so a crash costs one worker, not one per bucket (docs/reliability.md: every op and shape)."""
    ran: list[Any] = []
    measure = iso.InProcessExecutor.measure

    def crashing(self, runner_index, runner, tactic, **kwargs):  # as a dead worker reports it
        ran.append(tactic)
        if tactic == "exit":
            raise iso.TacticFailure("crash", "worker exited with code 7", block=True)
        return measure(self, runner_index, runner, tactic, **kwargs)

    monkeypatch.setattr(iso.InProcessExecutor, "measure", crashing)
    two = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4)),), warmup=0, repeat=1)
    tuner = AutoTuner(timer=ReportTimer(), policy=TuningPolicy(rounds=1, remeasure_top=0))
    tuner.tuning_mode = True
    _, tactic = tuner.choose_one("op", [CostRunner([5.0, "exit", 6.0])], two, INPUTS)
    assert tactic == 5.0
    assert ran.count("exit") == 1
    assert tuner.stats.tactic_failures == {"crash": 1}
    assert tuner.stats.tactics_blocked == 1 and tuner.stats.profiles_tuned == 2


_HANGING_TUNER = """
import os, sys, time
import torch
from graphtune.autotuner import AutoTuner, DynamicTensorSpec, TunableRunner, TuningConfig
from graphtune.autotuner import TuningPolicy
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.timing.base import Measurement

class Hangs(TunableRunner):
    def __init__(self, pid_file):
        self.pid_file = pid_file
    def get_valid_tactics(self, inputs, profile):
        return [0, 1]  # one tactic alone is picked untimed
    def forward(self, inputs, tactic=-1):
        if tactic == 1:
            with open(self.pid_file + ".part", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.pid_file + ".part", self.pid_file)
            time.sleep(600)
        return 1.0

class Timer:
    name = "report"
    def measure(self, fn, *, warmup, repeat):
        value = fn(0)
        return Measurement(value, value, 0.0, 1, repeat, self.name)

if __name__ == "__main__":
    tuner = AutoTuner(timer=Timer(), isolation=Isolation("subprocess", timeout_s=300),
                      policy=TuningPolicy(rounds=1, remeasure_top=0))
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    tuner.choose_one("op", [Hangs(sys.argv[1])], config, [torch.ones(4, 2)])
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.slow
def test_a_killed_tuning_process_takes_its_worker_along_even_mid_tactic(tmp_path) -> None:
    # daemon=True acts only through the parent's exit handlers: after a SIGKILL of the tuning
    # process, a worker inside a hung tactic ran on as an orphan (on a GPU, with its context).
    import graphtune

    script, pid_file = tmp_path / "hanging_tuner.py", tmp_path / "worker.pid"
    script.write_text(_HANGING_TUNER)
    env = dict(os.environ, PYTHONPATH=str(Path(graphtune.__file__).resolve().parents[1]))
    with open(tmp_path / "stderr.txt", "w") as err:
        tuner = subprocess.Popen(
            [sys.executable, str(script), str(pid_file)],
            env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    worker = None
    try:
        deadline = time.monotonic() + 60  # two processes import torch; slow on a loaded host
        while not pid_file.exists():
            assert tuner.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the hanging tactic never started"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert worker != tuner.pid and _running(worker)
        tuner.kill()  # as an OOM killer or a supervisor's stop does: no handler runs
        tuner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), "the worker outlived the tuning process"
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
        if worker is not None and _running(worker):  # the failure above: leave no orphan
            os.kill(worker, signal.SIGKILL)
