"""Tunable GEMM ``out = a @ weight.T (+ bias) (+ residual)``: cuBLAS through torch, and Triton.

The shape is the one of ``torch.nn.functional.linear``: ``a [M, K]`` activations, ``weight [N, K]``
(the layout a checkpoint stores), optional ``bias [N]``, and an optional ``residual [M, N]`` added
in the epilogue (``torch.addmm`` semantics, optionally in place like ``residual.addmm_``, which is
how the decode step folds its residual adds into the output projections). ``M`` (tokens in the
batch) is the dynamic dimension, tuned in power-of-two buckets; ``N`` and ``K`` are fixed per
weight.

Triton tactics are dicts ``{"bm", "bn", "bk", "warps", "stages", "split_k"}``. For decode the
batch is skinny (``M`` of 1..64), so one row of output tiles gives too few programs to fill the GPU;
split-K cuts the K loop into ``split_k`` slices run by separate programs, each writing a float32
partial that a second small kernel sums (deterministic, no atomics, no zero-fill: capturable).

Batches of at most 8 rows also get :class:`graphtune.ops.gemv.TritonGemvRunner`, a GEMV kernel
without ``tl.dot`` that streams the weight once for all rows; it shares this module's input rules,
``out=`` / in-place handling and split-K reduction (:func:`triton_gemm_supports`,
:func:`result_tensor`, :func:`reduce_split_k`), and :func:`gemm_runners` lists it last.

Pruning rules of :func:`gemm_tactics` (a pruned config is never timed):

* a block never exceeds the next power of two of its dimension (it is clamped, duplicates dropped);
* split-K only for skinny ``M`` (``<= 64``), and only when ``K`` splits into whole ``bk`` blocks
  (``K % (split_k * bk) == 0``); split counts near ``SMs / output tiles`` only;
* the pipelined operand tiles ``stages * (bm + bn) * bk * itemsize`` fit the shared-memory budget.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphtune.autotuner.config import (
    ConstraintSpec,
    DynamicTensorSpec,
    TuningConfig,
    next_power_of_two,
)
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops._triton import (
    TritonRunner,
    device_supported,
    kernels,
    run_kernel,
    triton_available,
)

OP_NAME = "graphtune.gemm"

# (bn, bk, warps, stages): tiles that suit skinny-M GEMMs with large N and K; bm follows M.
BASE_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (32, 128, 4, 4),
    (64, 64, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
)
SPLIT_K_CHOICES = (2, 4, 8, 16)
SKINNY_M = 64
TACTIC_KEYS = ("bm", "bn", "bk", "warps", "stages", "split_k")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Shared memory per block by compute capability, for torch builds whose device properties lack
# ``shared_memory_per_block_optin``.
_SMEM_BY_CC = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024}
_DEFAULT_SMEM = 99 * 1024
_DEFAULT_SMS = 132  # an H100/H200; only used to size split-K candidates off-GPU


def _block_ok(block: int) -> bool:
    return block >= 16 and block & (block - 1) == 0


def check_gemm_tactic(tactic: Any, k: int) -> str | None:
    """Why ``tactic`` cannot run a GEMM with inner size ``k``, or ``None`` when it can.

    These are the rules a tactic must satisfy on every ``M`` (a bucket's pick also runs the sizes
    that map to the bucket): known keys, power-of-two blocks ``>= 16`` (``tl.dot``), and split-K
    slices of whole ``bk`` blocks.
    """
    if not isinstance(tactic, dict) or set(tactic) != set(TACTIC_KEYS):
        return f"a Triton GEMM tactic is a dict with keys {TACTIC_KEYS}, got {tactic!r}"
    values = [tactic[key] for key in TACTIC_KEYS]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        return f"every value of a GEMM tactic must be a positive int, got {tactic!r}"
    if not all(_block_ok(tactic[key]) for key in ("bm", "bn", "bk")):
        return f"bm, bn and bk must be powers of two >= 16 (tl.dot), got {tactic!r}"
    split = tactic["split_k"]
    if split > 1 and k % (split * tactic["bk"]):
        return (
            f"split_k={split} with bk={tactic['bk']} needs K divisible by "
            f"{split * tactic['bk']}, but K={k}"
        )
    return None


def gemm_tactics(
    m: int,
    n: int,
    k: int,
    *,
    itemsize: int,
    smem_bytes: int,
    sm_count: int,
    max_tactics: int = 20,
) -> list[dict[str, int]]:
    """Triton GEMM tactics worth timing for one ``(M, N, K)`` (see the module's pruning rules).

    Args:
        m: Rows of ``a`` (the bucket).
        n: Output features.
        k: Inner size.
        itemsize: Bytes per operand element.
        smem_bytes: Shared memory one program may use.
        sm_count: Streaming multiprocessors (sizes the split-K candidates).
        max_tactics: Upper bound on the list; when more are valid, those that fill the GPU's
            SMs best in whole waves are kept.

    Returns:
        Tactic dicts in a fixed order (base config, then split count), so ties in tuning go to
        the simpler config.
    """
    bm = min(max(16, next_power_of_two(m)), 128)
    bms = [bm] if m <= SKINNY_M else sorted({min(bm, 64), bm})
    # Blocks larger than their dimension only compute padding: clamp them to the dimension
    # (>= 16 for tl.dot) and drop the duplicates this creates.
    bn_cap, bk_cap = max(16, next_power_of_two(n)), max(16, next_power_of_two(k))
    found: list[tuple[float, int, dict[str, int]]] = []
    seen: set[tuple[int, ...]] = set()
    for bm_value in bms:
        for bn_base, bk_base, warps, stages in BASE_CONFIGS:
            bn, bk = min(bn_base, bn_cap), min(bk_base, bk_cap)
            if stages * (bm_value + bn) * bk * itemsize > smem_bytes:
                continue
            tiles = math.ceil(m / bm_value) * math.ceil(n / bn)
            splits = [1]
            if m <= SKINNY_M:
                target = sm_count / tiles
                splits += [s for s in SPLIT_K_CHOICES if target / 2 <= s <= target * 2]
            for split in splits:
                tactic = {
                    "bm": bm_value,
                    "bn": bn,
                    "bk": bk,
                    "warps": warps,
                    "stages": stages,
                    "split_k": split,
                }
                ident = tuple(tactic.values())
                if ident in seen or check_gemm_tactic(tactic, k) is not None:
                    continue
                seen.add(ident)
                programs = tiles * split
                waves = math.ceil(programs / sm_count)
                fill = programs / (waves * sm_count)
                found.append((fill, len(found), tactic))
    if len(found) > max_tactics:
        keep = sorted(found, key=lambda item: (-item[0], item[1]))[:max_tactics]
        found = sorted(keep, key=lambda item: item[1])
    return [tactic for _, _, tactic in found]


def device_limits(device: torch.device) -> tuple[int, int]:
    """(shared memory per block, SM count) of ``device``; defaults off-GPU."""
    if device.type != "cuda":
        return 227 * 1024, _DEFAULT_SMS
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if not smem:
        smem = _SMEM_BY_CC.get((props.major, props.minor), _DEFAULT_SMEM)
    return int(smem), int(props.multi_processor_count)


_Inputs = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", bool]


def unpack_gemm_inputs(inputs: list[Any]) -> _Inputs:
    """Unpacks ``[a, weight, bias, residual, inplace]`` and checks the shapes (an optional sixth
    element, the output tensor, is read by :func:`_out_of`)."""
    a, weight, bias, residual, inplace = inputs[:5]
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise InputError(
            f"GEMM needs a [M, K] and weight [N, K] with the same K, got a {tuple(a.shape)} and "
            f"weight {tuple(weight.shape)}; flatten leading dims of a (gemm() does)."
        )
    if residual is not None and tuple(residual.shape) != (a.shape[0], weight.shape[0]):
        raise InputError(
            f"GEMM residual must be [M, N] = {[a.shape[0], weight.shape[0]]}, got "
            f"{tuple(residual.shape)}."
        )
    if inplace and residual is None:
        raise InputError("GEMM inplace=True accumulates into residual, so pass a residual.")
    return a, weight, bias, residual, bool(inplace)


def _out_of(inputs: list[Any]) -> torch.Tensor | None:
    """The caller's output tensor (``gemm(..., out=)``), passed to ``forward`` as a sixth input.

    It is not part of the inputs the tuner sees: where the result goes does not change which
    kernel is fastest, so it stays out of the cache key.
    """
    return inputs[5] if len(inputs) > 5 else None


def triton_gemm_supports(inputs: list[Any]) -> bool:
    """Whether the Triton GEMM kernels (tiled and GEMV) can run these inputs.

    One float dtype for all operands, a 1-D bias, a contiguous residual, a Triton device.
    """
    a, weight, bias, residual, _ = unpack_gemm_inputs(inputs)
    if a.dtype not in _DTYPES or weight.dtype != a.dtype:
        return False
    if bias is not None and (bias.dtype != a.dtype or bias.dim() != 1):
        return False
    if residual is not None and (residual.dtype != a.dtype or not residual.is_contiguous()):
        return False  # the split-K reduction indexes the residual as a flat [M * N]
    return device_supported(a.device)


def result_tensor(
    inputs: list[Any], a: torch.Tensor, n: int, residual: torch.Tensor | None, inplace: bool
) -> torch.Tensor:
    """Where a Triton GEMM writes ``[M, N]``: ``out=``, else the residual in place, else new."""
    out = _out_of(inputs)
    if out is not None:
        return out
    if inplace:
        return residual
    return torch.empty((a.shape[0], n), device=a.device, dtype=a.dtype)


def split_k_partials(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The float32 ``[split, M, N]`` partials of a split-K launch.

    Uninitialised on purpose: every element is written by exactly one program, so there is no
    zero-fill kernel (and nothing that would have to run before a graph replay).
    """
    return torch.empty((split, m, n), device=device, dtype=torch.float32)


def kernel_operands(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    target: torch.Tensor,
) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """The pointer and stride arguments both Triton GEMM kernels take, in their order.

    Returns:
        ``(a, weight, bias, res, target)`` (an absent bias or residual is replaced by ``a``, an
        unread placeholder pointer) and the strides of ``a``, ``weight``, ``res`` and ``target``
        (the split stride is 0 unless ``target`` is ``[split, M, N]`` partials).
    """
    res = residual if residual is not None else a
    pointers = (a, weight, bias if bias is not None else a, res, target)
    strides = (
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        res.stride(0),
        res.stride(1),
        target.stride(0) if target.dim() == 3 else 0,
        target.stride(-2),
        target.stride(-1),
    )
    return pointers, strides


def reduce_split_k(
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    warmup: bool,
) -> None:
    """Launches ``splitk_reduce_kernel``: ``out = sum(partials) (+ bias) (+ residual)``.

    ``out`` and ``residual`` must be contiguous ``[M, N]`` (``out`` may be ``residual``); the sum
    runs in a fixed order, so split-K results are deterministic.
    """
    split, m, n = partials.shape
    block = 1024
    placeholder = out  # unread pointer for an absent bias / residual (out's dtype, as theirs)
    args = (
        partials,
        bias if bias is not None else placeholder,
        residual if residual is not None else placeholder,
        out,
        m * n,
        n,
    )
    meta = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        SPLIT_K=split,
        BLOCK=block,
        num_warps=4,
    )
    run_kernel(kernels().splitk_reduce_kernel, (math.ceil(m * n / block),), args, meta, warmup)


