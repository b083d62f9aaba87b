"""The tactic consistency check (check_tactics) and ``graphtune check-tactics``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from graphtune.autotuner import DynamicTensorSpec, TunableRunner, TuningConfig, check_tactics
from graphtune.bench.schema import FIELDS, is_provenance

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),))


class Scale(TunableRunner):
    """``x * 2``; tactic ``"wrong"`` computes ``x * 2.1``, ``"raise"`` raises, ``"near"`` is
    off by one rounding step, ``"inplace"`` also writes (wrongly) into its second input."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, "near", "wrong", "raise", "inplace"]

    def forward(self, inputs: list, *, tactic: Any = -1, scale: float = 2.0, **kw: Any) -> Any:
        x, buf = inputs
        if tactic == "raise":
            raise RuntimeError("no kernel for this shape")
        if tactic == "wrong":
            return x * (scale + 0.1)
        if tactic == "near":
            return (x * scale).bfloat16().float()
        if tactic == "inplace":
            buf.add_(1.0)
        return x * scale


def test_every_tactic_is_compared_with_the_fallback() -> None:
    x, buf = torch.randn(4, 8), torch.zeros(3)
    report = check_tactics("scale", [Scale()], CONFIG, [x, buf], rtol=1e-2)
    by_tactic = {c.tactic: c for c in report.checks}
    assert set(by_tactic) == {"near", "wrong", "raise", "inplace"}  # the fallback is the ref
    assert by_tactic["near"].passed and 0 < by_tactic["near"].max_rel < 1e-2
    wrong = by_tactic["wrong"]
    assert not wrong.passed
    assert wrong.max_abs == pytest.approx(float((x * 0.1).abs().max()), rel=1e-4)
    assert wrong.max_rel == pytest.approx(0.05, rel=1e-4)
    assert not by_tactic["raise"].passed and "no kernel" in by_tactic["raise"].error
    assert math.isnan(by_tactic["raise"].max_abs)
    inplace = by_tactic["inplace"]  # its output is right; what it wrote into the input is not
    assert not inplace.passed and inplace.max_abs == 1.0
    assert not report.passed and {c.tactic for c in report.failures} == {
        "wrong",
        "raise",
        "inplace",
    }
    assert torch.equal(buf, torch.zeros(3)), "the caller's inputs are never written"
    tight = check_tactics("scale", [Scale()], CONFIG, [x, buf], rtol=1e-9)
    assert not {c.tactic: c for c in tight.checks}["near"].passed


class Outputs(TunableRunner):
    """Tactic ``"conj"`` negates a complex output's imaginary part; ``"sum"`` returns the sum as
    a Python number, off by 100 for tactic ``"sum off"``."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, "conj", "same"]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        x = inputs[0]
        total = float(x.abs().sum()) + (100.0 if tactic == "conj" else 0.0)
        return (x.conj().resolve_conj() if tactic == "conj" else x.clone()), total


def test_complex_parts_and_python_numbers_are_compared_too() -> None:
    x = torch.randn(4, 3, dtype=torch.complex64)
    checks = {c.tactic: c for c in check_tactics("c", [Outputs()], CONFIG, [x]).checks}
    assert checks["same"].passed and checks["same"].max_abs == 0.0
    # The real parts agree; the imaginary parts and the number do not.
    assert not checks["conj"].passed and checks["conj"].max_abs > 99.0


class Indices(TunableRunner):
    """Integer and bool outputs; tactic ``"off"`` moves one index by 100 and flips one flag."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, "off"]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        picked, flags = inputs[0].argmax(1), inputs[0][:, 0] > 0
        if tactic == "off":
            picked[3] += 100
            flags[0] = ~flags[0]
        return picked, flags


def test_integer_and_bool_outputs_report_the_largest_difference_and_the_count() -> None:
    x = torch.randn(4, 3)
    (check,) = check_tactics("i", [Indices()], CONFIG, [x]).checks
    assert not check.passed and check.max_abs == 100.0  # one element off by 100, not 1 element
    assert check.error == "output[0]: 1 of 4 elements differ"


@pytest.mark.parametrize("tolerance", [{"atol": -1.0}, {"rtol": math.nan}, {"atol": math.inf}])
def test_a_tolerance_that_is_not_finite_and_positive_is_refused(tolerance) -> None:
    from graphtune.errors import ConfigError

    x = torch.randn(4, 3)
    with pytest.raises(ConfigError, match="must be a finite number >= 0"):
        check_tactics("scale", [Scale()], CONFIG, [x, torch.zeros(4, 3)], **tolerance)


