"""The record of missed shapes, the op registry that rebuilds them, and ``tune --from-misses``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from graphtune import ops
from graphtune.autotuner import (
    AutoTuner,
    CallRecord,
    DynamicTensorSpec,
    MissLog,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
    load_misses,
)
from graphtune.autotuner.timing import WallClockTimer
from graphtune.cli import from_misses
from graphtune.errors import CacheFileError, ConfigError, GraphtuneError
from graphtune.ops.registry import rebuild_call, registered_ops, tune_records

QUICK = TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0)


def quick_tuner() -> AutoTuner:
    return AutoTuner(WallClockTimer(samples=1), policy=QUICK, show_progress=False)


class Plain(TunableRunner):
    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        return inputs[0]


def test_misses_record_shapes_strides_dtypes_scalars_and_counts(tmp_path) -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),), max_value=4)
    tuner = AutoTuner(show_progress=False)
    x = torch.randn(8, 3).t()  # a non-contiguous view: its strides are recorded
    for _ in range(3):
        tuner.choose_one("op", [Plain()], config, [x, 1e-5, None, (2, "a")], flag=True)
    (record,) = tuner.misses.records()
    assert record.count == 3 and record.op == "op"
    assert record.inputs[0] == {"shape": [3, 8], "dtype": "float32", "stride": [1, 3],
                                "device": "cpu"}  # fmt: skip
    assert record.config["max_value"] == 4 and record.kwargs == {"flag": True}
    rebuilt = record.make_inputs()
    assert rebuilt[0].shape == (3, 8) and rebuilt[0].stride() == (1, 3)
    assert rebuilt[1:] == [1e-5, None, (2, "a")]  # the tuple comes back a tuple
    path = tmp_path / "misses.json"
    assert tuner.misses.save(path) == 1
    assert tuner.misses.save(path) == 1  # nothing new since the last save: nothing added
    (loaded,) = load_misses(path)
    assert loaded.count == 3 and loaded == CallRecord.from_json(loaded.to_json())


def test_nested_and_successive_blocks_save_each_miss_once(tmp_path) -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),))
    tuner, path, other = AutoTuner(show_progress=False), tmp_path / "m.json", tmp_path / "o.json"

    def counts(where: Path) -> list[int]:
        return [r.count for r in load_misses(where)]

    with autotune(None, tuner, tune=False, misses_path=path):
        with autotune(None, tuner, tune=False, misses_path=path):
            tuner.choose_one("op", [Plain()], config, [torch.zeros(4, 3)])
        assert counts(path) == [1]
    assert counts(path) == [1]
    with autotune(None, tuner, tune=False, misses_path=path):
        pass  # no call: nothing to add
    assert counts(path) == [1]
    with autotune(None, tuner, tune=False, misses_path=path):
        tuner.choose_one("op", [Plain()], config, [torch.zeros(4, 3)])
    assert counts(path) == [2] and tuner.misses.records()[0].count == 2
    assert tuner.misses.save(other) == 1 and counts(other) == [2]  # another file gets them all
    tuner.misses.clear()
    tuner.choose_one("op", [Plain()], config, [torch.zeros(4, 3)])
    tuner.misses.save(path)
    assert counts(path) == [3]


def test_misses_keep_dtypes_and_devices_and_never_fail_the_call(tmp_path, caplog) -> None:
    import enum

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))
    tuner = AutoTuner(show_progress=False)
    x = torch.randn(4, 3)
    args = dict(out_dtype=torch.float16, where=torch.device("cpu"))
    assert tuner.choose_one("op", [Plain()], config, [x, torch.bfloat16], **args)[1] == -1
    (record,) = tuner.misses.records()
    assert record.call_kwargs() == args and record.make_inputs()[1] is torch.bfloat16
    assert CallRecord.from_json(json.loads(json.dumps(record.to_json()))) == record

    class Act(enum.Enum):
        SILU = 1

    # An argument no file can describe: the call still runs the fallback, the miss is counted
    # and left out of the record, with one warning.
    for _ in range(2):
        assert tuner.choose_one("other", [Plain()], config, [x], act=Act.SILU)[1] == -1
    assert len(tuner.misses) == 1 and tuner.stats.fallbacks["other"] == 2
    assert caplog.text.count("is not recorded for `graphtune tune --from-misses`") == 1


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "cannot be read"),
        ('{"format": "x"}', "not a graphtune misses file"),
        ('{"format": "graphtune-misses", "version": 99, "misses": []}', "has version 99"),
    ],
)
def test_unreadable_misses_files_are_clear_errors(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(CacheFileError, match=match):
        load_misses(path)
    with pytest.raises(CacheFileError, match="does not exist"):
        load_misses(tmp_path / "none.json")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("notes, not JSON\n", "is not JSON"),
        ('{"format": "graphtune-misses", "version": 99, "misses": []}', "of version 99"),
    ],
)
def test_saving_misses_moves_a_file_that_is_no_misses_record_aside(
    tmp_path, caplog, text: str, reason: str
) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    tuner = AutoTuner(show_progress=False)
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))
    tuner.choose_one("op", [Plain()], config, [torch.randn(4, 3)])
    assert tuner.misses.save(path) == 1
    assert len(load_misses(path)) == 1
    # Nothing is lost: the file that was there is next to it, and the warning says where.
    assert (tmp_path / "m.json.unusable").read_text() == text
    assert reason in caplog.text and "m.json.unusable" in caplog.text


def _serve_decode_ops(tuner: AutoTuner, rows: int) -> None:
    """The ops of a tiny decode step, at ``rows`` rows, asking ``tuner`` (look-ups only)."""
    gen = torch.Generator().manual_seed(0)
    hidden, heads, kv, dim, inter = 32, 2, 1, 16, 64

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x = randn(rows, hidden)
    ops.fused_add_rms_norm(x, randn(hidden), 1e-5, randn(rows, hidden), tuner=tuner, max_m=8)
    ops.gemm(x, randn(3 * hidden, hidden), tuner=tuner, max_m=8)
    ops.silu_and_mul(randn(rows, 2 * inter), tuner=tuner, max_m=8)
    qkv = randn(rows, (heads + 2 * kv) * dim)
    positions = torch.arange(rows)
    table = randn(16, dim)
    cache = randn(8 * kv * 16, dim)
    rows_written = torch.arange(rows * kv)
    ops.rope_kv_cache(
        qkv, positions, table, table, cache, cache.clone(), rows_written,
        num_heads=heads, num_kv_heads=kv, tuner=tuner, max_m=8,
    )  # fmt: skip


def test_tune_from_misses_tunes_exactly_the_missed_buckets(tmp_path) -> None:
    serving = AutoTuner(show_progress=False)
    misses = tmp_path / "misses.json"
    with autotune(None, serving, tune=False, misses_path=misses):
        _serve_decode_ops(serving, rows=3)
    records = load_misses(misses)
    assert {r.op for r in records} == {
        "graphtune.rms_norm",
        "graphtune.gemm",
        "graphtune.silu_and_mul",
        "graphtune.rope_kv_cache",
    }
    assert set(registered_ops()) >= {r.op for r in records} | {"decode_attention"}
    tuner = quick_tuner()
    report = tune_records(records, tuner)
    assert len(report.tuned) == 4 and report.skipped == []
    # One profile per record: the bucket the live size (3) maps to, 2; no other bucket.
    assert sorted(key.op for key, _ in tuner.cache.items()) == sorted(r.op for r in records)
    assert {key.shapes[0][0] for key, _ in tuner.cache.items()} == {2}
    # Serving again from that cache: every call hits.
    again = AutoTuner(show_progress=False, cache=tuner.cache)
    _serve_decode_ops(again, rows=3)
    assert again.stats.fallbacks == {} and again.stats.hits == 4


def test_a_record_of_other_runners_or_ops_is_skipped_with_its_reason() -> None:
    good = CallRecord.of(ops_call_silu(rows=2), ("graphtune.ops.activation.TorchSiluAndMulRunner",))
    with pytest.raises(ConfigError, match="not the ones graphtune.ops builds here"):
        rebuild_call(good)
    unknown = CallRecord("no.such.op", ("m.R",), good.config, good.inputs)
    with pytest.raises(ConfigError, match="not in the graphtune.ops registry"):
        rebuild_call(unknown)
    report = tune_records([unknown], quick_tuner())
    assert report.tuned == [] and "no.such.op" in report.skipped[0][1]


def ops_call_silu(rows: int) -> Any:
    from graphtune.autotuner import OpCall
    from graphtune.ops.activation import OP_NAME, silu_and_mul_config, silu_and_mul_runners

    return OpCall(OP_NAME, silu_and_mul_runners(), silu_and_mul_config(8), (torch.randn(rows, 16),))


def test_tune_from_misses_cli(tmp_path, capsys) -> None:
    log = MissLog()
    call = ops_call_silu(rows=5)
    from graphtune.autotuner.identity import runner_id

    log.add(  # type: ignore[arg-type]
        "k", lambda: CallRecord.of(call, tuple(runner_id(r) for r in call.runners))
    )
    misses = tmp_path / "misses.json"
    log.save(misses)
    parser = argparse.ArgumentParser()
    from_misses.add_arguments(parser)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timing", default="wallclock")
    args = parser.parse_args(["--from-misses", str(misses), "--cache", str(tmp_path / "c.json")])
    assert from_misses.run(args) == 0
    entries = json.loads((tmp_path / "c.json").read_text())["entries"]
    assert [e["key"]["shapes"][0] for e in entries] == [[4, 16]]
    assert "1 of 1 recorded calls tuned" in capsys.readouterr().out
    bad = parser.parse_args(["--from-misses", str(tmp_path / "none.json"), "--cache", "x.json"])
    with pytest.raises(GraphtuneError):  # graphtune.cli.main makes it one error line, exit 1
        from_misses.run(bad)


def _damaged(record: CallRecord, **changes: Any) -> CallRecord:
    """``record`` with its first input's description edited, as by hand."""
    data = record.to_json()
    data["inputs"][0].update(changes.pop("input", {}))
    data.update(changes)
    return CallRecord.from_json(data)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"input": {"shape": [-1, 16], "stride": [16, 1]}}, "not a list of integers >= 0"),
        ({"input": {"shape": [2, 16], "stride": [1]}}, "but stride"),
        ({"input": {"shape": [10**12, 16], "stride": [16, 1]}}, "cannot allocate"),
        ({"input": {"device": "tpu:0"}}, "not a device"),
        ({"runners": ["x.Y"]}, "not the ones graphtune.ops builds here"),
    ],
)
def test_a_damaged_record_is_skipped_and_the_others_tuned(changes, reason) -> None:
    from graphtune.autotuner.identity import runner_id

    call = ops_call_silu(rows=5)
    good = CallRecord.of(call, tuple(runner_id(r) for r in call.runners))
    report = tune_records([_damaged(good, **changes), good], quick_tuner())
    assert [record for record, _, _ in report.tuned] == [good]
    ((_, why),) = report.skipped
    assert reason in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA")
