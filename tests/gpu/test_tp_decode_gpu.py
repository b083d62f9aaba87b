"""Tensor-parallel decode on two GPUs (NCCL inside the CUDA graphs); skipped with fewer GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_tp2_tokens_equal_tp1_and_graphs_hold_the_all_reduces() -> None:
    script = Path(__file__).with_name("tp_check.py")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ranks_agree"]
    assert out["captured"] == [1, 2, 4, 8]  # every size captured with NCCL inside
    assert out["tp2_graph"] == out["tp1"]  # float32: a flip would need a 1e-5 near-tie
    assert max(out["graph_vs_eager_max_abs"].values()) < 1e-3
    assert out["all_reduce"] == "symm_mem"  # two NVLink-connected GPUs: the one-shot path
    assert out["fused_norm"]  # Triton: the tuned step fuses all-reduce + add + RMSNorm
    assert out["tp2_graph_nccl"] == out["tp1"]
    assert out["tuned_picks_agree"] and out["tuned_picks"] > 0
    assert max(out["tuned_vs_eager_max_abs"].values()) < 1e-2  # float32, other kernels
    assert out["tuned_tokens"] == out["tp1"]
    assert not out["tuned_fallbacks"]  # every shape the step looks up was tuned
