"""Tensor-parallel decode: weight sharding, the sharded decode step and prefill, torchrun setup.

Megatron-style tensor parallelism over ``world_size`` ranks of one ``torch.distributed`` group:

* The fused QKV projection is column-parallel: rank ``r`` keeps query heads
  ``[r * H/tp, (r+1) * H/tp)`` and KV heads ``[r * KV/tp, (r+1) * KV/tp)``, still fused as
  ``[q | k | v]``, so grouped-query attention stays rank-local (query head ``j`` reads KV head
  ``j // groups`` on the same rank). The KV cache of a rank holds only its KV heads.
* The fused gate/up projection is column-parallel over the intermediate dimension (``[gate | up]``
  per rank); SwiGLU is elementwise and stays rank-local.
* The output and down projections are row-parallel: each rank multiplies its slice and one
  ``all_reduce`` (sum) per projection makes the hidden state whole again. The residual is added
  once: rank 0's GEMM adds ``x`` (``addmm`` untuned) and the other ranks' GEMMs add zeros (the
  same op, so the same tuning key on every rank), writing ``x`` or the reducer's buffer, and the
  all-reduce writes the sum to ``x``. No extra kernel, and the collective is an ordinary op that
  a CUDA graph captures (NCCL). A tuned step whose reducer can fuse the all-reduce with the
  residual add and the next RMSNorm (symmetric memory with Triton) runs that one kernel instead.
* Embedding, final norm and LM head are replicated, so every rank ends with the same logits and
  samples the same token; the batch (tokens, positions, slots) is replicated as well.

Every rank must run the same sequence of steps with the same batch sizes: the engine keeps the
batch replicated (every rank calls ``generate`` with the same prompts and sampling parameters), so
every rank pads to the same captured graph size and no rank skips a collective the others wait on.

At ``tp=1`` nothing here runs: :func:`shard_model` is never called, the model's ``parallel`` is
``None`` and the engine builds the plain :class:`~graphtune.engine.step.DecodeStep`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from graphtune import env
from graphtune.engine.collectives import BACKENDS, AllReduce, make_all_reduce
from graphtune.engine.config import ModelConfig
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError, DistributedError
from graphtune.ops.context import OpContext

logger = logging.getLogger(__name__)

# The key under which check_same_on_ranks exchanges a rank's own failure.
_FAILURE = "(its own checks)"


@dataclass(frozen=True)
class ParallelContext:
    """Which tensor-parallel group this process belongs to (passed in, never global).

    Attributes:
        group: The ``torch.distributed`` process group the all-reduces run on (``None`` means the
            default group). Every rank of the group holds one shard of the model.
        rank: This process's rank in ``group``.
        world_size: Ranks in ``group`` (the tensor-parallel degree).
        all_reduce_backend: The decode step's all-reduce: ``"auto"`` (symmetric-memory one-shot
            when every rank can use it, else NCCL), ``"nccl"`` or ``"symm_mem"`` (see
            :mod:`graphtune.engine.collectives`).

    Raises:
        ConfigError: ``world_size < 1``, ``rank`` outside ``[0, world_size)`` or an unknown
            ``all_reduce_backend``.
    """

    group: Any
    rank: int
    world_size: int
    all_reduce_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.all_reduce_backend not in BACKENDS:
            raise ConfigError(
                f"ParallelContext.all_reduce_backend={self.all_reduce_backend!r} is not one of "
                f"{', '.join(BACKENDS)}"
            )
        if self.world_size < 1:
            raise ConfigError(f"ParallelContext.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"ParallelContext.rank must be in [0, {self.world_size}), got {self.rank}"
            )
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # Two processes claiming one rank, or a degree other than the group's, would
            # all-reduce the wrong shards together: wrong tokens, no error.
            actual = (dist.get_rank(self.group), dist.get_world_size(self.group))
            if actual != (self.rank, self.world_size):
                raise ConfigError(
                    f"ParallelContext(rank={self.rank}, world_size={self.world_size}) but this "
                    f"process is rank {actual[0]} of {actual[1]} in its group (-1: not in it); "
                    "use ParallelContext.from_group(group)"
                )

    def check_ready(self) -> None:
        """Checks that the group the shard's all-reduces run on exists (an Engine runs them).

        Raises:
            ConfigError: ``world_size > 1`` and no ``torch.distributed`` group is initialised.
        """
        dist = torch.distributed
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"a tensor-parallel shard (rank {self.rank} of {self.world_size}) needs the "
                "torch.distributed group its all-reduces run on: call init_process_group first "
                "(torchrun sets its environment)"
            )

    def check_same_on_ranks(
        self, what: str, values: dict[str, Any], failure: Exception | None = None
    ) -> None:
        """Checks that every rank passes equal ``values`` (one ``all_gather_object`` of their
        digests): a tensor-parallel step needs the same requests, limits and sampling on every
        rank, or the ranks' collectives pair up different work (wrong tokens, a hang or an
        abort in the collective library).

        A rank whose own checks of its arguments failed passes that error as ``failure``
        (``values`` then do not matter): it still joins the exchange, so the other ranks learn
        of it instead of waiting for it in their next collective.

        Raises:
            Exception: ``failure`` itself, on the rank that passed it.
            DistributedError: Another rank failed its checks, or a value differs; the message
                names the ranks and the error or the value.
        """
        mine: dict[str, Any] = {
            name: hashlib.sha256(repr(v).encode()).hexdigest() for name, v in values.items()
        }
        mine[_FAILURE] = None if failure is None else f"{type(failure).__name__}: {failure}"
        views: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(views, mine, group=self.group)
        if failure is not None:
            raise failure
        failed = [(rank, view[_FAILURE]) for rank, view in enumerate(views) if view[_FAILURE]]
        if failed:
            rank, error = failed[0]
            raise DistributedError(
                f"{what}: rank {rank} refused its arguments ({error}); every tensor-parallel "
                "rank must pass the same valid arguments"
            )
        differ = {
            name: [r for r, view in enumerate(views) if view[name] != views[0][name]]
            for name in mine
        }
        differ = {name: ranks for name, ranks in differ.items() if ranks}
        if differ:
            listed = "; ".join(f"{name} on ranks {ranks}" for name, ranks in differ.items())
            raise DistributedError(
                f"{what}: every tensor-parallel rank must pass the same arguments, but these "
                f"differ from rank 0's: {listed}"
            )

    @classmethod
    def from_group(cls, group: Any = None, all_reduce_backend: str = "auto") -> ParallelContext:
        """The context of this process in an initialised ``group`` (default: the world group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialised; call init_process_group first (or launch "
                "the CLI with torchrun and --tp N)"
            )
        return cls(group, dist.get_rank(group), dist.get_world_size(group), all_reduce_backend)


def check_shardable(config: ModelConfig, tp: int) -> None:
    """Checks that ``config`` splits evenly over ``tp`` ranks.

    Raises:
        ConfigError: ``tp < 1``, or query heads, KV heads or the intermediate size are not
            divisible by ``tp`` (the message lists every broken rule and the degrees that work).
    """
    if tp < 1:
        raise ConfigError(f"tensor-parallel degree must be >= 1, got {tp}")
    if config.num_experts and tp > 1:
        raise ConfigError(
            f"{config.name} is a mixture-of-experts model (num_experts={config.num_experts}); "
            "tensor parallelism of experts is not implemented: use tp=1"
        )
    if tp > 1 and config.mlp_bias:
        raise ConfigError(
            f"{config.name} has MLP biases (mlp_bias), which the tensor-parallel step does not "
            "split; run it with tp=1"
        )
    sizes = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    broken = [f"{name} ({value})" for name, value in sizes.items() if value % tp]
    if broken:
        valid = [
            n for n in range(1, config.num_heads + 1) if all(v % n == 0 for v in sizes.values())
        ]
        raise ConfigError(
            f"{config.name} cannot be split over tp={tp} ranks: {', '.join(broken)} not divisible "
            f"by {tp}. Each rank must own whole query heads, whole KV heads (KV-head replication "
            f"is not implemented) and an equal slice of the MLP; use tp in {valid}."
        )


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank shape: heads, KV heads and intermediate size divided by ``tp``."""
    check_shardable(config, tp)
    return config.replace(
        num_heads=config.num_heads // tp,
        num_kv_heads=config.num_kv_heads // tp,
        intermediate_size=config.intermediate_size // tp,
        head_dim=config.dim_per_head,
    )


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    size = t.shape[0] // tp
    return t[rank * size : (rank + 1) * size]


def shard_model(model: DecoderModel, parallel: ParallelContext) -> DecoderModel:
    """This rank's shard of a full model (the full tensors are not kept).

    Args:
        model: Full weights (every rank must pass the same ones: same checkpoint or preset seed).
        parallel: The group, rank and degree.

    Returns:
        A model whose ``config`` is the per-rank shape (:func:`shard_config`), ``global_config``
        the full one and ``parallel`` the context; ``model`` itself when ``world_size == 1``.

    Raises:
        ConfigError: The model is already sharded or does not split evenly.
    """
    if model.parallel is not None:
        raise ConfigError("the model is already sharded; shard the full model once per rank")
    tp, rank = parallel.world_size, parallel.rank
    if tp == 1:
        return model
    cfg = model.config
    local = shard_config(cfg, tp)
    split = (cfg.q_size, cfg.kv_size, cfg.kv_size)

    def qkv(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([_rows(part, rank, tp) for part in t.split(split)]).contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return _rows(t.t(), rank, tp).t().contiguous()

    layers = []
    for layer in model.layers:
        gate, up = layer.w_gate_up.chunk(2)
        # replace() keeps the replicated tensors (norms, Qwen3's per-head q/k norms) as they are.
        layers.append(
            dataclasses.replace(
                layer,
                wqkv=qkv(layer.wqkv),
                bqkv=None if layer.bqkv is None else qkv(layer.bqkv),
                wo=cols(layer.wo),
                w_gate_up=torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)]).contiguous(),
                w_down=cols(layer.w_down),
            )
        )
    return DecoderModel(
        config=local,
        embed=model.embed,
        layers=layers,
        final_norm=model.final_norm,
        lm_head=model.lm_head,
        tokenizer=model.tokenizer,
        source=f"{model.source} [tp rank {rank}/{tp}]",
        extras=dict(model.extras),
        parallel=parallel,
        global_config=cfg,
    )


class TensorParallelDecodeStep(DecodeStep):
    """:class:`DecodeStep` for a sharded model: the same forward, with the row-parallel output
    projections completed by an all-reduce (:meth:`add_projection`, the one hook it overrides).

    Args:
        model: A sharded model (``model.parallel`` set, see :func:`shard_model`).
        cache: This rank's KV cache (built from ``model.config``: only this rank's KV heads).
        contiguous_slots: As for :class:`DecodeStep`.
        tuner: As for :class:`DecodeStep`; tune with a rank-consistent strategy (``agree``,
            ``parallel`` or ``broadcast``) so every rank runs the same kernels.
        gemm_cold_l2: As for :class:`DecodeStep`.
        fused: As for :class:`DecodeStep`.
        reducer: The all-reduce (see :mod:`graphtune.engine.collectives`); ``None`` builds the
            one ``model.parallel.all_reduce_backend`` names (a collective: every rank builds its
            step at the same point).

    Raises:
        ConfigError: The model is not sharded.
    """

    tensor_parallel = True

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        *,
        contiguous_slots: bool = False,
        tuner: Any = None,
        gemm_cold_l2: bool | None = None,
        reducer: AllReduce | None = None,
        fused: bool = True,
    ) -> None:
        if model.parallel is None:
            raise ConfigError(
                "TensorParallelDecodeStep needs a sharded model (load_model(..., "
                "parallel=ParallelContext(...)) or shard_model)"
            )
        super().__init__(
            model,
            cache,
            contiguous_slots=contiguous_slots,
            tuner=tuner,
            gemm_cold_l2=gemm_cold_l2,
            fused=fused,
        )
        self.parallel: ParallelContext = model.parallel
        if reducer is None:
            reducer = make_all_reduce(
                self.parallel,
                max_rows=cache.max_batch_size,
                hidden=model.config.hidden_size,
                dtype=model.dtype,
                device=model.device,
            )
        self.reducer: AllReduce = reducer
        # Rank 0 adds the residual inside its GEMM and the other ranks add these zeros, so every
        # rank runs the same op form (the same tuning key, which rank-consistent tuning needs)
        # and the all-reduce sums the residual once.
        self.zero_rows = (
            None
            if self.parallel.rank == 0
            else torch.zeros(
                (cache.max_batch_size, model.config.hidden_size),
                device=model.device,
                dtype=model.dtype,
            )
        )

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        """What this rank adds to its partial product: ``x`` on rank 0, zeros elsewhere."""
        if self.zero_rows is None:
            return x
        rows = x.shape[0]
        if rows <= self.zero_rows.shape[0]:
            return self.zero_rows[:rows]
        return torch.zeros_like(x)  # prefill of a prompt longer than the largest batch

    def add_projection(
        self,
        ops: OpContext,
        a: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        parity: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's slice of the projection, the all-reduce and the residual add, as
        ``(x, normed)``.

        A tuned step whose reducer offers the fused all-reduce + add + RMSNorm kernel (symmetric
        memory with Triton) writes the partial into the reducer's buffer and runs that one
        kernel, which also returns ``normed = rms_norm(x, norm_weight)``: the next stage then
        skips its norm prologue. Otherwise, as in an untuned step (torch only): rank 0's GEMM
        adds the residual, the partial goes where the reducer wants it, the all-reduce writes
        ``x``, ``normed`` is ``None`` and the next stage normalises ``x`` itself (fused into its
        projection when its tuned pick is the fused kernel).
        """
        rows = a.shape[0]
        fused = getattr(self.reducer, "fused_staging", None) if ops.tuned else None
        staged = fused(rows, parity) if fused is not None else None
        if staged is not None:
            partial = ops.gemm(a, weight, out=staged)
            eps = self.model.config.rms_norm_eps
            normed, x = self.reducer.reduce_add_rms_norm(partial, x, norm_weight, eps)
            return x, normed
        target = self.reducer.staging(rows)
        partial = ops.gemm(
            a, weight, residual=self._residual(x), out=x if target is None else target
        )
        self.reducer.reduce(partial, out=x)
        return x, None


