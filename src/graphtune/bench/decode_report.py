"""The decode benchmark's report for people: the table, the kernel tables and the plot."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from graphtune.bench.decode_results import BatchResult, DecodeBenchReport
from graphtune.bench.decode_spread import spread_warning
from graphtune.bench.kernel_families import FAMILIES
from graphtune.bench.results import write_result
from graphtune.errors import ConfigError
from graphtune.reporting import render_table


def format_report(report: DecodeBenchReport) -> str:
    """The per-batch table plus capture and bandwidth lines, for people."""
    compile_cols = any(r.compile_ms is not None or r.compile_note for r in report.results)
    tuned_cols = report.tuning_seconds is not None
    tuned_graph = any(r.tuned_graph_ms is not None for r in report.results)
    unfused_cols = any(r.tuned_unfused_ms is not None for r in report.results)
    hf_cols = any(r.hf_ms is not None or r.hf_eager_ms is not None for r in report.results)
    columns = [
        "batch",
        "eager ms",
        "graph ms",
        "GPU-busy ms",
        "speed-up",
        "graph / busy",
        "tokens/s",
        "floor ms",
    ]
    if compile_cols:
        columns.append("compile ms")
    if tuned_cols:
        columns += [
            "tuned graph ms" if tuned_graph else "tuned eager ms",
            "tuned busy ms",
            # Spaced: a header wraps at spaces only, so cut headers stay told apart.
            "tuned / untuned",
            "tuned / floor",
        ]
    rows = []
    for r in report.results:
        row: list[Any] = [
            r.batch_size,
            r.eager_ms,
            r.graph_ms,
            r.busy_ms,
            r.speedup,
            r.graph_over_busy,
            round(r.tokens_per_s) if r.tokens_per_s else None,
            r.floor_ms,
        ]
        if compile_cols:
            row.append(r.compile_ms)
        if tuned_cols:
            row += [
                r.tuned_graph_ms if tuned_graph else r.tuned_eager_ms,
                r.tuned_busy_ms,
                r.tuned_over_untuned,
                r.tuned_over_floor,
            ]
        rows.append(row)
    cfg = report.config
    params = report.model["parameters"]
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    title = (
        f"decode step: {report.model['name']} ({size} params), context {cfg['context']}, "
        f"{cfg['dtype']}, {cfg['device']}"
    )
    if rows:  # a column no row of this run measured (graph ms on a CPU...) is left out
        kept = [i for i in range(len(columns)) if i == 0 or any(row[i] is not None for row in rows)]
        columns = [columns[i] for i in kept]
        rows = [[row[i] for i in kept] for row in rows]
    # The title on a line of its own: a table of few columns would wrap it.
    table = render_table(None, columns, rows)
    width = len(table.splitlines()[0])
    lines = [title.center(width).rstrip() if len(title) < width else title, table]
    lines.append(legend(report, columns))
    noisy = spread_warning(report)
    if noisy:
        lines.append(noisy)
    if unfused_cols or hf_cols:
        lines.append(comparison_table(report))
    if report.capture_seconds is not None:
        lines.append(
            f"capture: {report.capture_seconds:.2f} s for {len(report.results)} sizes, "
            f"graph memory {report.graph_mib:.1f} MiB"
        )
    if report.copy_bandwidth_gbps:
        lines.append(
            f"device copy bandwidth (read+write): {report.copy_bandwidth_gbps:.0f} GB/s "
            "(the floor's)"
        )
    first = report.results[0] if report.results else None
    if first is not None and first.top_kernels:
        rows = [[k["name"][:70], k["calls"], k["us"], 100 * k["share"]] for k in first.top_kernels]
        launches = first.kernels_per_step
        kernels = f", {launches:.0f} device activities" if launches else ""
        lines.append(
            render_table(
                f"where the GPU time goes at batch {first.batch_size} "
                f"(profiler, per step{kernels})",
                ["kernel", "calls", "us", "% busy"],
                rows,
            )
        )
    if tuned_cols:
        fallbacks = report.tuning_fallbacks or {}
        lines.append(
            f"tuning: {report.tuning_profiles} (op, bucket) profiles tuned in "
            f"{report.tuning_seconds:.1f} s ({report.tuning_compile_seconds:.1f} s compiling); "
            + (f"untuned shapes fell back: {fallbacks}" if fallbacks else "no fallbacks")
        )
        diffs = {
            r.batch_size: r.tuned_max_abs_diff
            for r in report.results
            if r.tuned_max_abs_diff is not None
        }
        if diffs:
            lines.append(f"tuned vs untuned step logits: max abs diff {_worst_diff(diffs)}")
    if first is not None and first.tuned_top_kernels:
        rows = [
            [k["name"][:70], k["calls"], k["us"], 100 * k["share"]] for k in first.tuned_top_kernels
        ]
        launches = first.tuned_kernels_per_step
        kernels = f", {launches:.0f} device activities" if launches else ""
        lines.append(
            render_table(
                f"tuned step: where the GPU time goes at batch {first.batch_size} "
                f"(profiler, per step{kernels})",
                ["kernel", "calls", "us", "% busy"],
                rows,
            )
        )
    if first is not None:
        families = family_table(first)
        if families:
            lines.append(families)
    for r in report.results:
        if r.compile_note:
            lines.append(f"torch.compile batch {r.batch_size}: {r.compile_note}")
        if r.hf_note:
            lines.append(f"transformers compiled batch {r.batch_size}: {r.hf_note}")
    check = hf_check_line(report)
    if check:
        lines.append(check)
    weights = weights_table(report)
    if weights:
        lines.append(weights)
    lines.extend(report.notes)
    return "\n".join(lines)


#: What the main table's less obvious columns mean, for :func:`legend`.
_LEGEND = {
    "GPU-busy ms": "GPU-busy = profiled device time of one step",
    "speed-up": "speed-up = eager / graph",
    "graph / busy": "graph / busy = graph ms / GPU-busy ms",
    "floor ms": "floor = (weights + KV read) / measured copy bandwidth",
    "compile ms": "compile = torch.compile(mode='reduce-overhead')",
    "tuned busy ms": "tuned busy = GPU-busy of the tuned step",
}


def legend(report: DecodeBenchReport, columns: list[str]) -> str:
    """One line under the main table: what its ms are (the repeats and steps behind each median)
    and what its less obvious ``columns`` mean."""
    steps, repeats = report.config.get("steps"), report.config.get("repeats")
    parts = ["ms per decode step"]
    if steps and repeats:
        parts[0] += f": median of {repeats} repeats of {steps} back-to-back steps"
    if "tokens/s" in columns:
        steps_timed = [c for c in ("graph ms", "eager ms") if c in columns]
        parts.append(f"tokens/s = batch / {', else '.join(steps_timed) or 'step ms'}")
    parts += [meaning for column, meaning in _LEGEND.items() if column in columns]
    return "; ".join(parts)


def comparison_table(report: DecodeBenchReport) -> str:
    """The steps side by side per batch size (ms per step; graph runners on CUDA): untuned,
    tuned, tuned with its stages unfused, transformers compiled and eager (and the faster of the
    two over the engine's fastest step), the bytes floor, and kernels per step (device activities
    of one call: untuned / tuned / transformers compiled)."""
    rows = []
    for r in report.results:
        kernels = [r.kernels_per_step, r.tuned_kernels_per_step, r.hf_kernels_per_step]
        rows.append(
            [
                r.batch_size,
                r.graph_ms or r.eager_ms,
                r.tuned_graph_ms or r.tuned_eager_ms,
                r.tuned_unfused_ms,
                r.hf_ms,
                r.hf_eager_ms,
                r.speedup_over_hf,
                r.floor_ms,
                r.tuned_over_floor,
                " / ".join("-" if k is None else f"{k:.0f}" for k in kernels),
            ]
        )
    columns = ["batch", "untuned", "tuned", "tuned unfused", "HF compile", "HF eager", "HF/ours"]
    columns += ["floor", "tuned/floor", "kernels u/t/HF"]
    return render_table("ms per step, side by side", columns, rows)


def family_table(result: BatchResult) -> str:
    """Device time per step by kernel family (us, and kernels in brackets) of every step that
    was profiled at ``result``'s batch size, with the kernels per step; empty when none was."""
    steps = [
        ("untuned", result.kernel_families, result.kernels_per_step),
        ("tuned", result.tuned_kernel_families, result.tuned_kernels_per_step),
        ("HF compile", result.hf_kernel_families, result.hf_kernels_per_step),
    ]
    steps = [s for s in steps if s[1]]
    if not steps:
        return ""
    rows: list[list[Any]] = []
    for family in FAMILIES:
        if any(family in fams for _, fams, _ in steps):
            cells = [fams.get(family) for _, fams, _ in steps]
            rows.append([family, *(_cell(c) for c in cells)])
    total = ["total"]
    for _, fams, kernels in steps:
        us = sum(f["us"] for f in fams.values())
        total.append(f"{us:.1f}" + (f" ({kernels:.0f})" if kernels is not None else ""))
    rows.append(total)
    return render_table(
        f"device time per step by kernel family at batch {result.batch_size}: us (kernels)",
        ["family", *(name for name, _, _ in steps)],
        rows,
    )


