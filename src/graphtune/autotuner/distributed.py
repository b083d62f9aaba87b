"""Distributed tuning: how the ranks of a ``torch.distributed`` process group share tuning work.

Chosen with ``AutoTuner(distributed=...)`` or ``autotune(..., distributed=...)``, as a strategy
name or a :class:`DistributedTuning` (which also carries the process group; ``group=None`` means
the default group). Strategies:

* ``independent``: every rank tunes alone; no collective is made. Ranks whose timings differ may
  pick differently (fine for data-parallel replicas, wrong for tensor parallelism).
* ``broadcast``: rank 0 of the group times every candidate; the others time nothing and receive
  its times, so all ranks pick rank 0's pick.
* ``parallel``: the (profile x candidate) work of an op is dealt round-robin over the ranks (each
  item is timed by exactly one rank); the times are gathered with ``all_gather`` and every rank
  applies the same pick rule to the same numbers.
* ``agree``: every rank times every candidate; the times are reduced with **max**, so a tactic
  counts as fast only if it is fast on every rank (a tensor-parallel step is as slow as its
  slowest rank), and a tactic that failed on any rank (infinite time) is never picked.

Rank consistency (docs/design.md, principle 7): every rank reaches every collective in the same
order. Before tuning an op the ranks exchange the profiles they lack (all tune the union) and, per
profile, the candidates they offer (only candidates offered by every rank are timed, in rank 0's
order, which is also the tie-break order). A tactic that fails on one rank contributes ``inf``
(carried as an IEEE infinity in a float64 tensor) and that rank still joins. A rank whose tuning
must stop (a tactic corrupted its CUDA context, or anything else raised while it timed) still joins
the profile's collective with an abort flag, and then every rank raises, instead of the others
waiting forever; so does a rank whose planning failed (listing its candidates or ``prepare_all``),
in one flag exchange after planning (:meth:`OpCoordinator.join`), and a rank whose profile's input
sets or timing set-up failed, in one flag exchange before the profile's first collective. The
failing rank re-raises its own error; the others raise :class:`~graphtune.errors.DistributedError`
naming that rank and its error.

Every rank must make the same ``choose_one`` calls in the same order, starting from the same
cache: a shape found in one rank's cache but not another's would make only the latter enter the
collectives and wait there forever, and ranks holding different picks would run different kernels.
So :func:`align_cache` makes the ranks' caches one before any look-up (``autotune()`` calls it
after loading the file, the engine after loading its cache): every rank gets the entries it lacks
from the others, and where ranks hold different picks for one key the lowest rank's wins. The
blocklist is aligned alike (every rank blocks the union), since a blocked pick is not served: a
tactic blocked on one rank only would make that rank alone miss and tune. For the same reason a
tactic that one rank blocks while timing a profile (it crashed or hung there) is blocked on every
rank before the next look-up (:meth:`OpCoordinator.run`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.entries import BlockedTactic, CacheEntry, CacheKey, tactic_text
from graphtune.errors import ConfigError, DistributedError

logger = logging.getLogger(__name__)

STRATEGIES = ("independent", "broadcast", "parallel", "agree")


class Candidate(Protocol):
    """What the coordinator needs of the tuner's (runner, tactic) candidates."""

    runner_index: int
    tactic_index: int
    tactic: Any
    samples: list[float]
    failed: str | None

    @property
    def score(self) -> float:
        """Median time, or ``inf`` when failed or not timed."""
        ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class DistributedTuning:
    """How ranks share tuning.

    Attributes:
        strategy: ``"independent"``, ``"broadcast"``, ``"parallel"`` or ``"agree"`` (see the
            module docstring).
        group: The ``torch.distributed`` process group; ``None`` means the default group. It must
            be initialised (``torch.distributed.init_process_group``) before tuning with any
            strategy but ``independent``; graphtune never initialises one itself.
    """

    strategy: str = "independent"
    group: Any = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"DistributedTuning.strategy={self.strategy!r} is not one of "
                f"{', '.join(STRATEGIES)}; use 'agree' or 'parallel' for tensor-parallel ranks."
            )

    @classmethod
    def resolve(cls, value: str | DistributedTuning | None) -> DistributedTuning | None:
        """Accepts a strategy name, a :class:`DistributedTuning` or ``None`` (not distributed)."""
        if value is None or isinstance(value, DistributedTuning):
            return value
        if isinstance(value, str):
            return cls(strategy=value)
        raise ConfigError(
            f"distributed={value!r}: pass one of {', '.join(STRATEGIES)} or a "
            "DistributedTuning(strategy=..., group=...)."
        )

    @property
    def collective(self) -> bool:
        """Whether the strategy makes collectives (every strategy but ``independent``)."""
        return self.strategy != "independent"

    def rank_and_world(self) -> tuple[int, int]:
        """This process's rank in the group and the group's size (``(0, 1)`` when not initialised
        and ``independent``).

        Raises:
            DistributedError: A collective strategy without an initialised process group.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            if not self.collective:
                return 0, 1
            raise DistributedError(
                f"distributed tuning strategy {self.strategy!r} needs an initialised "
                "torch.distributed process group, and none is. Call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment "
                "for it), or use strategy 'independent'."
            )
        return dist.get_rank(self.group), dist.get_world_size(self.group)


class OpCoordinator:
    """Runs one op's tuning across the ranks; made by the tuner once per tuned op.

    Args:
        setting: The strategy and group.
        op: Op name (for messages).
        ids: Identity of every runner offered (``runner_id``), in order.
    """

    def __init__(self, setting: DistributedTuning, op: str, ids: tuple[str, ...]) -> None:
        self.setting = setting
        self.op = op
        self.ids = ids
        self.rank, self.world_size = setting.rank_and_world()
        self._next = 0  # round-robin position over the op's (profile x candidate) items
        # For each profile tuned: (runner id, tactic text) -> rank that timed it (parallel,
        # broadcast) or ``None`` (every rank timed it: agree, independent).
        self.assignments: list[dict[tuple[str, str], int | None]] = []

    @property
    def provenance(self) -> dict[str, Any]:
        """What a cache entry records about how it was tuned."""
        return {"strategy": self.setting.strategy, "world_size": self.world_size}

    # -- collectives --------------------------------------------------------------------------

    def _gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=self.setting.group)
        return out

    def _src(self) -> int:
        """Global rank of the group's rank 0 (``broadcast`` takes a global rank)."""
        if self.setting.group is None:
            return 0
        return torch.distributed.get_global_rank(self.setting.group, 0)

    # -- what to tune -------------------------------------------------------------------------

    def profiles_to_tune(self, keys: Sequence[CacheKey], cached: Sequence[bool]) -> list[bool]:
        """Which profiles to tune: those missing here, or (collective strategies) on any rank.

        Raises:
            DistributedError: The ranks are tuning different ops, runners or profiles.
        """
        if not self.setting.collective:
            return [not c for c in cached]
        mine = ([k.to_json() for k in keys], list(cached))
        views = self._gather_objects(mine)
        if any(view[0] != views[0][0] for view in views):
            differ = [r for r, view in enumerate(views) if view[0] != views[0][0]]
            raise DistributedError(
                f"op {self.op!r}: ranks {differ} are tuning other profiles than rank 0 (other "
                "shapes, runners or timing mode). Every rank must make the same choose_one calls "
                "in the same order with the same inputs' shapes under distributed tuning."
            )
        return [not all(view[1][i] for view in views) for i in range(len(keys))]

    def join(self, failure: Exception | None, doing: str) -> None:
        """Joins the ranks after a step where one rank may have failed alone (planning: a
        ``requires_tactic`` runner without a tactic, a wrong ``get_valid_tactics`` signature;
        a profile's inputs: an ``inputs_pre_hook`` that raises; a corrupted CUDA context): one
        small ``all_reduce`` of a flag per rank, and only when a flag is set one
        ``all_gather_object`` of the failed ranks' errors, so every other rank names the rank
        and its error instead of waiting for it in the next collective.

        Args:
            failure: This rank's error in the step, or ``None``.
            doing: What the step does, for the message (``"preparing its tactics"``).

        Raises:
            Exception: ``failure`` itself, on the rank that passed it (after joining).
            DistributedError: Another rank failed in the step (named, with its error).
        """
        errors: list[Any] = []
        if self.setting.collective and self.world_size > 1:
            dist = torch.distributed
            group = self.setting.group
            flags = torch.zeros(self.world_size, dtype=torch.float64)
            flags[self.rank] = 0.0 if failure is None else 1.0
            flags = flags.to(_collective_device(group))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if any(flags.tolist()):  # every rank sees the same flags: all gather, or none
                errors = self._gather_objects(None if failure is None else _error_text(failure))
        if failure is not None:
            raise failure
        failed = [(r, text) for r, text in enumerate(errors) if text is not None]
        if failed:
            rank, text = failed[0]
            more = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise DistributedError(
                f"op {self.op!r}: rank {rank}{more} of the tuning group failed while {doing} "
                f"({text}), so this rank stops too instead of waiting for it; fix what failed "
                "there and run every rank again"
            )

    def run(
        self,
        candidates: list[C],
        time_fn: Callable[[list[C]], None],
        *,
        skip_single: bool = False,
        cache: TuningCache | None = None,
    ) -> list[C]:
        """Times one profile's candidates by the strategy and leaves every rank the same times.

        Args:
            candidates: This rank's candidates for the profile.
            time_fn: Times the given candidates in this process (fills ``samples``/``failed``).
            skip_single: When exactly one candidate is left (offered by every rank), time
                nothing and return it untimed: there is nothing to choose. Every rank computes
                the same list, so every rank skips the collective alike.
            cache: The cache ``time_fn`` blocks crashed or hung tactics in. Under a collective
                strategy, what any rank blocked while timing is then blocked on every rank: a
                pick blocked on one rank only would be a miss there and a hit elsewhere, and
                that rank would tune alone and wait forever.

        Returns:
            The candidates offered by every rank, in rank 0's order (``tactic_index`` renumbered
            to that order, the tie-break), each with ``samples == [agreed time]`` or ``failed``
            set (or one untimed candidate, see ``skip_single``). Identical times on every rank,
            so the tuner's pick rule gives one pick.

        Raises:
            DistributedError: Another rank had to stop tuning (named with its error; every
                rank raises, none hangs).
            Exception: This rank had to stop tuning (``time_fn`` raised, e.g. a
                :class:`~graphtune.errors.TuningError` for a corrupted CUDA context): its own
                error, re-raised after joining.
        """
        if not self.setting.collective:
            if not (skip_single and len(candidates) == 1):
                time_fn(candidates)
            self.assignments.append({self._ident(c): None for c in candidates})
            return candidates
        chosen = self._common(candidates)
        n = len(chosen)
        if n == 0 or (skip_single and n == 1):
            # Every rank computed the same list: no collective on any rank.
            self.assignments.append({self._ident(c): None for c in chosen})
            return chosen
        strategy = self.setting.strategy
        if strategy == "broadcast":
            owners: list[int | None] = [0] * n
        elif strategy == "parallel":
            owners = [(self._next + i) % self.world_size for i in range(n)]
            self._next += n
        else:
            owners = [None] * n
        mine = [c for c, owner in zip(chosen, owners, strict=True) if owner in (None, self.rank)]
        held = cache.blocklist() if cache is not None else []
        error: Exception | None = None
        try:
            time_fn(mine)
        except Exception as exc:  # join the collective anyway, then raise (principle 7)
            error = exc
        # By identity: a tactic blocked again (new details) is news to the other ranks too.
        before = {b.ident: b for b in held}
        now = cache.blocklist() if cache is not None else []
        fresh = [b for b in now if before.get(b.ident) is not b]
        local = [
            _finite_or_inf(c.score) if owner in (None, self.rank) else math.inf
            for c, owner in zip(chosen, owners, strict=True)
        ]
        times, aborted, blocked = self._exchange(local, error is not None, bool(fresh), owners)
        self.assignments.append(
            {self._ident(c): owner for c, owner in zip(chosen, owners, strict=True)}
        )
        if blocked:  # every rank saw the flag: all gather (before an abort, so all save it too)
            views = self._gather_objects(fresh)
            if cache is not None and (taken := _block_union(cache, views)):
                logger.info(
                    "op %r: %d tactic(s) that crashed or hung on another rank are blocked here too",
                    self.op,
                    taken,
                )
        if aborted:  # every rank saw it: all join to name who stopped and why
            self.join(error, "timing its tactics")
        for cand, value in zip(chosen, times, strict=True):
            if math.isfinite(value):
                cand.samples[:] = [value]
                cand.failed = None
            elif cand.failed is None:
                cand.failed = "failed or not timed on another rank"
        return chosen

    def _exchange(
        self, local: list[float], abort: bool, blocked: bool, owners: list[int | None]
    ) -> tuple[list[float], bool, bool]:
        """The strategy's one collective: returns the agreed times, whether any rank aborted and
        whether any rank blocked a tactic (two flags after the times, reduced with max)."""
        dist = torch.distributed
        group = self.setting.group
        device = _collective_device(group)
        flags = [1.0 if abort else 0.0, 1.0 if blocked else 0.0]
        vec = torch.tensor([*local, *flags], dtype=torch.float64, device=device)
        if self.setting.strategy == "broadcast":
            if self.rank != 0:
                vec[:-2] = math.inf
            flag = torch.tensor(flags, dtype=torch.float64, device=device)
            dist.broadcast(vec, src=self._src(), group=group)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return vec[:-2].tolist(), bool(flag[0].item()), bool(flag[1].item())
        if self.setting.strategy == "parallel":
            rows = [torch.empty_like(vec) for _ in range(self.world_size)]
            dist.all_gather(rows, vec, group=group)
            times = [float(rows[owner][i]) for i, owner in enumerate(owners)]  # type: ignore[index]
            aborted, blocked = (any(bool(row[j].item()) for row in rows) for j in (-2, -1))
            return times, aborted, blocked
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)  # agree: slowest rank counts
        return vec[:-2].tolist(), bool(vec[-2].item()), bool(vec[-1].item())

    def _ident(self, cand: Candidate) -> tuple[str, str]:
        return (self.ids[cand.runner_index], tactic_text(cand.tactic))

    def _common(self, candidates: list[C]) -> list[C]:
        """Candidates every rank offers, in rank 0's order, with the tie-break renumbered."""
        local: dict[tuple[int, str], C] = {}
        for cand in candidates:
            local.setdefault((cand.runner_index, tactic_text(cand.tactic)), cand)
        views = self._gather_objects(list(local))
        others = [set(map(tuple, view)) for view in views[1:]]
        common = [tuple(i) for i in views[0] if all(tuple(i) in o for o in others)]
        dropped = len(local) - len(common)
        if dropped:
            logger.info(
                "op %r: %d candidate(s) of this rank are not offered (or are blocklisted) on "
                "every rank; only the %d common ones are timed",
                self.op,
                dropped,
                len(common),
            )
        chosen = [local[ident] for ident in common]
        for position, cand in enumerate(chosen):
            cand.tactic_index = position
        return chosen


