"""``graphtune generate`` and ``graphtune bench decode`` on the tiny preset (CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from failing_writes import fail_writes_in
from test_engine_events import interrupt_decode_at

from graphtune.bench.schema import SCHEMA, is_provenance
from graphtune.cli.main import main


def test_generate_prints_token_ids(capsys):
    code = main(
        [
            "generate",
            "--model",
            "tiny",
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "4,5",
            "--max-new-tokens",
            "5",
            "--runner",
            "graph",
            "--device",
            "cpu",
            "--ignore-eos",
            "--stats",
        ]
    )
    out = capsys.readouterr()
    assert code == 0
    lines = [line for line in out.out.splitlines() if line.startswith("tokens: ")]
    assert len(lines) == 2 and all(len(line[8:].split(",")) == 5 for line in lines)
    assert "no CUDA" in out.out  # the runner's stats table names the fallback reason
    eager = main(
        [
            "generate",
            "--model",
            "tiny",
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "4,5",
            "--max-new-tokens",
            "5",
            "--runner",
            "eager",
            "--device",
            "cpu",
            "--ignore-eos",
        ]
    )
    assert eager == 0
    assert [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens: ")
    ] == lines


def test_generate_errors_are_clean(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--device", "cpu"]) == 1
    assert "tokenizer" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,999", "--device", "cpu"]) == 1
    assert "outside" in capsys.readouterr().err
    code = main(["generate", "--model", "no-such-model", "--prompt-ids", "1", "--device", "cpu"])
    assert code == 1
    assert "not a preset" in capsys.readouterr().err


def test_bench_decode_tiny_cpu(tmp_path, capsys):
    out_json = tmp_path / "decode.json"
    plot = tmp_path / "decode.png"
    pytest.importorskip("matplotlib")
    code = main(
        [
            "bench",
            "decode",
            "--model",
            "tiny",
            "--batch-sizes",
            "1,4",
            "--context",
            "16",
            "--steps",
            "2",
            "--repeats",
            "2",
            "--device",
            "cpu",
            "--json",
            str(out_json),
            "--plot",
            str(plot),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert "eager ms" in captured.out
    # Said once, with the table.
    assert (captured.out + captured.err).count("CUDA graphs need CUDA") == 1
    data = json.loads(out_json.read_text())
    assert [r["batch_size"] for r in data["results"]] == [1, 4]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in data["results"])
    prov = data["provenance"]
    assert prov["torch"] == torch.__version__ and prov["commit"]
    assert is_provenance(prov) and prov["schema"] == SCHEMA and prov["device"] == "cpu"
    assert "bench decode" in prov["command"]
    assert plot.stat().st_size > 1000
    # stdout carries the table, JSON only where --json says.
    assert "{" not in captured.out


def test_bench_rejects_bad_batch_sizes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--batch-sizes", "1,x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: argument --batch-sizes")


def test_generate_gpu_memory_utilization_needs_cuda(capsys):
    args = ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--device", "cpu"]
    assert main([*args, "--gpu-memory-utilization", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization sizes the KV cache" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--gpu-memory-utilization", "1.5"])
    assert exit_info.value.code == 2
    assert "must be in (0, 1]" in capsys.readouterr().err


BENCH = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1"]


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--json", "{d}/r.json", "--plot", "{d}/r.json"], "--json and --plot both name"),
        (["--tune", "--tuning-cache", "{d}/r.json", "--json", "{d}/r.json"], "both name"),
        (["--plot", "{d}/p.xyz"], "'.xyz' is none of"),
        (["--plot", "{d}/plot"], "has no suffix"),
        (["--plot", "-"], "has no suffix"),
    ],
)
def test_bench_refuses_outputs_that_would_be_lost_before_running(tmp_path, capsys, flags, fragment):
    pytest.importorskip("matplotlib")
    args = [flag.format(d=tmp_path) for flag in flags]
    assert main([*BENCH, *args]) == 1
    err = capsys.readouterr().err
    assert fragment in err and "batch 1" not in err
    assert list(tmp_path.iterdir()) == []


def test_bench_reports_each_late_write_failure_with_where_its_data_went(
    tmp_path, capsys, monkeypatch
):
    pytest.importorskip("matplotlib")
    # The output folder fills up after the start-up checks (check_output_path) passed.
    out, spare = fail_writes_in(monkeypatch, tmp_path)
    json_path, plot_path = out / "x.json", out / "y.png"
    flags = ["--steps", "2", "--repeats", "1", "--context", "16"]
    assert main([*BENCH, *flags, "--json", str(json_path), "--plot", str(plot_path)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    kept_json, kept_plot = sorted(spare.glob("*x.json")), sorted(spare.glob("*y.png"))
    assert len(kept_json) == len(kept_plot) == 1 and not list(out.iterdir())
    assert json.loads(kept_json[0].read_text())["results"][0]["eager_ms"] > 0
    # One error line per file, each naming its flag and where its data is.
    assert len(errors) == 2, err
    for line, flag, path, kept in zip(
        errors, ("--json", "--plot"), (json_path, plot_path), (kept_json, kept_plot), strict=True
    ):
        assert (
            line == f"error: {flag} {path} could not be written; the data is in {kept[0]} instead"
        )


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_check_tactics_rejects_a_tolerance_that_is_not_finite_and_positive(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["check-tactics", "--model", "tiny", "--atol", value])
    assert exit_info.value.code == 2
    assert "--atol" in capsys.readouterr().err


@pytest.mark.parametrize("command", [BENCH, ["generate", "--model", "tiny", "--prompt-ids", "1"]])
@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999999"])
def test_a_seed_torch_cannot_take_is_a_usage_error(capsys, command, seed):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--seed", seed])
    assert exit_info.value.code == 2
    assert "--seed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["tune", "--model", "tiny", "--cache", "{d}/c.json", "--device", "cpu"],
        ["check-tactics", "--model", "tiny", "--device", "cpu"],
        ["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "cpu"],
    ],
)
def test_a_kv_cache_longer_than_the_model_positions_is_refused(tmp_path, capsys, command):
    args = [part.format(d=tmp_path) for part in command]
    assert main([*args, "--max-seq-len", "999999999"]) == 1
    assert "--max-seq-len 999999999 needs 999999999 positions" in capsys.readouterr().err


def test_host_allocation_failures_are_reported_as_out_of_memory():
    from graphtune.cli.main import _out_of_memory

    failed = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 512000000000 bytes"
    )
    assert _out_of_memory(failed) == "host"
    assert _out_of_memory(MemoryError()) == "host"
    assert _out_of_memory(RuntimeError("shape mismatch")) is None


@pytest.mark.parametrize(
    "command, flag",
    [(BENCH[:-2], "--batch-sizes"), (["check-tactics", "--model", "tiny"], "--batch")],
)
@pytest.mark.parametrize("sizes, fragment", [("1,,2", "comma-separated"), ("1,4,1", "twice")])
def test_batch_size_lists_with_blanks_or_repeats_are_usage_errors(
    capsys, command, flag, sizes, fragment
):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, flag, sizes])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_usage_lists_defaults_as_typed_and_rejects_odd_numbers(capsys):
    with pytest.raises(SystemExit):
        main(["check-tactics", "--help"])
    assert "(default: 1,8,32)" in capsys.readouterr().out
    for args in (["--prompt-ids", "1,²"], ["--prompt-ids", "1", "--temperature", "inf"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", "tiny", *args])
        assert exit_info.value.code == 2
        assert args[-2] in capsys.readouterr().err


def test_an_output_path_under_a_file_names_the_file(tmp_path, capsys):
    (tmp_path / "good.json").write_text("{}")
    assert main([*BENCH, "--json", str(tmp_path / "good.json" / "r.json")]) == 1
    assert "good.json is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("timing", ["graph", "events"])
def test_a_cuda_timer_for_cpu_ops_names_the_flag(tmp_path, capsys, timing):
    args = ["tune", "--model", "tiny", "--device", "cpu", "--cache", str(tmp_path / "c.json")]
    assert main([*args, "--timing", timing]) == 1
    assert f"--timing {timing} times CUDA work" in capsys.readouterr().err


def test_an_empty_misses_file_says_so_and_all_reduce_needs_tp(tmp_path, capsys):
    misses = tmp_path / "misses.json"
    misses.write_text('{"format": "graphtune-misses", "version": 1, "misses": []}')
    args = ["tune", "--from-misses", str(misses), "--cache", str(tmp_path / "c.json")]
    assert main(args) == 0
    assert "holds no recorded misses" in capsys.readouterr().out
    generate = ["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "cpu"]
    assert main([*generate, "--all-reduce", "nccl"]) == 1
    assert "--all-reduce nccl picks the all-reduce of a tensor-parallel step" in (
        capsys.readouterr().err
    )


def test_generate_sizes_the_cache_for_all_but_the_last_new_token():
    from argparse import Namespace

    from graphtune.cli.generate import check_lengths
    from graphtune.engine import get_preset

    config = get_preset("tiny").replace(max_position_embeddings=24)
    fits = Namespace(max_new_tokens=5, max_seq_len=24)
    assert check_lengths(fits, config, [[5] * 20]) == 24
    assert check_lengths(Namespace(max_new_tokens=5, max_seq_len=None), config, [[5] * 20]) == 24
    assert check_lengths(Namespace(max_new_tokens=1, max_seq_len=None), config, [[5]]) == 2


def test_generate_looks_picks_up_in_the_tuning_cache_and_records_misses(
    tmp_path, capsys, monkeypatch
):
    import graphtune.engine.engine
    from graphtune.autotuner.tuner import AutoTuner
    from graphtune.ops import _triton

    # A test that patched graphtune.autotuner.AutoTuner may have been the engine's first import.
    monkeypatch.setattr(graphtune.engine.engine, "AutoTuner", AutoTuner)
    # As in a process without TRITON_INTERPRET (another module of this worker may have set it):
    # the CPU runs torch only, and tuning does not interpret Triton kernels for minutes.
    monkeypatch.setattr(_triton, "kernels_interpreted", lambda: False)
    cache, misses = tmp_path / "c.json", tmp_path / "m.json"
    tune = ["tune", "--model", "tiny", "--cache", str(cache), "--device", "cpu"]
    assert main([*tune, "--max-batch", "1", "--max-seq-len", "64"]) == 0
    capsys.readouterr()
    generate = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "3"]
    generate += ["--runner", "eager", "--device", "cpu", "--stats"]
    monkeypatch.setenv("GRAPHTUNE_MISSES", str(misses))
    assert main([*generate, "--max-seq-len", "64", "--tuning-cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "no fallbacks: every look-up found a tuned pick" in out and " 0 misses" in out
    assert not misses.exists()
    # GRAPHTUNE_CACHE is the default; another KV cache length misses attention's picks.
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(cache))
    assert main(generate) == 0
    assert "decode_attention" in capsys.readouterr().out
    (record,) = json.loads(misses.read_text())["misses"]
    assert record["op"] == "decode_attention"


def test_generate_summary_says_the_graph_runner_ran_eagerly_without_cuda(capsys):
    generate = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "3"]
    assert main([*generate, "--runner", "graph", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    (summary,) = [line for line in out.out.splitlines() if " tokens in " in line]
    assert "runner graph (eager here: no CUDA), tiny" in summary
    assert "falls back to eager" in out.err  # the note before the run stays
    assert main([*generate, "--runner", "eager", "--device", "cpu"]) == 0
    (summary,) = [line for line in capsys.readouterr().out.splitlines() if " tokens in " in line]
    assert "runner eager, tiny" in summary


def test_runner_summary_counts_the_steps_that_ran_eagerly():
    from graphtune.cli.generate import runner_summary
    from graphtune.graphs.policy import FallbackReason
    from graphtune.graphs.stats import RunnerStats

    stats = RunnerStats(replays=7)
    assert runner_summary("graph", stats) == "runner graph"
    stats.count_fallback(FallbackReason.BATCH_TOO_LARGE)
    stats.count_fallback(FallbackReason.BATCH_TOO_LARGE)
    stats.count_fallback(FallbackReason.KEY_NOT_CAPTURED)
    assert runner_summary("graph", stats) == (
        "runner graph (3 of 10 steps eager: batch too large, key not captured)"
    )
    eager_only = RunnerStats(eager_calls=4)  # an EagerRunner records no reason
    assert runner_summary("eager", eager_only) == "runner eager"


#: Three requests of 3 tokens each on the eager runner.
_GENERATE_3 = ["generate", "--model", "tiny", "--device", "cpu", "--runner", "eager"]
_GENERATE_3 += ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--prompt-ids", "6"]
_GENERATE_3 += ["--max-new-tokens", "3", "--ignore-eos"]


def test_generate_reports_progress_through_reporting(monkeypatch, caplog, capsys):
    # A pipe or a log (no terminal) gets INFO records of graphtune.reporting; every token counts.
    import logging

    from graphtune import reporting

    monkeypatch.setattr(reporting, "LOG_INTERVAL_S", 0.0)  # a record per step, not per 10 s
    monkeypatch.delenv("GRAPHTUNE_NO_PROGRESS", raising=False)
    with caplog.at_level(logging.INFO, logger="graphtune.reporting"):
        assert main(_GENERATE_3) == 0
    records = [r.getMessage() for r in caplog.records if r.name == "graphtune.reporting"]
    assert records[0].startswith("generating (0 of 3 requests finished): 3/9")  # the prefill
    assert records[-1].startswith("generating (3 of 3 requests finished): 9/9 done in")
    assert capsys.readouterr().out.count("tokens: ") == 3
    caplog.clear()
    monkeypatch.setenv("GRAPHTUNE_NO_PROGRESS", "1")  # the switch hides them
    with caplog.at_level(logging.INFO, logger="graphtune.reporting"):
        assert main(_GENERATE_3) == 0
    assert not [r for r in caplog.records if r.name == "graphtune.reporting"]


def test_ctrl_c_during_generate_prints_the_requests_that_finished(monkeypatch, capsys):
    import graphtune.cli.generate as generate

    # One KV slot, so the requests run one after another and finish at different steps.
    monkeypatch.setattr(generate, "engine_batch_size", lambda prompts, tuned: 1)
    assert main(_GENERATE_3) == 0
    full = capsys.readouterr().out.splitlines()
    interrupt_decode_at(monkeypatch, 5)  # requests 0 and 1 took 2 + 2 decode steps; 2 is running
    assert main(_GENERATE_3) == 130
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[:4] == full[:4]  # requests 0 and 1, as a whole run prints them
    assert "prompt: 6" not in out.out
    assert " tokens in " in lines[4] and "runner eager, tiny" in lines[4]
    assert lines[5] == "interrupted: 1 of 3 requests did not finish (not shown)"
    (error,) = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert error == ("error: interrupted (Ctrl-C); 2 of 3 requests finished and are printed above")
