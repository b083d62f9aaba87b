"""The torch formulations of the fused-MoE op: the input rules, a sparse loop and a dense form.

For ``x [T, H]``, expert weights ``gate_up [E, 2I, H]`` (gate rows first, then up rows) and
``down [E, H, I]`` (transformers' ``Qwen3MoeExperts`` / ``MixtralExperts`` layout), and a routing
``topk_weights [T, k]``, ``topk_ids [T, k]``:

    out[t] = sum_j  w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = ids[t, j]

Two formulations, both the fallback tactic ``-1`` of :class:`~graphtune.ops.moe.runners.
TorchFusedMoeRunner`:

* :func:`sparse_fused_moe` loops over the experts that were selected, as transformers does: each
  expert runs only on its own tokens, so it reads only the selected experts' weights. Finding
  them needs the per-expert counts on the host: one synchronisation, so it cannot be captured.
* :func:`dense_fused_moe` runs every expert on every token and masks the unselected ones to
  zero: fixed shapes, no host synchronisation, capturable, but ``E / k`` times the arithmetic and
  every expert's weights read. Tokens go in chunks so its intermediates stay under
  :data:`DENSE_CHUNK_BYTES`.

:func:`torch_fused_moe` runs the dense form while a CUDA stream is capturing and the sparse loop
otherwise. Rounding follows transformers' expert loop: each projection's output is rounded to the
dtype, ``silu(gate)`` and its product with ``up`` are rounded, the routing weight is applied in
the promoted dtype of the two (bf16 for Qwen3-MoE, float32 for Mixtral) and rounded. The sparse
loop then adds the experts in the dtype, in expert order (``index_add_``, as transformers); the
dense form sums the E weighted rows in one reduction (float32 accumulation, one rounding).

Expert ids outside ``[0, E)``: the sparse loop raises :class:`~graphtune.errors.InputError` (it
synchronises anyway); the capturable paths (dense form, Triton runner) cannot check without a
synchronisation and give such a slot no expert, so it adds nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from graphtune.errors import InputError, describe_tensor, wrong_device_error

#: Bytes the dense form's intermediates of one token chunk may take (the chunk follows from it).
DENSE_CHUNK_BYTES = 256 << 20
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)

MoeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_INPUT_NAMES = ("x", "gate_up", "down", "topk_weights", "topk_ids")


def check_moe_tensors(inputs: list[Any]) -> None:
    """Checks that ``[x, gate_up, down, topk_weights, topk_ids]`` are five tensors and ``x`` has
    a dimension: the rules every other check (and :func:`~graphtune.ops.moe.op.fused_moe`'s
    flattening of ``x``) relies on, so a bad argument is named instead of an attribute error.

    Raises:
        InputError: An input is missing or not a tensor, or ``x`` is 0-d.
    """
    if len(inputs) < len(_INPUT_NAMES):
        raise InputError(
            f"fused_moe: needs the inputs {list(_INPUT_NAMES)}, got {len(inputs)}; pass all five."
        )
    for name, value in zip(_INPUT_NAMES, inputs[: len(_INPUT_NAMES)], strict=True):
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"fused_moe: {name} must be a torch.Tensor, got {describe_tensor(value)}; pass "
                f"a tensor (route_top_k returns topk_weights and topk_ids)."
            )
    if inputs[0].dim() < 1:
        raise InputError(
            "fused_moe: x must be [..., H] with at least one dimension, got a 0-d tensor; pass "
            "the activations as [T, H]."
        )


def unpack_moe_inputs(inputs: list[Any]) -> MoeInputs:
    """Unpacks ``[x, gate_up, down, topk_weights, topk_ids]`` (and an optional sixth input, the
    residual: see :func:`moe_residual`) and checks the shape rules.

    Raises:
        InputError: An input is not a tensor, or a shape, dtype or dimension count does not
            match the layout above, or a tensor is not on ``x``'s device.
    """
    check_moe_tensors(inputs)
    x, gate_up, down, weights, ids = inputs[:5]
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise InputError(
            f"fused_moe needs x [T, H], gate_up [E, 2I, H] and down [E, H, I], got x "
            f"{tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}."
        )
    tokens, hidden = x.shape
    experts, two_inter, gate_hidden = gate_up.shape
    inter = two_inter // 2
    if two_inter % 2 or gate_hidden != hidden or tuple(down.shape) != (experts, hidden, inter):
        raise InputError(
            f"fused_moe: with x [T, H={hidden}] and gate_up {tuple(gate_up.shape)} (gate rows, "
            f"then up rows: [E, 2I, H]), down must be [E, H, I] = {[experts, hidden, inter]}, got "
            f"{tuple(down.shape)}."
        )
    if x.dtype not in FLOAT_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise InputError(
            f"fused_moe: x, gate_up and down must share one of {FLOAT_DTYPES}, got {x.dtype}, "
            f"{gate_up.dtype}, {down.dtype}; cast the weights to the activations' dtype."
        )
    if weights.dim() != 2 or weights.shape[0] != tokens or tuple(ids.shape) != tuple(weights.shape):
        raise InputError(
            f"fused_moe: topk_weights and topk_ids must both be [T={tokens}, k], got "
            f"{tuple(weights.shape)} and {tuple(ids.shape)}; route_top_k returns them."
        )
    if not weights.dtype.is_floating_point or ids.dtype not in ID_DTYPES:
        raise InputError(
            f"fused_moe: topk_weights must be a float tensor and topk_ids int32 or int64, got "
            f"{weights.dtype} and {ids.dtype}."
        )
    device = x.device
    if (
        gate_up.device != device
        or down.device != device
        or weights.device != device
        or ids.device != device
    ):
        # The torch code does not always notice (a meta weight gives garbage on the CPU).
        named = (("gate_up", gate_up), ("down", down), ("topk_weights", weights), ("topk_ids", ids))
        raise wrong_device_error("fused_moe", "x", device, named)
    return x, gate_up, down, weights, ids


def has_residual(inputs: list[Any]) -> bool:
    """Whether a fused-MoE call has a residual (input 5, not ``None``); :func:`moe_residual`
    checks it."""
    return len(inputs) > 5 and inputs[5] is not None


def moe_residual(inputs: list[Any]) -> torch.Tensor | None:
    """The residual of a fused-MoE call (input 5, ``None`` when absent): a contiguous ``[T, H]``
    tensor of ``x``'s dtype and device, to which the experts' output is added in place.

    Raises:
        InputError: The residual's shape, dtype, device or layout does not match ``x``.
    """
    if not has_residual(inputs):
        return None
    residual = inputs[5]
    x = inputs[0]
    if (
        not isinstance(residual, torch.Tensor)
        or residual.shape != x.shape
        or residual.dtype != x.dtype
        or residual.device != x.device
        or not residual.is_contiguous()
    ):
        raise InputError(
            f"fused_moe: residual must be a contiguous {tuple(x.shape)} {x.dtype} tensor on "
            f"{x.device} like x (the experts' output is added to it in place), got "
            f"{describe_tensor(residual)}."
        )
    return residual


def moe_output(inputs: list[Any]) -> tuple[torch.Tensor, bool]:
    """Where a Triton runner writes a call's ``[T, H]`` result, and whether there is work.

    The tensor is the residual when the call has one (the runners add into it), else a new
    uninitialised tensor. Without work (``T``, ``H``, ``I`` or ``k`` zero) it already holds the
    result: the residual unchanged, or zeros.
    """
    x, gate_up, _, _, ids = unpack_moe_inputs(inputs)
    residual = moe_residual(inputs)
    tokens, hidden = x.shape
    work = tokens > 0 and hidden > 0 and ids.shape[1] > 0 and gate_up.shape[1] > 1
    if residual is not None:
        return residual, work
    make = torch.empty if work else torch.zeros
    return make((tokens, hidden), dtype=x.dtype, device=x.device), work


def add_to_residual(out: torch.Tensor, inputs: list[Any]) -> torch.Tensor:
    """``residual += out`` when the call has a residual (returns the residual), else ``out``:
    one rounding of the bf16/fp16 sum, as ``x.add_(out)``."""
    residual = moe_residual(inputs)
    return out if residual is None else residual.add_(out)


def _swiglu_expert(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def sparse_fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The loop over the selected experts (transformers' formulation); one host synchronisation.

    Raises:
        InputError: An expert id is outside ``[0, E)``.
    """
    tokens, top_k = topk_ids.shape
    experts = gate_up.shape[0]
    # Slot-major pairs (pair = slot * tokens + token), as transformers' loop takes each expert's
    # rows (by slot, then token): a CPU GEMM's result for a row can depend on its position in
    # the batch, so the same order is what makes the two equal bit for bit.
    flat = topk_ids.t().reshape(-1)
    valid = (flat >= 0) & (flat < experts)
    binned = torch.where(valid, flat, experts).long()
    order = torch.argsort(binned, stable=True)  # pairs by expert, then by (slot, token)
    counts = torch.bincount(binned, minlength=experts + 1).tolist()  # the host sync
    if counts[experts]:
        raise InputError(
            f"fused_moe: {counts[experts]} of the {flat.numel()} topk_ids are outside [0, "
            f"E={experts}); route with route_top_k over the E experts of these weights."
        )
    out = torch.zeros_like(x)
    flat_weights = topk_weights.t().reshape(-1)
    start = 0
    for expert, count in enumerate(counts[:experts]):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        rows = pairs % tokens
        y = _swiglu_expert(x[rows], gate_up[expert], down[expert])
        out.index_add_(0, rows, (y * flat_weights[pairs, None]).to(out.dtype))
    return out


