"""The bytes a mixture-of-experts decode step really reads: its routing, counted per layer.

A dense decode step reads every weight once; an MoE step reads, in each MoE layer, only the
experts its tokens selected. The decode benchmark's bytes floor for an MoE model therefore counts
the weights from the routing of the very step it times:

* :func:`record_routing` runs the step once eagerly through a :class:`RoutingRecorder` (an
  :class:`~graphtune.ops.OpContext` that keeps every ``topk_ids`` ``fused_moe`` receives);
* :func:`experts_hit` counts the distinct experts per MoE layer;
* :func:`step_weight_bytes` adds every non-expert weight (attention, norms, routers, dense MLPs,
  the LM head) and, per MoE layer, the gate/up and down rows of the experts hit.

:func:`expected_experts_hit` is the same count's expectation under uniform routing (each token
picks k distinct experts uniformly at random), reported beside the measured count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from graphtune.engine.attention import DecodeAttention
from graphtune.engine.model import DecoderModel
from graphtune.engine.step import DecodeStep
from graphtune.errors import InputError
from graphtune.ops.context import OpContext


@dataclass(frozen=True)
class RoutingRecorder(OpContext):
    """The untuned op context, keeping the routing (``topk_ids [rows, k]``) of every
    ``fused_moe`` call in :attr:`routings` (one per MoE layer and call)."""

    routings: list[torch.Tensor] = field(default_factory=list, compare=False)

    def fused_moe(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Records ``topk_ids``, then runs the untuned op."""
        self.routings.append(topk_ids.detach().clone())
        return super().fused_moe(x, gate_up, down, topk_weights, topk_ids, residual=residual)


def record_routing(
    step: DecodeStep, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> list[torch.Tensor]:
    """The routing of one decode step with these inputs: ``topk_ids`` per MoE layer, in layer
    order. Runs the forward once eagerly with the untuned ops (it writes the K/V of these rows,
    as the step itself does)."""
    recorder = RoutingRecorder()
    attention = DecodeAttention(step, recorder, positions, slots)
    with torch.inference_mode():
        step.forward(recorder, tokens, positions, step.write_rows(positions, slots), attention)
    return recorder.routings


def experts_hit(routings: Sequence[torch.Tensor], num_experts: int) -> list[int]:
    """Distinct experts in ``[0, num_experts)`` each routing selects."""
    hits = []
    for ids in routings:
        flat = ids.reshape(-1)
        valid = flat[(flat >= 0) & (flat < num_experts)]
        hits.append(int(torch.unique(valid).numel()))
    return hits


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """``E * (1 - (1 - k / E) ** T)``: distinct experts hit by ``T`` tokens routed uniformly
    (each expert is one of a token's k distinct picks with probability ``k / E``)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(frozen=True)
class StepBytes:
    """What one step reads of the weights.

    Attributes:
        total: Bytes of weights read (the bytes floor's weight part).
        dense: Of which every non-expert weight.
        experts: Of which the experts hit.
        experts_hit: Distinct experts per MoE layer.
    """

    total: int
    dense: int
    experts: int
    experts_hit: tuple[int, ...]


def step_weight_bytes(model: DecoderModel, hits: Sequence[int]) -> StepBytes:
    """Weight bytes a step reads when MoE layer ``j`` (in layer order) reads ``hits[j]`` experts.

    Args:
        model: The model (a dense model needs ``hits == []``: every weight counts).
        hits: Distinct experts per MoE layer (:func:`experts_hit`).

    Raises:
        InputError: ``hits`` does not have one entry per MoE layer.
    """
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    if len(hits) != len(moe_layers):
        raise InputError(
            f"step_weight_bytes: {len(hits)} expert counts for {len(moe_layers)} MoE layers of "
            f"{model.config.name}; count them with experts_hit(record_routing(...))"
        )
    expert_tensors = ("experts_gate_up", "experts_down")
    dense = _nbytes(model.lm_head) + _nbytes(model.final_norm)
    experts = 0
    for layer in model.layers:
        dense += sum(_nbytes(t) for k, t in layer.tensors().items() if k not in expert_tensors)
    for layer, hit in zip(moe_layers, hits, strict=True):
        layer_bytes = sum(_nbytes(getattr(layer, k)) for k in expert_tensors)
        experts += hit * layer_bytes // model.config.num_experts
    return StepBytes(dense + experts, dense, experts, tuple(hits))


def step_bytes(
    step: DecodeStep, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> StepBytes:
    """The weight bytes one step with these inputs reads: every weight for a dense model; for an
    MoE model the routing of this very step counted (:func:`record_routing`, one eager run)."""
    model = step.model
    if not any(layer.is_moe for layer in model.layers):
        return step_weight_bytes(model, [])
    hits = experts_hit(record_routing(step, tokens, positions, slots), model.config.num_experts)
    return step_weight_bytes(model, hits)