def test_keyword_arguments_reach_both_sides() -> None:
    x = torch.randn(4, 8)
    report = check_tactics("scale", [Scale()], CONFIG, [x, torch.zeros(1)], rtol=1e-2, scale=3.0)
    checks = {c.tactic: c for c in report.checks}
    assert checks["near"].passed  # both sides multiplied by 3 (a side with 2 would be 33% off)
    assert checks["wrong"].max_rel == pytest.approx(0.1 / 3.0, rel=1e-4)


class BrokenFallback(Scale):
    def forward(self, inputs: list, *, tactic: Any = -1, **kw: Any) -> Any:
        raise ValueError("fallback broken")


def test_a_broken_fallback_is_reported() -> None:
    report = check_tactics("scale", [BrokenFallback()], CONFIG, [torch.randn(4, 8), None])
    assert report.reference_error == "ValueError: fallback broken" and not report.passed


class WritesNested(TunableRunner):
    """Writes ``x * 2`` into ``inputs[1][0]`` (a tensor inside a list) and into ``out=``; tactic
    1 skips both writes."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 1]

    def forward(self, inputs: list, *, tactic: Any = -1, out: Any = None, **kw: Any) -> Any:
        x, nested = inputs
        if tactic != 1:
            nested[0].copy_(x * 2)
            out.copy_(x * 2)
        return x.sum()


def test_writes_into_nested_inputs_and_keyword_outputs_are_compared_on_copies() -> None:
    # Nested tensors and tensor kwargs were shared by every run (each compared with itself, so
    # a skipped write passed) and written in the caller's own tensors.
    x, cache, out = torch.randn(4, 8), torch.zeros(4, 8), torch.zeros(4, 8)
    report = check_tactics("write", [WritesNested()], CONFIG, [x, [cache]], out=out)
    (check,) = report.checks
    assert not check.passed and check.max_abs > 0
    assert torch.equal(cache, torch.zeros(4, 8)) and torch.equal(out, torch.zeros(4, 8))


def test_a_fallback_with_nan_is_reported_not_compared() -> None:
    # Compared with a NaN reference, a tactic with NaN in the same places passed and a correct
    # one failed.
    x = torch.randn(4, 8)
    x[0, 0] = math.nan
    report = check_tactics("scale", [Scale()], CONFIG, [x, torch.zeros(1)])
    assert report.checks == [] and not report.passed
    assert report.reference_error is not None and "NaN" in report.reference_error


def test_masks_with_infinities_compare_where_they_are_finite() -> None:
    mask = torch.tensor([[0.0, float("-inf")]] * 4)

    class Mask(TunableRunner):
        def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
            return [0, 1]

        def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
            out = inputs[0].clone()
            if tactic == 1:
                out[:, 1] = 0.0  # fills a masked position: a real difference
            return out

    report = check_tactics("mask", [Mask()], CONFIG, [mask])
    assert [c.passed for c in report.checks] == [True, False]


def test_check_tactics_cli_runs_every_op_of_a_decode_step(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-m", "graphtune", "check-tactics", "--model", "tiny", "--batch", "1,3",
         "--device", "cpu", "--json", "-"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # '-': the JSON alone on stdout, the table on stderr
    assert is_provenance(data["provenance"]) and data["provenance"]["device"] == "cpu"
    assert data["config"]["batch"] == [1, 3] and data["passed"] is True
    data = data["reports"]
    ops = {item["op"] for item in data}
    # Every op of the step, once per distinct shape: what the step itself looks up (the fused
    # stages, and the single ops their unfused runners call).
    assert ops == {
        "graphtune.norm_qkv_rope",
        "graphtune.add_projection",
        "graphtune.norm_gate_up_silu",
        "graphtune.norm_linear",
        "graphtune.gemm",
        "graphtune.rms_norm",
        "graphtune.rope_kv_cache",
        "graphtune.silu_and_mul",
        "decode_attention",
    }
    assert all(item["passed"] for item in data)
    assert any(item["checks"] for item in data)  # the matmul attention runner was compared
    assert "failed" in done.stderr
    # The fused ops' fallbacks run their unfused ops untuned on purpose: no "no tuned pick" warning.
    assert "no tuned pick" not in done.stderr


def test_check_tactics_passes_for_the_triton_kernels_of_a_qwen3_moe_step(tmp_path) -> None:
    """Under the interpreter, with the q/k norm inside the RoPE kernel and the MoE kernels: the
    fallback and every Triton tactic agree on outputs and on every in-place write."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "graphtune", "check-tactics", "--model", "qwen3-moe-tiny",
         "--batch", "1", "--device", "cpu", "--dtype", "float32", "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = {item["op"]: item for item in json.loads(report.read_text())["reports"]}
    assert {"graphtune.rope_kv_cache", "graphtune.fused_moe", "graphtune.route_top_k"} <= set(data)
    for op in ("graphtune.rope_kv_cache", "graphtune.fused_moe"):
        runners = {check["runner"].split("[")[0] for check in data[op]["checks"]}
        assert any(name.startswith("Triton") for name in runners), (op, runners)
        assert data[op]["passed"], op


