"""Reference decode engine for Llama-family models (Llama 2/3, Qwen2, Mistral).

Build a model with :func:`load_model` (a Hugging Face checkpoint folder or a preset with random
weights), wrap it in an :class:`Engine` that picks a graph or eager step runner, and call
:meth:`Engine.generate`. Pass ``parallel=ParallelContext(...)`` to :func:`load_model` for
tensor-parallel decode over a ``torch.distributed`` group. ``graphtune bench decode`` measures
the decode step (see docs/engine.md).
"""

from graphtune.engine.config import PRESETS, ModelConfig, RopeScaling, from_hf_config, get_preset
from graphtune.engine.engine import Engine, RequestFailure, step_pad_rule
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.loading import load_checkpoint, load_model
from graphtune.engine.model import DecoderModel, LayerWeights, random_model
from graphtune.engine.parallel import ParallelContext, TensorParallelDecodeStep, shard_model
from graphtune.engine.sampling import GREEDY, SamplingParams, sample
from graphtune.engine.step import DecodeStep, prefill

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
    "RopeScaling",
    "SamplingParams",
    "TensorParallelDecodeStep",
    "from_hf_config",
    "get_preset",
    "load_checkpoint",
    "load_model",
    "prefill",
    "random_model",
    "sample",
    "shard_model",
    "step_pad_rule",
]
