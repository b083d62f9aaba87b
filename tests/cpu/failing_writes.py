"""A result write that fails in one folder (a full disk), for the benchmark scripts' tests of
where their result goes then (``graphtune.bench.results`` falls back to the temporary folder)."""

from __future__ import annotations

from pathlib import Path

import pytest


def fail_writes_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """Makes result writes into ``tmp_path/out`` fail with ENOSPC and points the temporary folder
    at ``tmp_path/spare``; returns both folders (created)."""
    import graphtune.bench.results as results

    out, spare = tmp_path / "out", tmp_path / "spare"
    out.mkdir()
    spare.mkdir()
    write = results._write_atomically

    def fail_in_out(path: Path, data: bytes) -> None:
        if Path(path).parent == out:
            raise OSError(28, "No space left on device")
        write(path, data)

    monkeypatch.setattr(results, "_write_atomically", fail_in_out)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(spare))
    return out, spare