def test_check_tactics_json_carries_provenance_and_replaces_an_earlier_list_report(
    tmp_path, monkeypatch, capsys
) -> None:
    # The report used to be a bare list of op reports, with no provenance record; such a file
    # (an earlier run's) is still replaced, through the atomic results writer.
    import graphtune.bench.results as results
    from graphtune.cli.main import main

    report = tmp_path / "report.json"
    report.write_text(json.dumps([{k: None for k in results.CHECK_TACTICS_REPORT_KEYS}]))
    written = []
    real = results.write_result
    monkeypatch.setattr(
        results, "write_result", lambda path, data: written.append(path) or real(path, data)
    )
    command = ["check-tactics", "--model", "tiny", "--batch", "1", "--device", "cpu"]
    assert main([*command, "--json", str(report)]) == 0
    capsys.readouterr()
    data = json.loads(report.read_text())
    assert written == [report] and list(data) == ["provenance", "config", "passed", "reports"]
    prov = data["provenance"]
    assert is_provenance(prov) and list(prov) == list(FIELDS)
    assert prov["device"] == "cpu" and prov["torch"] == torch.__version__ and "commit" in prov
    assert data["config"] == {
        "model": "tiny",
        "batch": [1],
        "device": "cpu",
        "dtype": "float32",
        "max_seq_len": 256,
        "atol": None,
        "rtol": None,
    }
    assert data["passed"] is True and data["reports"] and all(r["passed"] for r in data["reports"])
    assert results.graphtune_result_file(report)  # a rerun may replace it
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


class AssumesContiguous(TunableRunner):
    """Tactic ``"flat"`` reads its input's memory as if it were contiguous."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, "flat"]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        x = inputs[0]
        if tactic == "flat":
            x = torch.as_strided(x, x.shape, (x.shape[1], 1))
        return x * 2


def test_inputs_keep_their_strides_so_a_runner_that_ignores_them_fails() -> None:
    x = torch.randn(8, 4).t()  # a transposed view: (4, 8), strides (1, 4)
    checks = check_tactics("op", [AssumesContiguous()], CONFIG, [x]).checks
    assert [c.passed for c in checks] == [False]


def test_triton_gemm_offers_nothing_for_a_strided_bias(monkeypatch) -> None:
    from graphtune.ops.gemm import common
    from graphtune.ops.gemm.common import triton_gemm_supports

    monkeypatch.setattr(common, "device_supported", lambda device: True)  # CUDA or interpreter
    a, w = torch.randn(3, 16), torch.randn(8, 16)
    assert triton_gemm_supports([a, w, torch.randn(8), None, False])
    assert not triton_gemm_supports([a, w, torch.randn(16)[::2], None, False])  # read as flat


def test_check_tactics_sees_a_skipped_kv_write() -> None:
    # The recorded calls hold the live KV cache, which the step had just written: the fallback
    # then wrote the values already there, so a tactic that skipped its write passed.
    from graphtune.cli._step_calls import decode_step_calls

    calls = decode_step_calls("tiny", 2, device=torch.device("cpu"), dtype=torch.float32)
    rope = next(c for c in calls if c.op == "graphtune.rope_kv_cache")
    k_cache = rope.inputs[4]
    written = k_cache.clone()
    rope.runners[0].forward(list(rope.inputs), tactic=-1)  # the fallback, on the live inputs
    assert not torch.equal(k_cache, written), "the K/V write must change what the cache holds"


@pytest.mark.parametrize(
    "runners, config, inputs",
    [
        (Scale(), CONFIG, None),  # one runner, not a list of them
        ([Scale()], CONFIG, "tensor"),  # a tensor as inputs: each run got its rows
        ([Scale()], None, None),
    ],
)
def test_check_tactics_refuses_what_choose_one_refuses(runners, config, inputs) -> None:
    from graphtune.errors import ConfigError

    x, buf = torch.randn(4, 3), torch.zeros(4, 3)
    inputs = torch.stack([x, buf]) if inputs == "tensor" else [x, buf]
    with pytest.raises(ConfigError):
        check_tactics("op", runners, config, inputs)


def test_a_complex_fallback_output_holding_nan_is_no_reference() -> None:
    class Complex(TunableRunner):
        def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
            return [-1, 1]

        def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
            return torch.full((4,), complex(float("nan"), 0.0), dtype=torch.complex64)

    report = check_tactics("cplx", [Complex()], CONFIG, [torch.randn(4, 3)])
    assert not report.passed and report.reference_error is not None


@dataclass
class Result:
    y: torch.Tensor
    n: int


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Structured(TunableRunner):
    """Returns the output structure its ``kind`` names; each tactic gets one part wrong."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, "same", "nan", "shape", "swapped", "keys", "short", "none"]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        x = inputs[0]
        y = {"nan": torch.full_like(x, math.nan), "shape": x[:1] * 2}.get(tactic, x * 2)
        if self.kind == "dataclass":
            return None if tactic == "none" else Result(y, 3)
        if self.kind == "dict":
            if tactic == "swapped":  # each key holds the other's value, listed the other way round
                return {"scale": x * 2, "bias": x + 1}
            if tactic == "keys":
                return {"bias": y, "shift": x + 1}
            if tactic == "same":  # the right values, listed in another order
                return {"scale": x + 1, "bias": y}
            return {"bias": y, "scale": x + 1}
        if tactic == "short":
            return (y,)
        return Pair(y, x + 1) if tactic != "same" else [y, x + 1]  # a list where a tuple was


