"""The reference decode engine: prefill, a captured decode step, sampling, a request loop.

The engine picks its step runner once, at construction: a ``CUDAGraphRunner`` wrapping the decode
step (padded rows write the KV cache's scratch slot) or an ``EagerRunner``, and one for prefill
(each admission round's prompts packed into calls of :mod:`graphtune.engine.prefill`). A runner
only ever sees the step callable; it never learns that an engine exists.

Live requests are kept compacted: request ``i`` of the live batch owns KV slot ``i``. When a
request in the middle finishes, the last one moves into its slot (a copy of its cached prefix), so
the decode step can read slots ``[0, B)`` as a view instead of gathering them every step.

With ``tune=True`` the engine builds the step with a tuner and tunes it by running it at every
batch bucket (:func:`graphtune.engine.tuning.tune_step`, inside ``autotune(tuning_cache, tuner)``:
the cache file is loaded, extended and saved), then captures: every graph bakes in the tuned
tactics, and since tuning mode is off again while capturing, the tuner only looks up there.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from os import PathLike
from typing import Any

import torch

from graphtune.autotuner import AutoTuner, DistributedTuning, autotune
from graphtune.autotuner.distributed import align_cache
from graphtune.engine.arguments import checked_engine_arguments
from graphtune.engine.build import (
    build_prefill_runner,
    build_prefill_step,
    build_runner,
    build_step,
)
from graphtune.engine.events import TokenHook, check_hook, notify
from graphtune.engine.group_abort import AGREED_ERRORS, GroupAbort
from graphtune.engine.kv_cache import KVCache, aligned_seq_len
from graphtune.engine.memory_plan import MemoryPlan, plan_memory
from graphtune.engine.memory_report import MemoryReport
from graphtune.engine.model import DecoderModel
from graphtune.engine.prefill import (
    DEFAULT_MAX_PREFILL_TOKENS,
    check_max_tokens,
    default_prefill_runner,
    prefill_logits,
)
from graphtune.engine.requests import (
    LiveRequest,
    RequestFailure,
    agreed_requests,
    check_rows,
    check_slots_free,
    check_step_inputs,
    noise_keys,
    parse_requests,
    prompt_ids,
    retire,
)
from graphtune.engine.sampling import GREEDY, NON_FINITE, SamplingParams, sample
from graphtune.engine.tuning import TuneReport, describe_tuning, tune_step
from graphtune.errors import ConfigError, NumericalError

logger = logging.getLogger(__name__)


class Engine:
    """Serves greedy or sampled generation for a :class:`DecoderModel`.

    Args:
        model: The weights (moved to ``device``/``dtype`` in place when they differ).
        runner: ``"graph"`` (CUDA graphs; falls back to eager, with a recorded reason, without
            CUDA) or ``"eager"``.
        capture_sizes: Batch sizes to capture; ``None`` uses the graph runner's default list.
        max_batch_size: Most requests decoded together (KV slots; larger prompt lists queue).
        max_seq_len: Most positions per request, ``len(prompt) + max_new_tokens - 1`` (the
            last new token is never cached); longer requests are refused. The KV cache's
            length (``self.max_seq_len``) is this rounded up to a multiple of 16.
        device: Target device; ``None`` keeps the model's.
        dtype: Weight and cache dtype; ``None`` keeps the model's.
        lazy_capture: Capture each batch size on first use instead of at construction.
        strict_numerics: Raise :class:`NumericalError` when a request's logits are not finite.
            By default that request stops, is listed in :attr:`failures` and logged, and the
            other requests go on.
        tune: Tune the decode step's ops (GEMMs, RMSNorm, RoPE + KV write, SiLU-and-mul,
            decode attention) by running the step at batch sizes ``1, 2, 4, ...,
            max_batch_size`` before capturing, and run the step with the picks. Entries already in
            the tuner's cache (or in ``tuning_cache``) are not tuned again.
        tuning_cache: Tuning cache file: loaded when present and, with ``tune=True``, saved
            after tuning. Without ``tune`` the step only looks picks up in it (a file written by
            ``graphtune tune`` for the same model, dtype, ``--max-batch`` and
            ``--max-seq-len``).
        tuner: The :class:`~graphtune.autotuner.AutoTuner` to use; a new one by default. Given
            without ``tune``, the step runs that tuner's cached picks (look-ups only).
            With neither ``tune``, ``tuning_cache`` nor ``tuner`` the step is the untuned torch
            step.
        prefill_runner: ``"graph"`` (an admission round's prompts packed into calls captured per
            token-count bucket, each layer's attention a graph break) or ``"eager"``; ``None``:
            as ``runner``, but eager for an MoE model (``prefill.default_prefill_runner``).
        max_prefill_tokens: Most tokens of one prefill call (its largest graph; longer prompts
            run eagerly). Default ``min(2048, max_batch_size * max_seq_len)``.
        gpu_memory_utilization: Share (0 to 1] of the device's memory the engine may use, what
            is in use already included: the KV cache gets as many ``max_seq_len`` slots as fit
            after the profiled steps, activations and graphs, up to ``max_batch_size``
            (:attr:`memory_plan`, :mod:`graphtune.engine.memory_plan`). ``None``: unchecked.
        memory_report: Where the plan reads memory (default ``CudaMemoryReport(device)``).
        graph_backend: The runners' graph backend (default CUDA; tests: the simulated one).

    Tensor parallelism: pass a sharded model (``load_model(..., parallel=ParallelContext(...))``)
    and run the same ``Engine`` calls with the same arguments on every rank of the group. The
    batch is replicated across ranks (every rank holds every request; only weights and KV heads
    are split), so every rank pads to the same graph size and reaches every all-reduce; the
    engine builds :class:`~graphtune.engine.parallel.TensorParallelDecodeStep` for such a model.
    With ``tune=True`` a shard tunes its own (sharded) op shapes with the ``agree`` strategy
    over the model's group (every rank times every candidate, the slowest rank's time counts),
    so all ranks run the same kernels; a given ``tuner`` must have a collective strategy (also
    cache-only). The construction and every ``generate`` check that the ranks passed the same
    arguments and weights; a rank whose own arguments fail raises its error and the others a
    ``DistributedError`` naming it, rather than waiting for it. A construction, ``generate`` or
    ``step`` that fails on one rank later (after the ranks may have met) aborts the group, so the
    others fail at once, and the engine refuses every later call: rebuild the group and engine.

    Raises:
        ConfigError: Unknown runner, sizes out of range, a tuner on a shard that is not
            rank-consistent, a shard without an initialised process group, or a
            memory budget in which not one KV slot fits.
        DistributedError: Tensor-parallel ranks passed different arguments or weights, or
            another rank's arguments failed (named).
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        runner: str = "graph",
        capture_sizes: Sequence[int] | None = None,
        max_batch_size: int = 8,
        max_seq_len: int = 2048,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        lazy_capture: bool = False,
        strict_numerics: bool = False,
        tune: bool = False,
        tuning_cache: str | PathLike[str] | None = None,
        tuner: Any = None,
        prefill_runner: str | None = None,
        max_prefill_tokens: int | None = None,
        gpu_memory_utilization: float | None = None,
        memory_report: MemoryReport | None = None,
        graph_backend: Any = None,
    ) -> None:
        prefill_runner = prefill_runner or default_prefill_runner(model, runner)
        target_dtype = dtype or model.dtype
        target_device = checked_engine_arguments(
            model,
            runners=(runner, prefill_runner),
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            device=device,
            tuner=tuner,
            gpu_memory_utilization=gpu_memory_utilization,
            tuning_cache=tuning_cache,
            agreed={
                "model": model.config,
                "dtype": target_dtype,
                "max_batch_size": max_batch_size,
                "max_seq_len": max_seq_len,
                "runners": (runner, prefill_runner, max_prefill_tokens),
                "capture": (capture_sizes, lazy_capture),
                "tune": (tune, tuning_cache is not None),
                "strict_numerics": strict_numerics,
            },
        )
        if model.device != target_device or model.dtype != target_dtype:
            model.to(target_device, target_dtype)
        self.model = model
        self._group = GroupAbort(model.parallel)
        self.config = model.config
        self.device = target_device
        self.max_seq_len = aligned_seq_len(max_seq_len)
        self._request_limit = max_seq_len  # requests keep to the caller's number, not the cache's
        if max_prefill_tokens is None:
            max_prefill_tokens = min(DEFAULT_MAX_PREFILL_TOKENS, max_batch_size * self.max_seq_len)
        check_max_tokens(max_prefill_tokens)
        # From here on the ranks of a tensor-parallel group meet (memory plan, tuning, capture):
        # one that fails alone aborts the group, so the others do not wait in a collective.
        with self._group.guard("Engine(...)"):
            self.memory_plan: MemoryPlan | None = None
            if gpu_memory_utilization is not None:
                self.memory_plan, memory_report = plan_memory(
                    model,
                    gpu_memory_utilization,
                    memory_report,
                    max_batch_size=max_batch_size,
                    seq_len=self.max_seq_len,
                    runners=(runner, prefill_runner),
                    max_prefill_tokens=max_prefill_tokens,
                    capture_sizes=capture_sizes,
                    backend=graph_backend,
                )
                max_batch_size = self.memory_plan.slots
                if capture_sizes is not None:  # a size above the slots becomes the slots
                    capture_sizes = sorted({min(s, max_batch_size) for s in capture_sizes}) or None
            self.max_batch_size = max_batch_size
            self.cache = KVCache(
                self.config, max_batch_size, self.max_seq_len, target_device, target_dtype
            )
            self.tuner: Any = None
            self.tune_report: TuneReport | None = None
            if tune or tuning_cache is not None or tuner is not None:
                self.tuner = self._prepare_tuner(tune, tuning_cache, tuner)
            self.step_fn = build_step(model, self.cache, tuner=self.tuner)
            if tune:
                with autotune(tuning_cache, self.tuner, tune=True):
                    self.tune_report = tune_step(self.step_fn)
                logger.info("%s", self.tune_report.summary())
            self.runner_kind = runner
            self.strict_numerics = strict_numerics
            self.failures: list[RequestFailure] = []
            self.runner = build_runner(
                self.step_fn,
                runner,
                capture_sizes=capture_sizes,
                lazy=lazy_capture,
                device=self.device,
                backend=graph_backend,
            )
            self.prefill_step = build_prefill_step(self.step_fn, max_prefill_tokens)
            self.prefill_runner = build_prefill_runner(
                self.prefill_step,
                prefill_runner,
                lazy=lazy_capture,
                device=self.device,
                backend=graph_backend,
            )
            # What a non-lazy engine captures up front, and again on the first call after release().
            self._upfront_captures = [
                (r, step, size)
                for kind, r, step, size in (
                    (runner, self.runner, self.step_fn, self.max_batch_size),
                    (prefill_runner, self.prefill_runner, self.prefill_step, max_prefill_tokens),
                )
                if kind == "graph" and not lazy_capture
            ]
            self._capture()
            if self.memory_plan is not None and memory_report is not None:
                self.memory_plan = self.memory_plan.measured(memory_report)

    def _prepare_tuner(
        self, tune: bool, cache_path: str | PathLike[str] | None, tuner: Any
    ) -> AutoTuner:
        parallel = self.model.parallel
        if tuner is None:
            # Tensor-parallel ranks must run identical kernels for the replicated ops (norms,
            # LM head), or their logits, and then their tokens, could drift apart.
            agree = DistributedTuning("agree", parallel.group) if parallel is not None else None
            tuner = AutoTuner(distributed=agree)
        if not tune and cache_path is not None:
            tuner.cache.load(cache_path)
        if not tune and (cache_path is not None or parallel is not None):
            # Every shard looks up the same picks, whether its cache came from a file or from
            # the given tuner's earlier runs (tune=True aligns inside autotune()).
            align_cache(tuner.cache, tuner.distributed)
        return tuner

    @property
    def tuning_stats(self) -> Any:
        """The tuner's :class:`~graphtune.autotuner.tuner.TunerStats` (``fallbacks`` per op
        counts look-ups of shapes that were never tuned), or ``None`` for an untuned engine."""
        return None if self.tuner is None else self.tuner.stats

    def tuning_report(self) -> str:
        """What tuning did and how the step's look-ups went, for people
        (:func:`~graphtune.engine.tuning.describe_tuning`)."""
        return describe_tuning(self.tuner, self.tune_report)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step inputs of ``batch`` rows that touch only the scratch slot (for capture)."""
        return self.step_fn.example_inputs(batch)

    @property
    def stats(self) -> Any:
        """The decode runner's statistics (replays, fallbacks by reason, padding, memory)."""
        return self.runner.stats

    @property
    def prefill_stats(self) -> Any:
        """The prefill runner's statistics (one call per prefill chunk; breaks per replay)."""
        return self.prefill_runner.stats

    def release(self) -> None:
        """Releases the runners' graphs and memory pools, giving their memory back (between
        bursts of serving, say). The engine stays usable: the next :meth:`generate` or
        :meth:`step` captures again what the construction captured (a lazy engine: each size on
        its first use, as before), so it does not run eagerly from then on."""
        self.runner.release()
        self.prefill_runner.release()
        self._released = True

    def _capture(self) -> None:
        # In the caller's mode: a KV cache made under inference mode can only be written there,
        # and generate and step (which recapture after release) run under it anyway.
        for runner, step, size in self._upfront_captures:
            runner.capture(*step.example_inputs(size))
        self._released = False

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Runs one decode step through the runner; returns logits ``[B, vocab]``.

        Rows must be compacted (row ``i`` owns slot ``i``), as :meth:`generate` keeps them
        (free the slots taken from :attr:`cache` before calling it). The result is a view the
        next step overwrites. Runs under ``torch.inference_mode()``, as :meth:`generate` does.
        On a tensor-parallel engine any error (a rank's own bad inputs included: nothing makes
        the ranks agree on them first) aborts the group.

        Raises:
            InputError: Inputs that are not three 1-D int64 tensors of one length on the
                engine's device, or more rows than ``max_batch_size``
                (:func:`~graphtune.engine.requests.check_step_inputs`).
            DistributedError: A tensor-parallel engine whose group an earlier failure aborted.
        """
        if not torch.is_inference_mode_enabled():  # as generate: a lazy capture's buffers fit
            with torch.inference_mode():
                return self.step(tokens, positions, slots)
        return self._group.call("Engine.step", self._step, tokens, positions, slots)

    def _step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        check_step_inputs(self, tokens, positions, slots)
        if self._released:
            self._capture()
        return self.runner(tokens, positions, slots)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt`` (text needs the checkpoint's tokenizer)."""
        return prompt_ids(prompt, self.model.tokenizer)

    def _requests(
        self, prompts: Any, max_new_tokens: Any, sampling: Any, stops: Any, hook: Any
    ) -> tuple[list[LiveRequest], set[int]]:
        """``generate``'s arguments checked, as requests and stop ids."""
        check_slots_free(self.cache)
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        check_hook(hook)
        return parse_requests(
            prompts,
            max_new_tokens,
            stops,
            encode=self.encode,
            config=self.config,
            max_seq_len=self._request_limit,
        )

    def decode(self, ids: Sequence[int]) -> str | None:
        """Text of ``ids`` when a tokenizer is attached, else ``None``."""
        tokenizer = self.model.tokenizer
        return None if tokenizer is None else tokenizer.decode(list(ids))

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int | Sequence[int],
        sampling: SamplingParams | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        on_tokens: TokenHook | None = None,
    ) -> list[list[int]]:
        """Generates continuations; requests join and leave the live batch as they go.

        At most ``max_batch_size`` requests decode together; the rest wait and are admitted
        (prefilled) when a request finishes, so the batch size seen by the runner changes over
        time. A request finishes after its ``max_new_tokens`` or at a stop token (included in
        its output).

        Args:
            prompts: Token-id lists (or a 2-D tensor or NumPy array, a row per prompt), or
                strings when the model has a tokenizer.
            max_new_tokens: One limit for all, or one per prompt (a list, or a 1-D tensor or
                NumPy array).
            sampling: Greedy by default.
            stop_token_ids: Stop tokens (a list or set, or a 1-D tensor or NumPy array);
                ``None`` uses the config's EOS ids, ``[]`` never stops early.
            on_tokens: Called after every prefill round and decode step with a
                :class:`~graphtune.engine.events.TokenEvent` per request that took a token (or
                failed) in it, a finishing one carrying the request's output: to stream, show
                progress, or keep finished requests if the call is interrupted. An exception it
                raises ends the call (KV slots freed; a tensor-parallel group aborts).

        Returns:
            The generated token ids per prompt, in prompt order.

        Raises:
            ConfigError: ``sampling`` that is no ``SamplingParams``, or ``on_tokens`` not callable.
            InputError: An empty prompt, unknown token ids, a prompt that does not fit (the KV
                cache, or ``max_position_embeddings``: :meth:`ModelConfig.check_positions`), or a
                slot of :attr:`cache` held outside ``generate`` (it needs every slot free).
            NumericalError: Non-finite logits with ``strict_numerics``; otherwise such a request
                stops early and is listed in :attr:`failures` (reset by every call).
            DistributedError: A tensor-parallel engine whose group an earlier failure aborted.
        """
        sampling = sampling or GREEDY
        with self._group.guard("Engine.generate", agreed=AGREED_ERRORS):
            requests, stops = agreed_requests(
                self.model.parallel,
                lambda: self._requests(
                    prompts, max_new_tokens, sampling, stop_token_ids, on_tokens
                ),
                sampling,
            )
        # From here on a rank may be in a collective. strict_numerics raises on every rank at
        # once (the LM head is replicated, so are the logits): no rank waits, nothing to abort.
        with self._group.guard("Engine.generate", agreed=(NumericalError,)):
            self._serve(requests, stops, sampling, on_tokens)
        return [r.output for r in requests]

    def _serve(
        self, requests: list[LiveRequest], stops: set[int], sampling: Any, on_tokens: Any
    ) -> None:
        if self._released:  # after the arguments' checks: a refused call captures nothing
            self._capture()
        pending = deque(requests)
        live: list[LiveRequest] = []
        self.failures = []
        try:
            while pending or live:
                admitted = []
                while pending and len(live) + len(admitted) < self.max_batch_size:
                    admitted.append(pending.popleft())
                for request in admitted:  # in ``live`` as soon as it owns a slot, for the finally
                    request.slot = self.cache.allocate()
                    request.cached = len(request.prompt)
                    live.append(request)
                if admitted:
                    self._admit(admitted, sampling)
                else:
                    self._decode(live, sampling)
                notify(on_tokens, admitted or live, stops)  # before retire reorders ``live``
                retire(self.cache, live, stops)
        finally:
            # Only an exception (a failing kernel, an interrupt, strict_numerics) leaves requests
            # live here, and they must not strand KV slots: the next generate() would find the
            # cache full. Each slot is zeroed, not only a failed request's: strict mode raises at
            # the first bad row, so a later row's NaN K/V went unchecked, and the additive mask
            # does not hide NaN from the slot's next owner (see retire).
            for request in live:
                self.cache.clear(request.slot)
                self.cache.free(request.slot)

    def _admit(self, admitted: list[LiveRequest], sampling: SamplingParams) -> None:
        logits = prefill_logits(
            self.prefill_step,
            self.prefill_runner,
            [r.prompt for r in admitted],
            [r.slot for r in admitted],
        )
        check_rows(self.prefill_runner, "prefill", logits.shape[0], len(admitted))
        # One device-to-host read for all first tokens of this admission round.
        first = sample(logits, sampling, keys=noise_keys(admitted, sampling)).tolist()
        for request, token in zip(admitted, first, strict=True):
            self._accept(request, int(token))

    def _decode(self, live: list[LiveRequest], sampling: SamplingParams) -> None:
        host = torch.tensor(
            [[r.output[-1] for r in live], [r.cached for r in live], [r.slot for r in live]],
            dtype=torch.long,
        )
        keys = noise_keys(live, sampling)
        if keys is not None:  # one copy to the device for the step's inputs and its noise keys
            host = torch.cat([host, keys[None]])
        inputs = host.to(self.device, non_blocking=True)
        # The loop built these rows itself; Engine.step's checks are for its callers.
        logits = self.runner(inputs[0], inputs[1], inputs[2])
        check_rows(self.runner, "decode", logits.shape[0], len(live))
        # The one host sync per step: the loop must see tokens to stop at EOS.
        tokens = sample(logits, sampling, keys=None if keys is None else inputs[3]).tolist()
        for request, token in zip(live, tokens, strict=True):
            request.cached += 1
            self._accept(request, int(token))

    def _accept(self, request: LiveRequest, token: int) -> None:
        if token != NON_FINITE:
            request.output.append(token)
            return
        # Never sample from NaN/inf logits: stop this request, report it, keep serving the rest.
        request.failed = (
            f"logits were not finite (NaN or inf) after {len(request.output)} generated tokens; "
            "check the checkpoint's weights and dtype (float16 overflows where bfloat16 does not)"
        )
        failure = RequestFailure(request.index, len(request.output), request.failed)
        self.failures.append(failure)
        logger.warning("request %d stopped: %s", request.index, request.failed)
        if self.strict_numerics:
            raise NumericalError(f"request {request.index}: {request.failed}")
