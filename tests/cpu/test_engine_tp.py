"""Tensor-parallel decode over gloo: TP=2 matches TP=1 (logits and greedy tokens); clear errors.

One pair of ``spawn`` workers (a few seconds to start) runs every multi-process check; each rank
compares its TP=2 results with a whole TP=1 model it builds itself from the same preset and seed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import run_on_ranks
from hf_weights import TINY as TINY_HF

from graphtune.engine import Engine, KVCache, SamplingParams, load_model, prefill
from graphtune.engine.parallel import (
    ParallelContext,
    TensorParallelDecodeStep,
    check_shardable,
    shard_config,
    shard_model,
)
from graphtune.engine.presets import get_preset
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError
from graphtune.graphs import SimulatedGraphBackend
from graphtune.graphs.policy import default_capture_sizes

WORLD = 2
PROMPTS = [[1, 5, 9, 200, 17], [3, 4], [7, 8, 9, 10, 11, 12, 13], [42]]


def _child_env() -> dict[str, str]:
    """This process's environment without Triton's interpreter (see ``tp_results``)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


class StagedAllReduce:
    """An all-reduce that wants its input in its own buffer, like the symmetric-memory one (gloo
    underneath), so the steps' staging branches run on the CPU too."""

    name = "staged"

    def __init__(self, rows: int, hidden: int) -> None:
        self.buffer = torch.full((rows, hidden), float("nan"))  # stale data must not leak
        self.staged = 0

    def staging(self, rows: int) -> torch.Tensor | None:
        return self.buffer[:rows] if rows <= self.buffer.shape[0] else None

    def reduce(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch.distributed as dist

        self.staged += partial.data_ptr() == self.buffer.data_ptr()
        dist.all_reduce(partial)
        if out is None or out is partial:
            return partial.clone() if partial.data_ptr() == self.buffer.data_ptr() else partial
        return out.copy_(partial)


class FusedStagedAllReduce(StagedAllReduce):
    """Also offers the fused all-reduce + add + RMSNorm API (in torch over gloo), like the
    symmetric-memory reducer with Triton; records the parities it was asked for."""

    name = "staged-fused"

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__(rows, hidden)
        self.halves = torch.full((2, rows, hidden), float("nan"))
        self.parities: list[int] = []

    def fused_staging(self, rows: int, parity: int) -> torch.Tensor | None:
        self.parities.append(parity)
        return self.halves[parity % 2, :rows] if rows <= self.halves.shape[1] else None

    def reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        from graphtune.engine.model import rms_norm

        summed = partial.clone()
        dist.all_reduce(summed)
        residual.add_(summed)
        return rms_norm(residual, weight, eps), residual


def _step_diffs(steps: list[DecodeStep]) -> tuple[float, float]:
    """Max |logit difference| of steps[1:] against steps[0] over prefill and 4 decode steps
    (each step with a fresh cache)."""
    prefill_diff, decode_diff = 0.0, 0.0
    with torch.inference_mode():
        for slot, prompt in enumerate(PROMPTS[:2]):
            tokens = torch.tensor(prompt)
            want, *got = (prefill(s, tokens, slot, all_logits=True) for s in steps)
            prefill_diff = max([prefill_diff] + [(want - g).abs().max().item() for g in got])
        tokens = torch.tensor([PROMPTS[0][-1], PROMPTS[1][-1]])
        positions = torch.tensor([len(PROMPTS[0]), len(PROMPTS[1])])
        slots = torch.arange(2)
        for _ in range(4):
            want = steps[0](tokens, positions, slots).clone()
            for step in steps[1:]:
                got = step(tokens, positions, slots)
                decode_diff = max(decode_diff, (want - got).abs().max().item())
            tokens, positions = want.argmax(-1), positions + 1
    return prefill_diff, decode_diff


def _compare(preset: str, parallel: ParallelContext) -> dict[str, Any]:
    """Prefill + decode steps and Engine.generate at TP=1 and TP=2 on this rank."""
    full = load_model(preset, seed=3)
    shard = load_model(preset, seed=3, parallel=parallel)
    out: dict[str, Any] = {"kv_heads": shard.config.num_kv_heads}
    steps: list[DecodeStep] = []
    for model in (full, shard):
        cache = KVCache(model.config, 2, 32, dtype=torch.float32)
        cls = DecodeStep if model.parallel is None else TensorParallelDecodeStep
        steps.append(cls(model, cache, contiguous_slots=True))
    out["kv_cache_shape"] = tuple(steps[1].cache.k.shape)
    out["reducer"] = steps[1].reducer.name
    staged = StagedAllReduce(2, shard.config.hidden_size)
    steps.append(
        TensorParallelDecodeStep(
            shard, KVCache(shard.config, 2, 32), reducer=staged, contiguous_slots=True
        )
    )
    out["prefill_diff"], out["decode_diff"] = _step_diffs(steps)
    out["staged_reduces"] = staged.staged
    # The tuned step: the shard tunes its own shapes with 'agree' (the Engine's default for a
    # shard), through both reducers; it must match the untuned whole model.
    engine = Engine(shard, runner="eager", max_batch_size=2, max_seq_len=32, tune=True)
    tuner = engine.tuner
    # Tuning ran the step: every captured size now finds a tuned pick for every op on every rank.
    misses = tuner.stats.misses
    with torch.inference_mode():
        for size in default_capture_sizes(engine.max_batch_size):
            engine.step(*engine.example_inputs(size))
    out["fallbacks_after_tuning"] = dict(tuner.stats.fallbacks)
    out["misses_after_tuning"] = tuner.stats.misses - misses
    out["tuned_by"] = sorted({str(e.tuned_by) for _, e in tuner.cache.items()})
    out["tuned_picks"] = sorted(
        f"{k.op}|{k.shapes}|{e.runner_id}|{e.tactic}" for k, e in tuner.cache.items()
    )
    staged_tuned = StagedAllReduce(2, shard.config.hidden_size)
    fused = FusedStagedAllReduce(2, shard.config.hidden_size)
    tuned = [
        TensorParallelDecodeStep(
            shard, KVCache(shard.config, 2, 32), tuner=tuner, reducer=reducer, contiguous_slots=True
        )
        for reducer in (None, staged_tuned, fused)
    ]
    whole = DecodeStep(full, KVCache(full.config, 2, 32), contiguous_slots=True)
    _, out["tuned_decode_diff"] = _step_diffs([whole, *tuned])
    out["tuned_staged_reduces"] = staged_tuned.staged
    out["fused_parities"] = fused.parities
    # Engine: 4 prompts through 2 slots (requests queue, retire and move slots), graph runner
    # (eager fallback on CPU) for TP=2, eager for TP=1.
    tokens_by_tp = []
    for model, runner in ((full, "eager"), (shard, "graph")):
        engine = Engine(
            model, runner=runner, max_batch_size=2, max_seq_len=48, capture_sizes=[1, 2]
        )
        tokens_by_tp.append(engine.generate(PROMPTS, [6, 3, 8, 5], stop_token_ids=[]))
    out["greedy_tp1"], out["greedy_tp2"] = tokens_by_tp
    # Replayed graphs (simulated on the CPU) must wait for the all-reduce as the eager call did.
    replayed = Engine(
        shard,
        max_batch_size=2,
        max_seq_len=48,
        capture_sizes=[1, 2],
        graph_backend=SimulatedGraphBackend(),
    )
    out["greedy_tp2_replayed"] = replayed.generate(PROMPTS, [6, 3, 8, 5], stop_token_ids=[])
    out["replays"] = replayed.runner.stats.replays
    out["sampled"] = Engine(shard, runner="eager", max_batch_size=2, max_seq_len=48).generate(
        PROMPTS[:3],
        6,
        stop_token_ids=[],
        sampling=SamplingParams(temperature=0.8, top_k=20, seed=5),
    )
    return out


def _compare_presets(rank: int) -> dict[str, Any]:
    parallel = ParallelContext.from_group()
    return {p: _compare(p, parallel) for p in ("tiny", "qwen2-tiny", "qwen3-tiny")}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return run_on_ranks(_compare_presets, WORLD, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("preset", ["tiny", "qwen2-tiny", "qwen3-tiny"])
def test_tp2_matches_tp1(tp_results: dict[int, Any], preset: str) -> None:
    for rank in range(WORLD):
        r = tp_results[rank][preset]
        assert r["kv_heads"] == get_preset(preset).num_kv_heads // WORLD
        assert r["kv_cache_shape"][2] == r["kv_heads"]  # only this rank's KV heads are cached
        assert r["prefill_diff"] < 1e-4, r["prefill_diff"]
        assert r["decode_diff"] < 1e-4, r["decode_diff"]
        assert r["greedy_tp2"] == r["greedy_tp1"]
        assert r["greedy_tp2_replayed"] == r["greedy_tp1"] and r["replays"] > 0
        assert [len(t) for t in r["greedy_tp2"]] == [6, 3, 8, 5]
        assert r["reducer"] == "gloo"  # the process group (no symmetric memory on CPU)
        # Two staged reduces per layer and decode step; prefill rows (5 and 2 tokens) are
        # staged only when they fit the 2-row buffer.
        layers = get_preset(preset).num_layers
        assert r["staged_reduces"] >= 2 * layers * 4, r["staged_reduces"]
        assert r["tuned_decode_diff"] < 1e-4, r["tuned_decode_diff"]
        # Decode stages every projection; prefill (the same forward) stages the 2-token prompt.
        assert r["tuned_staged_reduces"] == 2 * layers * (4 + 1)
        assert r["fallbacks_after_tuning"] == {} and r["misses_after_tuning"] == 0
        # The fused path ran every projection of every decode step, alternating its buffers.
        assert r["fused_parities"] == [0, 1] * layers * 4
        assert r["tuned_by"] and all("agree" in t for t in r["tuned_by"]), r["tuned_by"]
    # Every rank holds the same picks (tuned with 'agree').
    assert tp_results[0][preset]["tuned_picks"] == tp_results[1][preset]["tuned_picks"]
    assert tp_results[0][preset]["tuned_picks"]
    # Replicated logits: both ranks sample the same tokens.
    assert tp_results[0][preset]["sampled"] == tp_results[1][preset]["sampled"]


def test_sharding_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match=r"num_kv_heads \(1\) not divisible by 2"):
        check_shardable(get_preset("mistral-tiny"), 2)
    with pytest.raises(ConfigError, match=r"num_heads \(4\).*use tp in \[1, 2\]"):
        check_shardable(get_preset("tiny"), 3)
    odd = get_preset("tiny").replace(intermediate_size=130, num_heads=8, num_kv_heads=4)
    with pytest.raises(ConfigError, match=r"intermediate_size \(130\)"):
        check_shardable(odd, 4)
    with pytest.raises(ConfigError, match="rank must be in"):
        ParallelContext(None, 2, 2)
    with pytest.raises(ConfigError, match="not divisible"):
        load_model("mistral-tiny", parallel=ParallelContext(None, 0, 2))


def test_shard_layout_and_misuse() -> None:
    full = load_model("qwen2-tiny", seed=1)
    cfg = full.config
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.dim_per_head == cfg.dim_per_head
    shard = shard_model(full, ParallelContext(None, 1, 2))
    assert shard.global_config == cfg and shard.config == local
    # Rank 1 keeps the second half of q, of k and of v, fused as [q | k | v].
    q, k, v = full.layers[0].wqkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
    want = torch.cat([q[cfg.q_size // 2 :], k[cfg.kv_size // 2 :], v[cfg.kv_size // 2 :]])
    assert torch.equal(shard.layers[0].wqkv, want)
    gate, up = full.layers[0].w_gate_up.chunk(2)
    assert torch.equal(shard.layers[0].w_gate_up, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(shard.layers[0].w_down, full.layers[0].w_down[:, 64:])
    assert torch.equal(shard.layers[0].wo, full.layers[0].wo[:, cfg.q_size // 2 :])
    assert shard.lm_head is full.lm_head  # replicated (and still tied)
    # tp=1 keeps the whole model and the plain step: no collective can run.
    assert shard_model(full, ParallelContext(None, 0, 1)) is full
    assert load_model("tiny", parallel=ParallelContext(None, 0, 1)).parallel is None
    with pytest.raises(ConfigError, match="already sharded"):
        shard_model(shard, ParallelContext(None, 0, 2))
    cache = KVCache(shard.config, 1, 16)
    with pytest.raises(ConfigError, match="TensorParallelDecodeStep"):
        DecodeStep(shard, cache)
    with pytest.raises(ConfigError, match="all_reduce_backend"):
        ParallelContext(None, 0, 2, all_reduce_backend="mpi")
    with pytest.raises(ConfigError, match="sharded model"):
        TensorParallelDecodeStep(full, KVCache(cfg, 1, 16))


def test_cli_generate_tp2_under_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    from graphtune.cli.main import main

    args = [
        "generate",
        "--model",
        "tiny",
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        "4,5",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
        "--ignore-eos",
    ]
    assert main(args) == 0
    want = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens:")]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "graphtune",
            *args,
            "--tp",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = [line for line in proc.stdout.splitlines() if line.startswith("tokens:")]
    assert got == want  # rank 0 printed once; rank 1 printed nothing
    assert "tp 2" in proc.stdout


def test_cli_tp_without_torchrun_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from graphtune.cli.main import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (
        main(["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "cpu", "--tp", "2"])
        == 1
    )
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--tp",
                "2",
                "--compare-compile",
            ]
        )
        == 1
    )
    assert "not supported with --tp" in capsys.readouterr().err


def test_cli_bench_decode_tp2_tune_agrees_on_every_pick(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "tp2.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "graphtune",
            "bench",
            "decode",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--tune",
            "--batch-sizes",
            "1,2",
            "--context",
            "8",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["tuning_rank_agreement"] == 1.0
    assert data["tuning_profiles"] > 0
    assert data["model"]["all_reduce"] == "gloo"  # the process group's backend
    for result in data["results"]:
        assert result["tuned_max_abs_diff"] < 1e-3, result  # float32 on the CPU


def test_checkpoint_folder_shards_like_the_whole_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TINY_HF)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    full = load_model(tmp_path)
    for rank in range(WORLD):
        parallel = ParallelContext(None, rank, WORLD)
        got = load_model(tmp_path, parallel=parallel)
        want = shard_model(full, parallel)
        assert got.config == want.config and got.global_config == full.config
        for mine, theirs in zip(got.layers, want.layers, strict=True):
            for name, tensor in mine.tensors().items():
                assert torch.equal(tensor, theirs.tensors()[name]), name
        assert got.layers[0].bqkv is not None and torch.equal(got.lm_head, full.lm_head)


def test_ranks_that_loaded_other_checkpoints_of_one_shape_have_other_weight_marks(
    tmp_path: Path,
) -> None:
    # Only the embedding's corner was compared: a checkpoint whose layers differ (a stale copy
    # on one node) passed, and the shards' sums mixed two models' weights.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_HF)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "a", safe_serialization=True)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.neg_()  # a row-parallel (sharded) weight
    model.save_pretrained(tmp_path / "b", safe_serialization=True)
    marks = {
        name: {
            load_model(tmp_path / name, parallel=ParallelContext(None, rank, WORLD)).extras[
                "weights_mark"
            ]
            for rank in range(WORLD)
        }
        for name in ("a", "b")
    }
    assert len(marks["a"]) == 1 and len(marks["b"]) == 1  # every shard of one file agrees
    assert marks["a"] != marks["b"]
    assert marks["a"] == {load_model(tmp_path / "a").extras["weights_mark"]}


def test_cli_all_reduce_choices_are_the_backends() -> None:
    from graphtune.cli._parallel import ALL_REDUCE_CHOICES
    from graphtune.engine.collectives import BACKENDS

    assert ALL_REDUCE_CHOICES == BACKENDS
