"""Decode attention runners agree with a float64 reference and tune through the real AutoTuner.

The Triton flash-decoding runner runs under Triton's CPU interpreter here (set before anything
imports Triton, as in test_ops_kernels.py); its tests skip where the interpreter is not in use.
Under the interpreter ``tl.dot`` is a numpy product, so float32 results are exact up to float32
rounding and the base-2 exponential; float16 adds the rounding of the probabilities before the
``p . v`` product and of the output (2^-11 relative each).
"""

from __future__ import annotations

import math
import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (graphtune imports them
# lazily). On a CUDA machine the GPU tests need compiled kernels in the same process, so the
# interpreter is only forced where there is no GPU; the Triton tests below then skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphtune.autotuner import AutoTuner, TuningPolicy, autotune  # noqa: E402
from graphtune.autotuner.config import next_power_of_two  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import _counters, _triton, attention  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not (_triton.triton_available() and _triton.device_supported(torch.device("cpu"))),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

# Relative (norm) error bounds of the Triton runner against float64, by dtype (see the module
# docstring): float32 is measured near 1e-7, float16 near 5e-4.
TRITON_TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _inputs(batch: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    kv_heads, groups, seq, dim = 2, 4, 24, 16
    q = torch.randn(batch, kv_heads, groups, dim, generator=gen, dtype=dtype)
    keys = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype)
    values = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    visible = torch.arange(seq)[None, :] < lengths[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    return [q, keys, values, mask]


def _reference(q, keys, values, mask):
    q, keys, values, mask = (t.double() for t in (q, keys, values, mask))
    scores = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    # A row without a visible key attends to nothing: 0, as torch's SDPA (>= 2.5) returns.
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) @ values


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def test_every_runner_and_tactic_matches_float64_reference():
    for seed in range(3):
        inputs = _inputs(batch=3, seed=seed)
        want = _reference(*inputs)
        for runner in attention.RUNNERS:
            for tactic in runner.get_valid_tactics(inputs, None):
                got = runner.forward(inputs, tactic).double()
                err = (got - want).norm() / want.norm()
                assert err < 1e-5, (type(runner).__name__, tactic, float(err))


def test_low_precision_tactic_is_offered_for_half_inputs_only():
    runner = attention.MatmulAttention()
    assert "low_precision" not in runner.get_valid_tactics(_inputs(2, 0), None)
    assert "low_precision" in runner.get_valid_tactics(_inputs(2, 0, torch.bfloat16), None)
    inputs = _inputs(2, 1, torch.bfloat16)
    got = runner.forward(inputs, "low_precision").double()
    want = _reference(*inputs)
    assert (got - want).norm() / want.norm() < 2e-2


# --- Triton flash-decoding runner ----------------------------------------------------------------


def _decode_inputs(
    gen: torch.Generator,
    batch: int,
    kv_heads: int,
    groups: int,
    seq: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    first_rows: int = 16,
) -> list[torch.Tensor]:
    """Random q/K/V and a decode mask (key j visible iff j <= position[b]).

    Row 0 sees only its first ``first_rows`` keys at most, so with several splits all its
    visible keys fall in the first split and the others see none. Keys are a strided view in
    the batch dim (every other row of a larger cache) and values a transposed ``[B, S, KV, D]``
    buffer, so the kernel's stride handling is exercised.
    """
    q = torch.randn(batch, kv_heads, groups, dim, generator=gen).to(dtype)
    keys = torch.randn(2 * batch, kv_heads, seq, dim, generator=gen).to(dtype)[::2]
    values = torch.randn(batch, seq, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    positions = torch.randint(0, seq, (batch,), generator=gen)
    positions[0] = int(torch.randint(0, min(seq, first_rows), (1,), generator=gen))
    visible = torch.arange(seq)[None, :] <= positions[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    return [q, keys, values, mask]


def _gen() -> torch.Generator:
    # Fresh inputs per run; the seed is in every assertion message.
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


# Tactics outside tactics_for's pruning: many splits over few keys (most splits see no key).
EXTRA_TACTICS = [{"block_n": 16, "splits": 8, "warps": 4, "stages": 2}]


@needs_interpreter
@pytest.mark.parametrize(
    "batch,groups,seq,dim",
    [
        (1, 4, 40, 16),
        (3, 1, 96, 32),
        (2, 4, 260, 16),  # splits up to a split per tile: 128-key tiles give 4, 1 of them empty
    ],
)
def test_triton_every_tactic_matches_float64(batch, groups, seq, dim):
    gen = _gen()
    runner = attention.TritonDecodeAttention()
    inputs = _decode_inputs(gen, batch, 2, groups, seq, dim)
    tactics = runner.get_valid_tactics(inputs, None)
    assert 1 <= len(tactics) <= 15
    if seq >= 256:
        assert {t["splits"] for t in tactics} >= {1, 2, 4}
    want = _reference(*inputs)
    for tactic in [*tactics, *EXTRA_TACTICS]:
        got = runner.forward(inputs, tactic)
        assert got.shape == inputs[0].shape and got.dtype == torch.float32
        assert _rel(got, want) < TRITON_TOL[torch.float32], (tactic, gen.initial_seed())


@needs_interpreter
def test_triton_scan_in_several_loads_finds_keys_past_the_first():
    # 1100 keys: the kernel scans the mask row for the visible span in several loads
    # (SCAN_BLOCK is at most 512), and row 1 sees keys only past the first 1024.
    gen = _gen()
    runner = attention.TritonDecodeAttention()
    inputs = _decode_inputs(gen, 2, 1, 2, 1100, 16)
    mask = inputs[3]
    mask[1] = float("-inf")
    mask[1, ..., 1030:1080] = 0.0
    want = _reference(*inputs)
    for splits in (1, 4):
        tactic = {"block_n": 32, "splits": splits, "warps": 2, "stages": 2}
        got = runner.forward(inputs, tactic)
        assert _rel(got, want) < TRITON_TOL[torch.float32], (tactic, gen.initial_seed())


@needs_interpreter
def test_triton_float16_and_a_general_additive_mask():
    gen = _gen()
    runner = attention.TritonDecodeAttention()
    inputs = _decode_inputs(gen, 2, 2, 4, 80, 16, dtype=torch.float16)
    tactics = [{"block_n": 64, "splits": 1, "warps": 4, "stages": 2}, EXTRA_TACTICS[0]]
    want = _reference(*inputs)
    for tactic in tactics:
        got = runner.forward(inputs, tactic)
        assert got.dtype == torch.float16
        assert _rel(got, want) < TRITON_TOL[torch.float16], (tactic, gen.initial_seed())
    # Finite biases are added, not only -inf hidden: an ALiBi-like mask, -inf past the position.
    q, keys, values, mask = _decode_inputs(gen, 2, 2, 4, 80, 16)
    mask = mask + torch.randn(mask.shape, generator=gen)
    want = _reference(q, keys, values, mask)
    for tactic in tactics:
        got = runner.forward([q, keys, values, mask], tactic)
        assert _rel(got, want) < TRITON_TOL[torch.float32], (tactic, gen.initial_seed())


@needs_interpreter
def test_triton_fully_masked_row_gives_zeros_like_sdpa():
    gen = _gen()
    runner = attention.TritonDecodeAttention()
    q, keys, values, mask = _decode_inputs(gen, 2, 2, 4, 40, 16)
    mask = mask.clone()
    mask[1] = float("-inf")  # no visible key in row 1 (e.g. a padded row)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    for tactic in ({"block_n": 64, "splits": 1, "warps": 4, "stages": 2}, EXTRA_TACTICS[0]):
        got = runner.forward([q, keys, values, mask], tactic)
        assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros_like(got[1]))
        assert _rel(got[0], _reference(q, keys, values, mask)[0]) < 1e-5, tactic
        if torch.isfinite(sdpa[1]).all():  # torch >= 2.5 returns 0 too; older gives NaN
            assert torch.equal(got[1], sdpa[1])


@pytest.mark.parametrize(
    "batch,kv_heads,seq,sms",
    [
        (1, 8, 528, 132),
        (8, 8, 528, 132),
        (64, 8, 528, 132),
        (128, 8, 528, 132),
        (1, 2, 40, 132),
        (3, 2, 24, 132),
        (1, 1, 4096, 132),
        (2, 8, 2048, 4),
        (1, 8, 1, 132),
        (132, 1, 4096, 132),  # the one-warp tile beside the four base configs: 15 tactics
    ],
)
def test_decode_tactics_obey_the_pruning_rules(batch, kv_heads, seq, sms):
    tactics = attention.decode_attention_tactics(batch, kv_heads, seq, sm_count=sms)
    assert 1 <= len(tactics) <= 15
    assert len({tuple(sorted(t.items())) for t in tactics}) == len(tactics)
    for t in tactics:
        assert attention.check_decode_tactic(t) is None
        assert t["block_n"] <= max(16, next_power_of_two(seq))
        splits = t["splits"]
        assert splits & (splits - 1) == 0
        if splits > 1:  # about one tile per split at most, and a few programs per SM at most
            assert splits <= next_power_of_two(-(-seq // t["block_n"]))
            assert batch * kv_heads * splits <= attention.PROGRAMS_PER_SM * sms
    if batch * kv_heads * 4 <= sms and seq >= 4 * 128:
        assert max(t["splits"] for t in tactics) >= 4  # a small batch needs splits to fill SMs
    if batch * kv_heads >= attention.PROGRAMS_PER_SM * sms:
        assert {t["splits"] for t in tactics} == {1}
    one_warp = [t for t in tactics if t["warps"] == 1]
    # the one-warp tile only where one program per (request, KV head) fills the GPU
    assert bool(one_warp) == (batch * kv_heads >= sms), one_warp


def test_decode_tactics_fit_shared_memory():
    smem = 227 * 1024
    bf16 = attention.decode_attention_tactics(8, 8, 2048, 128, itemsize=2, smem_bytes=smem)
    fp32 = attention.decode_attention_tactics(8, 8, 2048, 128, itemsize=4, smem_bytes=smem)
    assert {t["block_n"] for t in bf16} == {32, 64, 128}
    for t in fp32:
        assert t["stages"] * 2 * t["block_n"] * 128 * 4 <= smem
    assert len(fp32) < len(bf16)
    tiny = attention.decode_attention_tactics(1, 8, 2048, 256, itemsize=4, smem_bytes=1024)
    assert [(t["block_n"], t["stages"]) for t in tiny] == [(32, 2)] * len(tiny)


def test_check_decode_tactic_names_the_rule():
    good = {"block_n": 64, "splits": 2, "warps": 4, "stages": 2}
    assert attention.check_decode_tactic(good) is None
    assert "keys" in attention.check_decode_tactic({"block_n": 64})
    assert "powers of two" in attention.check_decode_tactic({**good, "splits": 3})
    assert "block_n >= 16" in attention.check_decode_tactic({**good, "block_n": 8})
    assert "ints" in attention.check_decode_tactic({**good, "warps": True})


@needs_interpreter
def test_triton_runner_rejects_what_its_kernel_cannot_take():
    gen = _gen()
    runner = attention.TritonDecodeAttention(sm_count=4)
    assert runner.cache_key_extras() == ({"sm": 4},)
    assert attention.TritonDecodeAttention().cache_key_extras() == ()
    odd_dim = _decode_inputs(gen, 1, 2, 4, 40, 24)  # head_dim not a power of two
    bool_mask = _decode_inputs(gen, 1, 2, 4, 40, 16)
    bool_mask[3] = bool_mask[3] == 0
    tactic = {"block_n": 64, "splits": 1, "warps": 4, "stages": 2}
    for inputs in (odd_dim, bool_mask):
        assert runner.get_valid_tactics(inputs, None) == []
        # A pick served such inputs runs torch SDPA (TritonRunner.forward); the kernel's own
        # launch refuses them.
        torch.testing.assert_close(runner.forward(inputs, tactic), runner.forward(inputs, -1))
        with pytest.raises(InputError, match="tactic -1"):
            runner.launch(inputs, tactic)
        if inputs is odd_dim:  # the fallback still works on every shape
            torch.testing.assert_close(
                runner.forward(inputs, -1).double(), _reference(*inputs), rtol=0, atol=1e-5
            )
    with pytest.raises(ConfigError, match="get_valid_tactics"):
        runner.forward(_decode_inputs(gen, 1, 2, 4, 40, 16), {"block": 64})


class _TaggedTimer:
    """Fake timer: the time of a call comes from ``score(runner class name, tactic)``."""

    name = "fake"

    def __init__(self, score) -> None:
        self.score = score
        self.current: tuple[str, object] | None = None

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        fn(0)
        assert self.current is not None
        us = self.score(*self.current)
        return Measurement.from_samples([us], calls_per_sample=1, timer=self.name)


def _tag_runners(monkeypatch, timer: _TaggedTimer) -> None:
    for cls in (
        attention.MatmulAttention,
        attention.SdpaAttention,
        attention.TritonDecodeAttention,
    ):
        original = cls.forward

        def tagged(self, inputs, tactic=-1, _original=original, _name=cls.__name__):
            timer.current = (_name, tactic)
            return _original(self, inputs, tactic)

        monkeypatch.setattr(cls, "forward", tagged)


def test_tuner_picks_per_batch_bucket_and_lookups_follow_the_cache(monkeypatch):
    timer = _TaggedTimer(lambda name, tactic: 1.0 if name == "MatmulAttention" else 2.0)
    _tag_runners(monkeypatch, timer)
    # One round, nothing re-measured: the interpreted Triton tactics are slow to run.
    tuner = AutoTuner(
        timer=timer, show_progress=False, policy=TuningPolicy(rounds=1, remeasure_top=0)
    )
    config = attention.tuning_config(max_batch_size=8)
    with autotune(tuner=tuner):
        runner, _ = tuner.choose_one(
            attention.OP_NAME, attention.RUNNERS, config, _inputs(batch=5, seed=0)
        )
    assert isinstance(runner, attention.MatmulAttention)
    # Every bucket (1, 2, 4, 8) was tuned by the first miss; a later batch only looks up.
    hits = tuner.stats.hits
    out = attention.decode_attention(*_inputs(batch=2, seed=1), tuner=tuner, config=config)
    assert out.shape == (2, 2, 4, 16)
    assert tuner.stats.hits == hits + 1


@needs_interpreter
def test_tuner_can_pick_a_triton_split_tactic_and_lookups_run_it(monkeypatch):
    def score(name: str, tactic: object) -> float:
        if name == "TritonDecodeAttention" and isinstance(tactic, dict):
            return 1.0 / tactic["splits"]  # the most splits is "fastest"
        return 5.0

    timer = _TaggedTimer(score)
    _tag_runners(monkeypatch, timer)
    tuner = AutoTuner(
        timer=timer, show_progress=False, policy=TuningPolicy(rounds=1, remeasure_top=0)
    )
    config = attention.tuning_config(max_batch_size=1)
    gen = _gen()
    inputs = _decode_inputs(gen, 1, 2, 4, 160, 16)  # several split counts are valid
    most = max(t["splits"] for t in attention.TritonDecodeAttention().tactics_for(inputs))
    with autotune(tuner=tuner):
        runner, tactic = tuner.choose_one(attention.OP_NAME, attention.RUNNERS, config, inputs)
    assert isinstance(runner, attention.TritonDecodeAttention)
    assert most > 1 and tactic["splits"] == most and not tuner.stats.tactic_failures
    assert runner.compiled >= 1  # the tuner's prepare compiled the tactics ahead of timing
    out = attention.decode_attention(*inputs, tuner=tuner, config=config)
    assert timer.current == ("TritonDecodeAttention", tactic)
    assert _rel(out, _reference(*inputs)) < TRITON_TOL[torch.float32], gen.initial_seed()
    assert math.isfinite(float(out.abs().sum()))


@needs_interpreter
@pytest.mark.parametrize("batch,groups,seq", [(1, 4, 260), (3, 2, 160)])
def test_one_kernel_split_merge_matches_float64_and_the_two_kernel_path(batch, groups, seq):
    """The last split program merges: same result as the merge kernel, counters back to 0."""
    gen = _gen()
    one = attention.TritonDecodeAttentionOneKernel()
    two = attention.TritonDecodeAttention()
    inputs = _decode_inputs(gen, batch, 2, groups, seq, 16)
    tactics = one.get_valid_tactics(inputs, None)
    assert tactics and all(t["splits"] > 1 for t in tactics)
    want = _reference(*inputs)
    counters = attention.arrival_counters(inputs[0].device, batch * 2)
    for tactic in [*tactics, *EXTRA_TACTICS]:
        got = one.forward(inputs, tactic)
        assert _rel(got, want) < TRITON_TOL[torch.float32], (tactic, gen.initial_seed())
        assert _rel(got, two.forward(inputs, tactic).double()) < 1e-6, tactic
        assert torch.equal(one.forward(inputs, tactic), got)  # deterministic, counters reset
        assert int(counters.abs().sum()) == 0


@needs_interpreter
def test_one_kernel_merge_of_a_fully_masked_row_gives_zeros():
    gen = _gen()
    q, keys, values, mask = _decode_inputs(gen, 2, 2, 4, 40, 16)
    mask = mask.clone()
    mask[1] = float("-inf")
    got = attention.TritonDecodeAttentionOneKernel().forward(
        [q, keys, values, mask], EXTRA_TACTICS[0]
    )
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros_like(got[1]))


def test_one_kernel_runner_is_not_a_default_runner_and_refuses_too_many_rows():
    assert not any(
        isinstance(r, attention.TritonDecodeAttentionOneKernel) for r in attention.RUNNERS
    )
    with pytest.raises(InputError, match="arrival counters"):
        attention.arrival_counters(torch.device("cpu"), _counters.COUNTERS + 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_low_precision_is_offered_only_for_a_mask_of_qs_dtype(dtype):
    q, keys, values = (torch.randn(1, 2, 4, 16, dtype=dtype) for _ in range(3))
    mask = torch.zeros(1, 1, 1, 4)
    runner = attention.MatmulAttention()
    assert runner.get_valid_tactics([q, keys, values, mask], None) == [-1]
    same = [q, keys, values, mask.to(dtype)]
    assert "low_precision" in runner.get_valid_tactics(same, None)
    got = runner.forward(same, tactic="low_precision")
    assert got.dtype == dtype and torch.isfinite(got).all()
