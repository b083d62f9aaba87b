"""``graphtune check-tactics`` on long runs: Ctrl-C keeps the op calls checked so far."""

from __future__ import annotations

import json

import pytest

from graphtune.cli import _step_calls
from graphtune.cli.main import main

_COMMAND = ["check-tactics", "--model", "tiny", "--device", "cpu"]


def _interrupt_at_batch(monkeypatch, batch: int) -> None:
    """Ctrl-C while the step of ``batch`` is being built (after the batches before it)."""
    record = _step_calls.decode_step_calls

    def calls(model, size, **kwargs):
        if size == batch:
            raise KeyboardInterrupt
        return record(model, size, **kwargs)

    monkeypatch.setattr(_step_calls, "decode_step_calls", calls)


def test_ctrl_c_prints_and_writes_the_batches_that_finished(monkeypatch, tmp_path, capsys):
    target = tmp_path / "ct.json"
    _interrupt_at_batch(monkeypatch, 4096)
    assert main([*_COMMAND, "--batch", "1,4096", "--json", str(target)]) == 130
    out, err = capsys.readouterr()
    data = json.loads(target.read_text())
    assert data["config"]["batch"] == [1, 4096]
    ops = {report["op"] for report in data["reports"]}
    assert {"graphtune.gemm", "decode_attention"} <= ops and all(
        report["passed"] for report in data["reports"]
    )
    assert data["notes"] == [
        "interrupted (Ctrl-C): finished batch sizes [1]; batch sizes [4096] not (or only "
        "partly) checked"
    ]
    assert "tactic consistency of tiny" in out and "decode_attention" in out
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line == (
        f"error: interrupted (Ctrl-C); {len(data['reports'])} op calls checked (finished batch "
        f"sizes [1]) printed above and written to {target}"
    )


def test_ctrl_c_before_any_check_writes_nothing(monkeypatch, tmp_path, capsys):
    target = tmp_path / "ct.json"
    _interrupt_at_batch(monkeypatch, 1)
    assert main([*_COMMAND, "--batch", "1,2", "--json", str(target)]) == 130
    out, err = capsys.readouterr()
    assert not target.exists() and out == ""
    assert "error: interrupted (Ctrl-C); no op call had been checked yet" in err


def test_ctrl_c_with_json_to_stdout_prints_the_partial_result(monkeypatch, capsys):
    _interrupt_at_batch(monkeypatch, 2)
    assert main([*_COMMAND, "--batch", "1,2", "--json", "-"]) == 130
    out, err = capsys.readouterr()
    data = json.loads(out)  # '-': the JSON alone on stdout, the table on stderr
    assert data["reports"] and data["notes"][0].startswith("interrupted (Ctrl-C)")
    assert "tactic consistency of tiny" in err and "printed above" in err
