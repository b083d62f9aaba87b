"""A tensor-parallel call that fails on one rank partway fails the other ranks at once: the failed
rank aborts the group (its process staying alive, as a server that catches the error would) and
its engine refuses every later call with the rebuild error, instead of the peers waiting in their
next collective for the group's timeout.

Two ``spawn`` ranks over gloo with a 20 s group timeout, so a tree without the abort fails in
about 20 s (the peer's bound below is 10 s) instead of hanging for gloo's default 30 minutes.
"""

from __future__ import annotations

import datetime
import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import run_on_ranks

from graphtune.engine import Engine, load_model
from graphtune.engine.parallel import ParallelContext, init_from_torchrun
from graphtune.errors import ConfigError

WORLD = 2
GROUP_TIMEOUT_S = 20.0
PEER_BOUND_S = 10.0
PROMPTS = [[1, 2, 3], [4, 5]]


class _FailingRunner:
    """The engine's decode runner, raising an out-of-memory error at its ``fail_at``-th call
    (an error of one GPU alone: the other rank's runner goes on into the step's all-reduce)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("simulated out-of-memory on rank 1 only")
        return self.inner(*args)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the test compares the type and message of whatever was raised
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _midfail(folder: Path, rank: int) -> dict[str, Any]:
    engine = Engine(
        load_model("tiny", seed=3, parallel=ParallelContext.from_group()),
        runner="eager",
        max_batch_size=2,
        max_seq_len=48,
    )
    out: dict[str, Any] = {}
    # Agreed argument errors (every rank raises together) must leave the group and engine alone.
    out["agreed error"] = _outcome(lambda: engine.generate([[1, 2, 10**6 if rank else 3]], 3))
    out["after agreed error"] = engine.generate(PROMPTS, 4, stop_token_ids=[])
    if rank == 1:
        engine.runner = _FailingRunner(engine.runner, fail_at=3)
    start = time.monotonic()
    out["mid-generate"] = _outcome(lambda: engine.generate(PROMPTS, 8, stop_token_ids=[]))
    out["seconds"] = time.monotonic() - start
    answered = folder / "rank0-answered"
    if rank == 0:
        answered.touch()
    else:  # stays alive until rank 0 has its answer: its exit must not be what freed rank 0
        deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S
        while not answered.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    start = time.monotonic()
    out["retry"] = _outcome(lambda: engine.generate(PROMPTS, 8, stop_token_ids=[]))
    out["step"] = _outcome(lambda: engine.step(*engine.example_inputs(1)))
    out["retry seconds"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    folder = tmp_path_factory.mktemp("tp-abort")
    return run_on_ranks(
        functools.partial(_midfail, folder), WORLD, folder, group_timeout=GROUP_TIMEOUT_S
    )


def test_agreed_argument_errors_do_not_abort_the_group(outcomes: dict[int, Any]) -> None:
    assert outcomes[1]["agreed error"].startswith("InputError: ")
    assert "rank 1 refused its arguments" in outcomes[0]["agreed error"]
    assert outcomes[0]["after agreed error"] == outcomes[1]["after agreed error"]


def test_a_rank_failing_mid_generate_fails_its_peer_at_once(outcomes: dict[int, Any]) -> None:
    assert outcomes[1]["mid-generate"].startswith("OutOfMemoryError: simulated out-of-memory")
    assert outcomes[0]["mid-generate"] != "ok"
    assert outcomes[0]["seconds"] < PEER_BOUND_S, outcomes[0]


def test_an_aborted_engine_refuses_later_calls_on_every_rank(outcomes: dict[int, Any]) -> None:
    for rank in range(WORLD):
        for call, what in (("retry", "Engine.generate"), ("step", "Engine.step")):
            message = outcomes[rank][call]
            assert message.startswith(
                f"DistributedError: {what}: the tensor-parallel group was "
                "aborted after an error on this rank"
            ), (rank, message)
            assert "rebuild the process group" in message and "\n" not in message
        assert outcomes[rank]["retry seconds"] < 1.0, outcomes[rank]
    assert "OutOfMemoryError" in outcomes[1]["retry"]


def _strict_nan_then_bad_step(rank: int) -> dict[str, Any]:
    model = load_model("tiny", seed=3, parallel=ParallelContext.from_group())
    engine = Engine(model, runner="eager", max_batch_size=2, max_seq_len=48, strict_numerics=True)
    out: dict[str, Any] = {}
    saved = model.lm_head.detach().clone()
    with torch.no_grad():  # the LM head is replicated: every rank's logits are NaN at once
        model.lm_head.fill_(float("nan"))
    out["nan"] = _outcome(lambda: engine.generate([[1, 2, 3]], 3, stop_token_ids=[]))
    with torch.no_grad():
        model.lm_head.copy_(saved)
    out["after nan"] = engine.generate([[1, 2, 3]], 3, stop_token_ids=[])
    tokens, positions, slots = engine.example_inputs(1)
    if rank == 1:  # its own bad input: nothing makes the ranks agree on step()'s arguments
        tokens = tokens.to(torch.int32)
    start = time.monotonic()
    out["bad step"] = _outcome(lambda: engine.step(tokens, positions, slots))
    out["seconds"] = time.monotonic() - start
    return out


def test_strict_numerics_raises_on_every_rank_without_an_abort_and_one_rank_bad_step_aborts(
    tmp_path: Path,
) -> None:
    outcomes = run_on_ranks(
        _strict_nan_then_bad_step, WORLD, tmp_path, group_timeout=GROUP_TIMEOUT_S
    )
    for rank in range(WORLD):
        assert outcomes[rank]["nan"].startswith("NumericalError: "), outcomes[rank]
    assert outcomes[0]["after nan"] == outcomes[1]["after nan"]  # still usable, and agreed
    assert outcomes[1]["bad step"].startswith("InputError: ")
    assert outcomes[0]["bad step"] != "ok"
    assert outcomes[0]["seconds"] < PEER_BOUND_S, outcomes[0]


def _build_fails_on_rank_1(folder: Path, rank: int) -> dict[str, Any]:
    import graphtune.engine.engine as engine_module

    model = load_model("tiny", seed=3, parallel=ParallelContext.from_group())
    out: dict[str, Any] = {}
    if rank == 1:  # a failure of this rank alone while the engine is built (say, out of memory)

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise torch.OutOfMemoryError("simulated out-of-memory while building on rank 1")

        engine_module.build_prefill_step = failing
        out["build"] = _outcome(
            lambda: Engine(model, runner="eager", max_batch_size=2, max_seq_len=48)
        )
        answered = folder / "rank0-answered"
        deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S
        while not answered.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # alive until rank 0 has its answer, as a server catching the error
        return out
    engine = Engine(model, runner="eager", max_batch_size=2, max_seq_len=48)
    start = time.monotonic()
    out["generate"] = _outcome(lambda: engine.generate(PROMPTS, 4, stop_token_ids=[]))
    out["seconds"] = time.monotonic() - start
    (folder / "rank0-answered").touch()
    return out


def test_a_rank_failing_while_the_engine_is_built_fails_its_peer_at_once(tmp_path: Path) -> None:
    outcomes = run_on_ranks(
        functools.partial(_build_fails_on_rank_1, tmp_path),
        WORLD,
        tmp_path,
        group_timeout=GROUP_TIMEOUT_S,
    )
    assert outcomes[1]["build"].startswith("OutOfMemoryError: simulated")
    assert outcomes[0]["generate"] != "ok"
    assert outcomes[0]["seconds"] < PEER_BOUND_S, outcomes[0]


def test_init_from_torchrun_passes_the_group_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    variables = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    init_from_torchrun(1, torch.device("cpu"), timeout_s=7)
    assert seen["timeout"] == datetime.timedelta(seconds=7)
    seen.clear()
    init_from_torchrun(1, torch.device("cpu"))
    assert "timeout" not in seen  # torch's default
    with pytest.raises(ConfigError, match="timeout_s must be > 0 seconds, got 0"):
        init_from_torchrun(1, torch.device("cpu"), timeout_s=0)
