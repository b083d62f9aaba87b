"""``graphtune check-tactics`` on long runs: Ctrl-C keeps the op calls checked so far, and a
progress line names each batch size and op call as its check starts, and a batch whose checks
would not fit in the host's memory is refused before they run (the memory figure is faked here,
never exhausted)."""

from __future__ import annotations

import json

import pytest
import torch

import graphtune.autotuner
from graphtune.autotuner.profiles import nested_tensors
from graphtune.cli import _step_calls
from graphtune.cli.check_tactics import check_step
from graphtune.cli.main import main
from graphtune.engine import kv_cache
from graphtune.engine.presets import PRESETS
from graphtune.errors import ConfigError

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
    assert data["passed"] is False  # every finished check passed, but the run was cut short
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


def test_each_op_call_is_announced_before_its_check_runs(monkeypatch):
    lines: list[str] = []
    announced_before: list[bool] = []
    check = graphtune.autotuner.check_tactics

    def checked(op, *args, **kwargs):
        announced_before.append(f"op {op}," in lines[-1])
        return check(op, *args, **kwargs)

    monkeypatch.setattr(graphtune.autotuner, "check_tactics", checked)
    reports = check_step("tiny", (1, 2), device="cpu", log=lines.append)
    assert announced_before and all(announced_before)
    per_call = [line for line in lines if ": op " in line]
    assert len(per_call) == len(reports) == len(announced_before)
    # Batch 2 checks only the calls whose shapes batch 1 did not have (1-row GEMMs differ).
    assert lines[0] == "checking batch 1: running one decode step to record its op calls"
    assert any(line.startswith("checking batch 2: op ") for line in per_call)
    first_of_1 = [line for line in per_call if line.startswith("checking batch 1:")]
    assert first_of_1[-1].endswith(f"(op call {len(first_of_1)} of {len(first_of_1)})")


@pytest.mark.parametrize("hidden", [False, True])
def test_the_command_prints_progress_on_stderr_unless_hidden(monkeypatch, capsys, hidden):
    monkeypatch.setenv("GRAPHTUNE_NO_PROGRESS", "1" if hidden else "0")
    assert main([*_COMMAND, "--batch", "1", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    reports = json.loads(out)["reports"]  # stdout holds the JSON alone
    progress = [line for line in err.splitlines() if line.startswith("checking batch 1: op ")]
    assert len(progress) == (0 if hidden else len(reports))


#: Bytes of the tiny preset's KV cache of 64 slots (and the scratch one), float32, 256 positions.
_CACHE_OF_64 = kv_cache.kv_bytes_per_token(PRESETS["tiny"], 4) * 256 * 65


def _calls(batch: int) -> list:
    return _step_calls.decode_step_calls(
        "tiny", batch, device=torch.device("cpu"), dtype=torch.float32
    )


def test_the_estimate_counts_the_copies_and_the_float64_comparison():
    call = next(c for c in _calls(2) if c.op == "decode_attention")
    tensors = nested_tensors(list(call.inputs))
    inputs = sum(t.numel() * t.element_size() for t in tensors)
    need = _step_calls.check_memory_bytes(call)
    assert need == 3 * inputs + 32 * max(t.numel() for t in tensors)
    # The KV cache of a layer is among the inputs: the estimate grows with --batch.
    bigger = next(c for c in _calls(64) if c.op == "decode_attention")
    assert _step_calls.check_memory_bytes(bigger) > 10 * need
    needs = [max(_step_calls.check_memory_bytes(c) for c in _calls(b)) for b in (1, 64)]
    assert needs[0] <= _CACHE_OF_64 < needs[1]


def test_a_batch_whose_checks_do_not_fit_is_refused_before_any_check(monkeypatch):
    need = max(_step_calls.check_memory_bytes(c) for c in _calls(1))
    checked: list[str] = []
    check = graphtune.autotuner.check_tactics
    monkeypatch.setattr(
        graphtune.autotuner,
        "check_tactics",
        lambda op, *a, **k: checked.append(op) or check(op, *a, **k),
    )
    with pytest.raises(ConfigError) as info:
        check_step("tiny", (1,), device="cpu", available_memory=lambda: need - 1)
    assert checked == []  # refused before the first copy
    message = str(info.value)
    assert "\n" not in message and "--batch 1 (--max-seq-len 256)" in message
    assert message.endswith("lower --batch or --max-seq-len")
    assert check_step("tiny", (1,), device="cpu", available_memory=lambda: need) and checked
    checked.clear()  # unknown free memory (no /proc/meminfo, no sysconf): nothing is refused
    assert check_step("tiny", (1,), device="cpu", available_memory=lambda: None) and checked


def test_the_command_refuses_a_batch_too_big_and_keeps_the_batches_before_it(
    monkeypatch, tmp_path, capsys
):
    # Enough for every KV cache and for batch 1's checks, not for batch 64's (the estimate's
    # test checks that).
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: _CACHE_OF_64)
    target = tmp_path / "ct.json"
    assert main([*_COMMAND, "--batch", "1,64", "--json", str(target)]) == 1
    out, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and "--batch 64 (--max-seq-len 256)" in line
    assert "host has" in line and line.endswith("lower --batch or --max-seq-len")
    data = json.loads(target.read_text())
    assert data["reports"] and data["notes"][0].startswith("stopped (checking the op calls")
    assert "finished batch sizes [1]" in data["notes"][0] and "tactic consistency" in out
