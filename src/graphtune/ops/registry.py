"""The op registry: op name -> how to rebuild the op's runners and tuning config in a new process.

Each op module of :mod:`graphtune.ops` registers its op when it is imported (so importing
:mod:`graphtune.ops` registers all of them). A registered op can be re-created from a
:class:`~graphtune.autotuner.calls.CallRecord` (what ``AutoTuner.misses`` records while serving):
:func:`rebuild_call` gives back a live :class:`~graphtune.autotuner.calls.OpCall` with the same
runner identities, config and input shapes, which :func:`tune_records` tunes offline
(``graphtune tune --from-misses FILE``). The tuner itself never imports the ops; this is the
seam.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from graphtune.autotuner.calls import CallRecord, OpCall
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.entries import CacheKey, key_timing, split_timing
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.runner import TunableRunner
from graphtune.errors import ConfigError, GraphtuneError, InputError

logger = logging.getLogger(__name__)

#: ``rebuild(record, tuner)``: the runners and config of a recorded call; ``tuner`` is the one that
#: will tune it (a fused op's unfused runner asks it for the inner ops' picks), or ``None``.
Rebuild = Callable[[CallRecord, Any], tuple[Sequence[TunableRunner], TuningConfig]]


@dataclass(frozen=True)
class OpSpec:
    """A registered op.

    Attributes:
        name: The op name given to ``choose_one``.
        rebuild: Returns the op's runners and tuning config for a recorded call and the tuner
            that will tune it (reading what it needs from the record: inputs that are ``None``
            or tensors, ``config["max_value"]``, runner extras).
    """

    name: str
    rebuild: Rebuild


_REGISTRY: dict[str, OpSpec] = {}


def register_op(name: str, rebuild: Rebuild) -> OpSpec:
    """Registers (or replaces) the op ``name``; returns its spec."""
    spec = OpSpec(name, rebuild)
    _REGISTRY[name] = spec
    return spec


def registered_ops() -> tuple[str, ...]:
    """Names of the registered ops, sorted."""
    return tuple(sorted(_REGISTRY))


def op_spec(name: str) -> OpSpec:
    """The registered op ``name``.

    Raises:
        ConfigError: No op of that name is registered.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(
            f"op {name!r} is not in the graphtune.ops registry (registered: "
            f"{', '.join(registered_ops())}); register it with "
            "graphtune.ops.registry.register_op(name, rebuild) in the module that defines it "
            "(and give `graphtune tune --from-misses` that module with --import)."
        )
    return spec


def runner_extras(ident: str) -> list[Any]:
    """The ``cache_key_extras()`` encoded in a runner id (``[]`` when it has none)."""
    _, bracket, rest = ident.partition("[")
    return json.loads(bracket + rest) if bracket else []


def is_tensor(record: CallRecord, index: int) -> bool:
    """Whether input ``index`` of the recorded call was a tensor."""
    return "shape" in record.inputs[index]


def rebuild_call(
    record: CallRecord, device: torch.device | str | None = None, tuner: Any = None
) -> OpCall:
    """The live call a record describes, with fresh inputs (see
    :meth:`~graphtune.autotuner.calls.CallRecord.make_inputs`); ``tuner`` is the tuner that will
    tune it (``None``: the process default, for ops whose runners ask one).

    Raises:
        ConfigError: The op is not registered, or the runners or config it rebuilds differ from
            the recorded ones (the record was made by other code).
    """
    runners, config = op_spec(record.op).rebuild(record, tuner)
    ids = tuple(runner_id(r) for r in runners)
    if ids != record.runners:
        raise ConfigError(
            f"op {record.op!r}: the recorded runners {list(record.runners)} are not the ones "
            f"graphtune.ops builds here {list(ids)}; record the misses with this graphtune, or "
            "tune that call in the process that makes it."
        )
    fields = {name: getattr(config, name) for name in record.config}
    if fields != record.config:
        raise ConfigError(
            f"op {record.op!r}: the recorded tuning config {record.config} differs from the "
            f"op's config here {fields}; tune that call in the process that makes it."
        )
    inputs = tuple(record.make_inputs(device))
    return OpCall(record.op, tuple(runners), config, inputs, record.call_kwargs())


