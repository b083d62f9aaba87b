"""Reference decode engine for Llama-family models (Llama 2/3, Qwen2, Mistral, Qwen3) and their
mixture-of-experts relatives (Qwen3-MoE, Mixtral).

Build a model with :func:`load_model` (a Hugging Face checkpoint folder or a preset with random
weights), wrap it in an :class:`Engine` that picks a graph or eager step runner, and call
:meth:`Engine.generate` (its ``on_tokens`` hook gets each step's :class:`TokenEvent` list, to
stream). Pass ``parallel=ParallelContext(...)`` to :func:`load_model` for tensor-parallel decode
over a ``torch.distributed`` group. The step has one forward
(:mod:`graphtune.engine.step`) and is tuned by running it (:func:`tune_step`);
``graphtune bench decode`` (:mod:`graphtune.bench`) measures it (see docs/engine.md).
"""

from graphtune.engine.build import build_runner, build_step
from graphtune.engine.config import ModelConfig, RopeScaling, from_hf_config
from graphtune.engine.devices import resolve_device, resolve_dtype
from graphtune.engine.engine import Engine
from graphtune.engine.events import TokenEvent
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.loading import load_checkpoint, load_config, load_model
from graphtune.engine.model import DecoderModel, LayerWeights, random_model
from graphtune.engine.parallel import ParallelContext, TensorParallelDecodeStep, shard_model
from graphtune.engine.prefill import PrefillStep, prefill, prefill_capture_sizes
from graphtune.engine.presets import PRESETS, fewer_layers, get_preset
from graphtune.engine.requests import RequestFailure
from graphtune.engine.sampling import GREEDY, SamplingParams, sample
from graphtune.engine.step import DecodeStep, step_pad_rule
from graphtune.engine.tuning import (
    FusionCheck,
    TuneReport,
    check_fusion,
    record_step_calls,
    tune_step,
)

__all__ = [
    "GREEDY",
    "PRESETS",
    "DecodeStep",
    "DecoderModel",
    "Engine",
    "RequestFailure",
    "KVCache",
    "LayerWeights",
    "ModelConfig",
    "ParallelContext",
    "PrefillStep",
    "RopeScaling",
    "SamplingParams",
    "TensorParallelDecodeStep",
    "TokenEvent",
    "FusionCheck",
    "TuneReport",
    "build_runner",
    "build_step",
    "fewer_layers",
    "from_hf_config",
    "get_preset",
    "load_checkpoint",
    "load_config",
    "load_model",
    "prefill",
    "prefill_capture_sizes",
    "random_model",
    "record_step_calls",
    "resolve_device",
    "resolve_dtype",
    "sample",
    "shard_model",
    "step_pad_rule",
    "check_fusion",
    "tune_step",
]
