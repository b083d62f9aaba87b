"""What the exhaustive tactic sweeps (attention_sweep.py, gemv_sweep.py) share: the common
arguments, the ranking of one sweep's candidates against what the tuner is offered, and the
result file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.engine.config import ModelConfig
from graphtune.engine.presets import get_preset
from graphtune.errors import ConfigError


def tactic_key(tactic: dict) -> tuple:
    """A hashable form of a tactic dict (key order does not matter)."""
    return tuple(sorted(tactic.items()))


def add_common_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--out``, ``--model`` (the preset whose ``what`` is swept), ``--replays``, ``--commit``
    and ``--label``."""
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--model", default="llama-1b-shape", help=f"preset whose {what} to sweep")
    parser.add_argument("--replays", type=int, default=10, help="CUPTI replays per candidate")
    parser.add_argument("--commit", help="commit to record (default: git)")
    parser.add_argument("--label", help="suffix of the result file name")


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


def write_result(args: argparse.Namespace, prefix: str, found: dict[str, Any]) -> Path:
    """Writes ``<prefix>-<model>-<gpu>[-label].json`` (provenance and options first) under
    ``args.out`` and prints where."""
    payload = {
        "provenance": bench.provenance(args.commit),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **found,
    }
    slug = bench.gpu_slug(torch.cuda.get_device_name())
    name = f"{prefix}-{args.model}-{slug}" + (f"-{args.label}" if args.label else "")
    path = bench.write_json(args.out / f"{name}.json", payload)
    print(f"wrote {path}")
    return path
