"""The one forward: the untuned step is the lean torch step, and tuning by running it leaves no
fallback look-up at any captured size, for every preset's architecture.

Presets are used with small dimensions on the CPU: the tiny presets as they are, and
``llama-1b-shape`` through ``ModelConfig.replace`` (same architecture, Llama-3 RoPE scaling and
tied embeddings, 2 layers of width 64). Kernel counts use ``torch.profiler`` on the CPU, which
records the aten ops each Python-level call dispatches: a proxy for the kernels a GPU launches.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from graphtune.autotuner import AutoTuner, TuningPolicy  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.engine import (  # noqa: E402
    DecodeStep,
    Engine,
    KVCache,
    get_preset,
    prefill,
    random_model,
    tune_step,
)
from graphtune.engine.config import PRESETS, ModelConfig  # noqa: E402
from graphtune.engine.model import apply_rope_signed, rms_norm, swiglu  # noqa: E402
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.graphs.policy import default_capture_sizes  # noqa: E402

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
)


def small_config(name: str) -> ModelConfig:
    """The preset's architecture at a CPU-friendly size."""
    config = get_preset(name)
    if config.hidden_size <= SMALL["hidden_size"]:
        return config
    return config.replace(name=f"{name}-small", **SMALL)


def reference_step(
    step: DecodeStep, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The untuned decode step as it was written by hand before the one forward (contiguous
    slots): the lean torch code whose ops the forward's fallbacks must reproduce one for one."""
    model, cfg = step.model, step.model.config
    batch = tokens.shape[0]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
    qk_size = cfg.q_size + cfg.kv_size
    eps = cfg.rms_norm_eps
    x = F.embedding(tokens, model.embed)
    cos = step.cos.index_select(0, positions)[:, None, :]
    sin = step.sin.index_select(0, positions)[:, None, :]
    keys_at, at = step.key_positions[None, :], positions[:, None]
    visible = keys_at <= at
    if cfg.sliding_window is not None:
        visible = visible & (keys_at > at - cfg.sliding_window)
    mask = torch.where(visible, step.zero, step.neg_inf)[:, None, None, :]
    write_rows = (
        (slots[:, None] * kv_heads + step.kv_head_index[None, :]) * step.cache.max_seq_len
        + positions[:, None]
    ).reshape(-1)
    for index, layer in enumerate(model.layers):
        h = rms_norm(x, layer.attn_norm, eps)
        qkv = F.linear(h, layer.wqkv, layer.bqkv)
        if layer.q_norm is not None:  # Qwen3: per-head norms of q and k before RoPE
            for start, end, weight in (
                (0, heads * dim, layer.q_norm),
                (heads * dim, qk_size, layer.k_norm),
            ):
                part = qkv[:, start:end].unflatten(-1, (-1, dim))
                part.copy_(F.rms_norm(part, (dim,), None, eps) * weight)
        qk = apply_rope_signed(qkv[:, :qk_size].view(batch, heads + kv_heads, dim), cos, sin)
        step.k_flat[index].index_copy_(0, write_rows, qk[:, heads:].reshape(-1, dim))
        step.v_flat[index].index_copy_(0, write_rows, qkv[:, qk_size:].reshape(-1, dim))
        attn = F.scaled_dot_product_attention(
            qk[:, :heads].reshape(batch, kv_heads, step.groups, dim),
            step.cache.k_layers[index][:batch],
            step.cache.v_layers[index][:batch],
            attn_mask=mask,
        )
        x.addmm_(attn.reshape(batch, heads * dim), layer.wo.t())
        h = rms_norm(x, layer.mlp_norm, eps)
        x.addmm_(swiglu(F.linear(h, layer.w_gate_up)), layer.w_down.t())
    return F.linear(rms_norm(x, model.final_norm, eps), model.lm_head)


# Ops that only make views (no kernel) unless they had to copy.
VIEWS = {
    "aten::view",
    "aten::reshape",
    "aten::slice",
    "aten::select",
    "aten::unflatten",
    "aten::flatten",
    "aten::t",
    "aten::transpose",
    "aten::as_strided",
    "aten::_reshape_alias",
    "aten::unsqueeze",
    "aten::expand",
    "aten::alias",
    "aten::chunk",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::narrow",
    "aten::detach",
}


def dispatched_ops(fn) -> dict[str, int]:
    """Top-level aten ops of one call of ``fn`` by name (views that copied nothing left out)."""

    def descendants(event):
        for child in event.cpu_children:
            yield child
            yield from descendants(child)

    with torch.inference_mode():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (
            parent is not None and parent.name.startswith("aten::")
        ):
            continue
        copied = any(d.name in ("aten::copy_", "aten::clone") for d in descendants(event))
        if event.name in VIEWS and not copied:
            continue
        counts[event.name] = counts.get(event.name, 0) + 1
    return counts


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_untuned_step_is_the_lean_torch_step(preset: str) -> None:
    model = random_model(small_config(preset), seed=1)
    cache = KVCache(model.config, 4, 48)
    cache.k.normal_(generator=torch.Generator().manual_seed(2))
    cache.v.normal_(generator=torch.Generator().manual_seed(3))
    step = DecodeStep(model, cache, contiguous_slots=True)
    args = (torch.tensor([5, 17, 99]), torch.tensor([40, 3, 11]), torch.arange(3))
    want = dispatched_ops(lambda: reference_step(step, *args))
    got = dispatched_ops(lambda: step(*args))
    # The same ops, one for one: RoPE of q and k in one pass with the rows gathered once per
    # step, the residual adds inside the output GEMMs (addmm_), F.rms_norm, index_copy_, SDPA.
    assert got == want
    assert got["aten::addmm_"] == 2 * model.config.num_layers
    assert got["aten::index_select"] == 2  # cos and sin, once per step
    with torch.inference_mode():
        torch.testing.assert_close(step(*args), reference_step(step, *args), rtol=0, atol=0)


class _FirstWins:
    """Fake timer: every candidate takes 1 us, so the first-listed (the torch fallback) wins and
    the CPU never runs an interpreted kernel in a timed loop."""

    name = "fake"

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


def _tuner() -> AutoTuner:
    return AutoTuner(
        timer=_FirstWins(), show_progress=False, policy=TuningPolicy(rounds=1, remeasure_top=0)
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tuning_by_running_the_step_leaves_no_fallback_at_any_captured_size(preset: str) -> None:
    tuner = _tuner()
    engine = Engine(
        random_model(small_config(preset), seed=0),
        runner="eager",
        max_batch_size=12,
        max_seq_len=32,
        tune=True,
        tuner=tuner,
    )
    report = engine.tune_report
    assert report is not None and report.buckets == (1, 2, 4, 8, 12)
    assert report.profiles_tuned > 0 and not tuner.tuning_mode
    tuned_ops = {row[0] for row in report.rows}
    assert {"graphtune.gemm", "graphtune.rms_norm", "graphtune.rope_kv_cache"} <= tuned_ops
    assert {"graphtune.silu_and_mul", "decode_attention"} <= tuned_ops
    misses = tuner.stats.misses
    with torch.inference_mode():
        for size in (*default_capture_sizes(engine.max_batch_size), 3, 5, 11):
            engine.step(*engine.example_inputs(size))
    assert tuner.stats.fallbacks == {}, engine.tuning_report()
    assert tuner.stats.misses == misses  # every look-up hit a tuned pick
    assert "no fallbacks" in engine.tuning_report()


def test_tune_step_needs_a_tuner() -> None:
    model = random_model(get_preset("tiny"))
    with pytest.raises(ConfigError, match="needs a step built with a tuner"):
        tune_step(DecodeStep(model, KVCache(model.config, 2, 16)))


def test_tune_step_writes_only_the_scratch_slot() -> None:
    model = random_model(get_preset("tiny"))
    cache = KVCache(model.config, 3, 16)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    before = cache.k.clone()
    tune_step(DecodeStep(model, cache, contiguous_slots=True, tuner=_tuner()))
    owned = slice(0, cache.max_batch_size)
    assert torch.equal(cache.k[:, owned], before[:, owned])
    assert not torch.equal(cache.k[:, cache.scratch_slot], before[:, cache.scratch_slot])


def test_prefill_last_logits_are_the_last_row_of_all_logits() -> None:
    model = random_model(get_preset("mistral-tiny"), seed=4)  # sliding window, one KV head
    step = DecodeStep(model, KVCache(model.config, 2, 48))
    prompt = torch.arange(1, 40)
    with torch.inference_mode():
        every = prefill(step, prompt, 1, all_logits=True).clone()
        last = prefill(step, prompt, 1)
    assert every.shape == (39, model.config.vocab_size) and last.shape == (model.config.vocab_size,)
    torch.testing.assert_close(last, every[-1], rtol=1e-5, atol=1e-5)


def test_untuned_step_traces_as_one_graph() -> None:
    """torch.compile sees plain torch in the untuned step: one graph, no breaks."""
    dynamo = pytest.importorskip("torch._dynamo")
    model = random_model(get_preset("tiny"))
    step = DecodeStep(model, KVCache(model.config, 2, 16), contiguous_slots=True)
    args = (torch.tensor([1, 2]), torch.tensor([3, 4]), torch.arange(2))
    with torch.inference_mode():
        explained = dynamo.explain(lambda *a: step(*a))(*args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
