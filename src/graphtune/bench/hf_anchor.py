"""transformers' implementation of the benchmarked model, on the same weights: the anchor.

:func:`hf_model_sharing` builds the transformers model of a :class:`~graphtune.engine.DecoderModel`
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Qwen3MoeForCausalLM`` or
``MixtralForCausalLM``) without a second copy of the weights: the modules are built on the meta
device and every parameter is then a view of the engine's tensor (Q, K and V are row slices of the
fused QKV matrix, gate and up of the fused gate/up one; the experts' ``gate_up_proj`` and
``down_proj`` are the engine's stacks as they are). A 30 B-parameter shape thus fits on one GPU
once, for both implementations.

:func:`time_hf_decode` times transformers' own decode step for a batch: a ``StaticCache`` filled
by a prefill of ``context`` random tokens, then the forward of one token per request at position
``context`` (the same position every call, so every call costs the same; newer transformers keep
the write position in the cache, which is set back before each call), eagerly and optionally
through ``torch.compile(mode="reduce-overhead")``. It also copies that cache into the engine's
and runs the engine's step on the same tokens, so the anchor comes with an accuracy check: the
largest logit difference and how often both pick the same greedy token.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.timing import sync, time_per_call_ms
from graphtune.engine.config import ModelConfig
from graphtune.engine.model import DecoderModel
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: transformers' config and model classes per ``ModelConfig.architecture``.
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def hf_config_fields(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``config`` (what ``from_hf_config`` maps back to it)."""
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
        hidden_act="silu",
    )
    if config.head_dim is not None:
        fields["head_dim"] = config.head_dim
    arch = config.architecture
    if arch in ("mistral", "mixtral"):
        fields["sliding_window"] = config.sliding_window
    if arch == "qwen2" and config.sliding_window is not None:
        raise ConfigError("hf_config_fields: Qwen2 with a sliding window is not supported")
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


def _engine_tensors(model: DecoderModel) -> dict[str, torch.Tensor]:
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
    return out


def hf_model_sharing(model: DecoderModel) -> Any:
    """transformers' model of ``model`` whose parameters are views of ``model``'s tensors.

    Raises:
        ConfigError: transformers is not installed, the architecture has no class in it, the
            model is a tensor-parallel shard, or a parameter has no engine tensor (or another
            shape).
    """
    if model.parallel is not None:
        raise ConfigError("hf_model_sharing needs a whole model, not a tensor-parallel shard")
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the transformers anchor needs the 'transformers' package: pip install transformers"
        ) from None
    config_name, model_name = HF_CLASSES[model.config.architecture]
    hf_config = getattr(transformers, config_name)(**hf_config_fields(model.config))
    with torch.device("meta"):
        hf = getattr(transformers, model_name)(hf_config)
    tensors = _engine_tensors(model)
    shared: dict[int, torch.nn.Parameter] = {}  # tied embeddings stay one parameter
    for name, param in hf.named_parameters(remove_duplicate=False):
        tensor = tensors.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(param.shape):
            raise ConfigError(
                f"hf_model_sharing: transformers' {name} {tuple(param.shape)} has no engine "
                f"tensor of that shape (got {None if tensor is None else tuple(tensor.shape)})"
            )
        owner, _, leaf = name.rpartition(".")
        new = shared.setdefault(id(tensor), torch.nn.Parameter(tensor, requires_grad=False))
        hf.get_submodule(owner)._parameters[leaf] = new
    # The rotary tables are buffers built from the config; build them again on the device.
    rotary = hf.model.rotary_emb
    with torch.device(model.device):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(f"hf_model_sharing: tensors left on the meta device: {meta[:5]}")
    return hf.eval()


@dataclass
class HfDecodeTiming:
    """transformers' decode step at one batch size.

    Attributes:
        eager_ms: Per-step time of the eager forward.
        compile_ms: Per-step time through ``torch.compile(mode="reduce-overhead")``, if asked.
        compile_note: How compiling went (seconds, or the failure).
        max_abs_diff: Largest logit difference from the engine's untuned step on the same cache.
        argmax_agreement: Share of rows where both pick the same greedy token.
        check_note: Why there is no accuracy check, if there is none.
    """

    eager_ms: float
    compile_ms: float | None = None
    compile_note: str | None = None
    max_abs_diff: float | None = None
    argmax_agreement: float | None = None
    check_note: str | None = None


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_kwarg(hf: Any) -> str:
    # transformers 5.2x renamed the forward's past_key_values to cache (the old name warns).
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _rewind(cache: Any, context: int) -> None:
    # transformers >= 5.2x writes a StaticCache layer at its own running position
    # (``cumulative_length``, a device tensor; sliding-window layers also keep it as a Python int)
    # instead of the call's cache_position: set it back so that every timed call writes position
    # ``context`` (one fill per layer, timed with the call). The accuracy check catches a
    # transformers version that keeps the position elsewhere.
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(context)
        if isinstance(getattr(layer, "cumulative_length_int", None), int):
            layer.cumulative_length_int = context