def _cell(entry: dict[str, Any] | None) -> str:
    return "-" if entry is None else f"{entry['us']:.1f} ({entry['calls']:.0f})"


def hf_check_line(report: DecodeBenchReport) -> str | None:
    """The logits check of ``--compare-hf`` in one line, when it ran."""
    checked = [r for r in report.results if r.hf_argmax_agreement is not None]
    if not checked:
        return None
    agree = " / ".join(f"{100 * r.hf_argmax_agreement:.0f}%" for r in checked)
    sizes = "/".join(str(r.batch_size) for r in checked)
    diffs = {r.batch_size: r.hf_max_abs_diff or 0.0 for r in checked}
    return (
        "transformers vs engine, one decode step on transformers' cache: greedy tokens agree on "
        f"{agree} of rows at batch {sizes}, max |logit diff| {_worst_diff(diffs)}"
    )


def _worst_diff(diffs: dict[int, float]) -> str:
    """The largest of the logits differences by batch size; a NaN wins and is named with its
    batch sizes (``max`` skips a NaN that follows a number, and NaN logits are the worst case)."""
    nan = [b for b, d in diffs.items() if math.isnan(d)]
    if nan:
        return f"nan (at batch {'/'.join(map(str, nan))})"
    return f"{max(diffs.values()):.3g}"


