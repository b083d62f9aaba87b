"""Reading one mixture-of-experts layer from a checkpoint, in either layout transformers uses.

The engine holds a layer's experts as ``gate_up [E, 2I, H]`` (each expert's gate rows, then its
up rows) and ``down [E, H, I]``, the layout :func:`graphtune.ops.fused_moe` takes and the one
transformers 5 keeps in memory (``Qwen3MoeExperts.gate_up_proj`` / ``down_proj``). Checkpoints
come in two layouts, both read here:

* **per expert**, as published on the Hub and as transformers 5 writes them by default
  (``save_pretrained`` converts back to the original format): Qwen3-MoE
  ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` with the router ``mlp.gate``;
  Mixtral ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) with the
  router ``block_sparse_moe.gate``;
* **fused**, as transformers 5 writes with ``save_original_format=False``: ``mlp.experts.
  gate_up_proj`` and ``mlp.experts.down_proj`` with the router ``mlp.gate``, for both.

Per-expert tensors are copied into preallocated stacks, so a layer never holds two copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphtune.engine.config import ModelConfig

#: ``get(name, shape)``: the named checkpoint tensor, checked against ``shape``, on the target
#: device and dtype.
Getter = Callable[[str, tuple[int, ...]], torch.Tensor]

#: Per-expert names: (module prefix, gate, up, down) per architecture.
PER_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def load_moe_layer(
    get: Getter, has: Callable[[str], bool], prefix: str, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router [E, H], gate_up [E, 2I, H], down [E, H, I])`` of the layer at ``prefix``
    (``"model.layers.{i}."``).

    Raises:
        CheckpointError: A tensor is missing or has the wrong shape (raised by ``get``, naming
            the tensor; a per-expert checkpoint's message names the first missing expert).
    """
    experts, hidden = config.num_experts, config.hidden_size
    inter = config.moe_intermediate_size
    fused = prefix + "mlp.experts.gate_up_proj"
    if has(fused):
        return (
            get(prefix + "mlp.gate.weight", (experts, hidden)),
            get(fused, (experts, 2 * inter, hidden)),
            get(prefix + "mlp.experts.down_proj", (experts, hidden, inter)),
        )
    module, gate_name, up_name, down_name = PER_EXPERT_NAMES[config.architecture]
    base = f"{prefix}{module}."
    router = get(base + "gate.weight", (experts, hidden))
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    for e in range(experts):
        names = (f"{base}experts.{e}.{name}.weight" for name in (gate_name, up_name, down_name))
        gate = get(next(names), (inter, hidden))
        up = get(next(names), (inter, hidden))
        expert_down = get(next(names), (hidden, inter))
        if gate_up is None or down is None:
            gate_up = gate.new_empty((experts, 2 * inter, hidden))
            down = gate.new_empty((experts, hidden, inter))
        gate_up[e, :inter].copy_(gate)
        gate_up[e, inter:].copy_(up)
        down[e].copy_(expert_down)
    assert gate_up is not None and down is not None  # ModelConfig guarantees experts >= 1
    return router, gate_up, down