def init_from_torchrun(
    tp: int,
    device: torch.device,
    all_reduce_backend: str = "auto",
    timeout_s: float | None = None,
) -> tuple[ParallelContext, torch.device]:
    """Initialises the default process group from torchrun's environment for ``--tp tp``.

    On CUDA the group has NCCL for CUDA tensors and gloo for CPU tensors (``cpu:gloo,cuda:nccl``;
    the CUDA device is set from ``LOCAL_RANK`` first, so NCCL binds the right GPU); gloo alone
    otherwise. Launch GPU runs with NVLink multicast off
    (``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).

    Args:
        tp: Requested tensor-parallel degree; must equal torchrun's ``WORLD_SIZE``.
        device: The resolved device (``cuda`` is replaced by ``cuda:LOCAL_RANK``).
        all_reduce_backend: Passed to :class:`ParallelContext`.
        timeout_s: The group's timeout (``init_process_group(timeout=...)``): how long a
            collective waits for a rank that never joins it; ``None`` keeps torch's default (10
            minutes on NCCL, 30 on gloo). An Engine whose call fails on one rank aborts the group,
            so the others fail at once; this bounds the wait when a rank hangs or never calls.

    Returns:
        The context over the world group and the device this rank runs on.

    Raises:
        ConfigError: Not launched by torchrun, ``WORLD_SIZE != tp``, or ``timeout_s <= 0``.
    """
    import torch.distributed as dist

    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"init_from_torchrun: timeout_s must be > 0 seconds, got {timeout_s}")

    launched = env.torchrun_rank()
    if launched is None:
        raise ConfigError(
            f"--tp {tp} needs {tp} processes: launch with 'torchrun --nproc-per-node {tp} -m "
            "graphtune ...' (with NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on GPUs)"
        )
    rank, world = launched
    if world != tp:
        raise ConfigError(
            f"--tp {tp} but torchrun started {world} processes; use --nproc-per-node {tp}"
        )
    if device.type == "cuda":
        device = torch.device("cuda", env.torchrun_local_rank() or 0)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        missing = env.missing_rendezvous()
        if missing:
            raise ConfigError(
                f"--tp {tp}: {' and '.join(missing)} not set, so the ranks cannot meet; launch "
                "with torchrun, which sets them"
            )
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        except dist.DistNetworkError as exc:  # a port in use, an address not reachable
            raise ConfigError(
                f"--tp {tp}: the ranks could not meet at MASTER_ADDR:MASTER_PORT ({exc}); pick a "
                "free port (torchrun --master-port) or check the address"
            ) from None
    logger.info("rank %d/%d: %s process group on %s", rank, world, backend, device)
    return ParallelContext(dist.group.WORLD, rank, world, all_reduce_backend), device


def destroy() -> None:
    """Destroys the default process group when one is initialised (end of a CLI run)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
