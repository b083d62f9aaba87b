"""Bad input on the command line as a user runs it (a subprocess): one ``error:`` line that names
the input, the rule and the fix, never a traceback or a quietly different run."""

from __future__ import annotations

import pytest
import torch
from test_cli_errors import error_line, graphtune

CPU_BENCH = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_runner_graph_without_cuda_is_refused_not_timed_eagerly():
    result = graphtune(*CPU_BENCH, "--runner", "graph", "--steps", "1", "--repeats", "1")
    error_line(result, 1, "--runner graph", "CUDA graphs need CUDA", "--runner eager")
    assert "batch 1" not in result.stderr and "eager ms" not in result.stdout  # nothing ran


def test_model_folder_whose_config_json_is_a_folder_says_so(tmp_path):
    (tmp_path / "model" / "config.json").mkdir(parents=True)
    result = graphtune("tune", "--model", str(tmp_path / "model"), "--cache", str(tmp_path / "c"))
    line = error_line(result, 1, str(tmp_path / "model" / "config.json"), "is a folder")
    assert "has no config.json" not in line
