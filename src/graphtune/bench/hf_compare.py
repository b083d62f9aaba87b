"""transformers' implementation of the benchmarked model on the engine's own tensors, for
``bench decode --compare-hf``: the anchor, and one logits check.

:func:`hf_model` builds the transformers model of the engine's architecture (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``) on
the ``meta`` device and makes every parameter a view of the engine's tensor: no second random
init and no copy (Q/K/V and gate/up are row slices of the engine's fused matrices; the experts'
``gate_up_proj`` and ``down_proj`` are the engine's stacks as they are); only the RoPE buffers are
built again. A 30 B-parameter shape thus fits on one GPU once, for both implementations.

:func:`time_hf_decode` runs transformers' decode at one batch size on a ``StaticCache`` prefilled
with ``context`` tokens (:class:`HfDecoder`):

1. the eager forward. Its first decode step is the logits check: the prefilled cache is copied
   into the engine's cache and the engine's untuned step runs the same tokens at the same
   position (largest logit difference, share of rows with the same greedy token). Then the eager
   step is timed: the anchor where compiling fails, and for mixture-of-experts models;
2. with ``compile=True``, the recipe Hugging Face documents for fast decoding (the issue-13
   anchor): a fresh static cache and the decode forward compiled with
   ``mode="reduce-overhead"`` (CUDA graphs) and ``fullgraph=True`` (compiled again with graph
   breaks when that fails, and ``note`` says so), timed like the engine's steps.

Every decode call writes the next cache position (the static cache counts its tokens itself in
recent transformers), so each cache holds ``context + 1 +`` the calls made;
``HfDecodeTiming.max_cache_len`` says how long the compiled one was (attention reads all of it with
a mask, as the engine's untuned SDPA step reads its whole ``max_seq_len``). transformers' forward
has renamed its arguments across releases (``past_key_values`` to ``cache``, ``cache_position``
dropped), so the call is built from the signature of the installed version.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtune.bench.cupti import gpu_busy
from graphtune.bench.timing import sync, time_per_call_ms
from graphtune.engine.config import ModelConfig
from graphtune.engine.hf_fields import HF_ACTIVATIONS
from graphtune.engine.kv_cache import aligned_seq_len
from graphtune.engine.model import DecoderModel
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: transformers' config and model classes per ``ModelConfig.architecture``.
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
#: Decode calls ``time_hf_decode`` may make on one cache beyond ``warmup + steps * repeats``.
EXTRA_CALLS = 16


def hf_unavailable(model: DecoderModel) -> str | None:
    """Why transformers cannot run ``model`` here, or ``None`` when it can."""
    if model.parallel is not None:
        return "--compare-hf skipped: transformers runs one whole model, not a shard"
    if model.config.architecture not in HF_CLASSES:
        return f"--compare-hf skipped: no transformers class for {model.config.architecture!r}"
    try:
        import transformers  # noqa: F401  (the import is the check)
    except ImportError:
        return "--compare-hf skipped: transformers is not installed (pip install transformers)"
    return None


def hf_config_fields(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``config`` as a published checkpoint writes them (what
    :func:`graphtune.engine.config.from_hf_config` maps back to ``config``)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None:
        rope.update(rope_type=scaling.rope_type, factor=scaling.factor)
        if scaling.rope_type == "llama3":
            rope.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
    eos = list(config.eos_token_ids)
    fields: dict[str, Any] = dict(
        architectures=[HF_CLASSES[config.architecture][1]],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        hidden_act=next(hf for hf, ours in HF_ACTIVATIONS.items() if ours == config.hidden_act),
    )
    if config.head_dim is not None:
        fields["head_dim"] = config.head_dim
    arch = config.architecture
    if arch in ("mistral", "mixtral"):
        fields["sliding_window"] = config.sliding_window
    if arch in ("qwen2", "qwen3") and config.sliding_window is not None:
        raise ConfigError(f"hf_config_fields: {arch} with a sliding window is not supported")
    if arch == "llama":
        fields["mlp_bias"] = config.mlp_bias
    if arch == "qwen3":
        fields["use_sliding_window"] = False
    if arch == "mixtral":
        fields.update(
            intermediate_size=config.moe_intermediate_size,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
        )
    if arch == "qwen3_moe":
        fields.update(
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
            mlp_only_layers=list(config.mlp_only_layers),
            decoder_sparse_step=config.decoder_sparse_step,
            use_sliding_window=False,
        )
    return fields


def hf_state_dict(model: DecoderModel) -> dict[str, torch.Tensor]:
    """transformers' parameter names mapped to (views of) the engine's tensors."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {
        "model.embed_tokens.weight": model.embed,
        "model.norm.weight": model.final_norm,
        "lm_head.weight": model.lm_head,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = layer.attn_norm
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        for name, part in zip(("q", "k", "v"), layer.wqkv.split((q, kv, kv)), strict=True):
            out[f"{a}{name}_proj.weight"] = part
        if layer.bqkv is not None:
            for name, part in zip(("q", "k", "v"), layer.bqkv.split((q, kv, kv)), strict=True):
                out[f"{a}{name}_proj.bias"] = part
        out[a + "o_proj.weight"] = layer.wo
        if layer.q_norm is not None and layer.k_norm is not None:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = layer.q_norm, layer.k_norm
        if layer.is_moe:
            out[p + "mlp.gate.weight"] = layer.router
            out[p + "mlp.experts.gate_up_proj"] = layer.experts_gate_up
            out[p + "mlp.experts.down_proj"] = layer.experts_down
        elif layer.w_gate_up is not None:
            out[p + "mlp.gate_proj.weight"] = layer.w_gate_up[:inter]
            out[p + "mlp.up_proj.weight"] = layer.w_gate_up[inter:]
            out[p + "mlp.down_proj.weight"] = layer.w_down
        if layer.b_gate_up is not None and layer.b_down is not None:
            out[p + "mlp.gate_proj.bias"] = layer.b_gate_up[:inter]
            out[p + "mlp.up_proj.bias"] = layer.b_gate_up[inter:]
            out[p + "mlp.down_proj.bias"] = layer.b_down
    return out