def time_hf_decode(
    hf: Any,
    step: DecodeStep,
    tokens: torch.Tensor,
    context: int,
    *,
    steps: int,
    repeats: int,
    compile: bool = False,
    seed: int = 0,
) -> HfDecodeTiming:
    """Times transformers' decode step for ``tokens [B]`` after ``context`` cached tokens.

    Args:
        hf: The model from :func:`hf_model_sharing`.
        step: The engine's untuned step over the same weights; its cache slots ``[0, B)`` get
            transformers' keys and values for the accuracy check (overwritten).
        tokens: ``[B]`` the token each request feeds.
        context: Tokens already cached per request (prefilled with random tokens).
        steps: Calls per timed repeat.
        repeats: Timed repeats (median reported).
        compile: Also time ``torch.compile(hf, mode="reduce-overhead")``.
        seed: Seed of the prefill tokens.
    """
    from transformers import StaticCache

    device, batch = tokens.device, tokens.shape[0]
    cache = StaticCache(config=hf.config, max_cache_len=context + 1)
    gen = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.randint(0, hf.config.vocab_size, (batch, context), generator=gen, device=device)
    position = torch.full((batch, 1), context, dtype=torch.long, device=device)
    cache_kwarg = _cache_kwarg(hf)
    inputs = {
        "input_ids": tokens[:, None],
        "position_ids": position,
        "cache_position": position[0],
        cache_kwarg: cache,
        "use_cache": True,
    }

    def call(model: Any = hf) -> Any:
        _rewind(cache, context)
        return model(**inputs)

    with torch.inference_mode():
        if context:
            hf(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
        want = call().logits[:, -1]
        result = HfDecodeTiming(time_per_call_ms(call, device, steps, repeats))
        if compile:
            _time_compiled(call, hf, device, steps, repeats, result)
        window = getattr(hf.config, "sliding_window", None)
        if window is not None and context >= window:
            # transformers' sliding-window cache keeps the last tokens in a rolled buffer.
            result.check_note = (
                f"no accuracy check: context {context} fills the sliding window {window}, which "
                "transformers keeps as a rolled buffer"
            )
            return result
        for layer, (keys, values) in enumerate(_cache_layers(cache)):
            step.cache.k_layers[layer][:batch, :, :context].copy_(keys[:, :, :context])
            step.cache.v_layers[layer][:batch, :, :context].copy_(values[:, :, :context])
        slots = torch.arange(batch, device=device)
        got = step(tokens, position[:, 0], slots)
    result.max_abs_diff = float((got.float() - want.float()).abs().max())
    result.argmax_agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return result


def _time_compiled(
    step_call: Callable[[Any], Any],
    hf: Any,
    device: torch.device,
    steps: int,
    repeats: int,
    result: HfDecodeTiming,
) -> None:
    compiled = torch.compile(hf, mode="reduce-overhead", dynamic=False)
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    def call() -> Any:
        if mark is not None:
            mark()
        return step_call(compiled)

    started = time.perf_counter()
    try:
        call()
        sync(device)
        seconds = time.perf_counter() - started
        result.compile_ms = time_per_call_ms(call, device, steps, repeats)
    except Exception as exc:  # a compiler failure is a result to report, not a crash
        logger.warning("torch.compile of the transformers model failed: %s", exc)
        result.compile_note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        return
    finally:
        # The next batch size compiles its own graphs; drop these (and their memory pools).
        torch.compiler.reset()
    result.compile_note = f"compiled in {seconds:.1f} s"


def time_hf_anchor(
    step: DecodeStep,
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    results: list[BatchResult],
    cfg: DecodeBenchConfig,
    report: DecodeBenchReport,
    log: Callable[[str], None],
) -> None:
    """The anchor of ``run_decode_bench`` (``cfg.compare_hf``): transformers on ``step``'s
    weights at every batch size, into the ``hf_*`` fields of ``results``; a note in ``report``
    says which transformers and which attention and experts implementations ran."""
    import transformers

    hf = hf_model_sharing(step.model)

    hf_config = hf.config
    report.notes.append(
        f"transformers {transformers.__version__} anchor on the same weight tensors: attention "
        f"{hf_config._attn_implementation!r}, experts "
        f"{getattr(hf_config, '_experts_implementation', None)!r}, StaticCache"
    )
    for (tokens, _, _), result in zip(inputs, results, strict=True):
        timing = time_hf_decode(
            hf,
            step,
            tokens,
            cfg.context,
            steps=cfg.steps,
            repeats=cfg.repeats,
            compile=cfg.hf_compile,
            seed=cfg.seed,
        )
        result.hf_eager_ms = timing.eager_ms
        result.hf_compile_ms = timing.compile_ms
        result.hf_compile_note = timing.compile_note
        result.hf_max_abs_diff = timing.max_abs_diff
        result.hf_argmax_agreement = timing.argmax_agreement
        agree = timing.argmax_agreement
        if timing.check_note and timing.check_note not in report.notes:
            report.notes.append(timing.check_note)
        log(
            f"batch {result.batch_size}: transformers eager {timing.eager_ms:.3f} ms/step"
            + (f", compiled {timing.compile_ms:.3f} ms/step" if timing.compile_ms else "")
            + (f" ({timing.compile_note})" if timing.compile_note else "")
            + (f"; greedy tokens agree on {100 * agree:.0f}% of rows" if agree is not None else "")
        )
