"""Progress bars and tables for people, shared by the tuner, the graph runner and the CLI.

Both use ``rich``. Progress goes to stderr and is hidden when stderr is not a terminal or when
``GRAPHTUNE_NO_PROGRESS=1``; tables are rendered to plain strings so callers decide where they go.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from graphtune import env


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
        enabled: Force the bar on or off; ``None`` decides from the terminal and environment.

    Yields:
        A task whose ``advance()`` moves the bar by one unit.
    """
    global _active
    show = progress_enabled() if enabled is None else enabled
    if not show or total <= 0:
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
        TextColumn("[bold]{task.description}"),
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

    Numeric-looking columns are right-aligned. ``None`` cells print as ``-``.
    """
    table = Table(title=title, show_lines=False)
    for index, name in enumerate(columns):
        numeric = bool(rows) and all(
            isinstance(row[index], (int, float)) or row[index] is None for row in rows
        )
        table.add_column(name, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(format_cell(cell) for cell in row))
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
