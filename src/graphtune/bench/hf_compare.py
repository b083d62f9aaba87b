"""Hugging Face transformers' decode recipe on the engine's own weights, for ``bench decode
--compare-hf``: a static KV cache and ``torch.compile(mode="reduce-overhead")``.

:func:`hf_model` builds the transformers model of the engine's architecture (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``) on the ``meta`` device and loads the engine's
tensors into it with ``assign=True``: no second random init and no copy (Q/K/V and gate/up are
row slices of the engine's fused matrices), only the RoPE buffers are rebuilt.
:func:`time_hf_decode` then runs the recipe Hugging Face documents for fast decoding: a
``StaticCache`` of one batch size, a prefill of ``context`` tokens, and the decode forward
compiled with ``mode="reduce-overhead"`` (CUDA graphs) and ``fullgraph=True``, timed like the
engine's steps (CUDA events around back-to-back calls).

Every call to the compiled forward writes the next cache position (the static cache counts its
tokens itself in recent transformers), so the cache holds ``context + 1 +`` the calls made;
``HfDecodeTiming.max_cache_len`` says how long it was (attention reads all of it with a mask, as
the engine's untuned SDPA step reads its whole ``max_seq_len``).

transformers' forward has renamed its arguments across releases (``past_key_values`` to
``cache``, ``cache_position`` dropped), so the call is built from the signature of the installed
version.
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
from graphtune.engine.kv_cache import aligned_seq_len
from graphtune.engine.model import DecoderModel
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: Compiled-forward calls ``time_hf_decode`` may make beyond ``warmup + steps * repeats``.
EXTRA_CALLS = 16


def hf_unavailable(model: DecoderModel, device: torch.device) -> str | None:
    """Why the Hugging Face comparison cannot run here, or ``None`` when it can."""
    if device.type != "cuda":
        return "--compare-hf skipped: torch.compile(mode='reduce-overhead') needs CUDA graphs"
    if model.parallel is not None:
        return "--compare-hf skipped: the Hugging Face recipe runs one whole model, not a shard"
    if model.config.architecture not in HF_CLASSES:
        return f"--compare-hf skipped: no transformers class for {model.config.architecture!r}"
    try:
        import transformers  # noqa: F401  (the import is the check)
    except ImportError:
        return "--compare-hf skipped: transformers is not installed (pip install transformers)"
    return None


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``config`` as a published checkpoint writes it (the inverse of
    :func:`graphtune.engine.config.from_hf_config`)."""
    out: dict[str, Any] = {
        "architectures": [HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.dim_per_head,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "use_cache": True,
    }
    scaling = config.rope_scaling
    if scaling is not None:
        out["rope_scaling"] = {"rope_type": scaling.rope_type, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            out["rope_scaling"].update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
    if config.architecture == "llama":
        out["attention_bias"] = False
        out["mlp_bias"] = False
    if config.architecture == "qwen2":
        out["use_sliding_window"] = False
    if config.architecture == "mistral":
        out["sliding_window"] = config.sliding_window
    return out


def hf_state_dict(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The engine's tensors under transformers' names (views of the fused matrices)."""
    cfg = model.config
    split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    out = {
        "model.embed_tokens.weight": model.embed,
        "model.norm.weight": model.final_norm,
        "lm_head.weight": model.lm_head,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.wqkv.split(split)
        out.update(
            {
                p + "input_layernorm.weight": layer.attn_norm,
                p + "post_attention_layernorm.weight": layer.mlp_norm,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.wo,
            }
        )
        if layer.bqkv is not None:
            qb, kb, vb = layer.bqkv.split(split)
            out.update(
                {
                    p + "self_attn.q_proj.bias": qb,
                    p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb,
                }
            )
        gate, up = layer.w_gate_up.chunk(2)
        out.update(
            {
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.w_down,
            }
        )
    return out


def hf_model(model: DecoderModel, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The transformers model of ``model``'s architecture holding ``model``'s own tensors.

    Raises:
        ConfigError: transformers is missing, or the architecture has no transformers class.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("the Hugging Face comparison needs transformers") from exc
    name = HF_CLASSES.get(model.config.architecture)
    if name is None:
        raise ConfigError(f"no transformers class for architecture {model.config.architecture!r}")
    data = hf_config_dict(model.config)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    config._attn_implementation = attn_implementation
    cls = getattr(transformers, name)
    with torch.device("meta"):
        hf = cls(config)
    state = hf_state_dict(model)
    hf.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    _rebuild_meta_buffers(hf, config, model.device)
    meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(f"transformers model left tensors on the meta device: {meta[:5]}")
    return hf.eval()


def _rebuild_meta_buffers(hf: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Re-creates the modules whose buffers were made on ``meta`` (the RoPE frequencies)."""
    for name, module in list(hf.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = hf.get_submodule(parent_name) if parent_name else hf
        setattr(parent, attr, type(module)(config=config).to(device))


@dataclass
class HfDecodeTiming:
    """One batch size of the Hugging Face recipe (milliseconds per decode step).

    Attributes:
        ms: Compiled decode step, CUDA events around back-to-back calls (median of repeats).
        compile_s: Wall time of the first compiled call (compilation and CUDA graph recording).
        max_cache_len: Length of the static cache (what attention reads per step).
        busy_ms: GPU-busy time of one compiled step (profiler), when measured.
        kernels_per_step: Device activities per compiled step, when measured.
        families: Device time by kernel family, when measured.
        note: What happened, for people (``"failed: ..."`` on a compiler error).
    """

    ms: float | None = None
    compile_s: float | None = None
    max_cache_len: int | None = None
    busy_ms: float | None = None
    kernels_per_step: float | None = None
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str = ""


class HfDecoder:
    """A static cache of one batch size, prefilled, and the (compiled) decode call on it."""

    def __init__(
        self,
        hf: torch.nn.Module,
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


def time_hf_decode(
    hf: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    steps: int,
    repeats: int,
    measure_busy: bool = False,
) -> HfDecodeTiming:
    """Times the compiled decode step of ``hf`` after prefilling ``prompt [B, context]``.

    The recipe compiles with ``fullgraph=True``; when that fails (a graph break in some
    transformers release) it is compiled again without, and ``note`` says so. Compiler and
    recording failures are returned in ``note`` (``"failed: ..."``), not raised.
    """
    device = prompt.device
    calls = 3 + steps * repeats + EXTRA_CALLS
    result = HfDecodeTiming(max_cache_len=aligned_seq_len(prompt.shape[1] + 1 + calls))
    broke = ""
    for fullgraph in (True, False):
        try:
            decoder = HfDecoder(hf, prompt, result.max_cache_len, fullgraph=fullgraph)
            started = time.perf_counter()
            decoder.step()
            sync(device)
            result.compile_s = time.perf_counter() - started
            break
        except Exception as exc:  # a compiler failure is a result to report, not a crash
            logger.warning("Hugging Face compiled decode (fullgraph=%s) failed: %s", fullgraph, exc)
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            if not fullgraph:
                result.note = f"failed: {error} (fullgraph=True: {broke})"
                return result
            broke = error
            torch.compiler.reset()
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
        logger.warning("Hugging Face compiled decode failed: %s", exc)
        result.note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        return result
    result.note = f"compiled in {result.compile_s:.1f} s, static cache {result.max_cache_len}"
    if broke:
        result.note += f"; fullgraph=True failed ({broke}), compiled with graph breaks"
    return result