def test_dataclass_outputs_are_compared_field_by_field() -> None:
    # A dataclass output held no tensors the check saw: NaN and a wrong shape passed.
    checks = {c.tactic: c for c in check_tactics("dc", [Structured("dataclass")], CONFIG,
                                                 [torch.randn(4, 3)]).checks}  # fmt: skip
    assert checks["same"].passed and checks["swapped"].passed
    assert not checks["nan"].passed and checks["nan"].error.startswith("output.y has NaN")
    assert not checks["shape"].passed and checks["shape"].error.startswith("output.y is (1, 3)")
    none = checks["none"]
    assert not none.passed and none.max_abs == math.inf
    assert none.error == "output is None, the fallback's is a Result"


def test_dict_outputs_are_compared_key_by_key_whatever_their_order() -> None:
    # Flattened in insertion order, swapped values listed the other way round compared equal.
    x = torch.randn(4, 3)
    checks = {c.tactic: c for c in check_tactics("d", [Structured("dict")], CONFIG, [x]).checks}
    assert checks["same"].passed, "the keys' order is no part of the output"
    swapped = checks["swapped"]
    assert not swapped.passed and swapped.max_abs == pytest.approx(float((x - 1).abs().max()))
    keys = checks["keys"]
    assert not keys.passed and keys.max_abs == math.inf
    assert keys.error == "output lacks the keys ['scale'] and has the extra keys ['shift']"
    assert checks["shape"].error.startswith("output['bias'] is (1, 3)")


def test_named_tuples_lists_and_tuples_are_compared_by_position() -> None:
    checks = {c.tactic: c for c in check_tactics("t", [Structured("tuple")], CONFIG,
                                                 [torch.randn(4, 3)]).checks}  # fmt: skip
    assert checks["same"].passed, "a list of the same values matches a NamedTuple"
    assert checks["short"].error == "output is a tuple of 1, the fallback's is a Pair of 2"
    assert checks["nan"].error == "output[0] has NaN or infinities elsewhere"


class Opaque:
    """An output object with no fields the check can compare."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y


def test_an_output_type_that_cannot_be_compared_is_no_reference() -> None:
    class ReturnsObject(TunableRunner):
        def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
            return [-1, 1]

        def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
            return (inputs[0] * 2, {"state": Opaque(inputs[0])})

    report = check_tactics("obj", [ReturnsObject()], CONFIG, [torch.randn(4, 3)])
    assert report.checks == [] and not report.passed  # it passed, comparing nothing
    assert report.reference_error is not None
    assert report.reference_error.startswith(
        "the fallback's output[1]['state'] is an Opaque, which check_tactics cannot compare"
    )
