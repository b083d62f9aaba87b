"""Tactic consistency check: does every (runner, tactic) of an op compute what the fallback does?

:func:`check_tactics` runs the fallback ``(runners[0], -1)`` and then every tactic each runner
offers for the inputs (``get_valid_tactics``, as tuning would; the blocklist is ignored) on copies
of the same inputs, and compares every output tensor *and* every tensor input afterwards (an op
that writes in place, like a KV-cache write or an in-place residual add, is checked on what it
wrote) with the fallback's. A tensor passes when its NaNs and infinities sit where the
reference's do and, over the finite elements, ``max|x - ref| <= atol + rtol * max|ref|`` (a
norm-wise bound, so a GEMM's near-zero outputs do not fail on rounding); integer and bool tensors
must be equal. Default tolerances depend on the dtype (:data:`RTOL`).

Outputs are compared by structure, never flattened: dicts key by key (the keys must be the same),
lists and tuples (NamedTuples too) position by position (the lengths must be the same),
dataclasses field by field (the types must be the same), ``None``, strings and bytes by equality,
Python numbers as 0-d tensors. A tactic whose structure differs fails with the path of the first
difference (``output['scale']``); a fallback output holding anything else (an object with no
comparable values) is no reference (:attr:`ConsistencyReport.reference_error`). Inputs and
keyword arguments are compared where the check copies them (tensors in lists, tuples and dicts);
other objects there are the caller's own, shared by every run, and not compared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.identity import runner_id, short_runner_name
from graphtune.autotuner.profiles import copy_tree, profile_for
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.runner_contract import refuse_reserved_keywords
from graphtune.errors import ConfigError

#: Default relative tolerance per dtype (float32 IEEE kernels may still sum in another order).
RTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}
_DEFAULT_RTOL = 1.6e-2


@dataclass(frozen=True)
class TacticCheck:
    """One (runner, tactic) compared with the fallback.

    Attributes:
        runner: Short runner name.
        runner_index: Position of the runner.
        tactic: The tactic.
        max_abs: Largest absolute difference over all compared tensors, integer and bool ones
            included (as numbers; ``inf`` on a shape, dtype or structure mismatch, ``nan`` when
            it raised).
        max_rel: ``max_abs / max|ref|`` of the worst tensor.
        passed: Whether every tensor was within the tolerance.
        error: The exception text when the tactic raised, or a mismatch description naming
            where (``output['scale']``, ``inputs[1]``): a structure, shape or dtype mismatch,
            how many elements of an integer or bool tensor differ.
    """

    runner: str
    runner_index: int
    tactic: Any
    max_abs: float
    max_rel: float
    passed: bool
    error: str | None = None


@dataclass
class ConsistencyReport:
    """What :func:`check_tactics` found for one op call."""

    op: str
    profile: str
    checks: list[TacticCheck] = field(default_factory=list)
    reference_error: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the fallback ran and every tactic matched it."""
        return self.reference_error is None and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[TacticCheck]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c.passed]


class _Mismatch(Exception):
    """A tactic's output (or what it wrote) is not shaped like the fallback's: ``str(self)``
    names the path and both sides."""


class _Incomparable(Exception):
    """The fallback's output holds a value of a type the check cannot compare."""


#: Compared by equality (``None`` for an op that only writes in place).
_CONSTANTS = (type(None), str, bytes)


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, complex))


def _as_tensor(value: Any) -> torch.Tensor:
    """A tensor as it is, a Python number as a 0-d tensor (so the two compare alike)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


def _what(value: Any) -> str:
    """How a mismatch message names a value."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor"
    if _is_number(value) or isinstance(value, _CONSTANTS):
        return repr(value)[:40]
    name = type(value).__qualname__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, (list, tuple)):
        return f"{article} {name} of {len(value)}"
    return f"{article} {name}"


