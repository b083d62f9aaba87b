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
from failing_writes import fail_writes_in

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


def _script(monkeypatch):
    """The script in this process, with its measurements stubbed (only main's checks and
    writes are under test) and the interpreter guard off (other test modules set it)."""
    benchmarks = str(ROOT / "benchmarks")
    monkeypatch.syspath_prepend(benchmarks)
    import host_overhead

    import graphtune.ops._triton

    monkeypatch.setattr(graphtune.ops._triton, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(host_overhead.bench, "host_speed", lambda: {"python_loop_us": 1.0})
    monkeypatch.setattr(host_overhead, "lookup_us", lambda calls, repeats: 1.0)
    monkeypatch.setattr(host_overhead, "launch_us", lambda calls, repeats: {})
    monkeypatch.setattr(host_overhead, "forward_ms", lambda calls, repeats: 1.0)
    return host_overhead


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--out", "{d}/afile"], "afile is a file, not a folder"),
        (["--out", "{d}", "--repeats", "0"], "--repeats: must be >= 1"),
    ],
)
def test_host_overhead_refuses_bad_arguments_before_measuring(
    tmp_path, capsys, monkeypatch, flags, message
):
    script = _script(monkeypatch)
    monkeypatch.setattr(script, "lookup_us", lambda *a: pytest.fail("measured"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exited:
        script.main([flag.format(d=tmp_path) for flag in flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_host_overhead_exits_1_when_its_result_went_to_the_temporary_folder(
    tmp_path, capsys, monkeypatch
):
    script = _script(monkeypatch)
    out, spare = fail_writes_in(monkeypatch, tmp_path)
    assert script.main(["--out", str(out), "--quick"]) == 1
    (kept,) = spare.iterdir()
    err = capsys.readouterr().err
    assert "could not be written" in err and str(kept) in err and "wrote" not in err
    assert not list(out.iterdir())
