"""benchmarks/host_overhead.py on the CPU, in a process without TRITON_INTERPRET (as the
script asks): every measurement is there and positive."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_benchmark_measures_lookups_launches_and_a_forward(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    script = ROOT / "benchmarks" / "host_overhead.py"
    argv = [sys.executable, str(script), "--out", str(tmp_path), "--quick", "--repeats", "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "host-overhead-cpu.json").read_text())
    assert result["provenance"]["schema"] == "graphtune.provenance/1"
    assert result["lookup_us"] > 0 and result["forward_ms"] > 0
    assert set(result["host_speed"]) == {"python_loop_us", "torch_empty_us"}
    launches = result["launch_us"]
    if launches:  # empty without Triton
        assert all(isinstance(v, float) and v > 0 for v in launches.values()), launches
        assert any(label.startswith("gemv m=1") for label in launches)
    assert "graphtune host time" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_host_overhead_refuses_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    script = ROOT / "benchmarks" / "host_overhead.py"
    argv = [sys.executable, str(script), "--out", str(tmp_path), "--quick"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("error:") == 1 and "TRITON_INTERPRET" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written
