"""CLI conventions: help text and defaults on every flag, a fast ``--help`` that imports no
torch, progress per phase and batch size, results kept when the JSON cannot be written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from graphtune.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
# The command as a user runs it: other test modules switch on Triton's interpreter in this
# process, which would make CPU tuning time interpreted Triton tactics for minutes.
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
ENV.update(PYTHONPATH=str(ROOT / "src"), GRAPHTUNE_NO_PROGRESS="1")
#: The smallest `bench decode` run: the tiny preset, one batch size, one step, one repeat.
_BENCH_TINY = (
    "bench decode --model tiny --device cpu --batch-sizes 1 --steps 1 --repeats 1 --context 8"
).split()


def _parsers(parser: argparse.ArgumentParser, name: str = "graphtune"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_and_shows_its_default():
    for name, parser in _parsers(build_parser()):
        assert parser.description, f"`{name}` has no description"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[-1]
            assert action.help, f"`{name} {flag}` has no help text"
            if action.nargs == 0:  # a switch: off unless given
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}
            said = "default" in shown or (action.required and "required" in shown)
            assert said, f"`{name} {flag}` does not show its default: {shown!r}"


def test_help_is_fast_and_imports_no_torch():
    probe = (
        "import sys, time; t = time.perf_counter(); from graphtune.cli.main import build_parser;"
        " build_parser().format_help(); print('torch' in sys.modules, time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, check=True
    ).stdout.split()
    assert out[0] == "False", "building the parser imported torch"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "graphtune", "--help"], capture_output=True, text=True, env=ENV
    )
    elapsed = time.perf_counter() - started
    assert result.returncode == 0 and "bench" in result.stdout
    assert elapsed < 2.0, f"graphtune --help took {elapsed:.2f} s"


@contextmanager
def _recording_progress(calls, description, total, *, enabled=None):
    labels = [description]

    class Task:
        def advance(self, label=None):
            labels.append(label)

    calls.append((total, labels))
    yield Task()


def test_bench_decode_reports_progress_per_phase_and_batch_size(monkeypatch, capsys):
    import graphtune.bench.decode as decode

    calls: list = []
    monkeypatch.setattr(decode, "progress", lambda *a, **k: _recording_progress(calls, *a, **k))
    args = [
        "bench",
        "decode",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,4",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--context",
        "8",
        "--runner",
        "eager",
    ]
    assert main(args) == 0
    ((total, labels),) = calls
    assert total == 2 and labels[0] == "eager step, batch 1"
    assert labels[1] == "eager step, batch 4" and len(labels) == total + 1


def test_bench_results_survive_an_unwritable_json(monkeypatch, tmp_path, capsys):
    import graphtune.bench.results as results

    def fail(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "_write_atomically", fail)
    args = [*_BENCH_TINY, "--json", str(tmp_path / "r.json")]
    assert main(args) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert captured.err.count("error:") == 1 and "printed above" in captured.err
    assert "eager ms" in out
    data = json.loads(out[out.index("{") :])
    assert data["results"][0]["eager_ms"] > 0


_CHECK_TINY = ["check-tactics", "--model", "tiny", "--device", "cpu", "--batch", "1"]


@pytest.mark.parametrize(
    ("command", "finished"),
    [
        ([*_BENCH_TINY, "--runner", "eager"], lambda doc: doc["results"][0]["eager_ms"] > 0),
        (_CHECK_TINY, lambda doc: doc["passed"] and doc["reports"]),
    ],
    ids=["bench-decode", "check-tactics"],
)
def test_json_is_written_before_the_table_meets_a_closed_pipe(tmp_path, command, finished):
    # As `graphtune bench decode --json F | head -1`: the reader is gone before the table, so
    # its print fails (EPIPE); the finished result must already be in F.
    target = tmp_path / "r.json"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "graphtune", *command, "--json", str(target)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env={**ENV, "PYTHONUNBUFFERED": "1"},  # the print itself meets the closed pipe
            timeout=240,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as a shell reports it
    assert "Traceback" not in done.stderr, done.stderr
    assert finished(json.loads(target.read_text()))


def test_bench_exits_1_when_its_json_went_to_the_temporary_folder(monkeypatch, tmp_path, capsys):
    import graphtune.bench.results as results

    target = tmp_path / "out" / "r.json"
    target.parent.mkdir()
    write = results._write_atomically

    def fail_at_target(path, data):
        if path == target:
            raise OSError(28, "No space left on device")
        write(path, data)

    monkeypatch.setattr(results, "_write_atomically", fail_at_target)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    args = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1"]
    args += ["--steps", "1", "--repeats", "1", "--context", "8", "--json", str(target)]
    assert main(args) == 1
    assert not target.exists()
    (kept,) = tmp_path.glob("graphtune-*-r.json")
    assert json.loads(kept.read_text())["results"][0]["eager_ms"] > 0
    assert str(kept) in capsys.readouterr().err


def test_result_files_get_the_umask_mode_or_keep_the_replaced_files_mode(tmp_path):
    from graphtune.bench.results import write_json

    old = os.umask(0o022)
    try:
        new, kept = tmp_path / "new.json", tmp_path / "kept.json"
        assert write_json(new, {"a": 1}) == new
        kept.write_text("{}")
        kept.chmod(0o640)
        assert write_json(kept, {"a": 1}) == kept
    finally:
        os.umask(old)
    # As any file the user creates (0o666 less the umask), and a replaced file keeps its mode.
    assert new.stat().st_mode & 0o777 == 0o644
    assert kept.stat().st_mode & 0o777 == 0o640 and json.loads(kept.read_text()) == {"a": 1}


def test_nested_progress_bars_share_one_display():
    from graphtune import reporting

    with reporting.progress("outer", 2, enabled=True) as outer:
        with reporting.progress("inner", 3, enabled=True) as inner:
            inner.advance()
            assert reporting._active is not None
            assert len(reporting._active.tasks) == 2
        outer.advance("next")
        assert len(reporting._active.tasks) == 1
    assert reporting._active is None
