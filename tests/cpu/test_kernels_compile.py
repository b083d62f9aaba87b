"""Every Triton kernel of graphtune.ops compiles for an sm_90 GPU (code generator, LLVM, ptxas).

The interpreter tests run kernel bodies as Python and never meet the code generator's rules
(one type per name across a runtime ``if``, loop-carried types, ``tl.dot`` shapes); this runs the
real compiler on the CPU for every runner's first and last tactic, with PDL on
(``tests/cpu/sm90_compile.py``), in a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# This process keeps the suite's convention (the interpreter is chosen before Triton is first
# imported, see test_ops_kernels.py); the compile check itself runs in a process without it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[2]


def test_every_triton_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every run
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cpu" / "sm90_compile.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {label: error for label, error in results.items() if error is not None}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    kernels = {label.rsplit(" ", 1)[-1] for label in results}
    # Each kernel family was compiled (the one-kernel attention in its inline-merge mode too).
    assert {
        "fused_gemv_kernel",
        "decode_attention_kernel",
        "decode_attention_combine_kernel",
        "gemm_kernel",
        "gemv_kernel",
        "rms_norm_kernel",
        "silu_and_mul_kernel",
        "rope_kv_kernel",
        "moe_route_top_k_kernel",
        "moe_router_kernel",
        "moe_gate_up_kernel",
        "moe_down_kernel",
        "moe_sum_kernel",
    } <= kernels, sorted(kernels)
    assert any("OneKernel" in label for label in results)