def dense_fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Every expert on every token, unselected ones masked to zero: capturable, ``E / k`` times
    the work of the sparse loop."""
    tokens, hidden = x.shape
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    valid = (topk_ids >= 0) & (topk_ids < experts)
    ids = torch.where(valid, topk_ids, 0).long()
    weights = torch.where(valid, topk_weights, 0)
    # dense[t, e]: the routing weight of expert e for token t (summed if a token repeats one).
    dense = torch.zeros(tokens, experts, dtype=weights.dtype, device=x.device)
    dense.scatter_add_(1, ids, weights)
    # unselected[t, e]: no slot of token t names expert e (an out-of-range id names none). Its
    # output is masked, not weighted by zero: an unselected expert that overflows (inf * 0 =
    # NaN) must not reach the token's row, as it does not in the sparse loop or the kernels.
    expert_range = torch.arange(experts, device=x.device)
    unselected = ~(topk_ids.unsqueeze(-1) == expert_range).any(dim=1)
    out = torch.empty_like(x)
    # Per token of a chunk: [2I] projections, [I] activations, [H] outputs (float32 once
    # weighted by a float32 routing weight) for each of the E experts.
    per_token = experts * (two_inter + inter + 2 * hidden) * 4
    chunk = max(1, DENSE_CHUNK_BYTES // per_token)
    flat_gate_up = gate_up.reshape(experts * two_inter, hidden)  # one GEMM for all experts
    for start in range(0, tokens, chunk):
        xc = x[start : start + chunk]
        proj = (flat_gate_up @ xc.T).view(experts, two_inter, -1)  # [E, 2I, c]
        act = F.silu(proj[:, :inter]) * proj[:, inter:]  # [E, I, c]
        y = torch.bmm(down, act)  # [E, H, c]
        # In place and before the weighting, so a selected expert's product is as before.
        y.masked_fill_(unselected[start : start + chunk].T.unsqueeze(1), 0)
        scale = dense[start : start + chunk].T.unsqueeze(1)  # [E, 1, c]
        weighted = (y * scale).to(x.dtype)
        out[start : start + chunk] = weighted.sum(dim=0, dtype=torch.float32).T.to(x.dtype)
    return out


def torch_fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    capturable: bool | None = None,
) -> torch.Tensor:
    """The fallback: :func:`dense_fused_moe` when ``capturable``, else :func:`sparse_fused_moe`.

    Args:
        capturable: ``None`` picks the dense form exactly while ``x``'s CUDA stream is capturing
            a graph (where the sparse loop's host synchronisation is illegal).
    """
    if capturable is None:
        capturable = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturable:
        return dense_fused_moe(x, gate_up, down, topk_weights, topk_ids)
    return sparse_fused_moe(x, gate_up, down, topk_weights, topk_ids)
