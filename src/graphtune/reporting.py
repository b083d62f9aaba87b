"""Progress bars and tables for people, shared by the tuner, the graph runner and the CLI.

Both use ``rich``. Progress goes to stderr as a bar when stderr is a terminal; otherwise (a log,
a pipe) long work is reported as INFO records of this module's logger, at most one per
:data:`LOG_INTERVAL_S` seconds, which the CLI shows. ``GRAPHTUNE_NO_PROGRESS=1`` hides both.
Tables are rendered to plain strings so callers decide where they go. Every text shown (a
cell, a title, a progress label) is literal: op names, runner ids and tactics come from users and
cache files, and as rich markup ``[false,128]`` would vanish and ``[/]`` raise.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from graphtune import env

logger = logging.getLogger(__name__)

#: Least seconds between two progress records when no bar can be shown.
LOG_INTERVAL_S = 10.0


class ProgressTask(Protocol):
    """What a long-running loop reports to: advance by one unit, optionally with a new label."""

    def advance(self, label: str | None = None, steps: int = 1) -> None: ...


class _RichTask:
    def __init__(self, progress: Progress, task_id: Any) -> None:
        self._progress = progress
        self._task_id = task_id

    def advance(self, label: str | None = None, steps: int = 1) -> None:
        if label is None:
            self._progress.advance(self._task_id, steps)
        else:
            self._progress.update(self._task_id, advance=steps, description=label)


class _SilentTask:
    def advance(self, label: str | None = None, steps: int = 1) -> None:
        return None


class LoggedTask:
    """Progress as log records, for a stderr that is no terminal: one INFO record of where the
    work is when :data:`LOG_INTERVAL_S` passed since the last one (work shorter than that logs
    nothing), and one at the end of work that logged any.

    Args:
        description: What the work is.
        total: Units of work.
        clock: Seconds, monotonic (passed in so tests drive the interval).
    """

    def __init__(self, description: str, total: int, clock: Any = time.monotonic) -> None:
        self._description = description
        self._total = total
        self._clock = clock
        self._done = 0
        self._started = self._last = clock()
        self._logged = False

    def advance(self, label: str | None = None, steps: int = 1) -> None:
        """Counts ``steps`` more units done; ``label`` is the work's new description."""
        self._done += steps
        if label is not None:
            self._description = label
        now = self._clock()
        if now - self._last >= LOG_INTERVAL_S:
            self._last, self._logged = now, True
            logger.info(
                "%s: %d/%d (%.0f s)",
                self._description,
                self._done,
                self._total,
                now - self._started,
            )

    def finish(self) -> None:
        """Logs the end of work that logged its progress (short work stays silent)."""
        if self._logged:
            elapsed = self._clock() - self._started
            logger.info(
                "%s: %d/%d done in %.0f s", self._description, self._done, self._total, elapsed
            )


#: The live progress display while a bar is shown (nested bars join it as extra lines).
_active: Progress | None = None


def progress_enabled() -> bool:
    """Whether progress bars are shown (stderr is a terminal and not disabled by env)."""
    return not env.progress_disabled() and sys.stderr.isatty()  # a bad value raises anyway


@contextmanager
def progress(
    description: str, total: int, *, enabled: bool | None = None
) -> Iterator[ProgressTask]:
    """Shows a progress bar over ``total`` units of work while the block runs.

    Args:
        description: Label shown left of the bar.
        total: Number of units the block will ``advance`` through.
        enabled: Force the bar on or off; ``None`` decides from the terminal and environment
            (no terminal: :class:`LoggedTask` records instead).

    Yields:
        A task whose ``advance()`` moves the bar by one unit.
    """
    global _active
    show = progress_enabled() if enabled is None else enabled
    if not show or total <= 0:
        if enabled is None and total > 0 and not env.progress_disabled():
            # No terminal for a bar (a log, a pipe): long work still says where it is.
            task = LoggedTask(description, total)
            yield task
            task.finish()
        else:
            yield _SilentTask()
        return
    if _active is not None:
        # A bar inside another one (a tuner or a capture inside a benchmark phase) is one more
        # line of the live display already shown: rich shows one live display at a time.
        outer = _active
        task_id = outer.add_task(description, total=total)
        try:
            yield _RichTask(outer, task_id)
        finally:
            outer.remove_task(task_id)
        return
    bar = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        _active = bar
        try:
            task_id = bar.add_task(description, total=total)
            yield _RichTask(bar, task_id)
        finally:
            _active = None


def render_table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    width: int = 140,
) -> str:
    """Renders rows as a boxed text table and returns it as a string.

    Numeric-looking columns are right-aligned. ``None`` cells print as ``-``. The title, headers
    and cells print as the literal text given (never read as rich markup).
    """
    table = Table(title=None if title is None else Text(title), show_lines=False)
    for index, name in enumerate(columns):
        numeric = bool(rows) and all(
            isinstance(row[index], (int, float)) or row[index] is None for row in rows
        )
        table.add_column(Text(name), justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(Text(format_cell(cell)) for cell in row))
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text().rstrip("\n")


def format_cell(cell: Any) -> str:
    """A table cell as :func:`render_table` prints it (floats to 4 significant-ish digits)."""
    if cell is None:
        return "-"
    if isinstance(cell, float):
        if cell != cell or cell in (float("inf"), float("-inf")):
            return str(cell)
        magnitude = abs(cell)
        if magnitude >= 100:
            return f"{cell:.1f}"
        if magnitude >= 1:
            return f"{cell:.3f}"
        return f"{cell:.4f}"
    return str(cell)