def hf_model(model: DecoderModel, attn_implementation: str = "sdpa") -> Any:
    """transformers' model of ``model`` whose parameters are views of ``model``'s tensors.

    Raises:
        ConfigError: transformers is not installed, the architecture has no class in it, the
            model is a tensor-parallel shard, or a parameter has no engine tensor (or another
            shape).
    """
    reason = hf_unavailable(model)
    if reason is not None:
        raise ConfigError(reason.replace("--compare-hf skipped: ", "hf_model: "))
    import transformers

    config_name, model_name = HF_CLASSES[model.config.architecture]
    hf_config = getattr(transformers, config_name)(**hf_config_fields(model.config))
    hf_config._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf = getattr(transformers, model_name)(hf_config)
    tensors = hf_state_dict(model)
    shared: dict[int, torch.nn.Parameter] = {}  # tied embeddings stay one parameter
    for name, param in hf.named_parameters(remove_duplicate=False):
        tensor = tensors.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(param.shape):
            raise ConfigError(
                f"hf_model: transformers' {name} {tuple(param.shape)} has no engine tensor of "
                f"that shape (got {None if tensor is None else tuple(tensor.shape)})"
            )
        owner, _, leaf = name.rpartition(".")
        new = shared.setdefault(id(tensor), torch.nn.Parameter(tensor, requires_grad=False))
        hf.get_submodule(owner)._parameters[leaf] = new
    _rebuild_meta_buffers(hf, hf_config, model.device)
    meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(f"hf_model: tensors left on the meta device: {meta[:5]}")
    return hf.eval()