def test_a_record_made_on_cuda_is_skipped_on_a_machine_without_it() -> None:
    from graphtune.autotuner.identity import runner_id

    call = ops_call_silu(rows=5)
    record = _damaged(
        CallRecord.of(call, tuple(runner_id(r) for r in call.runners)), input={"device": "cuda:0"}
    )
    report = tune_records([record], quick_tuner())
    assert report.tuned == [] and "has no CUDA" in report.skipped[0][1]


def test_a_record_whose_runner_ids_do_not_parse_is_skipped(tmp_path) -> None:
    serving = AutoTuner(show_progress=False)
    misses = tmp_path / "misses.json"
    with autotune(None, serving, tune=False, misses_path=misses):
        _serve_decode_ops(serving, rows=3)
    (rope,) = [r for r in load_misses(misses) if r.op == "graphtune.rope_kv_cache"]
    report = tune_records([_damaged(rope, runners=["x.Y"])], quick_tuner())
    assert report.tuned == [] and "does not rebuild" in report.skipped[0][1]


USER_OPS = """
import torch
from graphtune.autotuner import DynamicTensorSpec, TunableRunner, TuningConfig
from graphtune.ops.registry import register_op


class Scale(TunableRunner):
    def get_valid_tactics(self, inputs, profile, **kwargs):
        return [-1, 0]

    def forward(self, inputs, *, tactic=-1, **kwargs):
        return inputs[0] * 2


CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))
register_op("user.scale", lambda record, tuner: ([Scale()], CONFIG))
"""


