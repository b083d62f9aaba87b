"""In-step refinement on the GPU: real graph-timer races over real Triton candidates.

``tune_step(refine=True)`` on the tiny preset (bf16): every raced profile reports its step times,
a rival it keeps ran the step faster, what it keeps is one of the candidates the tuner measured,
and the refined step still computes what the untuned step does. Skipped without CUDA
(tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model, tune_step  # noqa: E402
from graphtune.engine.step_refine import profile_record, whole_step_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def test_refinement_keeps_measured_candidates_and_the_step_still_matches():
    model = load_model("tiny", device="cuda", dtype=BF16, seed=0)
    cache = KVCache(model.config, 2, 64, "cuda", BF16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    tuner = AutoTuner(show_progress=False)
    step = DecodeStep(model, cache, tuner=tuner)

    report = tune_step(step, refine=True)

    assert report.refinements, "the tiny step offers profiles with near rivals"
    assert f"in-step refinement: {sum(r.switched for r in report.refinements)} of" in (
        report.summary()
    )
    for refinement in report.refinements:
        assert refinement.rivals >= 1 and math.isfinite(refinement.pick_us)
        if refinement.switched:
            assert refinement.kept_us < refinement.pick_us
    for batch in (1, 2):
        with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
            step.decode(step.ops, *whole_step_inputs(step, batch))
        for call in calls:
            found = tuner.cached(call)
            record = profile_record(tuner, call)
            if found is None or record is None:
                continue
            measured = {(c.runner_index, repr(c.tactic)) for c in record.candidates}
            assert (found[1].runner_index, repr(found[1].tactic)) in measured, call.op

    untuned = DecodeStep(model, cache)
    for batch in (1, 2):
        slots = torch.arange(batch, device="cuda")
        inputs = (torch.full_like(slots, 7), torch.full_like(slots, 20), slots)
        with torch.no_grad():
            want = untuned(*inputs).double()
            got = step(*inputs).double()
        assert float((got - want).norm() / want.norm()) < 2e-2