def _pair(got: Any, ref: Any, path: str, strict: bool, pairs: list[tuple[str, Any, Any]]) -> None:
    """Appends ``(path, got tensor, reference tensor)`` for every tensor or number of ``ref``,
    walking both structures together.

    ``strict`` (outputs): a value of ``ref`` of any other type raises :class:`_Incomparable`;
    otherwise (inputs, keyword arguments) it is the caller's own object and is skipped.

    Raises:
        _Mismatch: ``got`` is not shaped like ``ref`` at ``path``.
        _Incomparable: See ``strict``.
    """
    if isinstance(ref, torch.Tensor) or _is_number(ref):
        if not (isinstance(got, torch.Tensor) or _is_number(got)):
            raise _Mismatch(f"{path} is {_what(got)}, the fallback's is {_what(ref)}")
        pairs.append((path, _as_tensor(got), _as_tensor(ref)))
    elif isinstance(ref, Mapping):
        if not isinstance(got, Mapping):
            raise _Mismatch(f"{path} is {_what(got)}, the fallback's is {_what(ref)}")
        if set(got) != set(ref):
            missing = [k for k in ref if k not in got]
            extra = [k for k in got if k not in ref]
            raise _Mismatch(f"{path} lacks the keys {missing} and has the extra keys {extra}")
        for key in ref:
            _pair(got[key], ref[key], f"{path}[{key!r}]", strict, pairs)
    elif strict and dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        if type(got) is not type(ref):
            raise _Mismatch(f"{path} is {_what(got)}, the fallback's is {_what(ref)}")
        for f in dataclasses.fields(ref):
            _pair(getattr(got, f.name), getattr(ref, f.name), f"{path}.{f.name}", strict, pairs)
    elif isinstance(ref, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(ref):
            raise _Mismatch(f"{path} is {_what(got)}, the fallback's is {_what(ref)}")
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            _pair(g, r, f"{path}[{i}]", strict, pairs)
    elif isinstance(ref, _CONSTANTS):
        if type(got) is not type(ref) or got != ref:
            raise _Mismatch(f"{path} is {_what(got)}, the fallback's is {_what(ref)}")
    elif strict:
        raise _Incomparable(
            f"the fallback's {path} is {_what(ref)}, which check_tactics cannot "
            "compare (it compares tensors, numbers, None, strings, and lists, tuples, dicts and "
            "dataclasses of them); have forward return one of those"
        )


def _pairs(got: tuple[Any, Any, Any], ref: tuple[Any, Any, Any]) -> list[tuple[str, Any, Any]]:
    """:func:`_pair` over one run's ``(output, inputs, keyword arguments)``."""
    pairs: list[tuple[str, Any, Any]] = []
    _pair(got[0], ref[0], "output", True, pairs)
    _pair(got[1], ref[1], "inputs", False, pairs)
    _pair(got[2], ref[2], "kwargs", False, pairs)
    return pairs


def _copy(inputs: Sequence[Any]) -> list[Any]:
    return [copy_tree(x) for x in inputs]


def _same_nonfinite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether NaNs and signed infinities sit at the same places (masks hold -inf by design)."""
    return all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


def _compare(
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]], atol: float | None, rtol: float | None
) -> tuple[float, float, bool, str | None]:
    worst_abs, worst_rel, ok, problem = 0.0, 0.0, True, None
    for path, a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            what = f"{path} is {tuple(a.shape)} {a.dtype}, the fallback's {tuple(b.shape)}"
            return math.inf, math.inf, False, f"{what} {b.dtype}"
        if not (b.dtype.is_floating_point or b.dtype.is_complex):
            differ = int((a != b).sum())
            if differ:  # must be equal; the sizes say how far off, the count how often
                wide_a, wide_b = a.double(), b.double()  # no integer overflow, bools as 0 and 1
                err, scale = float((wide_a - wide_b).abs().max()), float(wide_b.abs().max())
                worst_abs = max(worst_abs, err)
                worst_rel = max(worst_rel, err / scale if scale > 0 else math.inf)
                ok = False
                problem = problem or f"{path}: {differ} of {b.numel()} elements differ"
            continue
        if b.dtype.is_complex:  # both parts count (a cast to float would drop the imaginary one)
            a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        fa, fb = a.double(), b.double()
        if not _same_nonfinite(fa, fb):
            return math.inf, math.inf, False, f"{path} has NaN or infinities elsewhere"
        finite = torch.isfinite(fb)
        fa, fb = fa[finite], fb[finite]
        scale = float(fb.abs().max()) if fb.numel() else 0.0
        err = float((fa - fb).abs().max()) if fb.numel() else 0.0
        tol_r = RTOL.get(b.dtype, _DEFAULT_RTOL) if rtol is None else rtol
        tol_a = 0.0 if atol is None else atol
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / scale if scale > 0 else (0.0 if err == 0 else math.inf))
        ok = ok and err <= tol_a + tol_r * scale
    return worst_abs, worst_rel, ok, problem


def check_tactics(
    op: str,
    runners: Sequence[TunableRunner],
    config: TuningConfig,
    inputs: Sequence[Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    **kwargs: Any,
) -> ConsistencyReport:
    """Runs every (runner, tactic) of ``op`` on copies of ``inputs`` and compares each with the
    fallback ``(runners[0], -1)`` (see the module docstring).

    Args:
        op: Op name (for the report).
        runners: The op's runners, fallback first.
        config: The op's tuning config (names the profile in the report).
        inputs: The inputs to run on (live or synthetic); they are copied for every run, never
            written.
        atol: Absolute tolerance (default 0).
        rtol: Relative tolerance, scaled by the reference's largest magnitude (default by
            dtype, :data:`RTOL`).
        **kwargs: Passed to ``get_valid_tactics`` and ``forward``, as ``choose_one`` does.

    Returns:
        The report: one :class:`TacticCheck` per (runner, tactic) other than the fallback.

    Raises:
        ConfigError: What ``choose_one`` refuses of its other arguments (no runners, runners
            or inputs not in a list, ``config`` not a ``TuningConfig``; keyword arguments may
            be anything, tensors included, but not named ``inputs``, ``profile`` or
            ``tactic``), or a tolerance that is not a finite number >= 0.
        InputError: A spec points at an input or dimension that does not exist.
    """
    # choose_one's checks (a tensor as inputs would run each tactic on its rows, and pass),
    # except the keyword ones: nothing is keyed here, and a tensor may be an `out=` argument.
    call = OpCall.checked(op, runners, config, inputs, {}, caller="check_tactics")
    refuse_reserved_keywords("check_tactics", op, kwargs)  # they would reach the runners twice
    runners, inputs = list(call.runners), list(call.inputs)
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 <= value < math.inf
        ):
            raise ConfigError(
                f"check_tactics({op!r}): {name} must be a finite number >= 0, got {value!r}."
            )
    profile = profile_for(config, inputs)
    report = ConsistencyReport(op, profile.describe() if profile is not None else "no bucket")
    reference_inputs, reference_kwargs = _copy(inputs), copy_tree(kwargs)
    try:
        out = runners[0].forward(reference_inputs, tactic=FALLBACK_TACTIC, **reference_kwargs)
    except Exception as exc:  # reported, so a broken fallback is visible in the report
        report.reference_error = f"{type(exc).__name__}: {exc}"
        return report
    reference = (out, reference_inputs, reference_kwargs)
    try:
        tensors = [t for _, t, _ in _pairs(reference, reference)]
    except _Incomparable as exc:  # no tactic could be compared with it
        report.reference_error = str(exc)
        return report
    if any((t.is_floating_point() or t.is_complex()) and bool(t.isnan().any()) for t in tensors):
        # A tactic with NaN where the fallback has them would match it, and a correct one fail.
        report.reference_error = (
            "the fallback's result holds NaN, so no tactic can be compared with it; check the "
            "inputs (or the fallback) first"
        )
        return report
    for ri, runner in enumerate(runners):
        name = short_runner_name(runner_id(runner))
        try:
            tactics = list(runner.get_valid_tactics(_copy(inputs), profile, **kwargs))
        except Exception as exc:  # a runner that cannot list tactics is reported, not fatal
            error = f"get_valid_tactics: {type(exc).__name__}: {exc}"
            report.checks.append(TacticCheck(name, ri, None, math.nan, math.nan, False, error))
            continue
        for tactic in tactics:
            if ri == 0 and tactic == FALLBACK_TACTIC:
                continue
            report.checks.append(
                _check_one(name, ri, runner, tactic, inputs, reference, atol, rtol, kwargs)
            )
    return report


def _check_one(
    name: str,
    index: int,
    runner: TunableRunner,
    tactic: Any,
    inputs: Sequence[Any],
    reference: tuple[Any, Any, Any],
    atol: float | None,
    rtol: float | None,
    kwargs: dict[str, Any],
) -> TacticCheck:
    copied, copied_kwargs = _copy(inputs), copy_tree(kwargs)
    try:
        out = runner.forward(copied, tactic=tactic, **copied_kwargs)
    except Exception as exc:  # a tactic that raises is a failed check, with its error
        return TacticCheck(
            name, index, tactic, math.nan, math.nan, False, f"{type(exc).__name__}: {exc}"
        )
    try:
        pairs = _pairs((out, copied, copied_kwargs), reference)
    except _Mismatch as exc:
        return TacticCheck(name, index, tactic, math.inf, math.inf, False, str(exc))
    max_abs, max_rel, ok, problem = _compare(pairs, atol, rtol)
    return TacticCheck(name, index, tactic, max_abs, max_rel, ok, problem)
