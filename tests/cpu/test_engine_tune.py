"""Engine(tune=True) on the CPU: tuned step == untuned step, cache file reuse, fallbacks reported.

Tuning runs the step itself (``tune_step``), so the profiles tuned are those the step looks up.

Like the other ops tests, the Triton kernels run under Triton's CPU interpreter here (set before
anything imports Triton). A fake timer makes the *last* candidate of every profile the fastest,
so the tuned step really runs Triton kernels (and the matmul attention runner) wherever the ops
offer them, and the comparison with the untuned torch step means something.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_timers import last_wins_tuner  # noqa: E402

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.engine import DecodeStep, Engine, KVCache, load_model, tune_step  # noqa: E402
from graphtune.engine.presets import fewer_layers  # noqa: E402
from graphtune.ops import attention  # noqa: E402
from graphtune.ops._triton import collect_launches, triton_available  # noqa: E402

PROMPTS = [[1, 5, 9], [7, 3], [3, 4, 5, 6]]


def _tuner() -> AutoTuner:
    return last_wins_tuner()


@contextlib.contextmanager
def _recorded(tuner: AutoTuner):
    """A dry-run recording of the block's op calls whose Triton kernels are not run (only keyed:
    the fakes below read calls and picks; the interpreter takes ~1 s per step's kernels)."""
    with torch.no_grad(), tuner.record_calls(dry_run=True) as calls, collect_launches():
        yield calls


