"""Graph timer: capture back-to-back calls in one CUDA graph, replay it, time replays with events.

This is how a tuned op runs in production (inside a graph), and it takes host launch cost out of
the measurement: a replay is one host launch, whatever it holds. What is left per call is the
kernel time plus the GPU's own gap between consecutive graph nodes.

Sizing a replay: one replay is timed by a pair of events whose resolution is about 0.5 µs and
whose replay launch costs the GPU a few microseconds, so a replay must last much longer than that.
With ``auto_repeat`` (the default) the timer probes the captured graph and resizes it until a
replay lasts ``min_replay_us`` (100 µs), with at least ``min_calls`` (3) back-to-back calls while
a call is shorter than that, and the caller's ``repeat`` calls for a call that alone lasts that
long (rules and their reasons: :mod:`graphtune.autotuner.timing.sizing`); at most ``max_repeat``
(1024) calls. So a 1 µs kernel is timed over about 110 calls per replay, a 1 ms GEMM over one.
The first replay of a graph uploads it and is never timed. The last probe replays are timed
like a measurement (behind the same delay kernel), so a session gives them as its first
measurement (``first_from_probe``) instead of replaying the graph ``replays`` more times: the
tuner's first round only races the candidates, and each candidate's opening already paid for it.

Capturing a call costs the host the runner's whole launch path, so a long replay of a short kernel
is built from a piece instead (``repeat_pieces``, the default): the calls are captured once, as many
as the probes estimate to last ``min_piece_us`` (100 µs, as long as a default replay), and the
replay runs copies of that piece as child graphs (:mod:`graphtune.autotuner.timing.repeated`). The
GPU runs the same kernels either way. A call of a few microseconds or more is so timed in one piece,
an unbroken chain; the first probe of a bucket's first candidate (3 calls, the replay's fixed cost
spread over them) overstates a 1-2 µs call, and the piece is grown once, so such a call may be timed
as 2 or 3 copies of a 50-70 µs piece (later candidates are sized from the first one's time).

In cold-L2 mode pass ``repeat >= copies`` so that one replay walks through every input copy;
otherwise consecutive replays touch the same few copies and find them in L2.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import torch

from graphtune.autotuner.timing._checks import (
    check_counts,
    check_int,
    check_number,
    require_cuda,
)
from graphtune.autotuner.timing.base import Measurement, TimedFn
from graphtune.autotuner.timing.capture import capture_calls, release_graph
from graphtune.autotuner.timing.delay import GpuDelay, delay_us_for_host_time, host_lead_us
from graphtune.autotuner.timing.lead_in import LeadIn, corrected, prepare
from graphtune.autotuner.timing.repeated import RepeatedGraph, cuda_runtime
from graphtune.autotuner.timing.sizing import ReplayPlan, Step
from graphtune.errors import CaptureError, ConfigError

logger = logging.getLogger(__name__)

#: What the timer replays: a captured graph, or copies of one (:class:`RepeatedGraph`).
Replayable = torch.cuda.CUDAGraph | RepeatedGraph


#: Probe replays allowed while sizing a replay (each may change the graph).
_MAX_RESIZES = 3


def sizes_its_samples(timer: object) -> bool:
    """Whether ``timer`` chooses the calls of a sample itself: a :class:`GraphTimer` with
    ``auto_repeat`` adds calls until a replay lasts ``min_replay_us``, so a caller's ``repeat``
    is only the fewest calls it captures."""
    return isinstance(timer, GraphTimer) and timer.auto_repeat


class GraphTimer:
    """Times ``fn`` by replaying a CUDA graph of ``repeat`` back-to-back calls.

    Procedure of :meth:`measure`:

    1. ``max(1, warmup)`` untimed calls on a side stream (lazy initialisation such as cuBLAS
       handles and workspaces must happen outside capture, on the stream that will capture);
       events around all but the first bound a call's time, which sizes the first capture.
    2. Capture ``fn(i) .. fn(i + n - 1)`` in one ``torch.cuda.CUDAGraph`` on the side stream,
       with the graph's own private memory pool, garbage collection paused; with
       ``auto_repeat``, probe replays resize it (see the module docstring).
    3. One untimed replay (the first replay uploads the graph; none when the ``auto_repeat``
       probe already replayed this graph), then a delay kernel sized to cover the host enqueue
       that keeps the timed replays back to back (:func:`host_lead_us`), then ``replays``
       replays each between two events. A session's first measurement of a graph the probe
       timed last is that probe's ``probe_replays`` replays (``first_from_probe``).
    4. Per call = replay time / calls; the median over replays is reported. The graph is reset
       and dropped before returning, also on errors, so its pool can be reused.

    Args:
        replays: Timed replays (samples).
        auto_repeat: Raise the number of captured calls until a replay lasts ``min_replay_us``.
        min_replay_us: Target duration of one replay for ``auto_repeat``.
        max_repeat: Cap on the calls per replay for ``auto_repeat``.
        min_calls: With ``auto_repeat``, the fewest calls per replay while one call is shorter
            than ``min_replay_us`` (back-to-back calls, so the overlap between consecutive
            kernels is in every sample); a call that alone lasts that long is replayed with the
            caller's ``repeat`` calls.
        repeat_pieces: With ``auto_repeat``, capture the calls once as a piece of at least
            ``min_piece_us`` and replay copies of it (:class:`RepeatedGraph`) instead of
            capturing every call of a long replay; falls back to capturing every call where the
            CUDA runtime cannot be used (:func:`cuda_runtime`).
        min_piece_us: Shortest piece to repeat: each copy boundary costs a kernel with
            programmatic dependent launch its overlap once, and a chain of back-to-back calls
            can run slower than its first few calls (the in-graph truth of
            ``benchmarks/tuning.py``), so a piece must be long against both. The default is a
            fixed 100 µs, the same as the default ``min_replay_us``, which makes most replays
            one piece (the module docstring says when not); it does not follow
            ``min_replay_us``: with a longer ``min_replay_us`` a replay is several copies of a
            100 µs piece, and with a shorter one a replay of short calls still lasts about
            ``min_piece_us`` (its one piece). Unused with ``repeat_pieces=False``.
        probe_replays: Timed replays of each ``auto_repeat`` probe.
        first_from_probe: A session whose graph was timed by the last probe returns that
            probe's replays as its first measurement (``probe_replays`` samples) instead of
            timing ``replays`` more; :meth:`measure` (one session, one measurement) always
            times ``replays``.
        device: CUDA device (default: the current device).
        capture_error_mode: Passed to ``CUDAGraph.capture_begin`` (``"global"`` makes any
            CUDA-unsafe call during capture fail loudly, which is what we want while tuning).
        lead_in: Experimental, off (``None``) by default: a zero-argument callable launching a
            small kernel; each call is then timed right after it, its own time taken off
            (:mod:`graphtune.autotuner.timing.lead_in` says why and the caveat).
    """

    name = "graph"

    def __init__(
        self,
        *,
        replays: int = 10,
        auto_repeat: bool = True,
        min_replay_us: float = 100.0,
        max_repeat: int = 1024,
        min_calls: int = 3,
        repeat_pieces: bool = True,
        min_piece_us: float = 100.0,
        probe_replays: int = 3,
        first_from_probe: bool = True,
        device: torch.device | str | int | None = None,
        capture_error_mode: str = "global",
        lead_in: Callable[[], object] | None = None,
    ) -> None:
        # Checked here: the sizing rules would only fail on them after real captures.
        counts = (("replays", replays, 10), ("probe_replays", probe_replays, 3))
        for name, count, default in counts + (("max_repeat", max_repeat, 1024),):
            check_int("GraphTimer", name, count, minimum=1, default=default)
        check_int("GraphTimer", "min_calls", min_calls, minimum=1, default=3)
        for name, us in (("min_replay_us", min_replay_us), ("min_piece_us", min_piece_us)):
            check_number("GraphTimer", name, us, above=0, default=100.0)
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ConfigError(
                "GraphTimer: capture_error_mode must be 'global', 'thread_local' or 'relaxed', "
                f"got {capture_error_mode!r}"
            )
        self.replays = replays
        self.auto_repeat = auto_repeat
        self.min_replay_us = min_replay_us
        self.max_repeat = max_repeat
        self.min_calls = min_calls
        self.repeat_pieces = repeat_pieces
        self.min_piece_us = min_piece_us
        self.probe_replays = probe_replays
        self.first_from_probe = bool(first_from_probe)
        self.device = device
        self.capture_error_mode = capture_error_mode
        self.lead_in = lead_in
        self.lead_in_state = None if lead_in is None else LeadIn(lead_in)
        self._streams: dict[int, torch.cuda.Stream] = {}
        # Timing events per device, reused by every replay batch (created lazily by torch on
        # their first record; a batch waits for its events before the next one records them).
        self._events: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        #: Calls per replay used by the last measurement (after ``auto_repeat``).
        self.last_calls: int | None = None
        #: Host cost of one replay's launch in the last measurement, in microseconds.
        self.last_launch_us: float | None = None

    def measure(self, fn: TimedFn, *, warmup: int, repeat: int) -> Measurement:
        """Times ``fn``; see the class docstring for the procedure (one :meth:`open` session).

        Raises:
            ConfigError: Without CUDA, or for invalid ``warmup``/``repeat``.
            CaptureError: The calls could not be captured (for example ``fn`` synchronizes with
                the host), or a stream is already capturing. The tuner records the tactic as
                failed.
        """
        with self.open(fn, warmup=warmup, repeat=repeat) as session:
            return session.measure(fresh=True)

    def open(
        self, fn: TimedFn, *, warmup: int, repeat: int, hint_us: float | None = None
    ) -> GraphSession:
        """Steps 1 and 2 of the procedure (warm-up, capture sized by ``auto_repeat``), once.

        The returned session replays that one graph for every :meth:`GraphSession.measure`, so a
        candidate measured several times is captured once. Close it (or use it as a context
        manager) to free the graph and its memory pool. ``hint_us``, a guess of one call's time
        (the tuner passes the fastest candidate of the bucket so far), sizes the first capture
        (:class:`~graphtune.autotuner.timing.sizing.ReplayPlan`); the probes still decide.

        Raises:
            ConfigError, CaptureError: As :meth:`measure`.
        """
        check_counts("GraphTimer", warmup=warmup, repeat=repeat)
        device = require_cuda("GraphTimer", self.device)
        if torch.cuda.is_current_stream_capturing():
            raise CaptureError(
                "GraphTimer cannot time while the current stream is capturing a CUDA graph "
                "(nested capture); tune before capturing, or look tactics up from the cache"
            )
        fn, hint_us = prepare(self, fn, device, warmup, hint_us)  # the lead-in, when set
        with torch.cuda.device(device):
            caller = torch.cuda.current_stream(device)
            stream = self._side_stream(device)
            stream.wait_stream(caller)  # inputs may have been written on the caller's stream
            counter = itertools.count()
            try:
                estimate_us = self._warm_up(fn, counter, max(1, warmup), stream)
                graph, plan, probe = self._capture_sized(
                    fn, counter, repeat, stream, device, estimate_us, hint_us
                )
            finally:
                caller.wait_stream(stream)
        self.last_calls = plan.total
        probed = probe is not None
        # A graph the auto-repeat probe replayed is uploaded and its launch cost is known.
        launch_us = self.last_launch_us if probed else None
        expected = plan.expected_replay_us
        return GraphSession(
            self,
            graph,
            plan.total,
            stream,
            device,
            probed=probed,
            launch_us=launch_us,
            replay_us=None if expected is None else 0.9 * expected,  # see expected_replay_us
            probe_us=probe if self.first_from_probe else None,
        )

    def _capture_sized(
        self,
        fn: TimedFn,
        counter: Iterator[int],
        repeat: int,
        stream: torch.cuda.Stream,
        device: torch.device,
        estimate_us: float | None = None,
        hint_us: float | None = None,
    ) -> tuple[Replayable, ReplayPlan, list[float] | None]:
        """The graph, its plan (``plan.total`` calls per replay), and the µs of the timed replays
        of the last probe when that probe replayed the returned graph (so it is uploaded and
        ``last_launch_us`` was measured on it), else ``None``.

        The calls and copies follow a :class:`~graphtune.autotuner.timing.sizing.ReplayPlan`
        revised after each probe. With ``repeat_pieces`` (and the CUDA runtime usable,
        :func:`cuda_runtime`) a long replay runs copies of one captured piece
        (:class:`RepeatedGraph`): the same kernels on the GPU, but the runner's host launch path
        is paid for the piece only."""
        runtime = cuda_runtime() if self.auto_repeat and self.repeat_pieces else None
        plan = ReplayPlan(
            repeat,
            min_replay_us=self.min_replay_us,
            max_repeat=self.max_repeat,
            min_calls=self.min_calls if self.auto_repeat else repeat,
            min_piece_us=self.min_piece_us,
            pieces=runtime is not None,
            estimate_us=estimate_us if self.auto_repeat else None,
            hint_us=hint_us if self.auto_repeat else None,
        )
        piece = self._capture(fn, counter, plan.calls, stream, device, keep=plan.pieces)
        graph: Replayable = piece
        probe: list[float] | None = None
        try:
            # A short probe overstates the per-call time (the replay's fixed launch cost is
            # spread over few calls), so the first estimate can fall short: probe again.
            for _ in range(_MAX_RESIZES if self.auto_repeat else 0):
                probe = self._time_replays(graph, self.probe_replays, stream, device)
                step = plan.next(min(probe))
                if step is Step.REPEAT:
                    assert runtime is not None  # a plan without pieces never repeats
                    try:
                        repeated = RepeatedGraph(piece, plan.copies, runtime)
                    except CaptureError as exc:
                        logger.debug("GraphTimer: %s", exc)
                        step = plan.without_pieces()
                    else:
                        if isinstance(graph, RepeatedGraph):
                            graph.reset(keep_piece=True)
                        graph, probe = repeated, None
                        continue
                if step is None:
                    break
                logger.debug(
                    "GraphTimer: probe replay %.1f us (target %.0f us); capturing %d calls",
                    min(probe),
                    self.min_replay_us,
                    plan.calls,
                )
                # Release before recapturing so both graphs' pools are never held at once.
                release_graph(graph)
                piece = self._capture(fn, counter, plan.calls, stream, device, keep=plan.pieces)
                graph, probe = piece, None
        except BaseException:
            release_graph(graph)
            raise
        return graph, plan, probe

    def _warm_up(
        self, fn: TimedFn, counter: Iterator[int], calls: int, stream: torch.cuda.Stream
    ) -> float | None:
        """Runs the warm-up calls on ``stream`` and waits for them; returns the time per call of
        all but the first (which pays lazy initialisation) by events, or ``None`` for a single
        warm-up call. Eager calls include host gaps, so this bounds a call's GPU time above."""
        with torch.cuda.stream(stream):
            fn(next(counter))
            if calls < 2:
                stream.synchronize()
                return None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(calls - 1):
                fn(next(counter))
            end.record(stream)
        stream.synchronize()
        return start.elapsed_time(end) * 1000.0 / (calls - 1)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        # One side stream per device and timer: a fresh stream per measurement would make torch
        # set up a new cuBLAS workspace for each one.
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[index] = stream
        return stream

    def _capture(
        self,
        fn: TimedFn,
        counter: Iterator[int],
        calls: int,
        stream: torch.cuda.Stream,
        device: torch.device,
        *,
        keep: bool = False,
    ) -> torch.cuda.CUDAGraph:
        """:func:`capture_calls` with this timer's error mode (one seam that tests replace)."""
        return capture_calls(
            fn, counter, calls, stream, device, keep=keep, error_mode=self.capture_error_mode
        )

    def _time_replays(
        self,
        graph: Replayable,
        count: int,
        stream: torch.cuda.Stream,
        device: torch.device,
        *,
        uploaded: bool = False,
        launch_us: float | None = None,
        replay_us: float | None = None,
    ) -> list[float]:
        """Replays ``graph`` untimed (twice; once when ``uploaded``; not at all when also the
        host launch cost ``launch_us`` is known), then ``count`` timed times; returns µs per
        replay. The launch cost measured here is kept in ``last_launch_us``. ``replay_us``, a
        replay's expected GPU time (or ``None``), shortens the delay in front of the timed
        replays to what keeps them back to back (:func:`host_lead_us`).

        The host waits for the GPU once, after the timed replays: the untimed replays only need
        to be queued before the delay kernel (a launch costs the host the same whether or not
        the GPU is busy), and work queued ahead of the delay only lengthens it."""
        gpu_delay = GpuDelay(device)
        gpu_delay.cycles_per_us()  # calibrate outside the timed region
        events = self._timing_events(device, count)
        with torch.cuda.stream(stream):
            if not uploaded:
                graph.replay()  # untimed: the first replay of a graph includes its upload
            if launch_us is None:
                begin = time.perf_counter()
                graph.replay()  # untimed: measures the host cost of one launch
                launch_us = (time.perf_counter() - begin) * 1e6
            self.last_launch_us = launch_us
            # Once the timed replays are queued the GPU runs them back to back; until then a
            # replay started from an idle GPU would count the host's launch of the next one.
            # So a delay kernel covers the host enqueue of all of them (plus event records).
            lead_us = host_lead_us(count, launch_us + 5.0, replay_us)
            gpu_delay.enqueue(delay_us_for_host_time(lead_us))
            for start, end in events:
                start.record(stream)
                graph.replay()
                end.record(stream)
        stream.synchronize()
        return [start.elapsed_time(end) * 1000.0 for start, end in events]

    def _timing_events(
        self, device: torch.device, count: int
    ) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """``count`` pairs of timing events of ``device``, reused across replay batches (the
        batch that recorded them last has been waited for)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = self._events.setdefault(index, [])
        while len(pool) < count:
            pool.append(
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            )
        return pool[:count]


class GraphSession:
    """One captured graph of ``calls`` back-to-back calls, replayed for every measurement.

    Made by :meth:`GraphTimer.open`; :meth:`measure` is step 3 and 4 of the timer's procedure.
    ``probed``: the graph was already replayed (uploaded) and ``launch_us`` measured on it.
    ``replay_us``: a replay's expected GPU time, which shortens the delay in front of the timed
    replays (the fastest replay of the last measurement replaces it). ``probe_us``: the timed
    replays of the probe that last replayed this graph, given as the first measurement.
    """

    def __init__(
        self,
        timer: GraphTimer,
        graph: Replayable,
        calls: int,
        stream: torch.cuda.Stream,
        device: torch.device,
        *,
        probed: bool = False,
        launch_us: float | None = None,
        replay_us: float | None = None,
        probe_us: list[float] | None = None,
    ) -> None:
        self.timer = timer
        self.calls = calls
        self._graph: Replayable | None = graph
        self._stream = stream
        self._device = device
        self._uploaded = probed
        self._launch_us = launch_us
        self._replay_us = replay_us
        self._probe_us = probe_us or None

    def measure(self, *, fresh: bool = False) -> Measurement:
        """One measurement: ``timer.replays`` timed replays of the graph.

        The first measurement of a session opened with probe replays (``probe_us``) is those
        replays, unless ``fresh``. Otherwise the first measurement uploads the graph and
        measures the host cost of one replay's launch (which, with the replay's expected time,
        sizes the delay kernel), unless the probe of ``open`` did; later ones skip both and
        reuse that cost (the delay has a 1.5x margin and a 20 µs floor over it).

        Raises:
            ConfigError: The session was closed.
        """
        if self._graph is None:
            raise ConfigError("GraphSession.measure() after close(); open a new session")
        probe_us, self._probe_us = self._probe_us, None
        if probe_us is not None and not fresh:
            replay_us = probe_us
        else:
            with torch.cuda.device(self._device):
                caller = torch.cuda.current_stream(self._device)
                self._stream.wait_stream(caller)
                try:
                    replay_us = self.timer._time_replays(
                        self._graph,
                        self.timer.replays,
                        self._stream,
                        self._device,
                        uploaded=self._uploaded,
                        launch_us=self._launch_us,
                        replay_us=self._replay_us,
                    )
                finally:
                    caller.wait_stream(self._stream)
            self._uploaded = True
            self._launch_us = self.timer.last_launch_us
        self._replay_us = min(replay_us)
        return Measurement.from_samples(
            corrected(self.timer, self._device, [us / self.calls for us in replay_us]),
            calls_per_sample=self.calls,
            timer=self.timer.name,
        )

    def close(self) -> None:
        """Resets the graph so its memory pool can be reused (idempotent)."""
        graph, self._graph = self._graph, None
        if graph is not None:
            release_graph(graph)

    def __enter__(self) -> GraphSession:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self.close()
