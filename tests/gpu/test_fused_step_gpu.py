"""The fused, tuned decode step at the Llama-3.2-1B shape on the GPU (bf16, context 512).

* tuned by running it (graph timer), it matches the untuned step within bf16 tolerance;
* with every fused stage forced onto its fused Triton kernel (the single ops keep the real
  picks), it matches too, launches about five kernels per layer, and its CUDA-graph replay equals
  the eager step bit for bit with PDL on; so does the really tuned step's;
* the accuracy target: against a float32 eager reference of the same weights over 64 decode
  steps at batch 1 and 8, the tuned step's logit error and next-token KL are within noise of the
  untuned bf16 step's (the numbers are printed; ``benchmarks/decode_latency.py`` reports them).

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphtune import bench  # noqa: E402
from graphtune.autotuner import AutoTuner, TuningPolicy  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.bench.accuracy import decode_accuracy  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model, tune_step  # noqa: E402
from graphtune.engine.build import build_runner  # noqa: E402
from graphtune.ops import _pdl, _pruned  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
MAX_BATCH, MAX_SEQ, POSITION = 8, 528, 512
LIFTED_LIMITS = (
    "ADD_PROJECTION_MIN_ROWS",
    "QKV_AFTER_NORM_MIN_ROWS",
    "NORM_LINEAR_IN_LOOP_MIN_ROWS",
)
FUSED_OPS = {
    "graphtune.norm_qkv_rope",
    "graphtune.add_projection",
    "graphtune.norm_gate_up_silu",
    "graphtune.norm_linear",
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.fixture(scope="module")
def llama_1b():
    return load_model("llama-1b-shape", device="cuda", dtype=BF16, seed=0)


@pytest.fixture(scope="module")
def cache(llama_1b):
    cache = KVCache(llama_1b.config, MAX_BATCH, MAX_SEQ, "cuda", BF16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return cache


@pytest.fixture(scope="module")
def tuner(llama_1b, cache):
    tuner = AutoTuner(show_progress=False)
    report = tune_step(DecodeStep(llama_1b, cache, contiguous_slots=True, tuner=tuner))
    print(report.summary())
    print(tuner.summary_table())
    assert not tuner.stats.tactic_failures, tuner.stats.tactic_failures
    return tuner


class _LastWinsAsGraph:
    """Fake timer named like the graph timer (so cache keys match the real tuner's): every
    measurement is faster than the one before, so the last candidate (a fused Triton tactic)
    wins. Nothing is timed; candidates are still compiled."""

    name = "graph"

    def __init__(self) -> None:
        self.calls = 0

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.calls += 1
        return Measurement.from_samples([1e6 / self.calls], calls_per_sample=1, timer=self.name)


@pytest.fixture(scope="module")
def forced(llama_1b, cache, tuner):
    """A tuner with the real picks of every single op and the fused kernel for every stage."""
    forced = AutoTuner(
        timer=_LastWinsAsGraph(),
        policy=TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0, tie_floor_us=0.0),
        show_progress=False,
    )
    for key, entry in tuner.cache.items():
        if key.op not in FUSED_OPS:
            forced.cache.put(key, entry)
    # No whole-step check: it would put back the unfused path where the step runs faster so.
    # The fused kernels' row limits (graphtune/ops/_pruned.py) leave the residual projection,
    # the norm-first QKV and the LM head no kernel at a few rows; "every stage's kernel" lifts
    # them while tuning (they decide the tactics offered, not what a launch accepts).
    with pytest.MonkeyPatch.context() as patch:
        for limit in LIFTED_LIMITS:
            patch.setattr(_pruned, limit, 1)
        step = DecodeStep(llama_1b, cache, contiguous_slots=True, tuner=forced)
        tune_step(step, check_fused=False)
    picks = {(key.op, key.shapes[0][0]): entry.runner_index for key, entry in forced.cache.items()}
    assert all(picks[(op, m)] > 0 for op, m in picks if op in FUSED_OPS), picks  # a kernel
    return forced


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(batch)
    tokens = torch.randint(0, 128256, (batch,), generator=gen, device="cuda")
    return tokens, torch.full_like(tokens, POSITION), torch.arange(batch, device="cuda")


@pytest.mark.parametrize("which", ["tuner", "forced"])
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_step_matches_the_untuned_step(llama_1b, cache, request, which, batch):
    tuned = DecodeStep(llama_1b, cache, contiguous_slots=True, tuner=request.getfixturevalue(which))
    untuned = DecodeStep(llama_1b, cache, contiguous_slots=True)
    args = _inputs(batch)
    with torch.inference_mode():
        want = untuned(*args).float()
        got = tuned(*args).float()
    rel = _rel(got, want)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"{which} batch {batch}: relative logit error {rel:.2e}, top-1 agreement {agree:.2f}")
    assert rel < 2e-2 and agree >= 0.75
    assert tuned.tuner.stats.fallbacks == {}


@pytest.mark.parametrize("which", ["tuner", "forced"])
def test_fused_step_replays_bit_exactly_in_a_cuda_graph_with_pdl(llama_1b, cache, request, which):
    if torch.cuda.get_device_capability() >= (9, 0):
        assert _pdl.pdl_enabled(torch.device("cuda"))  # every fused launch is a PDL launch
    step = DecodeStep(llama_1b, cache, contiguous_slots=True, tuner=request.getfixturevalue(which))
    runner = build_runner(step, "graph", capture_sizes=[1, 8])
    try:
        with torch.inference_mode():
            runner.capture(*step.example_inputs(MAX_BATCH))
            for batch in (1, 8):
                args = _inputs(batch)
                want = step(*args).clone()
                for _ in range(2):
                    got = runner(*args)
                    assert torch.equal(got, want), (which, batch)
            one = _inputs(1)
            busy = bench.gpu_busy(lambda: step(*one))
    finally:
        runner.release()
    assert not runner.stats.failed_captures, runner.stats.table()
    layers = llama_1b.config.num_layers
    print(f"{which}: {busy.activities_per_call} device activities per step at batch 1")
    print(busy.families)
    if which == "forced":
        # Embedding, the step's write rows and attention mask (6 small torch kernels), per layer
        # the QKV stage, attention (one kernel, or split + merge), the O-projection, the MLP
        # stage and the down projection, then the LM head. The forced picks are each fused op's
        # last runner: for the QKV and MLP stages the RMSNorm kernel, then the fused GEMV.
        assert busy.activities_per_call <= 1 + 6 + 8 * layers + 1


def test_accuracy_against_float32_is_within_noise_of_the_untuned_step(llama_1b, tuner):
    results = decode_accuracy(llama_1b, tuner, batch_sizes=(1, 8), steps=64, max_seq_len=MAX_SEQ)
    for r in results:
        print(r.as_dict())
        # bf16 noise: the fused kernels change the summation order only; the strict "no worse"
        # verdict is r.no_worse (benchmarks/decode_latency.py reports it).
        assert r.ratios["kl_mean"] <= 1.1 and r.ratios["max_abs"] <= 1.25, r.as_dict()
        assert r.tuned.top1_agree >= r.untuned.top1_agree - 0.05
    assert tuner.stats.fallbacks == {}
