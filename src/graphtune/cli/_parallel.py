"""``--tp`` and ``--all-reduce``: tensor-parallel options shared by ``generate`` and ``bench``."""

from __future__ import annotations

import argparse
from typing import Any

from graphtune.cli._args import positive_int
from graphtune.errors import ConfigError

#: graphtune.engine.collectives.BACKENDS, kept literal so building the parser imports no torch.
ALL_REDUCE_CHOICES = ("auto", "nccl", "symm_mem")


def add_tensor_parallel_arguments(
    parser: argparse.ArgumentParser, command: str, only_rank0: str
) -> None:
    """Adds ``--tp N`` and ``--all-reduce`` to ``parser`` (``command`` names it in the help)."""
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help=f"tensor-parallel degree; N > 1 needs 'torchrun --nproc-per-node N "
        f"-m graphtune {command} --tp N ...' (NCCL on CUDA with "
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1, gloo on CPU); "
        f"{only_rank0}",
    )
    parser.add_argument(
        "--all-reduce",
        choices=ALL_REDUCE_CHOICES,
        default="auto",
        help="with --tp: the decode step's all-reduce (auto: symmetric-memory "
        "one-shot when every GPU can use it, else NCCL)",
    )


def start_tensor_parallel(args: argparse.Namespace, device: Any) -> tuple[Any, Any]:
    """``(ParallelContext or None, device)`` for ``args.tp``; starts the process group for tp > 1.

    Raises:
        ConfigError: ``--tp`` below 1, ``--all-reduce`` without ``--tp`` above 1, or tp > 1
            without a matching torchrun launch.
    """
    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    if args.tp == 1:
        from graphtune import env

        launched = env.torchrun_rank()
        if launched is not None and launched[1] > 1:
            raise ConfigError(
                f"{launched[1]} processes were started (WORLD_SIZE) but --tp is 1: each would run "
                f"the whole model and write the same files; pass --tp {launched[1]}, or start one"
            )
        if args.all_reduce != "auto":
            raise ConfigError(
                f"--all-reduce {args.all_reduce} picks the all-reduce of a tensor-parallel step; "
                "it needs --tp 2 or more (drop it for one process)"
            )
        return None, device
    from graphtune.engine.parallel import init_from_torchrun

    return init_from_torchrun(args.tp, device, args.all_reduce)


def stop_tensor_parallel(parallel: Any) -> None:
    """Destroys the process group that :func:`start_tensor_parallel` started, if any."""
    if parallel is not None:
        from graphtune.engine.parallel import destroy

        destroy()
