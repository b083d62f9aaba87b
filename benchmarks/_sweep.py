"""What the exhaustive tactic sweeps (attention_sweep.py, gemv_sweep.py, gemm_sweep.py) share:
the common arguments, the projection sweeps' ``--ops`` and ``--batches``, their rotating weight
copies, the ranking of one sweep's candidates against what the tuner is offered, and the result
file. Also the argument type of a comma-separated list of names, which other scripts' flags
(``--parts``, ``--shapes``, ...) take too (:func:`name_list`)."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.autotuner import FALLBACK_TACTIC
from graphtune.autotuner.entries import tactic_text
from graphtune.bench.cupti_sweep import cupti_graph_sweep
from graphtune.cli._args import batch_sizes, check_script_output, positive_int, report_written
from graphtune.engine.config import ModelConfig
from graphtune.engine.presets import get_preset
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: What :func:`sweep_runner` says of the weight rotation, recorded with each sweep.
ROTATION_KEYS = ("calls_per_graph", "copies_over_l2", "warm_calls_per_replay")


def tactic_key(tactic: dict) -> tuple:
    """A hashable form of a tactic dict (key order does not matter)."""
    return tuple(sorted(tactic.items()))


def name_list(names: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """``argparse`` type of a comma-separated subset of ``names`` (``what`` names one item in
    the messages): at least one name, each of ``names`` and given once, in the order given."""
    known = ",".join(names)

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(part.strip() for part in text.split(","))
        if "" in chosen:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}s of {known}, got {text!r}"
            )
        unknown = [name for name in chosen if name not in names]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown[0]!r} in {text!r}; choose from {known}"
            )
        repeated = [name for name in dict.fromkeys(chosen) if chosen.count(name) > 1]
        if repeated:
            raise argparse.ArgumentTypeError(
                f"{what} {repeated[0]!r} is given twice in {text!r}; give each once"
            )
        return chosen

    return parse


def add_common_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--out``, ``--model`` (the preset whose ``what`` is swept), ``--replays``, ``--commit``
    and ``--label``."""
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--model", default="llama-1b-shape", help=f"preset whose {what} to sweep")
    parser.add_argument(
        "--replays", type=positive_int, default=10, help="CUPTI replays per candidate"
    )
    parser.add_argument("--commit", help="commit to record (default: git)")
    parser.add_argument("--label", help="suffix of the result file name (default: none)")


def add_projection_arguments(
    parser: argparse.ArgumentParser, ops: Sequence[str], batches: str, batches_help: str
) -> None:
    """``--batches`` (default ``batches``) and ``--ops`` (of ``ops``, all by default) of a sweep
    over a decode layer's projections."""
    parser.add_argument(
        "--batches", type=batch_sizes, default=batches, help=f"{batches_help}, comma-separated"
    )
    parser.add_argument(
        "--ops",
        type=name_list(ops, "op"),
        default=",".join(ops),
        help=f"ops of {tuple(ops)}, comma-separated",
    )


def projection_choices(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    batch_ok: Callable[[int], bool],
    batch_rule: str,
) -> tuple[list[str], list[int]]:
    """The ``--ops`` and ``--batches`` asked for (their types checked the form); a usage error
    (exit 2) when a batch fails ``batch_ok`` (``batch_rule`` says the rule)."""
    if not all(batch_ok(b) for b in args.batches):
        parser.error(f"--batches must {batch_rule}")
    return list(args.ops), list(args.batches)


def rotating_copies(
    make: Callable[[int, int], torch.Tensor], rows: int, k: int, l2_bytes: int, itemsize: int = 2
) -> list[torch.Tensor]:
    """``make(rows, k)`` weights, enough copies (at most 16) to exceed twice the L2 cache, so a
    candidate replayed over them streams its weight from memory, as in the step."""
    count = max(1, min(16, math.ceil(2 * l2_bytes / (rows * k * itemsize))))
    return [make(rows, k) for _ in range(count)]