def test_from_misses_imports_a_users_ops_and_checks_the_key_it_tuned(
    tmp_path, monkeypatch, capsys
) -> None:
    import importlib

    from graphtune.cli.main import main
    from graphtune.ops import registry

    (tmp_path / "user_ops_for_misses.py").write_text(USER_OPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The user's op leaves the registry with the test (other tests list every registered op).
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.delitem(sys.modules, "user_ops_for_misses", raising=False)
    user = importlib.import_module("user_ops_for_misses")
    misses, cache = tmp_path / "misses.json", tmp_path / "cache.json"

    class EventsNamed(WallClockTimer):  # what a CUDA serving process's key says
        name = "events"

    for timer in (None, EventsNamed()):
        serving = AutoTuner(timer=timer, show_progress=False)
        with autotune(None, serving, tune=False, misses_path=misses):
            serving.choose_one("user.scale", [user.Scale()], user.CONFIG, [torch.randn(3, 4)])
    args = ["tune", "--from-misses", str(misses), "--cache", str(cache), "--device", "cpu"]
    assert main([*args, "--import", "user_ops_for_misses"]) == 1
    out = capsys.readouterr().out
    # The wallclock record is tuned; the events one is tuned under wallclock, which the serving
    # process never looks up: said, with the fix, instead of "tuned".
    assert "1 of 2 recorded calls tuned" in out and "pass --timing events" in out
    assert main(["tune", "--cache", str(cache), "--import", "x"]) == 1  # needs --from-misses
    assert "--import" in capsys.readouterr().err
    assert main([*args, "--import", "no_such_module_here"]) == 1
    assert "--import no_such_module_here: the module could not be imported" in (
        capsys.readouterr().err
    )


class AlwaysFails(TunableRunner):
    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        raise RuntimeError("no kernel image for this device")


def test_a_record_whose_every_tactic_fails_is_skipped_as_failed(monkeypatch) -> None:
    from graphtune.ops import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))
    registry.register_op("user.fails", lambda record, tuner: ([AlwaysFails()], config))
    serving = AutoTuner(show_progress=False)
    with autotune(None, serving, tune=False):
        serving.choose_one("user.fails", [AlwaysFails()], config, [torch.randn(3, 4)])
    report = tune_records(serving.misses.records(), quick_tuner())
    ((_, why),) = report.skipped
    assert report.tuned == [] and "every (runner, tactic) failed" in why
    assert "looks up another key" not in why  # what it used to say


def test_reset_stats_re_arms_the_warning_of_a_miss_that_is_not_recorded(caplog) -> None:
    import enum

    class Act(enum.Enum):
        SILU = 1

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))
    tuner = AutoTuner(show_progress=False)
    caplog.set_level("WARNING", logger="graphtune.autotuner.calls")
    for _ in range(2):
        tuner.choose_one("op", [Plain()], config, [torch.randn(4, 3)], act=Act.SILU)
    tuner.reset_stats()  # e.g. after warm-up: serving warns about its own misses again
    tuner.choose_one("op", [Plain()], config, [torch.randn(4, 3)], act=Act.SILU)
    assert [r.name for r in caplog.records].count("graphtune.autotuner.calls") == 2
