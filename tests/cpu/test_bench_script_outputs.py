"""The benchmark scripts' command lines on the CPU, every script in benchmarks/: a malformed
argument is a usage error (one ``error:`` line, exit 2) found before the CUDA check; ``--help``
shows the default of every flag that takes a value; a result file that cannot be written is
refused before any measurement (exit 2, one line naming ``--out``), and a result that went to the
temporary folder instead makes the script exit 1 (``check_script_output`` and
``report_written``). The GPU-only scripts run here with CUDA faked up to the check: the check
needs only the GPU's name. Also ``prefill.py``'s verdict and ``pruning_evidence.py``'s malformed
inputs."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import torch
from failing_writes import fail_writes_in

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("[!_]*.py"))

#: Every script that writes a result, with the flags it needs besides --out.
OUT_SCRIPTS = {
    "allreduce": [],
    "attention_sweep": [],
    "decode_latency": [],
    "faults": [],
    "fused_ops": [],
    "gemm_sweep": [],
    "gemv_sweep": [],
    "graph_capture": [],
    "graph_runner": [],
    "host_overhead": [],
    "memory_plan": [],
    "moe": [],
    "prefill": ["--device", "cpu"],
    "step_trace": [],
    "step_truth": [],
    "timers": [],
    "tuning": [],
    "tuning_stability": [],
    "tuning_time": [],
}
#: The scripts that read results and write none.
READERS = {"pruning_evidence", "truth_agreement"}

#: A malformed argument of each script, and the flag its error names: every list a script takes,
#: else a typed flag (or a flag without its value where a script has no typed one).
MALFORMED = [
    ("allreduce", ["--commit"], "--commit"),
    ("attention_sweep", ["--batches", "1,,2"], "--batches"),
    ("decode_latency", ["--batch-sizes", "1,,2"], "--batch-sizes"),
    ("decode_latency", ["--batch-sizes", "0,-3"], "--batch-sizes"),
    ("decode_latency", ["--big-batch-sizes", "x"], "--big-batch-sizes"),
    ("decode_latency", ["--parts", ","], "--parts"),
    ("faults", ["--timeout", "0"], "--timeout"),
    ("fused_ops", ["--cases", "bad"], "--cases"),
    ("fused_ops", ["--cases", "llama-1b:1,llama-1b:x"], "--cases"),
    ("gemm_sweep", ["--batches", "128,"], "--batches"),
    ("gemv_sweep", ["--ops", "qkv,"], "--ops"),
    ("graph_capture", ["--cold-variants", "largest,nope"], "--cold-variants"),
    ("graph_runner", ["--commit"], "--commit"),
    ("host_overhead", ["--repeats", "x"], "--repeats"),
    ("memory_plan", ["--commit"], "--commit"),
    ("moe", ["--tokens", "1,,8"], "--tokens"),
    ("moe", ["--shapes", ","], "--shapes"),
    ("prefill", ["--prompt-lengths", "16,x"], "--prompt-lengths"),
    ("pruning_evidence", [], "result"),
    ("step_trace", ["--batches", "1,x"], "--batches"),
    ("step_truth", ["--batches", "x"], "--batches"),
    ("step_truth", ["--context", "-1"], "--context"),
    ("timers", ["--only", "no such case"], "--only"),
    ("truth_agreement", [], "results"),
    ("tuning", ["--modes", "graph,cupti"], "--modes"),
    ("tuning_stability", ["--tuners", "nope"], "--tuners"),
    ("tuning_stability", ["--only", "no such case"], "--only"),
    ("tuning_time", ["--max-batch", "0"], "--max-batch"),
]


def test_every_script_is_covered():
    assert sorted({*OUT_SCRIPTS, *READERS}) == SCRIPTS
    assert sorted({name for name, _, _ in MALFORMED}) == SCRIPTS


def _script(monkeypatch, name):
    """The benchmark script ``name`` in this process (the benchmarks folder is no package)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def _fake_cuda(monkeypatch, module):
    """CUDA as far as the scripts' output check needs it: a device and the GPU's name. The
    device is ``meta``, so anything past the check fails at once instead of measuring."""
    import graphtune.bench

    device = torch.device("meta")
    real = graphtune.bench.provenance

    def provenance(commit=None, device=None, **kwargs):  # the CPU's, for an 'h100'
        return {**real(commit, "cpu"), "gpu_slug": "h100"}

    for owner in (graphtune.bench, module):  # some scripts import them by name
        if hasattr(owner, "require_cuda_or_exit"):
            monkeypatch.setattr(owner, "require_cuda_or_exit", lambda script: device)
        if hasattr(owner, "provenance"):
            monkeypatch.setattr(owner, "provenance", provenance)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def _exit_code(script, argv) -> int:
    """``script.main(argv)``'s exit status, returned or raised."""
    try:
        return script.main(argv)
    except SystemExit as exited:
        return exited.code


