"""Pure helpers of benchmarks/moe.py: which configurations of a bucket it measures, how they
score, and their text in the table.

At a bucket the GEMV runner can serve, ``fused_moe`` runs two tuned choices: the op's pick
(``graphtune.fused_moe``: the gate/up tile, timed with the down tile that tile implies) and then
the down stage's pick (``graphtune.fused_moe.gemv_down``: the down tile, timed after one fixed
gate/up tile). A configuration here is a reference ``[i, j]``: ``i`` indexes the op record's
candidates, ``j`` the down record's tiles (:func:`down_choice`), or is ``None`` for the op's
candidate as the op sweep runs it (a GEMV tactic then with its implied down tile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from _tuning_scores import regret

from graphtune.autotuner import FALLBACK_TACTIC


def tokens_of(profile_text: str) -> int:
    """``T`` of a profile's ``describe()`` text (``"64x2048, ..."``)."""
    return int(profile_text.split("x", 1)[0])


def records_by_tokens(history: Iterable[Any], op: str) -> dict[int, Any]:
    """The tuner's history records of ``op`` by bucket ``T``; a profile tuned twice keeps its
    last record, which is the one its cache entry came from."""
    return {tokens_of(r.profile): r for r in history if r.op == op}


def down_choice(record: Any | None) -> tuple[list[Any], int | None]:
    """The down record's tile candidates (its fallback, not a tile, left out) and the index among
    them of the tile ``fused_moe`` runs after tuning, or ``None`` where it runs the tile the
    gate/up tactic implies: no record, every candidate failed (nothing cached), or the pick is
    the fallback (``choose_down`` returns ``None`` for both)."""
    if record is None:
        return [], None
    cands = list(record.candidates)
    positions = [k for k, c in enumerate(cands) if c.tactic != FALLBACK_TACTIC]
    winner = record.winner_index
    pick = positions.index(winner) if winner in positions else None
    return [cands[k] for k in positions], pick


def pair_plan(gemv: Sequence[bool], tiles: int) -> list[tuple[int, int]]:
    """Every (gate/up, down) pair to measure: each op candidate ``i`` with ``gemv[i]`` times each
    of the ``tiles`` down tiles, gate/up-major in the records' orders."""
    return [(i, j) for i, g in enumerate(gemv) if g for j in range(tiles)]


def pick_scores(times: Sequence[float], pick: int | None) -> dict[str, Any]:
    """One tuned choice against the fastest of its own candidates: ``pick``, ``pick_us``,
    ``best`` (the first of equal times), ``best_us``, ``regret``.

    Raises:
        ValueError: No times.
    """
    if not times:
        raise ValueError("pick_scores: no candidates were measured")
    best = min(range(len(times)), key=lambda i: times[i])
    pick_us = times[pick] if pick is not None else math.inf
    return {
        "pick": pick,
        "pick_us": pick_us,
        "best": best,
        "best_us": times[best],
        "regret": regret(pick_us, times[best]),
    }


def step_scores(
    op_us: Sequence[float],
    op_pick: int | None,
    gemv: Sequence[bool],
    pairs: Sequence[tuple[int, int]],
    pair_us: Sequence[float],
    down_pick: int | None,
) -> dict[str, Any]:
    """What the step runs at this bucket against the fastest configuration measured there.

    The step runs the pair ``[op_pick, down_pick]`` when the op's pick is a GEMV tactic
    (``gemv[op_pick]``) and the down stage has a pick; otherwise the op's pick as the op sweep ran
    it (``[op_pick, None]``). The best is over every op candidate (as the op sweep ran it) and
    every measured pair; ties go to the earlier one, op candidates first.

    Returns:
        ``kind`` (``"pair"`` or ``"op"``), ``pick`` and ``best`` (references ``[i, j]``),
        ``pick_us``, ``best_us``, ``regret``, and ``regret_gate_up``: the op's gate/up pick
        against every gate/up tactic, all with the down stage's pick (``None`` unless the
        step runs a pair).

    Raises:
        ValueError: ``pairs`` and ``pair_us`` differ in length, or the step's pair was not
            measured.
    """
    if len(pairs) != len(pair_us):
        raise ValueError(f"step_scores: {len(pairs)} pairs but {len(pair_us)} times")
    refs: list[tuple[int, int | None]] = [(i, None) for i in range(len(op_us))]
    refs += list(pairs)
    times = [*op_us, *pair_us]
    step: tuple[int, int | None] | None = None
    gate_up: float | None = None
    if op_pick is not None and gemv[op_pick] and down_pick is not None:
        step = (op_pick, down_pick)
        if step not in pairs:
            raise ValueError(
                f"step_scores: the step's pair {step} (op candidate, down candidate) was not "
                "measured; pair_plan must cover every GEMV candidate and down tile"
            )
        row = {i: t for (i, j), t in zip(pairs, pair_us, strict=True) if j == down_pick}
        gate_up = regret(row[op_pick], min(row.values()))
    elif op_pick is not None:
        step = (op_pick, None)
    scores = pick_scores(times, refs.index(step) if step is not None else None)
    return {
        "kind": "pair" if step is not None and step[1] is not None else "op",
        "pick": list(step) if step is not None else None,
        "pick_us": scores["pick_us"],
        "best": list(refs[scores["best"]]),
        "best_us": scores["best_us"],
        "regret": scores["regret"],
        "regret_gate_up": gate_up,
    }


def tile_text(tile: Any) -> str:
    """A down tile as ``features/bk/warps`` (its values in their order); ``none`` for no pick."""
    if tile is None:
        return "none"
    if isinstance(tile, dict):
        return "/".join(str(v) for v in tile.values())
    return str(tile)


RUNNER_NAMES = {"TritonFusedMoeRunner": "grouped", "TritonMoeGemvRunner": "gemv"}


def short(bucket: dict[str, Any], index: int | None) -> str:
    """Candidate ``index`` of a bucket as ``torch``, ``grouped bm/bn/bk/g/w/s`` or ``gemv
    bn/bk/w`` (its tactic's values in their order)."""
    if index is None:
        return "none"
    cand = bucket["candidates"][index]
    tactic = cand["tactic"]
    if tactic == -1:
        return "torch"
    name = RUNNER_NAMES.get(cand["runner"], cand["runner"])
    if not isinstance(tactic, dict):
        return f"{name} {tactic}"
    return f"{name} " + "/".join(str(v) for v in tactic.values())


def config_text(bucket: dict[str, Any], ref: list[int | None] | None) -> str:
    """A configuration ``[i, j]`` of a bucket (``step``'s references) as :func:`short` of op
    candidate ``i``, then ``+ features/bk/warps`` of down tile ``j`` when there is one."""
    if ref is None:
        return "none"
    text = short(bucket, ref[0])
    if ref[1] is not None:
        text += " + " + tile_text(bucket["down"]["candidates"][ref[1]]["tactic"])
    return text


def pct(value: float | None) -> str:
    """A regret as a percentage; ``-`` where there is none."""
    return "-" if value is None else f"{100 * value:.2f}%"
