"""Keyed sampling noise: the uniform stays in the open interval (0, 1), the noise equals a plain
splitmix64 reference bit for bit, and ``sample`` refuses keys that do not fit its logits."""

from __future__ import annotations

import math

import pytest
import torch

from graphtune.engine import SamplingParams, sample
from graphtune.engine.sampling import keyed_exponential, request_keys
from graphtune.errors import InputError

M = 1 << 64
ADD, MUL1, MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    """splitmix64 on Python ints modulo 2**64 (the reference)."""
    z = (x + ADD) % M
    z = ((z ^ (z >> 30)) * MUL1) % M
    z = ((z ^ (z >> 27)) * MUL2) % M
    return z ^ (z >> 31)


def _unxorshift(y: int, bits: int) -> int:
    x = y
    for _ in range(64 // bits + 1):
        x = y ^ (x >> bits)
    return x


def hashing_to(target: int, vocab: int) -> tuple[int, int]:
    """The int64 key and the column whose noise hashes ``target``: splitmix64 is a bijection,
    and a (key, column) pair hashes ``key * vocab + column``."""
    z = _unxorshift(target % M, 31)
    z = _unxorshift(z * pow(MUL2, -1, M) % M, 27)
    z = _unxorshift(z * pow(MUL1, -1, M) % M, 30)
    key, column = divmod((z - ADD) % M, vocab)
    return (key - M if key >= 1 << 63 else key), column


def reference_noise(key: int, column: int, vocab: int) -> float:
    k = splitmix64((key * vocab + column) % M) >> 12
    uniform = (k + 0.5) * 2.0**-52
    return torch.tensor(-math.log(uniform), dtype=torch.float64).float().item()


def test_the_uniform_is_strictly_inside_zero_one_at_the_extreme_hashes():
    # All bits set (-1), none, only the sign bit, all but the sign bit. 53 bits of an all-ones
    # hash used to round to a uniform of exactly 1.0: noise -log(1) = 0, clamped to 1e-20.
    from graphtune.engine.sampling import _uniform_open_

    z = torch.tensor([-1, 0, -(2**63), 2**63 - 1], dtype=torch.long)
    uniform = _uniform_open_(z.clone())
    assert uniform.dtype == torch.float64
    assert bool(((uniform > 0) & (uniform < 1)).all())
    assert uniform.tolist() == [1 - 2.0**-53, 2.0**-53, 0.5 + 2.0**-53, 0.5 - 2.0**-53]
    noise = (-uniform.log()).float()
    assert bool((torch.isfinite(noise) & (noise > 1e-20)).all())


def test_a_hash_with_every_bit_set_gets_nonzero_noise():
    key, column = hashing_to(-1, 1)
    assert column == 0 and splitmix64(key % M) == M - 1
    noise = keyed_exponential(torch.tensor([key]), 1)
    assert noise.item() == pytest.approx(2.0**-53, rel=1e-6, abs=0)  # -log(1 - 2**-53), not 1e-20


def test_a_hash_with_every_bit_set_does_not_pick_a_token_of_probability_e_minus_40():
    # That token's noise used to be 1e-20 (a uniform of exactly 1), so it won: p / noise = 400
    # against about 1 for the other token.
    key, column = hashing_to(-1, 2)
    logits = torch.zeros(1, 2)
    logits[0, column] = -40.0
    picked = sample(logits, SamplingParams(temperature=1.0), keys=torch.tensor([key]))
    assert picked.tolist() == [1 - column]


@pytest.mark.parametrize("vocab", [7, 151936])
def test_keyed_exponential_matches_a_plain_splitmix64_reference(vocab):
    all_ones_key, all_ones_column = hashing_to(-1, vocab)
    keys = [0, 1, 12345, 2**62 + 7, 2**63 - 1, -1, -(2**63), -(2**40) + 3, all_ones_key]
    keys += request_keys(5, [(0, 0), (3, 17)]).tolist()
    columns = [0, 1, vocab // 2, vocab - 1, all_ones_column]
    noise = keyed_exponential(torch.tensor(keys), vocab)
    got = [[noise[row, c].item() for c in columns] for row in range(len(keys))]
    want = [[reference_noise(key, c, vocab) for c in columns] for key in keys]
    assert got == want


def test_request_keys_match_the_reference():
    seeded = splitmix64(9)
    want = [splitmix64(splitmix64(seeded ^ i) ^ t) for i, t in ((0, 0), (4, 2), (7, 100))]
    got = [k % M for k in request_keys(9, [(0, 0), (4, 2), (7, 100)]).tolist()]
    assert got == want


LOGITS = torch.randn(4, 16)


@pytest.mark.parametrize(
    "keys",
    [
        torch.tensor([3]),  # one key for four rows: it broadcast, the same noise in every row
        torch.tensor([1, 2, 3, 4], dtype=torch.int32),  # hashed unlike the same int64 values
        torch.tensor([1, 2]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
        torch.tensor(3),
        torch.tensor([[1], [2], [3], [4]]),
        [1, 2, 3, 4],
    ],
    ids=["one-key", "int32", "two-keys", "float", "0-d", "2-d", "list"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sample_refuses_keys_that_do_not_fit_its_logits(keys, temperature):
    params = SamplingParams(temperature=temperature, seed=1)
    with pytest.raises(InputError, match=r"keys must be a 1-D int64 tensor.*request_keys"):
        sample(LOGITS, params, keys=keys)


def test_sample_takes_one_int64_key_per_row():
    keys = request_keys(1, [(i, 0) for i in range(4)])
    picked = sample(LOGITS, SamplingParams(temperature=1.0), keys=keys)
    assert picked.shape == (4,) and picked.dtype == torch.long
    assert torch.equal(picked[1:2], sample(LOGITS[1:2], SamplingParams(1.0), keys=keys[1:2]))


@pytest.mark.parametrize("keyed", [False, True])
def test_top_k_1_at_a_positive_temperature_samples_among_tokens_tied_at_the_top(keyed):
    # transformers' top-k keeps every token tied with the k-th score; argmax took the first.
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]]).expand(4000, 4)
    params = SamplingParams(temperature=0.7, top_k=1, seed=5)
    assert not params.greedy
    if keyed:
        picked = sample(logits, params, keys=request_keys(5, [(i, 0) for i in range(4000)]))
    else:
        picked = sample(logits, params, torch.Generator().manual_seed(5))
    counts = torch.bincount(picked, minlength=4).tolist()
    assert counts[0] == counts[3] == 0 and 1800 < counts[1] < 2200
