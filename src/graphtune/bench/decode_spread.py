"""How far the timed repeats of ``graphtune bench decode`` spread, and the warning when they spread
too far to trust the median.

Every timed column of the benchmark (ms per step: ``eager_ms``, ``graph_ms``, ``compile_ms``,
``tuned_graph_ms``, ``tuned_eager_ms``, ``tuned_unfused_ms``) is the median of ``--repeats``
samples, each the mean of ``--steps`` back-to-back calls. :func:`timed_ms` also records, per
column, the fastest sample and the relative spread of the samples in
:attr:`BatchResult.repeat_spread <graphtune.bench.decode_results.BatchResult.repeat_spread>`;
the spread is the library's :class:`~graphtune.autotuner.timing.base.Measurement` ``spread``:
``(p75 - p25) / median`` with 4 or more repeats, ``(max - min) / median`` with 2 or 3 (0 with
one). A spread above :data:`SPREAD_WARNING` (20%) means another process is taking the cores
(or the GPU) from the benchmark: :func:`spread_warning` says so in one line below the table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.timing import measure_per_call

#: Relative spread of a timed column's repeats above which the report warns.
SPREAD_WARNING = 0.20


def timed_ms(
    result: BatchResult,
    column: str,
    fn: Callable[[], object],
    device: torch.device,
    cfg: DecodeBenchConfig,
) -> float:
    """Times ``fn`` as every step of the benchmark is timed (``cfg.steps`` calls a sample,
    ``cfg.repeats`` samples, :func:`~graphtune.bench.timing.measure_per_call`), records the
    fastest sample and the spread under ``column`` in ``result.repeat_spread`` and returns the
    median in ms per call (the value of ``column``)."""
    m = measure_per_call(fn, device, cfg.steps, cfg.repeats)
    result.repeat_spread[column] = {"min_ms": m.min_us / 1e3, "spread": m.spread, "repeats": m.n}
    return m.median_us / 1e3


def spread_warning(report: DecodeBenchReport) -> str | None:
    """One line when any timed column's repeats spread by more than :data:`SPREAD_WARNING`
    at any batch size (naming the worst), with what to do about it; ``None`` otherwise."""
    timings = [
        (entry["spread"], column, r.batch_size)
        for r in report.results
        for column, entry in r.repeat_spread.items()
        if entry.get("spread") is not None
    ]
    spreads = [t for t in timings if t[0] > SPREAD_WARNING]
    if not spreads:
        return None
    spread, column, batch = max(spreads)
    cpu = str(report.config.get("device", "")).startswith("cpu")
    advice = (
        "set OMP_NUM_THREADS=1 (or fewer threads than idle cores), stop other work, or raise "
        "--repeats"
        if cpu
        else "stop other work on the GPU and its host, or raise --repeats"
    )
    name = column.removesuffix("_ms").replace("_", " ")
    return (
        f"warning: timings are noisy: the repeats spread by up to {100 * spread:.0f}% "
        f"({name} ms at batch {batch}; {len(spreads)} of {len(timings)} timings over "
        f"{100 * SPREAD_WARNING:.0f}%), so the machine is likely busy and the medians may be off; "
        f"{advice}"
    )