def _rebuild_meta_buffers(hf: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Re-creates, on ``device``, the modules whose buffers were made on ``meta`` (the RoPE
    frequencies: they are computed from the config, not loaded)."""
    for name, module in list(hf.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = hf.get_submodule(parent_name) if parent_name else hf
        with torch.device(device):
            setattr(parent, attr, type(module)(config=config))


@dataclass
class HfDecodeTiming:
    """transformers' decode step at one batch size (milliseconds per step).

    Attributes:
        ms: The compiled recipe (CUDA events around back-to-back calls, median of repeats);
            ``None`` when not asked or when it failed (``note`` says why).
        eager_ms: The eager forward on its static cache, timed the same way.
        compile_s: Wall time of the first compiled call (compilation and CUDA graph recording).
        max_cache_len: Length of the compiled recipe's static cache (what attention reads).
        busy_ms: GPU-busy time of one compiled step (profiler), when measured.
        kernels_per_step: Device activities per compiled step, when measured.
        families: Device time of one compiled step by kernel family, when measured.
        note: How compiling went (``"failed: ..."`` on a compiler error), for people.
        max_abs_diff: Largest logit difference from the engine's untuned step on the same cache.
        argmax_agreement: Share of rows where both pick the same greedy token.
        check_note: Why there is no logits check, if there is none.
    """

    ms: float | None = None
    eager_ms: float | None = None
    compile_s: float | None = None
    max_cache_len: int | None = None
    busy_ms: float | None = None
    kernels_per_step: float | None = None
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str = ""
    max_abs_diff: float | None = None
    argmax_agreement: float | None = None
    check_note: str | None = None


class HfDecoder:
    """A static cache of one batch size, prefilled, and the (compiled) decode call on it."""

    def __init__(
        self,
        hf: Any,
        prompt: torch.Tensor,
        max_cache_len: int,
        *,
        compile_forward: bool = True,
        fullgraph: bool = True,
    ) -> None:
        from transformers import StaticCache

        self.hf = hf
        self.batch, self.position = prompt.shape[0], prompt.shape[1]
        self.device = prompt.device
        params = inspect.signature(hf.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        offered = inspect.signature(StaticCache.__init__).parameters
        extra = {
            "max_batch_size": self.batch,
            "batch_size": self.batch,
            "device": self.device,
            "dtype": next(hf.parameters()).dtype,
        }
        kwargs = {k: v for k, v in extra.items() if k in offered}
        self.cache = StaticCache(config=hf.config, max_cache_len=max_cache_len, **kwargs)
        self.prefill_logits = self._forward(hf.forward, prompt, 0, {keep: 1} if keep else {})
        self.token = self.prefill_logits[:, -1].argmax(-1, keepdim=True)
        self.forward: Callable[..., Any] = hf.forward
        if compile_forward:
            self.forward = torch.compile(
                hf.forward, mode="reduce-overhead", fullgraph=fullgraph, dynamic=False
            )

    def _forward(
        self, fn: Callable[..., Any], ids: torch.Tensor, start: int, extra: dict[str, Any]
    ) -> torch.Tensor:
        length = ids.shape[1]
        positions = torch.arange(start, start + length, device=self.device)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "position_ids": positions[None].expand(self.batch, length),
            self.cache_arg: self.cache,
            "use_cache": True,
            **extra,
        }
        if self.cache_position:
            kwargs["cache_position"] = positions
        return fn(**kwargs).logits

    def step(self) -> torch.Tensor:
        """One decode step at the next position; returns ``[B, 1, vocab]`` logits."""
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
        if mark is not None:
            mark()
        logits = self._forward(self.forward, self.token, self.position, {})
        self.position += 1
        return logits


def check_logits(decoder: HfDecoder, step: DecodeStep, result: HfDecodeTiming) -> None:
    """The logits check: ``decoder``'s prefilled cache copied into ``step``'s cache slots
    ``[0, B)`` (overwritten), then one decode step of both on the same tokens at the same
    position; fills ``max_abs_diff`` and ``argmax_agreement`` (or ``check_note``)."""
    window = getattr(decoder.hf.config, "sliding_window", None)
    context, batch = decoder.position, decoder.batch
    if window is not None and context >= window:
        # transformers' sliding-window cache keeps the last tokens in a rolled buffer.
        result.check_note = (
            f"no logits check: context {context} fills the sliding window {window}, which "
            "transformers keeps as a rolled buffer"
        )
        return
    for layer, hf_layer in enumerate(decoder.cache.layers):
        step.cache.k_layers[layer][:batch, :, :context].copy_(hf_layer.keys[:, :, :context])
        step.cache.v_layers[layer][:batch, :, :context].copy_(hf_layer.values[:, :, :context])
    device = decoder.device
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    want = step(decoder.token[:, 0], positions, torch.arange(batch, device=device)).float()
    got = decoder.step()[:, -1].float()
    result.max_abs_diff = float((got - want).abs().max())
    result.argmax_agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())


def time_hf_decode(
    hf: Any,
    prompt: torch.Tensor,
    *,
    steps: int,
    repeats: int,
    compile: bool = True,
    measure_busy: bool = False,
    check_step: DecodeStep | None = None,
) -> HfDecodeTiming:
    """Times transformers' decode step after prefilling ``prompt [B, context]``, eagerly and
    (``compile``) through the compiled recipe (see the module docstring).

    ``check_step``: the engine's untuned step over the same weights, for the logits check (its
    cache slots ``[0, B)`` are overwritten). Compiler and recording failures are returned in
    ``note`` (``"failed: ..."``), not raised; so is a failed check (``check_note``).
    """
    device = prompt.device
    calls = 4 + steps * repeats + EXTRA_CALLS
    max_cache_len = aligned_seq_len(prompt.shape[1] + 1 + calls)
    result = HfDecodeTiming()
    eager = HfDecoder(hf, prompt, max_cache_len, compile_forward=False)
    if check_step is not None:
        try:
            check_logits(eager, check_step, result)
        except Exception as exc:  # reported, and the timing still runs
            logger.warning("transformers logits check failed: %s", exc)
            result.check_note = f"logits check failed: {type(exc).__name__}: {str(exc)[:200]}"
    result.eager_ms = time_per_call_ms(eager.step, device, steps, repeats)
    del eager
    if compile:
        _time_compiled(hf, prompt, max_cache_len, steps, repeats, measure_busy, result)
    return result


def _time_compiled(
    hf: Any,
    prompt: torch.Tensor,
    max_cache_len: int,
    steps: int,
    repeats: int,
    measure_busy: bool,
    result: HfDecodeTiming,
) -> None:
    device = prompt.device
    result.max_cache_len = max_cache_len
    broke = ""
    for fullgraph in (True, False):
        try:
            decoder = HfDecoder(hf, prompt, max_cache_len, fullgraph=fullgraph)
            started = time.perf_counter()
            decoder.step()
            sync(device)
            result.compile_s = time.perf_counter() - started
            break
        except Exception as exc:  # a compiler failure is a result to report, not a crash
            logger.warning("transformers compiled decode (fullgraph=%s) failed: %s", fullgraph, exc)
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.compiler.reset()
            if not fullgraph:
                result.note = f"failed: {error} (fullgraph=True: {broke})"
                return
            broke = error
    try:
        decoder.step()
        result.ms = time_per_call_ms(decoder.step, device, steps, repeats)
        if measure_busy:
            busy = gpu_busy(decoder.step, calls=5)
            if busy is not None:
                result.busy_ms = busy.per_call_ms
                result.kernels_per_step = busy.activities_per_call
                result.families = busy.families
    except Exception as exc:  # a replay failure is a result to report, not a crash
        logger.warning("transformers compiled decode failed: %s", exc)
        result.note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        return
    finally:
        # The next batch size compiles its own graphs; drop these (and their memory pools).
        torch.compiler.reset()
    result.note = f"compiled in {result.compile_s:.1f} s, static cache {result.max_cache_len}"
    if broke:
        result.note += f"; fullgraph=True failed ({broke}), compiled with graph breaks"
