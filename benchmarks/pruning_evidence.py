"""How close each runner's candidates came to their profile's best, per bucket, in a cold run.

Reads the ``candidates_table`` that ``benchmarks/tuning_time.py`` records (every candidate of every
tuned profile with the tuner's median time) and prints, per (op, runner, bucket): candidates,
those within 2% and 5% of their profile's best, and the profiles the runner won. The limits in
``src/graphtune/ops/_pruned.py`` cite this count.

    python3 benchmarks/pruning_evidence.py benchmarks/results/tuning-time-h200-25accda.json

A file it cannot read as such a result gets a one-line error and exit status 1.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from graphtune.cli._args import Parser


def rows_of(profile: str) -> str:
    """The bucket (rows of the first input) of a profile's text, e.g. ``8x2048, ...`` -> ``8``."""
    head = profile.split("x", 1)[0]
    return head if head.isdigit() else "?"


def count(table: list[dict]) -> dict[tuple[str, str, str], list[int]]:
    """``(op, runner, bucket) -> [candidates, within 2%, within 5%, wins]``."""
    counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for profile in table:
        timed = [row for row in profile["rows"] if row[2] is not None]
        if not timed:
            continue
        best = min(row[2] for row in timed)
        for runner, _tactic, us, *_ in timed:
            c = counts[(profile["op"], runner, rows_of(profile["profile"]))]
            c[0] += 1
            c[1] += us <= best * 1.02
            c[2] += us <= best * 1.05
            c[3] += us == best
    return counts


def load_table(path: Path) -> list[dict]:
    """The cold phase's ``candidates_table`` of a tuning_time.py result, its shape checked (so a
    JSON file of another shape is the one-line refusal, not a TypeError in :func:`count`).

    Raises:
        OSError, ValueError: The file cannot be read or parsed, or is not of that shape.
    """
    doc = json.loads(path.read_text())
    cold = doc.get("cold") if isinstance(doc, dict) else None
    table = cold.get("candidates_table") if isinstance(cold, dict) else None
    if not isinstance(table, list):
        raise ValueError("no 'cold' object with a 'candidates_table' list")
    for profile in table:
        ok = (
            isinstance(profile, dict)
            and isinstance(profile.get("op"), str)
            and isinstance(profile.get("profile"), str)
            and isinstance(profile.get("rows"), list)
        )
        if not ok or not all(_row_ok(row) for row in profile["rows"]):
            raise ValueError(f"a malformed profile entry {str(profile)[:80]}")
    return table


def _row_ok(row: object) -> bool:
    # [runner, tactic, median us or null, ...] as tuning_time.py writes them.
    return (
        isinstance(row, list)
        and len(row) >= 3
        and isinstance(row[0], str)
        and (row[2] is None or (isinstance(row[2], (int, float)) and not isinstance(row[2], bool)))
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a tuning_time.py results JSON")
    args = parser.parse_args(argv)
    try:
        table = load_table(args.result)
    except (OSError, ValueError, RecursionError) as exc:
        print(
            f"error: {args.result}: no cold candidates_table ({exc}); pass a tuning_time.py "
            "result recorded after it was added",
            file=sys.stderr,
        )
        return 1
    counts = count(table)
    print(f"{'op':<28} {'runner':<38} {'rows':>4} {'cands':>5} {'<=2%':>5} {'<=5%':>5} {'won':>4}")
    for (op, runner, rows), c in sorted(
        counts.items(),
        key=lambda kv: (kv[0][0], kv[0][1], int(kv[0][2]) if kv[0][2].isdigit() else 0),
    ):
        print(f"{op:<28} {runner:<38} {rows:>4} {c[0]:>5} {c[1]:>5} {c[2]:>5} {c[3]:>4}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