def weights_table(report: DecodeBenchReport) -> str | None:
    """The weights a mixture-of-experts step reads (the routing behind the floor), when any."""
    if not any(r.experts_hit for r in report.results):
        return None
    columns = ["batch", "experts hit / layer", "uniform routing", "weights read GB", "floor ms"]
    rows = []
    for r in report.results:
        hits = r.experts_hit or []
        read = r.weight_bytes_read / 1e9 if r.weight_bytes_read is not None else None
        mean = sum(hits) / len(hits) if hits else None
        rows.append([r.batch_size, mean, r.experts_hit_uniform, read, r.floor_ms])
    return render_table("weights a step reads", columns, rows) + (
        "\nexperts hit: distinct experts per MoE layer in the routing of the timed step "
        "(mean over layers); uniform routing: E * (1 - (1 - k/E)^batch)"
    )


def plot_formats() -> frozenset[str]:
    """The file suffixes (without the dot) a plot can be saved as: matplotlib's Agg backend's.

    Raises:
        ConfigError: matplotlib is not installed (the message says how to get it).
    """
    _pyplot()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return frozenset(FigureCanvasAgg(Figure()).get_supported_filetypes())


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'graphtune[plot]' (or drop --plot)"
        ) from exc
    return plt


def plot_report(report: DecodeBenchReport, path: str | Path) -> Path:
    """Saves ms/step vs batch size per runner, with the GPU-busy line and the bytes floor, in
    the format of ``path``'s suffix (one of :func:`plot_formats`), atomically
    (:func:`graphtune.bench.results.write_result`).

    Returns:
        The file holding the plot: ``path``, or the temporary folder's file it went to instead.

    Raises:
        ConfigError: matplotlib is not installed (the message says how to get it).
    """
    plt = _pyplot()
    sizes = [r.batch_size for r in report.results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("eager", "eager_ms", "o-"),
        ("graph runner", "graph_ms", "s-"),
        ("torch.compile reduce-overhead", "compile_ms", "^-"),
        ("tuned graph runner", "tuned_graph_ms", "D-"),
        ("tuned, stages unfused", "tuned_unfused_ms", "v-"),
        ("HF static cache + torch.compile", "hf_ms", "x-"),
        ("transformers eager", "hf_eager_ms", "+-"),
        ("GPU-busy (profiler)", "busy_ms", "k--"),
        ("bytes floor", "floor_ms", "k:"),
    ]
    for label, attr, style in series:
        points = [
            (s, getattr(r, attr))
            for s, r in zip(sizes, report.results, strict=True)
            if getattr(r, attr) is not None
        ]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    gpu = report.provenance.get("gpu") or report.config["device"]
    ax.set_title(f"{report.model['name']} decode step on {gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=Path(path).suffix.lstrip(".").lower(), dpi=120)
    plt.close(fig)
    return write_result(path, image.getvalue())
