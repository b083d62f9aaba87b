"""The inputs' device type is part of the cache key: a pick tuned on one device is never served
for inputs on another with the same timing mode (``wallclock``, a custom timer), and keys saved
before the field existed are read by the rule of ``docs/cache-format.md``."""

from __future__ import annotations

import json
import logging

import torch
from fake_timers import EveryCandidateEqual

from graphtune.autotuner import AutoTuner, CacheEntry, TuningConfig, autotune, persist
from graphtune.autotuner.maintenance import merge_files, verify_file
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.cli.main import main


class PerDevice(TunableRunner):
    """One tactic that is only valid on the CPU."""

    def get_valid_tactics(self, inputs, profile):
        return ["cpu_loop"] if inputs[0].is_cpu else ["device_kernel"]

    def forward(self, inputs, tactic=FALLBACK_TACTIC):
        return inputs[0] * 2


def _tuned_on_cpu(path, **tuner_args):
    tuner = AutoTuner(**tuner_args)
    with autotune(path, tuner=tuner, tune=True):
        pick = tuner.choose_one(
            "op", [PerDevice()], TuningConfig(timing="wallclock"), [torch.ones(8, 8)]
        )
    assert pick[1] == "cpu_loop"
    return tuner


def _look_up_on(device, path, **tuner_args):
    tuner = AutoTuner(**tuner_args)
    with autotune(path, tuner=tuner, tune=False):
        x = torch.empty(8, 8, device=device)  # "meta" stands in for a CUDA device here
        _, tactic = tuner.choose_one("op", [PerDevice()], TuningConfig(timing="wallclock"), [x])
    return tuner, tactic


def test_a_cpu_pick_is_not_served_for_inputs_on_another_device(tmp_path) -> None:
    path = tmp_path / "cache.json"
    _tuned_on_cpu(path)
    (key,) = [item["key"] for item in json.loads(path.read_text())["entries"]]
    assert key["device"] == "cpu"
    tuner, tactic = _look_up_on("meta", path)
    assert tactic == FALLBACK_TACTIC
    assert tuner.stats.misses == 1 and tuner.stats.hits == 0
    _, tactic = _look_up_on("cpu", path)
    assert tactic == "cpu_loop"


def test_a_custom_timer_keys_the_device_too(tmp_path) -> None:
    path = tmp_path / "cache.json"
    _tuned_on_cpu(path, timer=EveryCandidateEqual())
    _, tactic = _look_up_on("meta", path, timer=EveryCandidateEqual())
    assert tactic == FALLBACK_TACTIC


def _without_devices(path):
    doc = json.loads(path.read_text())
    for item in doc["entries"]:
        del item["key"]["device"]
    path.write_text(json.dumps(doc))


def _old_file(tmp_path, name="old.json"):
    """A file as a graphtune before device keys wrote it: one graph pick, one wallclock pick."""
    path = tmp_path / name
    entry = CacheEntry("m.R", 0, 3, 1.0, 2.0)
    graph = persist_key("graph", "cuda")
    wall = persist_key("wallclock", "cpu")
    persist.save(path, {graph: entry, wall: entry})
    _without_devices(path)
    return path, graph, wall


def persist_key(timing, device):
    from graphtune.autotuner import CacheKey

    return CacheKey("op", ("m.R",), ((4, 8),), ("float32",), timing, device=device)


def test_keys_saved_without_a_device_are_cuda_for_cuda_timers_and_unused_otherwise(
    tmp_path, caplog
) -> None:
    path, graph, wall = _old_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        loaded = persist.load(path, strict=True)
    assert list(loaded) == [graph]  # events and graph only run on CUDA
    (record,) = [r for r in caplog.records if "no device type" in r.getMessage()]
    assert "'wallclock'" in record.getMessage()
    report = verify_file(path)
    assert report.problems == [] and report.ignored_entries == 1
    assert "no device type" in report.ignored[0]


def test_show_and_merge_handle_keys_with_and_without_a_device(tmp_path, capsys) -> None:
    old, graph, wall = _old_file(tmp_path)
    new = tmp_path / "new.json"
    persist.save(new, {persist_key("wallclock", "cpu"): CacheEntry("m.R", 0, 4, 1.0, 2.0)})
    assert main(["cache", "show", str(old)]) == 0
    out = capsys.readouterr().out
    assert "cuda" in out and "1 entries no look-up can use are not shown" in out
    report = merge_files(old, new, tmp_path / "out.json")
    assert len(report.ignored) == 1 and "no device type" in report.ignored[0]
    merged = persist.load(tmp_path / "out.json", strict=True)
    assert set(merged) == {graph, wall} and merged[wall].tactic == 4
    assert {
        item["key"]["device"] for item in json.loads((tmp_path / "out.json").read_text())["entries"]
    } == {"cpu", "cuda"}
