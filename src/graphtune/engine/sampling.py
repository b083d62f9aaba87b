"""Token sampling on the device without host synchronisation.

Greedy is an ``argmax``. Random sampling applies temperature, then top-k and top-p as masks with
static shapes, then draws with the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` picks
index ``i`` with probability ``p_i``), which needs neither ``torch.multinomial`` (it synchronises
on some versions) nor data-dependent shapes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphtune.errors import ConfigError, InputError, describe_tensor

#: Smallest positive temperature: logits are divided by it in float32, where anything smaller
#: is subnormal (flushed to 0 on some devices) or rounds to 0 outright, and 0 / 0 is NaN.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    """How to choose the next token.

    Raises:
        ConfigError: A value out of range, a positive temperature below
            :data:`MIN_TEMPERATURE`, or ``top_k`` / ``top_p`` set (other than ``0`` / ``1``) at
            temperature 0, where greedy decoding takes the argmax and would ignore them.

    Attributes:
        temperature: ``0`` means greedy; otherwise logits are divided by it, so a positive
            temperature must be at least :data:`MIN_TEMPERATURE` (float32's smallest normal
            number, about ``1.18e-38``).
        top_k: Keep only the ``top_k`` most likely tokens (``0`` keeps all); tokens tied with
            the ``top_k``-th score are all kept (as in transformers), so more may stay. Needs a
            temperature above 0.
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p`` (``1``: all).
            Needs a temperature above 0.
        seed: Seed of the sampling noise. In ``Engine.generate`` each request's noise at each
            of its tokens is a function of (seed, its index in the call, the token's number)
            alone (:func:`request_keys`): whatever it shares the batch with, its row or
            ``max_batch_size``, a request gets the same noise, and so the same tokens wherever
            its logits are the same (a GPU step padded to another batch size may run other
            kernels, whose logits can differ in their last bits).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # NumPy and other registered scalars (np.int64 seeds, np.float32 temperatures) and ints
        # given for the float fields are stored as Python numbers of the field's type, so the
        # params print, compare and serialise as plain values (an int too large for a float is
        # refused here, not when the logits are divided by it).
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
            value = getattr(self, name)
            abc = numbers.Integral if kind is int else numbers.Real
            if isinstance(value, abc) and not isinstance(value, bool) and type(value) is not kind:
                try:
                    object.__setattr__(self, name, kind(value))
                except (OverflowError, ValueError):
                    raise ConfigError(f"{name} must be a finite number, got {value!r}") from None
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}"
            )
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(sampling_conflict(self.temperature, self.top_k, self.top_p))
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        conflict = sampling_conflict(self.temperature, self.top_k, self.top_p)
        if conflict is not None:
            raise ConfigError(conflict)

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax: temperature 0. ``top_k=1`` at a positive
        temperature still samples, among the tokens tied with the largest logit, as
        transformers' top-k does."""
        return self.temperature == 0.0


def _field(name: str, value: object) -> str:
    return name if value is None else f"{name}={value!r}"


