"""What the engine keeps per request, and its checks of what a caller passes in: the arguments
of ``Engine.generate`` (:func:`parse_requests`), one request (:func:`validate_request`; that no
KV slot is held outside it:
:func:`check_slots_free`; on tensor-parallel ranks, that every rank passes the same ones:
:func:`check_same_requests`), the inputs of ``Engine.step`` (:func:`check_step_inputs`) and the
rows a runner returned (:func:`check_rows`); and when a request is done (:func:`finish_reason`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from graphtune import env
from graphtune.engine.config import ModelConfig, request_positions
from graphtune.engine.sampling import request_keys
from graphtune.errors import ConfigError, InputError

#: Why a request finished: a stop token (included in its output), its ``max_new_tokens``, or
#: logits that were not finite (listed in ``Engine.failures``; its output ends before them).
FinishReason = Literal["stop", "length", "failed"]


@dataclass
class LiveRequest:
    """A request of ``Engine.generate`` while it is admitted (its slot) and decoded."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    failed: str | None = None


@dataclass(frozen=True)
class RequestFailure:
    """A request that was stopped early instead of taking the whole batch down.

    Attributes:
        index: Position of the prompt in the ``generate`` call.
        generated: Tokens it had produced before the failure (its output).
        reason: What went wrong and what to check.
    """

    index: int
    generated: int
    reason: str


def _is_array(value: Any) -> bool:
    """Whether ``value`` is a tensor or NumPy array (told apart by its int ``ndim``, so that
    NumPy, which graphtune does not require, need not be imported)."""
    return isinstance(value, torch.Tensor) or isinstance(getattr(value, "ndim", None), int)


def prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    """Token ids of one prompt: text through ``tokenizer`` (``None``: none attached), or an
    ordered iterable of ids (a list, a 1-D tensor or NumPy array).

    Raises:
        InputError: Text without a tokenizer, or a prompt that is neither text nor ids in order.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError(
                "text prompts need a tokenizer (tokenizer.json in the checkpoint folder); "
                "pass token ids instead"
            )
        return list(tokenizer.encode(prompt).ids)
    unordered = isinstance(prompt, (Mapping, Set))  # a dict's keys, a set: no token order
    # Bytes iterate as ints: b"Hi" would be read as the token ids 72 and 105.
    raw = isinstance(prompt, (bytes, bytearray, memoryview))
    if not isinstance(prompt, Iterable) or unordered or raw or getattr(prompt, "ndim", 1) != 1:
        raise InputError(
            f"a prompt must be text or a list of token ids, got {type(prompt).__name__} "
            f"{prompt!r:.40}; for one prompt of ids pass [[1, 2, 3]], not [1, 2, 3] (a "
            "tensor of prompts is 2-D: one row per prompt)"
        )
    return [token_id(t, "prompt") for t in prompt]


def parse_requests(
    prompts: Any,
    max_new_tokens: Any,
    stop_token_ids: Any,
    *,
    encode: Callable[[Any], list[int]],
    config: ModelConfig,
    max_seq_len: int,
) -> tuple[list[LiveRequest], set[int]]:
    """``Engine.generate``'s prompts, limits and stop ids checked, as requests and stop ids.

    ``prompts`` is a list of prompts or a 2-D tensor or NumPy array (a row per prompt), each made
    ids by ``encode``; ``max_new_tokens`` one int (or a one-element tensor or array), or one per
    prompt as a list or a 1-D tensor or NumPy array; ``stop_token_ids`` ``None`` (the config's
    EOS ids) or a list of ints (a set or a 1-D tensor or NumPy array too).

    Raises:
        InputError: The first rule broken (:func:`validate_request` for each request).
    """
    if isinstance(prompts, str) or not (isinstance(prompts, Sequence) or _is_array(prompts)):
        raise InputError(
            f"prompts must be a list of prompts, got {type(prompts).__name__}; pass [prompt] "
            "for one"
        )
    if getattr(prompts, "ndim", 1) == 0:  # a 0-d tensor or array has no len() to take
        raise InputError(
            f"prompts must be a list of prompts or a 2-D tensor, got the 0-d {prompts!r:.40}; "
            "pass [[token, ...]] for one prompt of ids"
        )
    # A one-element tensor or array is one limit for all, as an int is (as before arrays were
    # taken per prompt).
    one_element = getattr(max_new_tokens, "ndim", 0) == 1 and len(max_new_tokens) == 1
    if one_element:
        max_new_tokens = max_new_tokens[0]
    per_prompt = isinstance(max_new_tokens, Sequence) or getattr(max_new_tokens, "ndim", 0) == 1
    if getattr(max_new_tokens, "ndim", 0) > 1:
        raise InputError(
            f"max_new_tokens must be one int or one per prompt (a list or a 1-D tensor), got "
            f"{type(max_new_tokens).__name__} of shape {tuple(max_new_tokens.shape)}"
        )
    limits = (
        [token_id(m, "max_new_tokens") for m in max_new_tokens]
        if per_prompt
        else [token_id(max_new_tokens, "max_new_tokens")] * len(prompts)
    )
    if len(limits) != len(prompts):
        raise InputError(f"{len(prompts)} prompts but {len(limits)} max_new_tokens values")
    requests = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        ids = encode(prompt)
        validate_request(config, max_seq_len, ids, limit, i)
        requests.append(LiveRequest(i, ids, limit))
    stops = set(config.eos_token_ids)
    if stop_token_ids is not None:
        # Order does not matter for stop ids: a set is as good as a list, and so is a 1-D
        # tensor or array (as prompts and limits may be).
        listed = isinstance(stop_token_ids, (Sequence, Set)) and not isinstance(
            stop_token_ids, (str, bytes, bytearray)
        )
        if not (listed or getattr(stop_token_ids, "ndim", None) == 1):
            raise InputError(
                f"stop_token_ids must be a list of ints (or a set, or a 1-D tensor or array), "
                f"got {type(stop_token_ids).__name__} {stop_token_ids!r:.40}; pass [id] for one"
            )
        stops = {token_id(t, "stop_token_ids") for t in stop_token_ids}
        outside = sorted(t for t in stops if not 0 <= t < config.vocab_size)
        if outside:
            raise InputError(
                f"stop_token_ids {outside[:5]} are outside [0, {config.vocab_size}) "
                "and could never stop a request; check they come from this model's tokenizer"
            )
    return requests, stops


def validate_request(
    config: ModelConfig, max_seq_len: int, prompt: list[int], max_new: int, where: int
) -> None:
    """Checks one request of ``Engine.generate`` before anything runs.

    Raises:
        InputError: An empty prompt, a token id outside the vocabulary, ``max_new < 1``, or more
            positions (:func:`~graphtune.engine.config.request_positions`) than the model or
            the KV cache holds.
    """
    if not prompt:
        raise InputError(f"prompt {where} is empty; give at least one token")
    vocab = config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InputError(
            f"prompt {where} has token ids outside [0, {vocab}): {bad[:5]}; check the "
            "tokenizer matches the model"
        )
    if max_new <= 0:
        raise InputError(f"max_new_tokens must be > 0, got {max_new} for prompt {where}")
    positions = request_positions(len(prompt), max_new)
    config.check_positions(
        positions, f"prompt {where} ({len(prompt)} tokens) with max_new_tokens={max_new}"
    )
    if positions > max_seq_len:
        raise InputError(
            f"prompt {where} has {len(prompt)} tokens and asks for {max_new} new ones, which "
            f"need {positions} positions (the last new token is not cached), more than the KV "
            f"cache holds per request (max_seq_len={max_seq_len}); shorten the prompt, ask for "
            "fewer tokens or build the Engine with a larger max_seq_len"
        )


def check_slots_free(cache: Any) -> None:
    """Checks that ``Engine.generate`` owns every KV slot: it keeps request ``i`` of its live
    batch in slot ``i`` (the decode step reads slots ``[0, B)`` as a view), so a slot held by
    someone else would shift its requests onto slots the step does not read.

    Raises:
        InputError: A slot of ``cache`` is allocated (by a caller of ``Engine.step``).
    """
    held = cache.max_batch_size - cache.num_free
    if held:
        raise InputError(
            f"{held} of the engine's {cache.max_batch_size} KV-cache slots are held outside "
            "generate(), which needs them all (its requests own slots 0, 1, ...); free them "
            "with engine.cache.free(slot) (or engine.cache.reset()) before calling generate()"
        )


def check_same_requests(
    parallel: Any, requests: list[LiveRequest], sampling: Any, stops: set[int]
) -> None:
    """Checks that every tensor-parallel rank generates for the same requests
    (:meth:`~graphtune.engine.parallel.ParallelContext.check_same_on_ranks`).

    Raises:
        DistributedError: The prompts, limits, sampling or stop ids differ between ranks.
    """
    parallel.check_same_on_ranks(
        "Engine.generate",
        {
            "prompts": [r.prompt for r in requests],
            "max_new_tokens": [r.max_new_tokens for r in requests],
            "sampling": sampling,
            "stop_token_ids": sorted(stops),
        },
    )


def agreed_requests(
    parallel: Any,
    parse: Callable[[], tuple[list[LiveRequest], set[int]]],
    sampling: Any,
) -> tuple[list[LiveRequest], set[int]]:
    """``parse()``'s requests and stop ids; on a tensor-parallel shard (``parallel``), the same
    on every rank (:func:`check_same_requests`). A rank whose arguments fail ``parse`` still
    joins that check, so the other ranks raise instead of waiting for it in the step.

    Raises:
        ConfigError, InputError: This rank's arguments break a rule (from ``parse``).
        DistributedError: Another rank's arguments failed, or the ranks' requests differ.
    """
    try:
        requests, stops = parse()
    except (ConfigError, InputError) as exc:
        if parallel is not None:
            parallel.check_same_on_ranks("Engine.generate", {}, failure=exc)
        raise
    if parallel is not None:
        check_same_requests(parallel, requests, sampling, stops)
    return requests, stops


def retire(cache: Any, live: list[LiveRequest], stops: set[int]) -> None:
    """Frees the slots of the requests in ``live`` that are done (failed, at their limit, or at a
    stop token) and keeps the others in slots ``[0, len(live))``, moving the last ones down.

    A failed request's slot is zeroed first: its K/V may hold NaN, and attention hides unused
    positions with an additive mask, which does not hide NaN (0 x NaN is NaN), so the slot's
    next owner would read it.
    """
    done = [i for i, r in enumerate(live) if finish_reason(r, stops) is not None]
    # Descending, so the request moved from the end is never one still to be retired.
    for row in reversed(done):
        if live[row].failed:
            cache.clear(row)
        last = len(live) - 1
        if row != last:
            mover = live[last]
            cache.move(mover.slot, row, mover.cached)
            mover.slot = row
            live[row] = mover
        live.pop()
        cache.free(last)


def finish_reason(request: LiveRequest, stops: set[int]) -> FinishReason | None:
    """Why ``request`` is done (failed, at a stop token, or at its ``max_new_tokens``), or
    ``None`` while it goes on. A stop token that is also its last allowed token is ``"stop"``."""
    if request.failed:
        return "failed"
    if request.output[-1] in stops:
        return "stop"
    if len(request.output) >= request.max_new_tokens:
        return "length"
    return None


def token_id(value: Any, what: str) -> int:
    # operator.index accepts ints and integer tensors/NumPy scalars but not floats (1.7 must not
    # silently become token 1); bools are ints to it, Python's and a bool tensor's alike (True
    # would become token 1), so they are refused explicitly.
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):
        raise InputError(f"{what} must be integers, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(
            f"{what} must be integers, got {value!r} ({type(value).__name__})"
        ) from None


def check_step_inputs(engine: Any, tokens: Any, positions: Any, slots: Any) -> None:
    """Checks the inputs of ``Engine.step`` from their metadata (no device read): three 1-D
    int64 tensors of one length on the engine's device, at most ``max_batch_size`` rows. With
    ``GRAPHTUNE_DEBUG=1`` also their values (one host read): token ids in the vocabulary,
    positions and slots within the KV cache.

    Raises:
        InputError: The first rule broken, named with its fix.
    """
    named = (("tokens", tokens), ("positions", positions), ("slots", slots))
    for name, value in named:
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.long:
            raise InputError(
                f"Engine.step: {name} must be a 1-D int64 tensor, got "
                f"{getattr(value, 'dtype', type(value).__name__)} "
                f"{tuple(getattr(value, 'shape', ()))}"
            )
        device, want = value.device, engine.device
        if device.type != want.type or want.index not in (None, device.index):
            raise InputError(
                f"Engine.step: {name} is on {value.device}, the engine on {engine.device}"
            )
    rows = tokens.shape[0]
    if positions.shape[0] != rows or slots.shape[0] != rows:
        raise InputError(
            f"Engine.step: tokens, positions and slots have {rows}, {positions.shape[0]} and "
            f"{slots.shape[0]} rows; give one of each per row"
        )
    if rows > engine.max_batch_size:
        raise InputError(
            f"decode batch of {rows} rows exceeds max_batch_size="
            f"{engine.max_batch_size}; build the Engine with a larger max_batch_size"
        )
    if env.debug_checks() and rows:
        for name, value, bound in (
            ("tokens", tokens, engine.config.vocab_size),
            ("positions", positions, engine.max_seq_len),
            ("slots", slots, engine.max_batch_size),
        ):
            low, high = int(value.min()), int(value.max())
            if low < 0 or high >= bound:
                raise InputError(f"Engine.step: {name} must be in [0, {bound}), got {low}..{high}")


def check_rows(runner: Any, what: str, rows: int, batch: int) -> None:
    """Refuses ``rows`` rows of logits for a ``batch`` of requests (a runner that returned
    padded rows, or lost some) before sampling: pairing their tokens with the requests would
    shift or drop tokens.

    Raises:
        RuntimeError: An internal error, naming the runner and the rows.
    """
    if rows != batch:
        raise RuntimeError(
            f"internal error: the {what} runner ({type(runner).__name__}) returned logits of "
            f"{rows} rows for a batch of {batch} requests; please report this as a bug"
        )


def noise_keys(rows: list[LiveRequest], sampling: Any) -> torch.Tensor | None:
    """Each row's sampling noise key: its request and the number of the token it samples, so a
    request samples alike whatever shares its batch (``None`` when greedy: no noise)."""
    if sampling.greedy:
        return None
    return request_keys(sampling.seed, [(r.index, len(r.output)) for r in rows])