@pytest.mark.parametrize(("name", "argv", "flag"), MALFORMED)
def test_a_malformed_argument_is_one_error_line_before_the_cuda_check(
    name, argv, flag, tmp_path, monkeypatch, capsys
):
    script = _script(monkeypatch, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("reached the CUDA check"))
    out = [] if name in READERS else ["--out", str(tmp_path)]
    assert _exit_code(script, [*out, *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def _undefaulted(help_text: str) -> list[str]:
    """The options in an argparse ``--help`` that take a value but say neither their default nor
    that they are required."""
    blocks: list[list[str]] = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            blocks.append([line])
        elif blocks and blocks[-1] and line.startswith("   "):  # the option above, wrapped
            blocks[-1].append(line)
        else:
            blocks.append([])  # a heading or a positional argument: no option continues
    found = []
    for block in filter(None, blocks):
        head = re.split(r"\s{2,}", block[0].strip())[0]  # "--out OUT", "-v, --verbose"
        text = " ".join(" ".join(block).split())
        if any(" " in part for part in head.split(", ")) and not re.search(
            r"default|required", text
        ):
            found.append(head)
    return found


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_the_default_of_every_flag_that_takes_a_value(name, monkeypatch, capsys):
    script = _script(monkeypatch, name)
    assert _exit_code(script, ["--help"]) == 0
    text = capsys.readouterr().out
    assert "-h, --help" in text
    assert _undefaulted(text) == [], text


@pytest.mark.parametrize("name", sorted(OUT_SCRIPTS))
def test_scripts_refuse_an_unwritable_out_before_any_work(name, tmp_path, monkeypatch, capsys):
    script = _script(monkeypatch, name)
    _fake_cuda(monkeypatch, script)
    if name == "allreduce":  # as torchrun launches it
        for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(var, value)
    (tmp_path / "afile").write_text("x")
    tf32 = torch.backends.cuda.matmul.allow_tf32  # some scripts set it before the check
    try:
        code = _exit_code(script, ["--out", str(tmp_path / "afile"), *OUT_SCRIPTS[name]])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert "--out" in errors[0] and "afile is a file, not a folder" in errors[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # nothing written


def _prefill(monkeypatch):
    script = _script(monkeypatch, "prefill")

    def fake_bench(cfg, log, command):
        return {"provenance": {"gpu_slug": None}, "results": [], "pass": True, "table": ""}

    monkeypatch.setattr(script, "run_prefill_bench", fake_bench)
    return script


def test_prefill_refuses_an_unwritable_out_before_the_run(tmp_path, monkeypatch, capsys):
    script = _prefill(monkeypatch)
    monkeypatch.setattr(script, "run_prefill_bench", lambda *a, **k: pytest.fail("ran"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exited:
        script.main(["--out", str(tmp_path / "afile"), "--device", "cpu"])
    assert exited.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_gpu_scripts_make_a_missing_out_folder_as_their_write_did(tmp_path, monkeypatch):
    # The check before the work makes the folder the result's atomic write used to make.
    from graphtune.cli._args import check_script_output

    target = tmp_path / "new" / "sub" / "result.json"
    check_script_output(target)
    assert target.parent.is_dir() and not target.exists()


def test_prefill_exits_1_when_its_result_went_to_the_temporary_folder(
    tmp_path, monkeypatch, capsys
):
    script = _prefill(monkeypatch)
    out, spare = fail_writes_in(monkeypatch, tmp_path)
    assert script.main(["--out", str(out), "--device", "cpu"]) == 1
    (kept,) = spare.iterdir()
    err = capsys.readouterr().err
    assert "could not be written" in err and str(kept) in err
    assert not list(out.iterdir())


def test_prefill_without_any_target_does_not_pass_and_says_no_graph_ran_on_cpu():
    from graphtune.bench.prefill import PrefillBenchConfig, run_prefill_bench

    lines: list[str] = []
    cfg = PrefillBenchConfig(
        model="tiny",
        prompt_lengths=(4,),  # no TTFT target at 4 tokens
        batch_sizes=(1,),
        repeats=1,
        warmup=0,
        check_tokens=0,
        device="cpu",
    )
    report = run_prefill_bench(cfg, log=lines.append)
    assert report["results"][0]["target"] is None
    assert report["pass"] is False  # nothing judged is no pass (the no-data rule)
    assert report["targets_not_evaluated"] == ["batch 1 x 4 tokens"]
    assert "n/a" in report["table"]
    assert "no prefill graphs captured on cpu" in lines[0] and "graphs captured in" not in lines[0]


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"cold": null}',
        '{"cold": {"candidates_table": {}}}',
        '{"cold": {"candidates_table": [1]}}',
        '{"cold": {"candidates_table": [{"op": "a", "profile": "8x2", "rows": [1]}]}}',
    ],
)
def test_pruning_evidence_refuses_json_of_another_shape_in_one_line(
    text, tmp_path, monkeypatch, capsys
):
    script = _script(monkeypatch, "pruning_evidence")
    result = tmp_path / "r.json"
    result.write_text(text)
    assert script.main([str(result)]) == 1  # a failure, not a usage error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no cold candidates_table" in err


def test_pruning_evidence_counts_a_well_formed_table(tmp_path, monkeypatch, capsys):
    script = _script(monkeypatch, "pruning_evidence")
    table = [{"op": "a", "profile": "8x2", "rows": [["r", 1, 1.0], ["q", 2, None]]}]
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"cold": {"candidates_table": table}}))
    assert script.main([str(result)]) == 0
    assert "a" in capsys.readouterr().out