def sampling_conflict(
    temperature: float,
    top_k: int,
    top_p: float,
    spell: Callable[[str, object], str] = _field,
) -> str | None:
    """What is wrong with a combination of in-range sampling values, or ``None``: a positive
    temperature below :data:`MIN_TEMPERATURE`, or ``top_k`` / ``top_p`` other than their "off"
    values (``0`` / ``1.0``) at temperature 0, where greedy decoding takes the argmax and never
    reads them. ``spell(name, value)`` writes a setting as the caller's user types it
    (``top_k=5`` here, ``--top-k 5`` on the command line; ``value`` ``None``: the name alone)."""
    if 0.0 < temperature < MIN_TEMPERATURE:
        return (
            f"{spell('temperature', temperature)} is below {MIN_TEMPERATURE:.4g}, float32's "
            "smallest normal number, and would round to 0 when the float32 logits are divided "
            f"by it; use {spell('temperature', 0)} for greedy"
        )
    if temperature != 0.0:
        return None
    pairs = (("top_k", top_k, 0), ("top_p", top_p, 1.0))
    set_ = [(name, value, off) for name, value, off in pairs if value != off]
    if not set_:
        return None
    fields = " and ".join(spell(name, value) for name, value, _ in set_)
    offs = " and ".join(spell(name, off) for name, _, off in set_)
    one = len(set_) == 1
    warm = spell("temperature", None)
    return (
        f"{fields} {'needs' if one else 'need'} {warm} > 0: at {spell('temperature', 0)} (the "
        f"default) decoding is greedy (the argmax) and ignores {'it' if one else 'them'}; "
        f"pass a {warm} > 0, or leave {offs}"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


GREEDY = SamplingParams()


NON_FINITE = -1
"""Token returned for a row whose logits hold a NaN or an infinity (never a real token id)."""


# splitmix64's constants as the int64s with the same bits (its arithmetic wraps modulo 2**64,
# as int64 tensor arithmetic does).
_ADD, _MUL1, _MUL2 = (
    c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(x: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` shifts in the sign bit), into ``out``
    (an int64 tensor of ``x``'s shape, ``x`` itself included) when given."""
    shifted = torch.bitwise_right_shift(x, bits, out=out)
    return shifted.bitwise_and_((1 << (64 - bits)) - 1)


def _splitmix_(z: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """splitmix64 of every element of the int64 tensor ``z`` (on any device), in place; returns
    ``z``. ``scratch``, an int64 tensor of ``z``'s shape, holds the shifts (allocated if None),
    so a ``[B, vocab]`` hash needs no temporaries beyond it."""
    scratch = torch.empty_like(z) if scratch is None else scratch
    z.add_(_ADD)
    z.bitwise_xor_(_shr(z, 30, out=scratch)).mul_(_MUL1)
    z.bitwise_xor_(_shr(z, 27, out=scratch)).mul_(_MUL2)
    return z.bitwise_xor_(_shr(z, 31, out=scratch))


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of every element of the int64 tensor ``z``, as a new tensor."""
    return _splitmix_(z.clone())


def request_keys(seed: int, requests: list[tuple[int, int]]) -> torch.Tensor:
    """One noise key per row: ``(request index, token number)`` pairs mixed with ``seed``, as
    int64 ``[B]`` on the host (:func:`sample`'s ``keys``)."""
    pairs = torch.tensor(requests, dtype=torch.long).reshape(-1, 2)
    seeded = _splitmix(torch.tensor(seed, dtype=torch.long))
    return _splitmix(_splitmix(seeded ^ pairs[:, 0]) ^ pairs[:, 1])


def _uniform_open_(z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 uniforms in the open interval (0, 1) from the top 52 bits ``k`` of the int64
    hashes ``z``: ``(k + 0.5) * 2**-52``, exact, from ``2**-53`` to ``1 - 2**-53`` (53 bits
    could round to exactly 1, whose noise ``-log(1) = 0`` would win the race). Overwrites ``z``
    with ``k``; writes into ``out`` (float64, ``z``'s shape, not ``z``'s memory) when given."""
    k = _shr(z, 12, out=z)
    uniform = k.double() if out is None else out.copy_(k)
    return uniform.add_(0.5).mul_(2.0**-52)


def keyed_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential(1) noise ``[B, vocab]`` (float32, > 0) where row ``b`` depends on the int64
    ``keys[b]`` alone: splitmix64 of (key, column) on the keys' device; its top 52 bits make a
    uniform in (0, 1) (:func:`_uniform_open_`), so the noise lies in about [1.1e-16, 36.7].

    Peak memory is two int64 ``[B, vocab]`` buffers: the hash runs in place, and its scratch
    buffer then holds the float64 uniforms."""
    columns = torch.arange(vocab, device=keys.device, dtype=torch.long)
    z = torch.add(keys[:, None] * vocab, columns)
    scratch = torch.empty_like(z)
    uniform = _uniform_open_(_splitmix_(z, scratch), out=scratch.view(torch.float64))
    del z, scratch
    return uniform.log_().neg_().float()


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chooses one token per row of ``logits [B, vocab]``; returns int64 ``[B]`` on the device.

    A row with any NaN or infinite logit gets :data:`NON_FINITE` instead of a token: ``argmax``
    would otherwise return the NaN's index as if it were a choice. The check stays on the device,
    so the caller's one host read per step reveals it at no extra synchronisation.

    Args:
        logits: Scores of the next token.
        params: Temperature, top-k, top-p.
        generator: Source of randomness on the logits' device (ignored when greedy, and when
            ``keys`` are given).
        keys: One int64 noise key per row (:func:`request_keys`): each row's noise then
            depends on its key alone, not on the other rows or earlier draws.

    Raises:
        InputError: ``keys`` is not a 1-D int64 tensor with one key per row of ``logits`` (a
            check of its metadata only: no host synchronisation).
    """
    if keys is not None:
        _check_keys(keys, logits)
    finite = torch.isfinite(logits).all(dim=-1)
    return torch.where(finite, _choose(logits, params, generator, keys), NON_FINITE)


def _check_keys(keys: object, logits: torch.Tensor) -> None:
    # A single key would broadcast (the same noise in every row), and int32 keys would hash
    # differently from the same values as int64.
    if (
        not isinstance(keys, torch.Tensor)
        or keys.dim() != 1
        or keys.dtype != torch.long
        or keys.shape[0] != logits.shape[0]
    ):
        raise InputError(
            f"sample: keys must be a 1-D int64 tensor with one key per row of logits "
            f"({logits.shape[0]}), got {describe_tensor(keys)}; make them with "
            "request_keys(seed, pairs), one (request index, token number) pair per row."
        )


def _choose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    keys: torch.Tensor | None,
) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(dim=-1)
    # Each row's largest logit is brought to 0 first, so that a small temperature turns the
    # others into -inf instead of overflowing them all to +inf (a NaN softmax, token 0).
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token
        # always survives.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    if keys is not None:
        noise = keyed_exponential(keys.to(probs.device), vocab)
    else:
        # Clamp: an exact 0 draw would turn a masked (0-probability) token into 0/0 = NaN.
        noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)
    return (probs / noise).argmax(dim=-1)