def align_cache(
    cache: TuningCache, setting: DistributedTuning | None, tuning: bool = False
) -> None:
    """Makes every rank's cache the same: the union of the ranks' entries, the lowest rank's
    pick where they differ, and the union of their blocklists, the lowest rank's item where they
    differ (a collective strategy only; see the module docstring). Costs one
    small ``all_gather_object`` when the caches already agree, two when they do not.

    The first exchange also compares the ranks' strategies and whether they tune (``tuning``):
    ranks that tune by different strategies, or of which only some tune, would wait for each
    other's collectives forever.

    Raises:
        DistributedError: A collective strategy without an initialised process group, or ranks
            whose strategy or tuning mode differs from rank 0's (named).
    """
    if setting is None or not setting.collective:
        return
    rank, world = setting.rank_and_world()
    if world == 1:
        return
    entries = dict(cache.items())
    # The blocklist counts too: a blocked pick is not served, so ranks whose entries match but
    # whose blocklists do not would still disagree on which look-ups hit.
    blocklist = cache.blocklist()
    rows = [json.dumps([k.to_json(), e.to_json()], sort_keys=True) for k, e in entries.items()]
    items = [json.dumps(b.to_json(), sort_keys=True) for b in blocklist]
    digest = hashlib.sha256(json.dumps([sorted(rows), sorted(items)]).encode()).hexdigest()
    states: list[Any] = [None] * world
    mine = (setting.strategy, bool(tuning), digest)
    torch.distributed.all_gather_object(states, mine, group=setting.group)
    for index, what in ((0, "strategy"), (1, "tuning mode (tune=True or cache-only)")):
        differ = [r for r, view in enumerate(states) if view[index] != states[0][index]]
        if differ:
            raise DistributedError(
                f"distributed tuning: ranks {differ} have another {what} than rank 0 "
                f"({states[differ[0]][index]!r} against {states[0][index]!r}); every rank must "
                "enter autotune() with the same tune= and distributed strategy"
            )
    if len({view[2] for view in states}) == 1:
        return
    views: list[Any] = [None] * world
    torch.distributed.all_gather_object(views, (entries, blocklist), group=setting.group)
    merged: dict[CacheKey, CacheEntry] = {}
    for view, _ in reversed(views):  # the lowest rank's entry is written last: it wins
        merged.update(view)
    added = [k for k in merged if k not in entries]
    replaced = [
        k
        for k, e in entries.items()
        if (merged[k].runner_id, tactic_text(merged[k].tactic))
        != (e.runner_id, tactic_text(e.tactic))
    ]
    if added or replaced:
        logger.warning(
            "rank %d's tuning cache differed from the other ranks': it takes %d entries it lacked "
            "and the lowest rank's pick for %d shapes it held another pick for, so every rank "
            "looks up the same picks and runs the same kernels",
            rank,
            len(added),
            len(replaced),
        )
    # Only what changed: an equal entry rewritten would count as this process's to save, and
    # a save would then put it back over another process's newer entry in the file.
    cache.update({k: e for k, e in merged.items() if entries.get(k) != e})
    taken = _block_union(cache, [view for _, view in views])
    if taken:
        logger.warning(
            "rank %d's tuning cache lacked %d blocklisted tactic(s) of the other ranks': it "
            "blocks them too, so every rank serves (and tunes) the same look-ups",
            rank,
            taken,
        )


def _block_union(cache: TuningCache, views: Sequence[Sequence[BlockedTactic]]) -> int:
    """Blocks in ``cache`` every item of the ranks' ``views`` (in rank order); where ranks hold
    one (runner, tactic) with other details, the lowest rank's item, so every rank ends with the
    same blocklist. Returns how many (runner, tactic) pairs ``cache`` did not block before."""
    union: dict[tuple[str, str], BlockedTactic] = {}
    for view in views:
        for item in view:
            union.setdefault(item.ident, item)
    held = {b.ident: b for b in cache.blocklist()}
    for ident, item in union.items():
        if held.get(ident) != item:  # an equal item is left alone: no save rewrites it
            cache.block(item)
    return sum(1 for ident in union if ident not in held)


def _collective_device(group: Any) -> torch.device:
    """Where the exchanged tensors must live: CUDA for a group that only has NCCL (it cannot
    reduce CPU tensors), the CPU for gloo or a ``cpu:gloo,cuda:nccl`` group."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _error_text(exc: BaseException, limit: int = 500) -> str:
    """One rank's error as the other ranks name it: type and message, cut to ``limit``."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else math.inf