def torch_gemm(inputs: list[Any]) -> torch.Tensor:
    """The torch path: ``F.linear``, or ``addmm`` / ``addmm_`` with a residual."""
    a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
    out = _out_of(inputs)
    if out is not None:
        if residual is not None:
            torch.addmm(residual, a, weight.t(), out=out)
            return out.add_(bias) if bias is not None else out
        if bias is not None:
            return torch.addmm(bias, a, weight.t(), out=out)
        return torch.mm(a, weight.t(), out=out)
    if residual is None:
        return F.linear(a, weight, bias)
    if inplace:
        out = residual.addmm_(a, weight.t())
    else:
        out = torch.addmm(residual, a, weight.t())
    # A bias next to a residual is rare (no decode projection has both): a second rounding.
    return out.add_(bias) if bias is not None else out


class TorchGemmRunner(TunableRunner):
    """``F.linear`` / ``torch.addmm`` (cuBLAS on CUDA); only the fallback tactic."""

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        """Runs :func:`torch_gemm`."""
        return torch_gemm(inputs)


class TritonGemmRunner(TritonRunner):
    """Triton GEMM with block / warp / stage / split-K tactics; tactic ``-1`` is ``F.linear``.

    Args:
        max_tactics: Upper bound on tactics per bucket.
        sm_count: Override the device's SM count (tests, or to tune for another GPU's split-K).
        smem_bytes: Override the shared-memory budget per program.
        compile_workers: Threads for ahead-of-time compilation.
    """

    def __init__(
        self,
        *,
        max_tactics: int = 20,
        sm_count: int | None = None,
        smem_bytes: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        super().__init__(compile_workers=compile_workers)
        self.max_tactics = max_tactics
        self.sm_count = sm_count
        self.smem_bytes = smem_bytes

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Overrides change the candidate set, so they are part of the runner's identity."""
        extras = {"sm": self.sm_count, "smem": self.smem_bytes, "max": self.max_tactics}
        return () if extras == {"sm": None, "smem": None, "max": 20} else (extras,)

    def supports(self, inputs: list[Any]) -> bool:
        """See :func:`triton_gemm_supports`."""
        return triton_gemm_supports(inputs)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`gemm_tactics`; device limits come from the inputs' device."""
        a, weight = inputs[0], inputs[1]
        smem, sms = device_limits(a.device)
        return list(
            gemm_tactics(
                a.shape[0],
                weight.shape[0],
                a.shape[1],
                itemsize=a.element_size(),
                smem_bytes=self.smem_bytes or smem,
                sm_count=self.sm_count or sms,
                max_tactics=self.max_tactics,
            )
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """:func:`torch_gemm`: the fallback tactic."""
        return torch_gemm(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the Triton GEMM (and the split-K reduction) for ``tactic``.

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`check_gemm_tactic` for this K.
        """
        a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
        m, k = a.shape
        n = weight.shape[0]
        problem = check_gemm_tactic(tactic, k)
        if problem is not None:
            raise ConfigError(f"TritonGemmRunner: {problem}; pick a tactic from get_valid_tactics.")
        bm, bn, bk = tactic["bm"], tactic["bn"], tactic["bk"]
        split = tactic["split_k"]
        out = result_tensor(inputs, a, n, residual, inplace)
        if m == 0:
            return out
        target = out if split == 1 else split_k_partials(split, m, n, a.device)
        k_per_split = k // split if split > 1 else k
        grid = (math.ceil(m / bm) * math.ceil(n / bn), split)
        pointers, strides = kernel_operands(a, weight, bias, residual, target)
        args = (*pointers, m, n, k, k_per_split, *strides)
        meta = dict(
            HAS_BIAS=bias is not None,
            HAS_RES=residual is not None,
            SPLIT_K=split,
            EVEN_K=k_per_split % bk == 0,
            IEEE=a.dtype == torch.float32,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=tactic["warps"],
            num_stages=tactic["stages"],
        )
        run_kernel(kernels().gemm_kernel, grid, args, meta, warmup)
        if split > 1:
            reduce_split_k(target, bias, residual, out, warmup)
        return out


@functools.lru_cache(maxsize=1)
def gemm_runners() -> tuple[TunableRunner, ...]:
    """The process-wide GEMM runners: torch first (fallback), Triton when importable.

    Order matters: ``runners[0]`` is the untuned fallback and ties in tuning go to the earlier
    runner, so the tiled Triton GEMM comes before the skinny-``M`` GEMV (which offers tactics
    only for buckets of ``M <= 8``; see :mod:`graphtune.ops.gemv`).
    """
    runners: list[TunableRunner] = [TorchGemmRunner()]
    if triton_available():
        # Imported here: gemv builds on this module's helpers, so a top-level import would cycle.
        from graphtune.ops.gemv import TritonGemvRunner

        runners += [TritonGemmRunner(), TritonGemvRunner()]
    return tuple(runners)


def _rows_of_a(shapes: Any) -> int:
    return int(shapes[0][0])


@functools.lru_cache(maxsize=64)
def gemm_config(
    max_m: int | None = None, residual: bool = False, cold_l2: bool = False
) -> TuningConfig:
    """Tuning config of the GEMM op: ``M`` (input 0, dim 0) in power-of-two buckets.

    Args:
        max_m: Largest ``M`` tuned and looked up (``None``: buckets up to the live ``M``, and a
            larger live ``M`` is a miss that falls back to cuBLAS).
        residual: Whether input 3 (the residual) is a tensor, whose rows then follow ``M``.
        cold_l2: Time with cold-L2 rotation (``TuningConfig.cold_l2``); same cache keys.
    """
    constraints = (ConstraintSpec(3, 0, _rows_of_a),) if residual else ()
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=constraints,
        max_value=max_m,
        cold_l2=cold_l2,
    )


def gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``a @ weight.T + bias (+ residual)`` through the tuner's pick for this shape.

    Without a residual this is ``F.linear``; with one it is ``torch.addmm(residual, a,
    weight.T)`` (sum in float32, one rounding), and with ``inplace=True`` it writes into
    ``residual`` and returns it, like ``residual.addmm_(a, weight.T)``.

    Outside tuning mode this is a cache look-up (an untuned shape runs cuBLAS). Inside
    :func:`graphtune.autotune` a miss first tunes every bucket of ``M``.

    Args:
        a: ``[..., K]`` activations; leading dimensions are flattened into ``M``.
        weight: ``[N, K]``.
        bias: Optional ``[N]``.
        residual: Optional ``[..., N]`` added to the product (same leading shape as ``a``).
        inplace: Accumulate into ``residual`` (must be contiguous for the Triton runner).
        out: Write the ``[M, N]`` result here (contiguous, ``a``'s dtype; e.g. a communication
            buffer) instead of a new tensor. Not with ``inplace``. The pick does not depend on it.
        tuner: The tuner to ask; the process default when ``None``.
        max_m: Largest tuned ``M`` (see :func:`gemm_config`).
        runners: Runners to choose from; :func:`gemm_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (see :func:`gemm_config`); look-ups are the same.

    Returns:
        ``[..., N]`` in ``a``'s dtype.
    """
    if a.shape[-1] != weight.shape[-1]:
        raise InputError(
            f"gemm: a has K={a.shape[-1]} but weight {tuple(weight.shape)} has K="
            f"{weight.shape[-1]}; weight must be [N, K] as in nn.Linear."
        )
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    r2 = None
    if residual is not None:
        n = weight.shape[0]
        r2 = residual.view(-1, n) if inplace else residual.reshape(-1, n)
    if out is not None:
        _check_out(out, a2, weight, inplace)
    inputs = [a2, weight, bias, r2, bool(inplace)]
    chosen = runners if runners is not None else gemm_runners()
    config = gemm_config(max_m, residual is not None, cold_l2)
    runner, tactic = (tuner or get_tuner()).choose_one(OP_NAME, chosen, config, inputs)
    result = runner.forward(inputs if out is None else [*inputs, out], tactic)
    if inplace:
        return residual
    return out if out is not None else result.reshape(*lead, weight.shape[0])


def _check_out(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, inplace: bool) -> None:
    want = (a.shape[0], weight.shape[0])
    if inplace:
        raise InputError("gemm: out= and inplace=True both say where the result goes; pass one.")
    if tuple(out.shape) != want or out.dtype != a.dtype or not out.is_contiguous():
        raise InputError(
            f"gemm: out must be a contiguous [M, N] = {list(want)} {a.dtype} tensor, got "
            f"{tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})."
        )


class TunableLinear(nn.Module):
    """``nn.Linear`` whose GEMM is the tuner's pick per batch bucket (inference).

    Parameters are created with ``requires_grad=False`` (an inference module). With autograd
    recording (grad enabled and a tensor that requires grad, e.g. after :meth:`from_linear` of a
    trainable layer) it runs ``F.linear``, since the Triton kernels have no backward.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: Whether to hold a bias.
        device: Device of the parameters.
        dtype: dtype of the parameters.
        max_m: Largest tuned ``M`` (see :func:`gemm_config`).
        tuner: Tuner to ask; the process default when ``None``.
        runners: Runners to choose from; :func:`gemm_runners` when ``None``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_m: int | None = None,
        tuner: AutoTuner | None = None,
        runners: tuple[TunableRunner, ...] | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ConfigError(
                f"TunableLinear({in_features}, {out_features}): features must be >= 1."
            )
        reference = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = reference.weight.requires_grad_(False)
        if reference.bias is not None:
            self.bias = reference.bias.requires_grad_(False)
        else:
            self.register_parameter("bias", None)
        self.max_m = max_m
        self.tuner = tuner
        self.runners = runners

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        max_m: int | None = None,
        tuner: AutoTuner | None = None,
        runners: tuple[TunableRunner, ...] | None = None,
    ) -> TunableLinear:
        """A TunableLinear sharing ``linear``'s parameters (no copy)."""
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            max_m=max_m,
            tuner=tuner,
            runners=runners,
        )
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        if torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
        ):
            return F.linear(x, self.weight, self.bias)
        return gemm(
            x, self.weight, self.bias, tuner=self.tuner, max_m=self.max_m, runners=self.runners
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, max_m={self.max_m}"
        )
