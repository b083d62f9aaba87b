"""The experimental lead-in switches: ``benchmarks/tuning.py --lead-in`` and ``graphtune bench
decode --tune-lead-in`` (parsed, recorded, refused without PDL), against the fakes of
test_bench_tuning_run.py and test_bench_decode_tune.py."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_timers import last_wins_tuner  # noqa: E402
from test_bench_tuning_run import (  # noqa: E402, F401 (its path to benchmarks/, its fixture)
    CostTimer,
    _fake_main,
    bench,
    fake_gpu,
    tuning_options,
)


def _lead_in() -> None:
    """Stands for the PDL kernel."""


def test_tuning_lead_in_is_off_by_default_and_recorded():
    args = tuning_options.parse_args([])
    assert args.lead_in is False and tuning_options.options(args)["lead_in"] is False
    assert tuning_options.result_name(args, "h100") == "tuning-h100.json"
    args = tuning_options.parse_args(["--lead-in", "--quick"])
    assert tuning_options.options(args)["lead_in"] is True
    assert tuning_options.result_name(args, "h100") == "tuning-h100-quick-lead-in.json"


def test_tuning_lead_in_times_graph_modes_after_it_and_is_refused_without_pdl(
    fake_gpu,  # noqa: F811 (the fixture imported above)
    monkeypatch,
    tmp_path,
    capsys,
):
    import graphtune.autotuner.timing as timing
    import graphtune.ops.lead_in

    base = _fake_main(monkeypatch, fake_gpu) + ["--out", str(tmp_path), "--lead-in"]
    monkeypatch.setattr(graphtune.ops.lead_in, "pdl_lead_in", lambda device: None)
    assert bench.main(base) == 2
    assert list(tmp_path.iterdir()) == []
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--lead-in needs programmatic dependent launch" in line
    made: list[dict] = []
    monkeypatch.setattr(graphtune.ops.lead_in, "pdl_lead_in", lambda device: _lead_in)
    monkeypatch.setattr(
        timing, "GraphTimer", lambda **kw: made.append(kw) or CostTimer(fake_gpu), raising=True
    )
    bench.main([*base, "--modes", "graph,events"])
    data = json.loads(
        (tmp_path / "tuning-fake-lead-in-partial-modes-graph-events.json").read_text()
    )
    assert data["options"]["lead_in"] is True
    assert [kw["lead_in"] for kw in made] == [_lead_in, _lead_in]  # graph mode's two runs only


def test_bench_decode_tune_lead_in_is_recorded_and_refused_without_pdl(
    tmp_path, capsys, monkeypatch
):
    import graphtune.autotuner
    from graphtune.bench import decode_tuner
    from graphtune.cli.main import main

    out_json = tmp_path / "d.json"
    args = "bench decode --model tiny --batch-sizes 1 --context 4 --steps 1 --repeats 1".split()
    args += ["--device", "cpu", "--json", str(out_json)]
    assert main([*args, "--tune-lead-in"]) == 1
    assert "--tune-lead-in applies to the tuned step only" in capsys.readouterr().err
    assert main([*args, "--tune", "--tune-lead-in"]) == 1  # no PDL on the CPU
    assert "PDL cannot work on cpu" in capsys.readouterr().err
    assert not out_json.exists()
    made: list[dict] = []
    monkeypatch.setattr(
        graphtune.autotuner, "AutoTuner", lambda **kw: made.append(kw) or last_wins_tuner()
    )
    monkeypatch.setattr(decode_tuner, "lead_in_for", lambda device: _lead_in)
    monkeypatch.setattr(decode_tuner, "GraphTimer", lambda **kw: ("graph timer", kw))
    assert main([*args, "--tune", "--tune-lead-in"]) == 0
    assert made == [
        {"timer": ("graph timer", {"device": torch.device("cpu"), "lead_in": _lead_in})}
    ]
    assert json.loads(out_json.read_text())["config"]["tune_lead_in"] is True
    made.clear()
    assert main([*args, "--tune"]) == 0  # off: the default tuner, as before
    assert made == [{}] and json.loads(out_json.read_text())["config"]["tune_lead_in"] is False
