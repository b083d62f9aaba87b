"""Mixture-of-experts: the router and a tunable fused-MoE op (torch fallback, Triton GEMMs).

* :func:`route_top_k` — softmax over the experts, top-k, optional renormalisation
  (Qwen3-MoE's and Mixtral's routers), a tunable op: the torch router
  (:func:`torch_route_top_k`) or one Triton kernel (:mod:`graphtune.ops.moe.routing`).
* :func:`moe_router` — the router GEMM and the routing as one fused op: the two tunable ops
  above, or one Triton kernel at decode sizes (:mod:`graphtune.ops.moe.router`).
* :func:`fused_moe` — the experts: ``sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) *
  (up[e] @ x[t]))``, through the tuner's pick per token-count bucket
  (:mod:`graphtune.ops.moe.op`).
* :class:`TorchFusedMoeRunner` — the fallback (a loop over the selected experts, or the dense
  all-experts form while a CUDA graph is being captured; :mod:`graphtune.ops.moe.reference`).
* :class:`TritonFusedMoeRunner` — the pairs sorted and padded by expert on the GPU
  (:mod:`graphtune.ops.moe.align`), one grouped GEMM launch for gate/up with SiLU-and-mul, one
  for down with the routing weights, a deterministic top-k sum (:mod:`graphtune.ops.moe.runners`);
  tactics and their pruning rules in :mod:`graphtune.ops.moe.tactics`.
* :class:`TritonMoeGemvRunner` — decode sizes: one GEMV kernel per projection, no sort step, the
  top-k sum inside the down kernel (:mod:`graphtune.ops.moe.gemv`).

Importing this package imports neither Triton nor the kernels.
"""

from graphtune.ops.moe.align import (
    ExpertBlocks,
    max_sorted_rows,
    pairs_per_program,
    sort_by_expert,
)
from graphtune.ops.moe.gemv import TritonMoeGemvRunner, moe_gemv_tactics
from graphtune.ops.moe.op import OP_NAME, balanced_routing, fused_moe, fused_moe_config
from graphtune.ops.moe.reference import dense_fused_moe, sparse_fused_moe, torch_fused_moe
from graphtune.ops.moe.router import (
    TritonMoeRouter,
    UnfusedMoeRouter,
    moe_router,
    moe_router_config,
    moe_router_runners,
)
from graphtune.ops.moe.routing import (
    TorchRouteTopKRunner,
    TritonRouteTopKRunner,
    route_top_k,
    route_top_k_config,
    route_top_k_runners,
    torch_route_top_k,
)
from graphtune.ops.moe.runners import (
    TorchFusedMoeRunner,
    TritonFusedMoeRunner,
    fused_moe_runners,
)
from graphtune.ops.moe.tactics import check_moe_tactic, moe_tactics

__all__ = [
    "OP_NAME",
    "ExpertBlocks",
    "TorchFusedMoeRunner",
    "TorchRouteTopKRunner",
    "TritonFusedMoeRunner",
    "TritonMoeGemvRunner",
    "TritonMoeRouter",
    "TritonRouteTopKRunner",
    "UnfusedMoeRouter",
    "balanced_routing",
    "check_moe_tactic",
    "dense_fused_moe",
    "fused_moe",
    "fused_moe_config",
    "fused_moe_runners",
    "max_sorted_rows",
    "moe_gemv_tactics",
    "moe_router",
    "moe_router_config",
    "moe_router_runners",
    "pairs_per_program",
    "moe_tactics",
    "route_top_k",
    "route_top_k_config",
    "route_top_k_runners",
    "sort_by_expert",
    "sparse_fused_moe",
    "torch_fused_moe",
    "torch_route_top_k",
]
