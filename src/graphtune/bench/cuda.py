"""The GPU a benchmark script runs on, or a clear exit when there is none."""

from __future__ import annotations

import sys

import torch


def require_cuda_or_exit(script: str) -> torch.device:
    """Returns the current CUDA device, or prints why not (one ``error:`` line) and exits with
    status 2."""
    if not torch.cuda.is_available():
        print(
            f"error: {script} needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on the GPU "
            "machine: PYTHONPATH=src python3 benchmarks/<script>.py --out DIR",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.device("cuda", torch.cuda.current_device())