def test_tuned_engine_matches_untuned_and_reuses_the_cache_file(tmp_path, unpruned):
    path = tmp_path / "tuning.json"
    plain = Engine(load_model("tiny"), runner="graph", max_batch_size=4, max_seq_len=32)
    tuner = _tuner()
    tuned = Engine(
        load_model("tiny"),
        runner="graph",
        max_batch_size=4,
        max_seq_len=32,
        tune=True,
        tuning_cache=path,
        tuner=tuner,
    )
    assert path.is_file() and tuned.tuner is tuner and not tuner.tuning_mode
    report = tuned.tune_report
    assert report.buckets == (1, 2, 4)
    # The single ops (tuned by the unfused pass): 4 GEMM keys (QKV, gate-up = LM head [256, 64],
    # and O-proj and down with the residual folded in) + the norm + rope + silu + attention;
    # then the 5 fused stages (QKV stage, O-proj, MLP stage, down, final norm + LM head). Each
    # for 3 buckets: what the step runs.
    assert len(report.rows) == (8 + 5) * 3
    winners = " ".join(row[2] for row in report.rows)
    # Decided by the install, not by the picks (Triton is in the test extras, so on CI its
    # kernels must win here; inferring it from the winners let a lost Triton pass).
    with_triton = triton_available()
    if with_triton:  # its kernels are what the tuned step runs
        # The last GEMM runner is the skinny tensor-core GEMM (tactics for M <= 16).
        assert "TritonSkinnyGemmRunner" in winners and "TritonRopeRunner" in winners
        # The last runner of every fused stage is a fused kernel (for the QKV and MLP stages
        # the one that runs after the RMSNorm op).
        for fused in (
            "QkvRopeAfterNorm",
            "AddProjection",
            "GateUpSiluAfterNorm",
            "NormLinearInLoop",
        ):
            assert f"Triton{fused}" in winners, fused
    # The fake timer makes the last runner win: Triton's attention where Triton runs (the
    # interpreter), else the matmul runner.
    assert ("TritonDecodeAttention" if with_triton else "MatmulAttention") in winners

    # Same logits step by step (float32; the picks are other kernels, so not bit-equal).
    for batch in (1, 3):
        args = (
            torch.tensor([5, 17, 99][:batch]),
            torch.tensor([0, 2, 4][:batch]),
            torch.arange(batch),
        )
        want = plain.step_fn(*args).clone()
        got = tuned.step_fn(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert plain.step_fn.tuner is None

    hits = tuner.stats.hits
    assert tuned.generate(PROMPTS, 3, stop_token_ids=[]) == plain.generate(
        PROMPTS, 3, stop_token_ids=[]
    )
    assert tuner.stats.hits > hits and tuned.tuning_stats.fallbacks == {}
    assert "no fallbacks" in tuned.tuning_report()
    assert "off" in plain.tuning_report() and plain.tuning_stats is None

    # A second engine with the same file tunes nothing and runs the same picks.
    again = _tuner()
    second = Engine(
        load_model("tiny"),
        runner="eager",
        max_batch_size=4,
        max_seq_len=32,
        tune=True,
        tuning_cache=path,
        tuner=again,
    )
    assert again.stats.profiles_tuned == 0 and second.tune_report.rows == []
    assert again.timer.calls == 0


def test_untuned_shapes_fall_back_and_are_reported():
    model = load_model("tiny")
    tuner = _tuner()
    # Tune a step for batches up to 2 only; the engine below serves up to 4 with the same tuner.
    tune_step(DecodeStep(model, KVCache(model.config, 2, 32), tuner=tuner))
    engine = Engine(model, runner="eager", max_batch_size=4, max_seq_len=32, tuner=tuner)
    assert engine.tune_report is None
    args = (torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 0, 2]), torch.arange(4))
    want = DecodeStep(model, engine.cache, contiguous_slots=True)(*args)
    got = engine.step(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    fallbacks = engine.tuning_stats.fallbacks
    # Batch 4 is bucket 4, never tuned: every op of the step fell back to torch.
    assert {
        "graphtune.gemm",
        "graphtune.rms_norm",
        "graphtune.rope_kv_cache",
        "graphtune.silu_and_mul",
        attention.OP_NAME,
    } <= set(fallbacks)
    assert fallbacks[attention.OP_NAME] == model.config.num_layers  # looked up once per layer
    text = engine.tuning_report()
    assert "look-ups only" in text and "graphtune.gemm" in text


def test_tuning_cache_without_tune_only_looks_up(tmp_path):
    path = tmp_path / "c.json"
    Engine(
        load_model("tiny"),
        runner="eager",
        max_batch_size=2,
        max_seq_len=32,
        tune=True,
        tuning_cache=path,
        tuner=_tuner(),
    )
    # Cache keys hold the timing mode, so the look-up tuner names the same timer ("fake").
    lookup = _tuner()
    engine = Engine(
        load_model("tiny"),
        runner="eager",
        max_batch_size=2,
        max_seq_len=32,
        tuning_cache=path,
        tuner=lookup,
    )
    assert len(lookup.cache) > 0
    engine.generate([[1, 2]], 2, stop_token_ids=[])
    stats = engine.tuning_stats
    assert stats.profiles_tuned == 0 and stats.fallbacks == {} and stats.hits > 0


def test_tuned_step_matches_with_gathered_slots():
    model = load_model("qwen2-tiny")  # QKV bias and tied embeddings
    cache = KVCache(model.config, 3, 32, "cpu", torch.float32)
    tuner = _tuner()
    tuned = DecodeStep(model, cache, contiguous_slots=False, tuner=tuner)
    tune_step(tuned)  # writes the scratch slot only; the caches are filled below
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    args = (torch.tensor([7, 8]), torch.tensor([5, 9]), torch.tensor([2, 0]))
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = DecodeStep(model, cache, contiguous_slots=False)(*args).clone()
    k1, v1 = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = tuned(*args)
    # float32 throughout; the tuned kernels sum in other orders than torch, and the logits
    # inherit every layer's differences (about 1e-5 of an element seen alone).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(cache.k, k1, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache.v, v1, rtol=0, atol=1e-5)
    assert tuner.stats.fallbacks == {}


def test_tune_step_compiles_up_front_and_tunes_what_it_would_without() -> None:
    from graphtune.ops._triton_runner import triton_runners

    model = load_model("tiny")

    def counters() -> dict[int, tuple[int, int]]:
        return {id(r): (r.compiled, r.compile_shared) for r in triton_runners()}

    seen: dict[str, dict[int, tuple[int, int]]] = {}

    def log(line: str) -> None:
        if line.endswith("at batch 1"):  # the first tuning run starts: prepare is done
            seen["prepared"] = counters()

    tuned = {}
    for prepare in (True, False):
        tuner = _tuner()
        step = DecodeStep(model, KVCache(model.config, 4, 32), tuner=tuner)
        report = tune_step(step, log=log, prepare=prepare)
        tuned[prepare] = {key: (e.runner_id, e.tactic) for key, e in tuner.cache.items()}
        assert tuner.stats.fallbacks == {} and report.profiles_tuned == len(tuned[prepare])
        parts = report.prepare_seconds + report.bucket_runs_seconds + report.check_seconds
        assert report.bucket_runs_seconds > 0 and parts <= report.seconds
        if prepare:
            assert report.prepared == 0 or report.prepare_seconds > 0
            after = counters()
            # Nothing compiled while tuning: every tactic timed was compiled up front.
            assert {k: v for k, v in after.items() if k in seen["prepared"]} == seen["prepared"]
            assert (report.prepared > 0) == triton_available()
        else:
            assert report.prepared == 0 and report.prepare_seconds == 0.0
    assert tuned[True] == tuned[False]  # the up-front phase changes no key and no pick


def test_a_step_whose_profiles_are_all_cached_skips_the_bucket_runs() -> None:
    model = load_model("tiny")
    tuner = _tuner()
    step = DecodeStep(model, KVCache(model.config, 4, 32), tuner=tuner)
    first = tune_step(step)
    assert first.profiles_tuned > 0
    lines: list[str] = []
    tuned, timed = tuner.stats.profiles_tuned, tuner.timer.calls
    again = tune_step(step, log=lines.append)
    assert again.profiles_tuned == 0 and tuner.timer.calls == timed
    assert not [line for line in lines if "running the step at batch" in line]
    # The skip was right: the bucket runs in tuning mode find every profile cached.
    tuner.tuning_mode = True
    for ops in (step.ops.unfused(), step.ops):
        for batch in first.buckets:
            step.decode(ops, *step.example_inputs(batch))
    assert tuner.stats.profiles_tuned == tuned and tuner.stats.fallbacks == {}

    # A single op that only the unfused sequence calls is missing: the runs happen and tune it.
    partial = _tuner()
    kept = {k: e for k, e in tuner.cache.items() if k.op != "graphtune.silu_and_mul"}
    partial.cache.update(kept)
    step = DecodeStep(model, KVCache(model.config, 4, 32), tuner=partial)
    report = tune_step(step)
    assert {row[0] for row in report.rows} == {"graphtune.silu_and_mul"}
    assert report.profiles_tuned == len(tuner.cache.items()) - len(kept)


class _CostModel:
    """Fake step timer: a step's time is the sum of what its op calls cost, seen through a
    dry-run recording of the timed call: a fused op on its fused kernel costs ``FUSED[op]``, a
    single op ``SINGLE[op]`` (a fused op on its unfused runner shows its single ops)."""

    name = "cost-model"
    FUSED = {
        "graphtune.norm_qkv_rope": 10.0,  # unfused: norm + GEMM + RoPE = 2, so unfusing pays
        "graphtune.add_projection": 5.0,  # unfused: one GEMM = 1
        "graphtune.norm_gate_up_silu": 5.0,  # unfused: 21.5 (the SiLU is dear), so it stays
        "graphtune.norm_linear": 1.0,  # unfused: 1.5, so it stays
    }
    SINGLE = {"graphtune.gemm": 1.0, "graphtune.silu_and_mul": 20.0}

    def __init__(self, tuner: AutoTuner) -> None:
        self.tuner, self.calls, self.warmups = tuner, 0, []

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        from graphtune.ops.fused._base import UnfusedRunner

        self.calls += 1
        self.warmups.append((warmup, repeat))
        with _recorded(self.tuner) as calls:
            fn(0)
        total = 0.0
        for call in calls:
            if isinstance(call.runners[0], UnfusedRunner):
                found = self.tuner.cached(call)
                total += self.FUSED[call.op] if found and found[1].runner_index else 0.0
            else:
                total += self.SINGLE.get(call.op, 0.5)
        return Measurement.from_samples([total], calls_per_sample=1, timer=self.name)


def _fused_picks(tuner: AutoTuner, step: DecodeStep, batch: int) -> dict[str, set[int]]:
    """Per fused op, the kinds of its picks: 0 the unfused runner, 1 a fused kernel."""
    with _recorded(tuner) as calls:
        step.decode(step.ops, *step.example_inputs(batch))
    picks: dict[str, set[int]] = {}
    for call in calls:
        if call.op in _CostModel.FUSED:
            picks.setdefault(call.op, set()).add(int(tuner.cached(call)[1].runner_index > 0))
    return picks


def test_whole_step_check_switches_exactly_the_fused_ops_that_slow_the_step(unpruned):
    from graphtune.engine.tuning import check_fusion

    model = load_model("tiny")
    tuner = _tuner()  # the last runner wins every op alone: the fused ops pick their kernels
    step = DecodeStep(model, KVCache(model.config, 2, 32), tuner=tuner)
    assert tune_step(step).fusion_checks == []  # no step timer on the CPU: no check
    before = {batch: _fused_picks(tuner, step, batch) for batch in (1, 2)}
    assert all(kinds == {1} for kinds in before[1].values())
    # The tiny model's QKV kernel has tactics for one row only: at batch 2 it is unfused already.
    assert before[2]["graphtune.norm_qkv_rope"] == {0}
    lines: list[str] = []
    timer = _CostModel(tuner)
    checks = check_fusion(step, timer, log=lines.append)
    assert [c.batch for c in checks] == [1, 2] and len(lines) == 2
    assert timer.calls == sum(c.step_timings for c in checks) == (2 + 5) + (2 + 4)
    # QKV, O-projection and down-projection profiles switch; gate/up and the LM head stay.
    assert [(c.pinned, c.candidates) for c in checks] == [(3, 5), (2, 4)]
    for check in checks:
        assert check.kept_us < check.fused_us and check.kept_us < check.unfused_us
    for batch in (1, 2):
        assert _fused_picks(tuner, step, batch) == {
            "graphtune.norm_qkv_rope": {0},
            "graphtune.add_projection": {0},
            "graphtune.norm_gate_up_silu": before[batch]["graphtune.norm_gate_up_silu"],
            "graphtune.norm_linear": before[batch]["graphtune.norm_linear"],
        }

    # tune_step runs the check when given a step timer, and says what it switched.
    other_tuner = _tuner()
    other = DecodeStep(model, KVCache(model.config, 2, 32), tuner=other_tuner)
    report = tune_step(other, step_timer=_CostModel(other_tuner))
    assert [(c.batch, c.pinned) for c in report.fusion_checks] == [(1, 3), (2, 2)]
    assert "switched to unfused by batch: {1: '3/5', 2: '2/4'}" in report.summary()
    # check_fused=False keeps every per-op pick and times nothing.
    kept_tuner = _tuner()
    kept = DecodeStep(model, KVCache(model.config, 2, 32), tuner=kept_tuner)
    timer = _CostModel(kept_tuner)
    assert tune_step(kept, step_timer=timer, check_fused=False).fusion_checks == []
    assert timer.calls == 0


def test_whole_step_check_with_one_fused_profile_times_the_step_twice():
    from graphtune.engine.tuning import check_fusion

    model = load_model("tiny")
    tuner = _tuner()
    step = DecodeStep(model, KVCache(model.config, 1, 32), tuner=tuner)
    tune_step(step)
    with _recorded(tuner) as calls:
        step.decode(step.ops, *step.example_inputs(1))
    for call in calls:  # every fused profile but the QKV stage's on its unfused runner
        if call.op in _CostModel.FUSED and call.op != "graphtune.norm_qkv_rope":
            tuner.pin(call, 0)
    timer = _CostModel(tuner)
    (check,) = check_fusion(step, timer)
    # As tuned and unfused only: switching the one profile is the unfused step.
    assert timer.calls == check.step_timings == 2 and (check.pinned, check.candidates) == (1, 1)
    # One step a replay, after a timed warm-up call: a graph timer's plan then captures one step
    # once (test_timing_replay_plan.py: test_replay_plan_replays_a_long_call_alone).
    assert timer.warmups == [(2, 1), (2, 1)]
    assert check.kept_us == check.unfused_us < check.fused_us
    assert _fused_picks(tuner, step, 1)["graphtune.norm_qkv_rope"] == {0}


def test_whole_step_check_sizes_its_later_captures_from_the_step_timed_before():
    from graphtune.engine.tuning import check_fusion

    class _Sessions(_CostModel):
        """A cost model that can also open sessions (graphtune.autotuner.timing.SessionTimer)."""

        def __init__(self, tuner: AutoTuner) -> None:
            super().__init__(tuner)
            self.hints: list[float | None] = []

        def open(self, fn, *, warmup: int, repeat: int, hint_us: float | None = None):
            self.hints.append(hint_us)
            timer = self

            class _Session(contextlib.AbstractContextManager):
                def measure(self) -> Measurement:
                    return timer.measure(fn, warmup=warmup, repeat=repeat)

                def close(self) -> None:
                    pass

                def __exit__(self, *exc: object) -> None:
                    self.close()

            return _Session()

    model = load_model("tiny")
    tuner = _tuner()
    step = DecodeStep(model, KVCache(model.config, 2, 32), tuner=tuner)
    tune_step(step)
    timer = _Sessions(tuner)
    checks = check_fusion(step, timer)
    # The first timing has nothing to go by: two warm-up calls, the first bounds the time.
    # Every later one is sized by a timing before it and warms up with one call (an eager step).
    assert timer.warmups[0] == (2, 1) and set(timer.warmups[1:]) == {(1, 1)}
    first = checks[0]
    assert timer.hints[0] == first.fused_us  # the unfused step: sized by the step as tuned
    assert timer.hints[-1] == checks[-1].fused_us
    assert None not in timer.hints and len(timer.hints) == sum(c.step_timings for c in checks) - 1


def test_whole_step_check_unfuses_everything_when_only_all_together_pays():
    from graphtune.engine.tuning import check_fusion

    class _Together(_CostModel):
        """Every fused kernel costs 1 more than its unfused ops, except when all are unfused."""

        def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
            from graphtune.ops.fused._base import UnfusedRunner

            with _recorded(self.tuner) as calls:
                fn(0)
            fused = [c for c in calls if isinstance(c.runners[0], UnfusedRunner)]
            on_kernel = [c for c in fused if self.tuner.cached(c)[1].runner_index]
            total = 1.0 if not fused else 100.0 - 0.1 * (len(fused) - len(on_kernel))
            return Measurement.from_samples([total], calls_per_sample=1, timer=self.name)

    model = load_model("tiny")
    tuner = _tuner()
    step = DecodeStep(model, KVCache(model.config, 1, 32), tuner=tuner)
    tune_step(step)
    (check,) = check_fusion(step, _Together(tuner))
    assert check.pinned == check.candidates and check.kept_us == check.unfused_us == 1.0
    assert set().union(*_fused_picks(tuner, step, 1).values()) == {0}


def test_pin_rejects_an_index_that_names_no_runner():
    import pytest

    from graphtune.errors import ConfigError

    model = load_model("tiny")
    tuner = _tuner()
    step = DecodeStep(model, KVCache(model.config, 2, 32), tuner=tuner)
    with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
        step.decode(step.ops, *step.example_inputs(1))
    with pytest.raises(ConfigError, match="runner_index"):
        tuner.pin(calls[0], len(calls[0].runners))


def test_a_restart_records_the_unfused_step_only_where_a_fused_kernel_hides_single_ops(
    monkeypatch,
):
    import graphtune.ops.fused.mlp as mlp

    # The tiled gate/up + SiLU GEMM offered above 16 rows (not 32) keeps the step small, and so
    # does one layer (each layer makes the same calls; tune_step runs every bucket up to 32).
    monkeypatch.setattr(mlp, "TILED_ABOVE_M", 16)
    model = load_model(fewer_layers("tiny", 1))
    tuner = _tuner()
    # Largest bucket 32: above the fused GEMV's 16 rows. There only the MLP stage has a fused
    # kernel (the tiled gate/up + SiLU GEMM), which the last-wins tuner picks.
    step = DecodeStep(model, KVCache(model.config, 32, 32), tuner=tuner)
    tune_step(step)
    unfused_runs = []
    decode = step.decode

    def counting(ops, *args):
        if not ops.fused:
            unfused_runs.append(args[0].shape[0])
        return decode(ops, *args)

    step.decode = counting
    assert tune_step(step).profiles_tuned == 0 and unfused_runs == [32]
    # With the MLP stage on its unfused runner at 32, every fused op runs its unfused runner
    # there: the recorded step shows every single-op call, and no unfused step is recorded.
    with _recorded(tuner) as calls:
        decode(step.ops, *step.example_inputs(32))
    for call in calls:
        if call.op == "graphtune.norm_gate_up_silu":
            tuner.pin(call, 0)
    unfused_runs.clear()
    assert tune_step(step).profiles_tuned == 0 and unfused_runs == []
    # With a single op missing, the first recording alone finds it and the bucket runs tune it.
    kept = {k: e for k, e in tuner.cache.items() if k.op != "graphtune.silu_and_mul"}
    partial = _tuner()
    partial.cache.update(kept)
    again = DecodeStep(model, KVCache(model.config, 32, 32), tuner=partial)
    report = tune_step(again)
    assert {row[0] for row in report.rows} == {"graphtune.silu_and_mul"}
