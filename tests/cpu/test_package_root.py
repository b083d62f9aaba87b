"""The package root imports its public names lazily (PEP 562)."""

from __future__ import annotations

import subprocess
import sys


def _loaded(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(','.join(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.split(",")


def test_import_graphtune_alone_imports_neither_torch_nor_the_tuner() -> None:
    loaded = _loaded("import graphtune")
    assert "torch" not in loaded
    assert not [m for m in loaded if m.startswith(("graphtune.autotuner", "graphtune.graphs"))]


def test_public_names_resolve_on_first_use() -> None:
    import graphtune
    from graphtune.autotuner import AutoTuner, TuningPolicy
    from graphtune.graphs import CUDAGraphRunner

    assert graphtune.AutoTuner is AutoTuner and graphtune.TuningPolicy is TuningPolicy
    assert graphtune.CUDAGraphRunner is CUDAGraphRunner
    assert set(graphtune.__all__) <= set(dir(graphtune))
    try:
        graphtune.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
