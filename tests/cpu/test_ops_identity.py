"""Every runner class of graphtune.ops has a stable cache identity, and every op rebuilds from
its recorded call (the op registry behind ``graphtune tune --from-misses``).

The runners come from the ops' own factories, so a new runner class that no factory below builds
fails the coverage test until it is added here. Identities are compared within this process, for
a second build of the same runners (another tuner for the fused ops, which hold theirs only by a
weak reference), after a pickle round trip (what ``isolation="subprocess"`` sends) and with a
fresh interpreter.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import graphtune.ops  # noqa: E402,F401  (registers every op)
from graphtune.autotuner import AutoTuner, runner_id  # noqa: E402
from graphtune.autotuner.calls import CallRecord  # noqa: E402
from graphtune.autotuner.runner import TunableRunner  # noqa: E402
from graphtune.ops import attention, fused, moe  # noqa: E402
from graphtune.ops._triton_runner import TritonRunner  # noqa: E402
from graphtune.ops.activation import silu_and_mul_runners  # noqa: E402
from graphtune.ops.fused._base import UnfusedRunner  # noqa: E402
from graphtune.ops.fused_gemv import FusedTritonRunner  # noqa: E402
from graphtune.ops.gemm import TritonSkinnyGemmRunner, gemm_runners  # noqa: E402
from graphtune.ops.moe import gemv_down  # noqa: E402
from graphtune.ops.registry import rebuild_call, registered_ops  # noqa: E402
from graphtune.ops.rmsnorm import rms_norm_runners  # noqa: E402
from graphtune.ops.rotary import rope_runners  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: Bases that no factory builds by themselves (their subclasses are the runners).
BASES = {
    TritonRunner,
    UnfusedRunner,
    FusedTritonRunner,
    fused.projection._PlainTriton,
    moe.routing.TritonRoutingRunner,
}


def _runner_sets(tuner: AutoTuner | None) -> dict[str, tuple[TunableRunner, ...]]:
    """Every op's runners as its factory builds them (fused ops for ``tuner``)."""
    return {
        "gemm": gemm_runners(),
        "rms_norm": rms_norm_runners(),
        "rope": rope_runners(4, 2, True),
        "silu_and_mul": silu_and_mul_runners(),
        "attention": attention.RUNNERS,
        "norm_gate_up_silu": fused.norm_gate_up_silu_runners(tuner=tuner, max_m=8),
        "add_projection": fused.add_projection_runners(tuner=tuner, max_m=8),
        "norm_linear": fused.norm_linear_runners(tuner=tuner, max_m=8),
        "norm_qkv_rope": fused.norm_qkv_rope_runners(4, 2, True, tuner=tuner, max_m=8),
        "fused_moe": moe.fused_moe_runners(),
        "fused_moe_gemv_down": gemv_down.down_runners(),
        "route_top_k": moe.route_top_k_runners(2, True, False),
        "moe_router": moe.moe_router_runners(2, True, False, tuner=tuner, max_m=8),
        "skinny_gemm": (TritonSkinnyGemmRunner(),),
        # The fused stages' kernels that their factories no longer offer.
        "not_offered": (
            fused.TritonNormGateUpSilu(),
            fused.TritonGateUpSiluNormInLoop(),
            fused.TritonNormQkvRope(4, 2, True),
            fused.TritonNormLinear(),
            attention.TritonDecodeAttentionOneKernel(),
        ),
    }


def _ids(tuner: AutoTuner | None) -> dict[str, list[str]]:
    return {op: [runner_id(r) for r in rs] for op, rs in _runner_sets(tuner).items()}


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_every_runner_class_of_graphtune_ops_is_covered() -> None:
    defined = {c for c in _subclasses(TunableRunner) if c.__module__.startswith("graphtune.ops")}
    built = {type(r) for rs in _runner_sets(AutoTuner(show_progress=False)).values() for r in rs}
    if not graphtune.ops.triton_available():  # only the torch runners are built then
        defined = {c for c in defined if not issubclass(c, TritonRunner)}
    assert defined - BASES == built, "add the new runner classes to _runner_sets"


def test_runner_identities_are_stable_and_leave_the_tuner_and_counters_out() -> None:
    first, second = AutoTuner(show_progress=False), AutoTuner(show_progress=False)
    ids = _ids(first)
    assert _ids(second) == ids  # a fused op's runners built for another tuner: same keys
    for op, runners in _runner_sets(first).items():
        assert len(set(ids[op])) == len(ids[op]), op  # the runners of one op never share keys
        for runner, ident in zip(runners, ids[op], strict=True):
            assert "0x" not in ident and "AutoTuner" not in ident, ident
            assert runner_id(pickle.loads(pickle.dumps(runner))) == ident
            if isinstance(runner, TritonRunner):
                runner.compiled += 1  # bookkeeping is not configuration
                try:
                    assert runner_id(runner) == ident
                finally:
                    runner.compiled -= 1