@dataclass
class RecordsReport:
    """What :func:`tune_records` did: per record, its pick or why it was skipped.

    ``tuned`` lists every record whose key now has a pick; ``already_cached`` counts those of
    them whose pick was in the cache before (nothing was timed for them).
    """

    tuned: list[tuple[CallRecord, str, Any]] = field(default_factory=list)
    skipped: list[tuple[CallRecord, str]] = field(default_factory=list)
    already_cached: int = 0


def tune_records(
    records: Sequence[CallRecord], tuner: Any, device: torch.device | str | None = None
) -> RecordsReport:
    """Tunes exactly the profiles of ``records`` with ``tuner`` (``AutoTuner.tune_call``).

    A record that cannot be rebuilt (unknown op, other runners or config, inputs this machine
    cannot make, a record damaged by hand) is skipped with its reason; the others are tuned.
    """
    report = RecordsReport()
    for record in records:
        failed_before = tuner.stats.profiles_failed
        picks_before = tuner.stats.profiles_tuned + tuner.stats.untimed_picks
        try:
            runner, tactic = tuner.tune_call(_rebuilt(record, device, tuner))
        except GraphtuneError as exc:
            logger.warning("skipping the recorded %r call: %s", record.op, exc)
            report.skipped.append((record, str(exc)))
            continue
        if tuner.stats.profiles_failed > failed_before:
            problem: str | None = (
                "every (runner, tactic) failed on it, so nothing was tuned and the call keeps "
                "running the fallback (the warning above names the errors)"
            )
        else:
            problem = _missed_key_problem(record, tuner.cache)
        if problem is not None:
            logger.warning("the recorded %r call: %s", record.op, problem)
            report.skipped.append((record, problem))
            continue
        report.tuned.append((record, type(runner).__qualname__, tactic))
        # A new pick is timed (profiles_tuned) or, with a single candidate, taken untimed.
        if tuner.stats.profiles_tuned + tuner.stats.untimed_picks == picks_before:
            report.already_cached += 1
    return report


def _missed_key_problem(record: CallRecord, cache: Any) -> str | None:
    """Why the key the serving process missed is still not in ``cache`` after tuning the record
    (``None``: it is). The tuned key differs from it only where this process is not the serving
    one: the timer, the runners' source, the keyword arguments."""
    if record.key is None:
        return None
    try:
        missed = CacheKey.from_json(record.key)
    except (KeyError, TypeError, ValueError):
        return None  # a record without a readable key: what was tuned is all there is to check
    if record.config.get("cold_l2") is True and not split_timing(missed.timing)[1]:
        # Recorded before cold L2 was part of the key: the serving process, once updated, looks
        # the call up under the cold-L2 key that its recorded config tunes here.
        missed = replace(missed, timing=key_timing(missed.timing, True))
    if missed in cache:
        return None
    # A record saved before keys named the device has none: the serving process, once updated,
    # looks the call up under the device this process tuned it on, so any device matches.
    compared = ("runners", "timing", "device", "sources", "kwargs")
    if not missed.device:
        if any(replace(missed, device=k.device) == k for k in cache):
            return None
        compared = tuple(f for f in compared if f != "device")
    near = [
        k for k in cache if (k.op, k.shapes, k.dtypes) == (missed.op, missed.shapes, missed.dtypes)
    ]
    fields = [
        f for f in compared if near and all(getattr(k, f) != getattr(missed, f) for k in near)
    ]
    timer = split_timing(missed.timing)[0]  # cold L2 comes from the record's config
    hint = {
        "timing": f"the serving process times with {timer!r}: pass --timing {timer}",
        "device": f"the serving process ran it on {missed.device or 'an unrecorded device'}: "
        "pass that --device",
        "sources": "the runners' source files changed since the misses were recorded: record "
        "them again",
    }
    fixes = (
        "; ".join(hint[f] for f in fields if f in hint)
        or "tune that call in the process that makes it"
    )
    return (
        f"tuned, but the serving process looks up another key (it differs in "
        f"{', '.join(fields) or 'the key'}): {fixes}"
    )


def _rebuilt(record: CallRecord, device: torch.device | str | None, tuner: Any) -> OpCall:
    """:func:`rebuild_call`, with what an op's rebuild raises on a record edited by hand or
    damaged (a runner id it cannot parse, a missing field) as an :class:`InputError`."""
    try:
        return rebuild_call(record, device, tuner)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise InputError(
            f"op {record.op!r}: the record does not rebuild ({type(exc).__name__}: {exc}); "
            "record the misses again with this graphtune"
        ) from None
