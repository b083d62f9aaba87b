"""Long work shows progress where no bar can: a log or a pipe gets INFO records of
``graphtune.reporting``, at most one per ``LOG_INTERVAL_S``, and short work stays silent."""

from __future__ import annotations

import logging

import pytest

from graphtune import reporting


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "graphtune.reporting"]


def test_long_work_logs_where_it_is_at_most_once_per_interval(caplog):
    clock = FakeClock()
    task = reporting.LoggedTask("tuning op", 5, clock=clock)
    with caplog.at_level(logging.INFO, logger="graphtune.reporting"):
        for second in (3.0, 11.0, 15.0, 22.0):
            clock.now = second
            task.advance()
        task.advance("tuning op [8x64]")
        clock.now = 30.0
        task.finish()
    assert _messages(caplog) == [
        "tuning op: 2/5 (11 s)",
        "tuning op: 4/5 (22 s)",
        "tuning op [8x64]: 5/5 done in 30 s",
    ]


def test_short_work_logs_nothing(caplog):
    clock = FakeClock()
    task = reporting.LoggedTask("capturing", 3, clock=clock)
    with caplog.at_level(logging.INFO, logger="graphtune.reporting"):
        for _ in range(3):
            clock.now += 1.0
            task.advance()
        task.finish()
    assert _messages(caplog) == []


def test_progress_without_a_terminal_reports_through_the_log(monkeypatch):
    monkeypatch.setattr(reporting.sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.delenv("GRAPHTUNE_NO_PROGRESS", raising=False)
    with reporting.progress("work", 3) as task:
        assert isinstance(task, reporting.LoggedTask)
    monkeypatch.setenv("GRAPHTUNE_NO_PROGRESS", "1")  # the switch hides the records too
    with reporting.progress("work", 3) as task:
        assert not isinstance(task, reporting.LoggedTask)
    monkeypatch.delenv("GRAPHTUNE_NO_PROGRESS")
    with reporting.progress("work", 3, enabled=False) as task:  # forced off: silent
        assert not isinstance(task, reporting.LoggedTask)
