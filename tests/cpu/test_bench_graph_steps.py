"""The graph benchmarks' steps and the prefill benchmark on CPU: the engine's step with attention
as a graph break replays (simulated backend) what the step computes, and the prefill benchmark
runs end to end with a fake clock."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from graphtune.bench.graph_steps import AttentionBreakStep, engine_decode_step, step_inputs
from graphtune.bench.prefill import PrefillBenchConfig, format_prefill_table, run_prefill_bench
from graphtune.engine.build import build_runner
from graphtune.errors import ConfigError
from graphtune.graphs import SimulatedGraphBackend


def test_attention_break_step_is_the_engine_step_in_pieces():
    step = engine_decode_step(8, 32, model="tiny", device="cpu", dtype=torch.float32)
    broken = AttentionBreakStep(step)
    plain = build_runner(step, "graph", capture_sizes=[2, 4], backend=SimulatedGraphBackend())
    pieces = build_runner(broken, "graph", capture_sizes=[2, 4], backend=SimulatedGraphBackend())
    layers = step.model.config.num_layers
    with torch.inference_mode():
        plain.capture(*step.example_inputs(4))
        pieces.capture(*broken.example_inputs(4))
        assert {r.pieces for r in pieces.stats.records} == {layers + 1}
        assert {r.pieces for r in plain.stats.records} == {1}
        inputs = step_inputs(step, 3, 20, seed=1)
        want = plain(*inputs).clone()
        got = pieces(*inputs)
        eager = step(*inputs)
    assert torch.equal(got, want)
    assert pieces.stats.break_runs == layers and pieces.stats.replays == 1
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    tokens, positions, slots = inputs
    assert positions.tolist() == [20] * 3 and slots.tolist() == [0, 1, 2]
    assert int(tokens.max()) < step.model.config.vocab_size


def _run_prefill(cfg):
    """``run_prefill_bench`` on the simulated graph backend, each clock read 1 ms after the last."""
    ticks = itertools.count()
    return run_prefill_bench(
        cfg,
        log=lambda line: None,
        clock=lambda: next(ticks) * 1e-3,
        graph_backend=SimulatedGraphBackend(),
    )


def test_prefill_bench_runs_end_to_end_with_a_fake_clock():
    cfg = PrefillBenchConfig(
        model="tiny",
        prompt_lengths=(4, 16),
        batch_sizes=(1, 2),
        repeats=2,
        warmup=1,
        check_tokens=3,
        device="cpu",
    )
    report = _run_prefill(cfg)
    results = report["results"]
    assert [(r["batch_size"], r["prompt_len"]) for r in results] == [
        (1, 4),
        (1, 16),
        (2, 4),
        (2, 16),
    ]
    for r in results:
        assert r["ms"] == pytest.approx({"graph": 1.0, "eager": 1.0, "per_request": 1.0})
        assert r["token_mismatches"] == 0 and r["first_token_mismatches"] == 0
    assert results[1]["target"] == 0.5 and results[1]["passed"] is False  # 1.0 > 0.5
    assert report["max_prefill_tokens"] == 32 and report["prefill_capture_sizes"] == [16, 24, 32]
    assert report["prefill_graphs"]["replays"] > 0 and report["prefill_graphs"]["eager_calls"] == 0
    assert report["provenance"]["schema"].startswith("graphtune.provenance")
    assert "time to first token" in format_prefill_table(report)


@pytest.mark.parametrize("check_tokens", [0, 2])
def test_prefill_bench_fails_on_first_tokens_that_differ(monkeypatch, check_tokens):
    import graphtune.bench.prefill as prefill_bench

    # Per-request prefill picks other first tokens than graph prefill.
    monkeypatch.setattr(prefill_bench, "_per_request", lambda engine, prompts: [-1] * len(prompts))
    cfg = PrefillBenchConfig(
        model="tiny",
        prompt_lengths=(4,),  # no TTFT target: only the token checks decide
        batch_sizes=(2,),
        repeats=1,
        warmup=0,
        check_tokens=check_tokens,
        device="cpu",
    )
    report = _run_prefill(cfg)
    (result,) = report["results"]
    assert result["first_token_mismatches"] == 2 and result["passed"] is None
    assert report["pass"] is False
    header = report["table"].split("┡")[0]
    assert header.count("diffs") == 2  # first-token and generated-token diffs both shown
    assert bool(report["notes"]) == (check_tokens == 0)  # no generated-token check is said


def test_prefill_bench_config_is_validated():
    with pytest.raises(ConfigError, match="prompt_lengths"):
        PrefillBenchConfig(prompt_lengths=(0,))
    with pytest.raises(ConfigError, match="repeats"):
        PrefillBenchConfig(repeats=0)


def _prefill_script():
    """benchmarks/prefill.py as a module (the benchmarks folder is no package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill.py"
    spec = importlib.util.spec_from_file_location("prefill_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--prompt-lengths", "16,abc"],
            "expected comma-separated integers like 1,8, got '16,abc'",
        ),
        (["--prompt-lengths", "1,,2"], "got '1,,2'"),
        (["--prompt-lengths", "0"], "prompt lengths must be integers >= 1"),
        (["--batch-sizes", "0"], "batch sizes must be integers >= 1, got '0'"),
    ],
)
def test_prefill_script_flags_are_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _prefill_script().main(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prefill_script_failures_are_one_line_and_names_keep_runs_apart(
    tmp_path, capsys, monkeypatch
):
    script = _prefill_script()
    assert script.main(["--out", str(tmp_path), "--model", "nope", "--device", "cpu"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model 'nope'")

    def fake_bench(cfg, log, command):
        return {"provenance": {"gpu_slug": "h200"}, "results": [], "pass": True, "table": ""}

    monkeypatch.setattr(script, "run_prefill_bench", fake_bench)
    # The name is decided before the run (its --out is checked then), from the device.
    monkeypatch.setattr(script, "device_slug", lambda device: "h200")
    for extra in ([], ["--quick"], ["--batch-sizes", "1"], ["--model", "qwen3-tiny"]):
        assert script.main(["--out", str(tmp_path), *extra]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "prefill-h200-quick.json",
        "prefill-h200-qwen3-tiny.json",
        "prefill-h200-subset.json",
        "prefill-h200.json",
    ]
