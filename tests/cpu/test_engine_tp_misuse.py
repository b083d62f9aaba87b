"""Tensor-parallel misuse is a one-line error, never a hang or a silent wrong answer: ranks that
pass different arguments, a context that disagrees with its process group, a shard without a
group, and launches whose environment is wrong.

One pair of ``spawn`` workers over gloo runs the multi-process cases; each case ends with no rank
inside a collective, so one failing case cannot hang the next.
"""

from __future__ import annotations

from typing import Any

import pytest
from gloo_ranks import run_on_ranks

from graphtune import env
from graphtune.autotuner import AutoTuner, DistributedTuning, autotune
from graphtune.engine import Engine, load_model
from graphtune.engine.parallel import ParallelContext, shard_model
from graphtune.errors import ConfigError, DistributedError, InputError

WORLD = 2


def _outcome(fn: Any) -> str:
    try:
        fn()
    except (ConfigError, DistributedError, InputError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _agreeing() -> AutoTuner:
    return AutoTuner(distributed=DistributedTuning("agree"))


def _enter(context: Any) -> None:
    with context:
        pass


def _cases(rank: int) -> dict[str, str]:
    parallel = ParallelContext.from_group()
    shard = load_model("tiny", seed=3, parallel=parallel)
    engine = Engine(shard, runner="eager", max_batch_size=2, max_seq_len=32)
    prompt = [1, 2, 3] if rank == 0 else [1, 2, 4]  # one token apart: same shapes, other tokens
    return {
        "same requests": _outcome(lambda: engine.generate([[1, 2, 3]], 3)),
        "other prompt": _outcome(lambda: engine.generate([prompt], 3)),
        "other limit": _outcome(lambda: engine.generate([[1, 2, 3]], 3 + rank)),
        "other engine": _outcome(
            lambda: Engine(shard, runner="eager", max_batch_size=1 + rank, max_seq_len=32)
        ),
        "other weights": _outcome(
            lambda: Engine(
                load_model("tiny", seed=rank, parallel=parallel), runner="eager", max_batch_size=1
            )
        ),
        # Rank 1 alone passes a tuner that is not rank-consistent: it raises that error, and
        # rank 0 learns of it in the agreement instead of in a collective rank 1 never joins.
        "tuner of one rank": _outcome(
            lambda: Engine(
                shard,
                runner="eager",
                max_batch_size=1,
                tune=True,
                tuner=AutoTuner() if rank else None,
            )
        ),
        "cache-only tuner of one rank": _outcome(
            lambda: Engine(
                shard, runner="eager", max_batch_size=1, tuner=AutoTuner() if rank else _agreeing()
            )
        ),
        "other capture": _outcome(
            lambda: Engine(
                shard, runner="eager", max_batch_size=2, capture_sizes=[1, 2] if rank == 0 else [2]
            )
        ),
        # One rank's own checks fail: it raises its error, the other names it (no hang).
        "bad prompt on one rank": _outcome(
            lambda: engine.generate([[1, 2, 10**6 if rank else 3]], 3)
        ),
        "bad engine on one rank": _outcome(
            lambda: Engine(shard, runner="eager", max_batch_size=1, max_seq_len=10**9 * rank + 32)
        ),
        "tune on one rank": _outcome(lambda: _enter(autotune(None, _agreeing(), tune=rank == 0))),
        "other strategy": _outcome(
            lambda: _enter(autotune(None, AutoTuner(distributed="agree" if rank else "broadcast")))
        ),
        # Both processes claim rank 0 (no collective: rank 0's context is right).
        "claimed rank": _outcome(lambda: ParallelContext(None, 0, WORLD)),
        "claimed degree": _outcome(lambda: ParallelContext(None, rank, 4)),
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return run_on_ranks(_cases, WORLD, tmp_path_factory.mktemp("tp-misuse"))


@pytest.mark.parametrize(
    "case, differs",
    [
        ("other prompt", "prompts"),
        ("other limit", "max_new_tokens"),
        ("other engine", "max_batch_size"),
        ("other weights", "weights"),
        ("other capture", "capture"),
    ],
)
def test_ranks_passing_different_arguments_all_raise_naming_them(outcomes, case, differs):
    for rank in range(WORLD):
        assert outcomes[rank]["same requests"] == "ok"
        message = outcomes[rank][case]
        assert message.startswith("DistributedError") and f"{differs} on ranks [1]" in message


@pytest.mark.parametrize("case", ["tuner of one rank", "cache-only tuner of one rank"])
def test_tuning_a_shard_needs_a_rank_consistent_tuner(outcomes, case):
    assert outcomes[1][case].startswith("ConfigError") and "rank-consistent" in outcomes[1][case]
    assert (
        outcomes[0][case].startswith("DistributedError") and "rank 1 refused" in outcomes[0][case]
    )


def test_a_rank_whose_own_arguments_fail_is_named_by_the_others(outcomes):
    assert outcomes[1]["bad prompt on one rank"].startswith("InputError")
    assert "rank 1 refused its arguments (InputError" in outcomes[0]["bad prompt on one rank"]
    assert outcomes[1]["bad engine on one rank"].startswith("ConfigError")
    assert "rank 1 refused its arguments (ConfigError" in outcomes[0]["bad engine on one rank"]


@pytest.mark.parametrize("case", ["tune on one rank", "other strategy"])
def test_ranks_that_tune_differently_all_raise(outcomes, case):
    for rank in range(WORLD):
        assert outcomes[rank][case].startswith("DistributedError"), outcomes[rank][case]


def test_a_context_that_disagrees_with_its_group_is_refused(outcomes):
    assert outcomes[0]["claimed rank"] == "ok"
    assert "this process is rank 1 of 2" in outcomes[1]["claimed rank"]
    for rank in range(WORLD):
        assert "world_size=4" in outcomes[rank]["claimed degree"]


def test_a_shard_without_a_process_group_is_refused_by_the_engine():
    shard = shard_model(load_model("tiny"), ParallelContext(None, 0, WORLD))
    with pytest.raises(ConfigError, match="init_process_group"):
        Engine(shard, runner="eager", max_batch_size=1, max_seq_len=16)


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' must be a non-negative integer"),
        ({"RANK": "", "WORLD_SIZE": ""}, "RANK='' must be a non-negative integer"),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 is not a rank of WORLD_SIZE=2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' must be a non-negative integer"),
        # Digits str.isdigit accepts and int refuses.
        ({"RANK": "\u00b2", "WORLD_SIZE": "2"}, "RANK='\u00b2' must be a non-negative integer"),
        ({"RANK": "0", "WORLD_SIZE": "\u00b2"}, "WORLD_SIZE='\u00b2' must be a non-negative"),
    ],
)
def test_a_launch_environment_that_is_wrong_is_named(monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        env.torchrun_rank()


def test_cli_refuses_launches_that_would_hang_or_repeat_work(monkeypatch, capsys):
    from graphtune.cli.main import main

    args = ["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "cpu"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # Two processes and --tp 1: each would run the whole model and write the same files.
    assert main(args) == 1
    assert "but --tp is 1" in capsys.readouterr().err
    # --tp 2 without the rendezvous address: the ranks could never meet.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main([*args, "--tp", "2"]) == 1
    assert "MASTER_ADDR and MASTER_PORT not set" in capsys.readouterr().err
    for value in ("x", "\u00b2"):
        monkeypatch.setenv("LOCAL_RANK", value)
        with pytest.raises(ConfigError, match=f"LOCAL_RANK={value!r}"):
            env.torchrun_local_rank()