def test_runner_identities_are_the_same_in_a_fresh_process() -> None:
    code = (
        "import json, sys; sys.path.insert(0, 'tests/cpu'); import test_ops_identity as t; "
        "print(json.dumps(t._ids(None)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == _ids(AutoTuner(show_progress=False))


def _op_calls(tuner: AutoTuner) -> list:
    """One real call of every op of graphtune.ops (tiny shapes; nothing is tuned)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    heads, kv, dim, hidden, inter, rows = 4, 2, 8, 32, 48, 3
    x, norm = randn(rows, hidden), 1 + 0.1 * randn(hidden)
    w_qkv = randn((heads + 2 * kv) * dim, hidden)
    cos, sin = randn(16, dim), randn(16, dim)
    positions = torch.tensor([1, 5, 7])
    write_rows = torch.arange(rows * kv)
    caches = [torch.zeros(64, dim) for _ in range(2)]
    ops = graphtune.ops
    with tuner.record_calls(dry_run=True) as calls:
        h, _ = ops.fused_add_rms_norm(x, norm, 1e-5, randn(rows, hidden), tuner=tuner, max_m=4)
        qkv = ops.gemm(h, w_qkv, tuner=tuner, max_m=4)
        ops.rope_kv_cache(
            qkv, positions, cos, sin, *caches, write_rows, num_heads=heads, num_kv_heads=kv,
            tuner=tuner, max_m=4,
        )  # fmt: skip
        ops.silu_and_mul(randn(rows, 2 * inter), tuner=tuner, max_m=4)
        mask = torch.zeros(rows, 1, 1, 16)
        attention.decode_attention(
            randn(rows, kv, heads // kv, dim), randn(rows, kv, 16, dim), randn(rows, kv, 16, dim),
            mask, tuner=tuner, config=attention.tuning_config(4),
        )  # fmt: skip
        fused.norm_gate_up_silu(x, norm, 1e-5, randn(2 * inter, hidden), tuner=tuner, max_m=4)
        fused.add_projection(x.clone(), randn(rows, inter), randn(hidden, inter), tuner=tuner)
        fused.norm_linear(x, norm, 1e-5, randn(40, hidden), tuner=tuner, max_m=4)
        fused.norm_qkv_rope(
            x, norm, 1e-5, w_qkv, None, positions, cos, sin, *caches, write_rows,
            num_heads=heads, num_kv_heads=kv, signed_sin=True, tuner=tuner, max_m=4,
        )  # fmt: skip
        experts, top_k = 4, 2
        ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
        moe_inputs = [
            x, randn(experts, 2 * inter, hidden), randn(experts, hidden, inter),
            torch.full((rows, top_k), 0.5), ids,
        ]  # fmt: skip
        moe.fused_moe(*moe_inputs, tuner=tuner, max_m=4)
        # The down stage, which fused_moe asks only after a GEMV pick (none in a dry run).
        gemv_down.choose_down(tuner, moe.fused_moe_config(4), moe_inputs)
        moe.route_top_k(
            randn(rows, experts), top_k, renormalize=True, weights_dtype=torch.float32,
            tuner=tuner, max_m=4,
        )  # fmt: skip
        moe.moe_router(
            x, randn(experts, hidden), top_k, renormalize=True, weights_dtype=torch.float32,
            tuner=tuner, max_m=4,
        )  # fmt: skip
    return calls


def test_every_op_is_registered_and_rebuilds_from_its_recorded_call() -> None:
    tuner = AutoTuner(show_progress=False)
    calls = _op_calls(tuner)
    assert {c.op for c in calls} == set(registered_ops())  # every op, and only registered ones
    assert tuner.stats.fallbacks == {} and tuner.stats.misses == 0  # a dry run counts nothing
    for call in calls:
        ids = tuple(runner_id(r) for r in call.runners)
        record = CallRecord.from_json(json.loads(json.dumps(CallRecord.of(call, ids).to_json())))
        rebuilt = rebuild_call(record, tuner=tuner)
        assert tuple(runner_id(r) for r in rebuilt.runners) == ids, call.op
        assert [tuple(x.shape) for x in rebuilt.inputs if isinstance(x, torch.Tensor)] == [
            tuple(x.shape) for x in call.inputs if isinstance(x, torch.Tensor)
        ]
