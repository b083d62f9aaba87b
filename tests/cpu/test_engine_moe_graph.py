"""The tuned MoE step in a (simulated) CUDA graph on the CPU: captured whole, replayed exactly.

Tuning runs the step (``tune_step``), so the router GEMM and ``fused_moe`` are tuned like every
op. A fake timer makes the last-listed candidate of every profile the fastest, so the tuned step
runs the Triton kernels (interpreted here: ``TRITON_INTERPRET=1``) wherever an op offers them,
the router (one kernel) and ``fused_moe`` (the sort by expert and the grouped GEMMs) included.
The simulated graph backend records every ATen op and Triton launch of the capture and fails it
on a host synchronisation, as a CUDA capture does; a replay re-runs the recorded work on the same
memory.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from fake_timers import last_wins_tuner  # noqa: E402

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model, step_pad_rule, tune_step  # noqa: E402
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend  # noqa: E402
from graphtune.ops._triton import triton_available  # noqa: E402
from graphtune.ops.moe import OP_NAME  # noqa: E402
from graphtune.ops.moe.router import OP_NAME as ROUTER  # noqa: E402
from graphtune.ops.moe.routing import OP_NAME as ROUTE  # noqa: E402


def _tuner() -> AutoTuner:
    return last_wins_tuner()


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_tuned_moe_step_is_captured_whole_and_replays_the_eager_step(preset):
    model = load_model(preset, seed=3)
    cache = KVCache(model.config, 4, 32)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    tuner = _tuner()
    step = DecodeStep(model, cache, contiguous_slots=True, tuner=tuner)
    report = tune_step(step)
    # The last-listed runner wins: at these token counts the GEMV path (graphtune.ops.moe.gemv),
    # and the fused router (graphtune.ops.moe.router), whose unfused runner's routing op was
    # tuned in the single-ops pass.
    picks = (
        (OP_NAME, "TritonMoeGemvRunner"),
        (ROUTE, "TritonRouteTopKRunner"),
        (ROUTER, "TritonMoeRouter"),
    )
    for op, runner_name in picks:
        winners = {row[2].split()[0].split("[")[0] for row in report.rows if row[0] == op}
        if triton_available():
            assert winners == {runner_name}, report.rows
    untuned = DecodeStep(model, cache, contiguous_slots=True)
    runner = CUDAGraphRunner(
        step,
        max_batch_size=4,
        capture_sizes=[1, 2, 4],
        pad=step_pad_rule(cache.scratch_slot),
        backend=SimulatedGraphBackend(),
    )
    with torch.inference_mode():
        runner.capture(*step.example_inputs(4))
        assert runner.stats.failed_captures == [] and runner.stats.graphs == 3
        for batch in (1, 3, 4):  # 3 replays the graph of 4 with a padded row
            args = (
                torch.tensor([5, 17, 99, 200][:batch]),
                torch.tensor([3, 9, 1, 20][:batch]),
                torch.arange(batch),
            )
            k, v = cache.k.clone(), cache.v.clone()
            want = step(*args).clone()
            reference = untuned(*args).clone()
            cache.k.copy_(k)
            cache.v.copy_(v)
            replays = runner.stats.replays
            got = runner(*args)
            assert runner.stats.replays == replays + 1
            if batch == 3:
                # The padded replay runs bucket 4's picks, the eager step at 3 rows bucket 2's,
                # where the fused residual projection is not offered (graphtune.ops._pruned):
                # other kernels, equal to rounding.
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            # The Triton kernels against the torch expert loop (other kernels: not bit-equal).
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    assert tuner.stats.fallbacks == {}
    runner.release()


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_an_untuned_moe_step_that_reads_its_routing_on_the_host_is_not_replayed(preset):
    # The untuned fallback loops over the experts it reads with .tolist(): a host read that a
    # CUDA capture refuses. The simulated capture must refuse it too, or the replay would keep
    # the capture's routing for every later token.
    from graphtune.engine import Engine

    def tokens(**kwargs):
        engine = Engine(load_model(preset, seed=0), max_batch_size=4, max_seq_len=64, **kwargs)
        prompts = [[11, 12, 13], [99, 98], [200, 201, 202, 203], [37]]
        return engine, engine.generate(prompts, [5, 3, 6, 4], stop_token_ids=[])

    _, want = tokens(runner="eager")
    engine, got = tokens(graph_backend=SimulatedGraphBackend())
    assert got == want and engine.stats.replays == 0