def whole_rounds(copies: int, at_least: int) -> int:
    """The fewest calls per graph, at least ``at_least``, that walk whole rounds of ``copies``.

    A graph is replayed back to back (and every candidate's graph walks the same copies), so a
    graph that stopped mid-round would start its next replay on copies it used only a few calls
    before, still in L2: 20 calls over 9 copies read 2 of 20 weights warm per replay."""
    return -(-at_least // copies) * copies


def warm_calls(copies: int, calls: int, copy_bytes: int, l2_bytes: int) -> int:
    """Calls of one replay (of ``calls`` calls over ``copies`` copies in turn, replayed back to
    back) whose copy was last used with less than ``l2_bytes`` of other copies read since, so
    that it may still be in L2. Pure, for the result and the tests."""
    walk = [i % copies for i in range(calls)] * 2  # the replay before, then the one counted
    warm = 0
    for j in range(calls, 2 * calls):
        last = max(p for p in range(j) if walk[p] == walk[j])
        warm += len(set(walk[last + 1 : j])) * copy_bytes < l2_bytes
    return warm


def sweep_runner(
    runner: Any,
    inputs: list[list[Any]],
    candidates: Sequence[Any],
    offered: set[tuple],
    nbytes: int,
    *,
    replays: int,
    calls_per_graph: int,
    l2_bytes: int,
) -> dict[str, Any]:
    """Compiles ``candidates`` of ``runner`` ahead (the fallback tactic is torch: nothing to
    compile), then times each by the in-graph CUPTI truth, replayed over the ``inputs`` copies
    in turn, all in one profiler session.

    Each graph holds ``calls_per_graph`` calls rounded up to whole rounds of the copies
    (:func:`whole_rounds`), so two uses of one copy have every other copy read between them
    (about twice ``l2_bytes`` by :func:`rotating_copies`), across replay boundaries as well.
    Where the cap on copies leaves them short of twice the L2, a warning says so.

    Returns:
        ``compile_s``, ``sweep_s``, ``calls_per_graph`` (after rounding), ``copies_over_l2``
        (the copies' bytes, ``nbytes`` each, over ``l2_bytes``), ``warm_calls_per_replay``
        (:func:`warm_calls`; 0 unless the cap bit) and one row per candidate: ``tactic``,
        ``offered`` (the fallback always, a Triton tactic when its :func:`tactic_key` is in
        ``offered``), ``us`` per call, ``kernels`` per call, ``tb_s`` (``nbytes`` per call) and
        ``error``.
    """
    calls = whole_rounds(len(inputs), calls_per_graph)
    over_l2 = len(inputs) * nbytes / l2_bytes
    warm = warm_calls(len(inputs), calls, nbytes, l2_bytes)
    if over_l2 < 2:
        logger.warning(
            "sweep: %d weight copies of %d bytes total %.2fx the L2 (capped below 2x), so %d of "
            "%d calls per replay may read their weight from L2",
            len(inputs),
            nbytes,
            over_l2,
            warm,
            calls,
        )
    tactics = [t for t in candidates if t != FALLBACK_TACTIC]
    began = time.perf_counter()
    report = runner.precompile(inputs[0], tactics)
    compile_s = time.perf_counter() - began

    def call_of(tactic: Any) -> Callable[[int], object]:
        return lambda i: runner.forward(inputs[i % len(inputs)], tactic)

    began = time.perf_counter()
    truth = cupti_graph_sweep(
        [call_of(t) for t in candidates], [calls] * len(candidates), replays=replays
    )
    sweep_s = time.perf_counter() - began
    rows = []
    for tactic, res in zip(candidates, truth, strict=True):
        fallback = tactic == FALLBACK_TACTIC
        us = res["per_call_us"]
        rows.append(
            {
                "tactic": tactic,
                "offered": fallback or tactic_key(tactic) in offered,
                "us": us,
                "kernels": res["kernels_per_call"],
                "tb_s": nbytes / (us * 1e6) if 0 < us < math.inf else None,
                "error": res["error"] or (None if fallback else report.get(tactic_text(tactic))),
            }
        )
    return {
        "compile_s": compile_s,
        "sweep_s": sweep_s,
        "calls_per_graph": calls,
        "copies_over_l2": over_l2,
        "warm_calls_per_replay": warm,
        "rows": rows,
    }


def sweep_projections(
    batches: Sequence[int],
    ops: Sequence[str],
    cases_of: Callable[[int], dict[str, Any]],
    sweep_one: Callable[[str, Any], dict[str, Any]],
) -> list[dict[str, Any]]:
    """``sweep_one(op, case)`` for every batch (its cases made once by ``cases_of(batch)``) and
    op, in that order, with a progress line each (candidates, compile and sweep seconds)."""
    sweeps = []
    for m in batches:
        cases = cases_of(m)
        for op in ops:
            found = sweep_one(op, cases[op])
            sweeps.append(found)
            print(
                f"batch {m} {op}: {found['candidates']} candidates, compile "
                f"{found['compile_s']:.1f} s, sweep {found['sweep_s']:.1f} s",
                flush=True,
            )
    return sweeps


def model_or_usage_error(parser: argparse.ArgumentParser, name: str) -> ModelConfig:
    """The preset ``name``; a usage error (exit 2) naming the presets when there is none."""
    try:
        return get_preset(name)
    except ConfigError as exc:
        parser.error(f"--model: {exc}")
    raise AssertionError("parser.error exits")


def ranked(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``rows`` (each with ``us`` and ``offered``) fastest first, with the best of the space, the
    best the tuner is offered and how far behind that one is (``offered_over_best``)."""
    rows = sorted(rows, key=lambda row: row["us"])
    best_offered = next((row for row in rows if row["offered"]), None)
    return {
        "candidates": len(rows),
        "best": rows[0],
        "best_offered": best_offered,
        "offered_over_best": best_offered["us"] / rows[0]["us"] - 1 if best_offered else None,
        "rows": rows,
    }


def result_target(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> Path:
    """``<prefix>-<model>-<gpu>[-label].json`` under ``args.out``, checked before the sweep (a
    result that cannot land there is found late otherwise): a bad ``--out`` is a usage error,
    exit 2. Needs CUDA (the GPU's name)."""
    slug = bench.gpu_slug(torch.cuda.get_device_name())
    name = f"{prefix}-{args.model}-{slug}" + (f"-{args.label}" if args.label else "")
    target = args.out / f"{name}.json"
    check_script_output(target, "--out", parser)
    return target


def write_result(args: argparse.Namespace, target: Path, found: dict[str, Any]) -> bool:
    """Writes the result (provenance and options first) to ``target`` (:func:`result_target`)
    and prints where; ``False`` when it went to the temporary folder instead, which must make
    the script exit 1 (a script would find no file at ``target``)."""
    payload = {
        "provenance": bench.provenance(args.commit),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **found,
    }
    path = bench.write_json(target, payload)  # target, or the fallback file it went to instead
    return report_written("--out", target, path)
