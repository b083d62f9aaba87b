"""Tuning configuration: which dimensions are dynamic, how they are bucketed, how to time.

Everything here is pure (no torch, no clocks): frozen dataclasses validated on construction, and
the bucket helpers. A *bucket* is the representative size a whole range of live sizes is tuned
for; a live size is mapped to its bucket by ``map_to_bucket`` and capped by ``max_value``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from graphtune.errors import ConfigError, add_context_note

TIMING_MODES = ("auto", "graph", "events", "wallclock")
#: Calls per sample for a timer that does not size its samples, when ``TuningConfig.repeat`` is
#: ``None``.
DEFAULT_REPEAT = 10

# ``infer`` of a ConstraintSpec receives the shapes of every input (``None`` for non-tensors),
# with the dynamic dimensions already set to their buckets, and returns the constrained size.
Shapes = Sequence["tuple[int, ...] | None"]


def next_power_of_two(x: int) -> int:
    """Smallest power of two ``>= x`` (``1`` for ``x <= 1``)."""
    _check_int("x", x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def last_power_of_two(x: int) -> int:
    """Largest power of two ``<= x`` (``1`` for ``x <= 1``, so an empty batch maps to bucket 1)."""
    _check_int("x", x)
    return 1 if x <= 1 else 1 << (x.bit_length() - 1)


def power_of_two_buckets(max_value: int, min_value: int = 1) -> tuple[int, ...]:
    """Powers of two from ``min_value`` up to ``max_value``, plus ``max_value`` itself.

    ``max_value`` is included even when it is not a power of two, so the largest size a caller
    will ever run has its own bucket instead of borrowing a smaller one's pick.

    Args:
        max_value: Largest bucket (``>= 1``).
        min_value: Smallest bucket, rounded up to a power of two (``>= 1``).

    Returns:
        Ascending bucket sizes, e.g. ``power_of_two_buckets(12) == (1, 2, 4, 8, 12)``.
    """
    _check_int("max_value", max_value)
    _check_int("min_value", min_value)
    if max_value < 1 or min_value < 1 or min_value > max_value:
        raise ConfigError(
            f"power_of_two_buckets(max_value={max_value}, min_value={min_value}): both must be "
            ">= 1 and min_value <= max_value; pass the largest size you will run as max_value."
        )
    buckets = []
    value = next_power_of_two(min_value)
    while value <= max_value:
        buckets.append(value)
        value *= 2
    if not buckets or buckets[-1] != max_value:
        buckets.append(max_value)
    return tuple(buckets)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")


@dataclass(frozen=True)
class DynamicTensorSpec:
    """One dynamic dimension of one input, swept over buckets while tuning.

    Attributes:
        input_idx: Position of the tensor in the ``inputs`` list given to ``choose_one``.
        dim_idx: Dimension of that tensor (negative counts from the end).
        buckets: Sizes to tune, as a tuple of positive ints, or a callable that takes the max value
            (``TuningConfig.max_value``, or the live size when that is ``None``) and returns them.
        map_to_bucket: Maps a live size to the bucket whose tuning result it uses; a mapper that
            returns 0 says the size has no bucket (a zero-work or sparse case): the call is a
            miss that runs the fallback, and tuning covers the other sizes. ``None`` (the
            default) maps to the listed buckets when ``buckets`` is a tuple (a listed size to
            itself, any other to the largest listed bucket below it, or to the smallest one when
            it is below all of them), and to the callable's buckets for
            ``TuningConfig.max_value`` the same way; without ``max_value`` a callable's list
            depends on the live size, so a size rounds down to a power of two (and a callable
            giving other sizes is refused when tuning). Either way a live size never borrows a
            pick tuned for a larger (possibly padded) shape, except below the smallest bucket.
    """

    input_idx: int
    dim_idx: int
    buckets: tuple[int, ...] | Callable[[int], Iterable[int]] = power_of_two_buckets
    map_to_bucket: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        _check_index("DynamicTensorSpec", "input_idx", self.input_idx, allow_negative=False)
        _check_index("DynamicTensorSpec", "dim_idx", self.dim_idx, allow_negative=True)
        if not callable(self.buckets):
            if isinstance(self.buckets, (str, bytes)) or not isinstance(self.buckets, Sequence):
                raise ConfigError(
                    f"DynamicTensorSpec(input_idx={self.input_idx}).buckets must be a tuple of "
                    f"positive ints or a callable of the max value, got {self.buckets!r}."
                )
            object.__setattr__(self, "buckets", validate_buckets(self.buckets, self))
        if self.map_to_bucket is not None and not callable(self.map_to_bucket):
            raise ConfigError(
                f"DynamicTensorSpec(input_idx={self.input_idx}).map_to_bucket must be callable "
                f"(live size -> bucket) or None, got {self.map_to_bucket!r}; e.g. "
                "last_power_of_two."
            )

    def bucket(self, live: int) -> int:
        """The bucket ``map_to_bucket`` (or the default mapping) gives a live size (0: none)."""
        if self.map_to_bucket is not None:
            try:
                return self.map_to_bucket(live)
            except Exception as exc:
                # The user's error keeps its type; the note says which spec failed on what.
                add_context_note(
                    exc,
                    f"in DynamicTensorSpec(input_idx={self.input_idx}, dim_idx={self.dim_idx})"
                    f".map_to_bucket({live})",
                )
                raise
        if callable(self.buckets):
            return last_power_of_two(live)
        return listed_bucket(self.buckets, live)


def listed_bucket(buckets: tuple[int, ...], live: int) -> int:
    """The default mapping onto listed (sorted) buckets: ``live`` itself when listed, else the
    largest bucket below it, or the smallest bucket when ``live`` is below all of them."""
    below = [b for b in buckets if b <= live]
    return below[-1] if below else buckets[0]


@dataclass(frozen=True)
class ConstraintSpec:
    """A dimension whose size follows from the others (e.g. a scale tensor's rows = M).

    Attributes:
        input_idx: Position of the tensor in ``inputs``.
        dim_idx: Dimension of that tensor (negative counts from the end).
        infer: Given every input's shape (``None`` for non-tensors) with dynamic dimensions already
            set to the profile's buckets, returns this dimension's size.
    """

    input_idx: int
    dim_idx: int
    infer: Callable[[Shapes], int]

    def __post_init__(self) -> None:
        _check_index("ConstraintSpec", "input_idx", self.input_idx, allow_negative=False)
        _check_index("ConstraintSpec", "dim_idx", self.dim_idx, allow_negative=True)
        if not callable(self.infer):
            raise ConfigError(
                f"ConstraintSpec(input_idx={self.input_idx}).infer must be callable "
                f"(shapes -> int), got {self.infer!r}."
            )


def _check_index(owner: str, name: str, value: Any, *, allow_negative: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {value!r}.")
    if value < 0 and not allow_negative:
        raise ConfigError(f"{owner}.{name} must be >= 0, got {value}.")


def validate_buckets(values: Sequence[Any], spec: DynamicTensorSpec) -> tuple[int, ...]:
    """Checks that bucket sizes are positive ints and returns them sorted and de-duplicated."""
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad or not values:
        raise ConfigError(
            f"DynamicTensorSpec(input_idx={spec.input_idx}, dim_idx={spec.dim_idx}): buckets must "
            f"be a non-empty sequence of positive ints, got {list(values)!r}; "
            "e.g. power_of_two_buckets(256)."
        )
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class TuningConfig:
    """How one op is tuned.

    Attributes:
        dynamic_specs: The dynamic dimensions; their bucket combinations are the tuned profiles.
        constraint_specs: Dimensions inferred from the dynamic ones.
        max_value: Caps swept buckets and looked-up sizes (``None``: no cap).
        inputs_pre_hook: Called on each synthetic input list (``list -> list``) before timing, e.g.
            to make routing indices or masks realistic.
        cold_l2: Rotate enough copies of the inputs that their total exceeds the L2 cache, so each
            call reads from DRAM as in a real model step. One sample walks through all copies,
            so it holds at least as many calls as there are copies. Part of the cache key (its
            ``timing`` ends in ``+cold_l2``): a warm-L2 pick is never served to a cold-L2 call,
            nor the other way round.
        timing: ``"auto"`` (graph on CUDA, wallclock on CPU), ``"graph"``, ``"events"`` or
            ``"wallclock"``, on the device of the first input tensor not on the CPU. A timer
            passed to ``AutoTuner(timer=...)`` takes precedence.
        warmup: Untimed calls before each measurement.
        repeat: Back-to-back calls per sample, or ``None`` (the default) for the timer's
            choice: the graph timer sizes its replays itself (``GraphTimer.min_calls`` calls
            or more while a call is shorter than its ``min_replay_us``, one call for a call
            that alone lasts that long); other timers make :data:`DEFAULT_REPEAT`. A number is
            the fewest calls for the graph timer and the count for the others. Raised to the
            copies in cold-L2 mode (:func:`calls_per_sample`).
    """

    dynamic_specs: tuple[DynamicTensorSpec, ...] = ()
    constraint_specs: tuple[ConstraintSpec, ...] = ()
    max_value: int | None = None
    inputs_pre_hook: Callable[[list[Any]], list[Any]] | None = None
    cold_l2: bool = False
    timing: str = "auto"
    warmup: int = 3
    repeat: int | None = None

    def __post_init__(self) -> None:
        kinds = (("dynamic_specs", DynamicTensorSpec), ("constraint_specs", ConstraintSpec))
        for name, kind in kinds:
            specs = getattr(self, name)
            if isinstance(specs, kind):
                specs = (specs,)
            if isinstance(specs, (str, bytes)) or not isinstance(specs, Iterable):
                raise ConfigError(
                    f"TuningConfig.{name} must be a {kind.__name__} or a tuple of them, got "
                    f"{specs!r}."
                )
            specs = tuple(specs)
            for spec in specs:
                if not isinstance(spec, kind):
                    raise ConfigError(
                        f"TuningConfig.{name} must contain {kind.__name__} objects, got {spec!r}."
                    )
            object.__setattr__(self, name, specs)
        seen: set[tuple[int, int]] = set()
        specs_seen: tuple[DynamicTensorSpec | ConstraintSpec, ...] = (
            *self.dynamic_specs,
            *self.constraint_specs,
        )
        for spec in specs_seen:
            dim = (spec.input_idx, spec.dim_idx)
            if dim in seen:
                raise ConfigError(
                    f"TuningConfig: input {spec.input_idx} dim {spec.dim_idx} appears in more than "
                    "one dynamic/constraint spec; each dimension may be described once."
                )
            seen.add(dim)
        if self.max_value is not None:
            _check_int("TuningConfig.max_value", self.max_value)
            if self.max_value < 1:
                raise ConfigError(
                    f"TuningConfig.max_value must be >= 1 or None, got {self.max_value}."
                )
        if self.inputs_pre_hook is not None and not callable(self.inputs_pre_hook):
            raise ConfigError(
                "TuningConfig.inputs_pre_hook must be callable (list -> list) or None."
            )
        if not isinstance(self.cold_l2, bool):
            raise ConfigError(f"TuningConfig.cold_l2 must be a bool, got {self.cold_l2!r}.")
        if self.timing not in TIMING_MODES:
            raise ConfigError(
                f"TuningConfig.timing={self.timing!r} is not one of {', '.join(TIMING_MODES)}."
            )
        _check_int("TuningConfig.warmup", self.warmup)
        if self.repeat is not None:
            _check_int("TuningConfig.repeat", self.repeat)
        if self.warmup < 0 or (self.repeat is not None and self.repeat < 1):
            raise ConfigError(
                f"TuningConfig needs warmup >= 0 and repeat >= 1 (or None for the timer's "
                f"choice), got warmup={self.warmup}, repeat={self.repeat}."
            )

    def __hash__(self) -> int:
        # Computed once: every look-up hashes its config (the tuner's memo key), and hashing the
        # fields, specs included, costs more than the rest of the key. Equal configs still hash
        # equal. Not pickled (string hashes differ between processes): see __getstate__.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
            return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def bucket_of(self, spec: DynamicTensorSpec, live: int) -> int:
        """The bucket a live size of ``spec``'s dimension looks up (mapped, then capped); 0 when
        the mapper says the size has no bucket."""
        if spec.map_to_bucket is None and self.max_value is not None:
            # The sweep tunes exactly these, so a look-up must land on one of them (a rounding
            # rule of its own would miss buckets that are not powers of two: 9 -> 8; capping
            # the listed bucket would give max_value, which is no bucket: 100 -> 32 of (8, 64)).
            return listed_bucket(_capped_buckets(spec, self.max_value), live)
        bucket = spec.bucket(live)
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
            raise ConfigError(
                f"DynamicTensorSpec(input_idx={spec.input_idx}, dim_idx={spec.dim_idx})."
                f"map_to_bucket({live}) returned {bucket!r}; it must return an int >= 0 (0: no "
                "bucket, the call runs the fallback)."
            )
        if bucket == 0 or self.max_value is None:
            return bucket
        return min(bucket, self.max_value)

    def sweep_values(self, spec: DynamicTensorSpec, live: int) -> tuple[int, ...]:
        """Sizes tuned for ``spec``: its buckets capped by ``max_value``, plus the live bucket
        (unless the live size has none).

        Raises:
            ConfigError: Callable buckets without ``max_value`` and ``map_to_bucket`` gave a size
                that is not a power of two (other than the live size they were given): look-ups
                round down to powers of two, so that bucket would be tuned and never used.
        """
        if self.max_value is not None:
            raw = _capped_buckets(spec, self.max_value)
        elif callable(spec.buckets):
            raw = _uncapped_buckets(spec, live)
        else:
            raw = spec.buckets
        capped = {b for b in raw if self.max_value is None or b <= self.max_value}
        live_bucket = self.bucket_of(spec, live)
        if live_bucket:
            capped.add(live_bucket)
        return tuple(sorted(capped))


@functools.lru_cache(maxsize=256)
def _capped_buckets(spec: DynamicTensorSpec, max_value: int) -> tuple[int, ...]:
    """The buckets (a tuple, or what a callable gives for ``max_value``) up to ``max_value``:
    those above it left out (``max_value`` itself when every one is above it, so a look-up
    always has a bucket)."""
    if callable(spec.buckets):
        raw = validate_buckets(_called(spec, max_value), spec)
    else:
        raw = spec.buckets
    return tuple(b for b in raw if b <= max_value) or (min(raw[0], max_value),)


def _called(spec: DynamicTensorSpec, arg: int) -> tuple[Any, ...]:
    """What ``spec``'s buckets callable gives for ``arg``, as a tuple. Any iterable is taken (a
    list, a set, a generator: :func:`validate_buckets` sorts them) except a str, bytes or a
    mapping; what is no iterable (an int, ``None``) is refused here rather than with a bare
    ``TypeError`` deep in the sweep."""
    got = spec.buckets(arg)  # type: ignore[operator]
    if isinstance(got, (str, bytes, Mapping)) or not isinstance(got, Iterable):
        raise ConfigError(
            f"DynamicTensorSpec(input_idx={spec.input_idx}, dim_idx={spec.dim_idx}): its buckets "
            f"callable returned {got!r} for {arg}; it must return an iterable of positive ints, "
            "such as a tuple (e.g. power_of_two_buckets)."
        )
    return tuple(got)


def _uncapped_buckets(spec: DynamicTensorSpec, live: int) -> tuple[int, ...]:
    """Callable buckets without ``max_value``: the list depends on the live size, so look-ups
    round down to a power of two and only powers of two can be tuned. The live size itself (the
    cap :func:`power_of_two_buckets` appends) is left out: its calls look up the power below."""
    raw = validate_buckets(_called(spec, max(live, 1)), spec)
    odd = [b for b in raw if b & (b - 1) and b != live]
    if odd and spec.map_to_bucket is None:
        raise ConfigError(
            f"DynamicTensorSpec(input_idx={spec.input_idx}, dim_idx={spec.dim_idx}): its buckets "
            f"callable gave {list(raw)}, and without TuningConfig.max_value a live size rounds "
            f"down to a power of two, so {odd[0]} would be tuned but never looked up; pass "
            "max_value, or map_to_bucket, or the buckets as a tuple."
        )
    if spec.map_to_bucket is None:
        return tuple(b for b in raw if not b & (b - 1))
    return raw


def calls_per_sample(config: TuningConfig, copies: int, timer_sizes_samples: bool) -> int:
    """The ``repeat`` a profile's measurements ask the timer for.

    ``config.repeat``, or when it is ``None`` 1 for a timer that sizes its samples (the graph
    timer chooses the calls of a replay itself; a fixed ten would make a sample of a 1 ms
    candidate ten 1 ms calls) and :data:`DEFAULT_REPEAT` for other timers. With cold-L2
    rotation at least ``copies``: a sample must walk through all of them, or the few it touches
    stay in L2 (a graph timer replays the same calls).
    """
    floor = copies if config.cold_l2 else 1
    if config.repeat is not None:
        return max(config.repeat, floor)
    return max(1 if timer_sizes_samples else DEFAULT_REPEAT, floor)
