"""The decode benchmark's progress bar: one unit per (phase, batch size), labelled as it runs.

A batch-128 step on a CPU can take a minute per measurement, so ``bench decode`` shows which phase
and batch size is running (on stderr, through :func:`graphtune.reporting.progress`, which hides
itself when stderr is not a terminal or under ``GRAPHTUNE_NO_PROGRESS``).
"""

from __future__ import annotations

from graphtune.bench.decode_results import DecodeBenchConfig
from graphtune.reporting import ProgressTask


class PhaseBar:
    """Advances ``task`` one unit per finished (phase, batch size), labelled with the unit that
    runs next.

    Args:
        task: The progress task (from :func:`graphtune.reporting.progress`).
        labels: Every unit's label, in the order the benchmark runs them
            (:func:`phase_labels`).
    """

    def __init__(self, task: ProgressTask, labels: list[str]) -> None:
        self._task = task
        self._labels = labels
        self._index = 0

    @property
    def current(self) -> str:
        """The label of the unit running now."""
        return self._labels[min(self._index, len(self._labels) - 1)]

    def done(self) -> None:
        """One unit finished."""
        self._index += 1
        self._task.advance(self.current)


def phase_labels(cfg: DecodeBenchConfig, runners: tuple[str, ...], cuda: bool) -> list[str]:
    """The labels of every unit ``run_decode_bench`` runs for ``cfg``, in its order."""
    sizes = sorted(set(cfg.batch_sizes))
    graph = "graph" in runners
    labels = [f"eager step, batch {b}" for b in sizes] if "eager" in runners else []
    if graph:
        labels += ["capturing graphs"] + [f"graph step, batch {b}" for b in sizes]
    if cfg.compare_compile and cuda:
        labels += [f"torch.compile, batch {b}" for b in sizes]
    if cfg.tune:
        kind = "graph" if graph else "eager"
        labels += ["tuning the step"] + [f"tuned step check, batch {b}" for b in sizes]
        labels += ["capturing tuned graphs"] if graph else []
        labels += [f"tuned {kind} step, batch {b}" for b in sizes]
        if cfg.compare_unfused:
            labels += ["capturing tuned unfused graphs"] if graph else []
            labels += [f"tuned unfused {kind} step, batch {b}" for b in sizes]
    if cfg.compare_hf:
        labels += ["transformers on the same weights"]
    return labels
