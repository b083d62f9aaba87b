"""benchmarks/decode_latency.py without a GPU: the targets table from synthetic part results, the
part selection, and the clear exit without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_latency  # noqa: E402


def _row(batch: int, tuned: float, floor: float, unfused: float | None = None, hf=None) -> dict:
    return {
        "batch_size": batch,
        "tuned_graph_ms": tuned,
        "floor_ms": floor,
        "tuned_unfused_ms": unfused,
        "hf_ms": hf,
        "hf_argmax_agreement": None if hf is None else 1.0,
    }


def test_targets_table_gives_each_issue_13_verdict() -> None:
    found = {
        "1b": {"results": [_row(1, 0.75, 0.58, 0.99, 1.57), _row(128, 1.8, 1.09, 1.85)]},
        "pdl": {"tuned_graph_ms": {"pdl_on": 0.75, "pdl_off": 0.80}},
        "8b": {"llama-3-8b-shape": {"results": [_row(1, 5.0, 4.0, 5.0)]}},
        "accuracy": {
            "results": [{"batch_size": 1, "ratios": {"max_abs": 0.9, "kl_mean": 1.2, "kl_max": 1}}]
        },
    }
    verdicts = {what: ok for what, _, _, ok in decode_latency.targets(found)}
    assert verdicts["1B b1 tuned ms"] == "pass"
    assert verdicts["1B b128 tuned/floor"] == "MISS"  # 1.65x > 1.5x
    assert verdicts["1B b1 tuned / tuned unfused"] == "pass"
    assert verdicts["1B b128 tuned / before (1.865 ms)"] == "pass"
    assert verdicts["1B b1 tuned PDL off / on"] == "pass"
    assert verdicts["llama-3-8b-shape b1 tuned/floor"] == "MISS"  # 1.25x > 1.15x
    assert verdicts["accuracy b1 tuned/untuned max err"] == "pass"
    assert verdicts["accuracy b1 tuned/untuned mean KL"] == "MISS"
    assert "1B b1 HF compile / tuned" in verdicts
    assert "1B b1 HF vs engine same greedy token" in verdicts
    assert "1B b128 HF vs engine same greedy token" not in verdicts


def test_unknown_parts_and_missing_cuda_are_clear(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        decode_latency.main(["--out", str(tmp_path), "--parts", "1b,bogus"])
    assert exc.value.code == 2 and "unknown part 'bogus'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            decode_latency.main(["--out", str(tmp_path), "--parts", "8b"])
        assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_overlap_stats_reads_the_last_replay_by_correlation() -> None:
    from graphtune.bench.cupti import DeviceEvent

    def replay(start: float, corr: int) -> list[DeviceEvent]:
        copy = DeviceEvent("copy", "gpu_memcpy", start - 5, 1.0, corr - 1)  # runner's copy-in
        kernels = [
            DeviceEvent("a", "kernel", start, 4.0, corr),
            DeviceEvent("b", "kernel", start + 3.5, 2.0, corr),  # starts before a ends (PDL)
            DeviceEvent("c", "kernel", start + 6.5, 1.0, corr),  # 1 us after b
        ]
        return [copy, *kernels]

    events = replay(0.0, 10) + replay(100.0, 20) + replay(200.0, 30)
    got = decode_latency.overlap_stats(events, replays=3)
    assert got["kernels"] == 3 and got["overlapping_pairs"] == 1
    assert got["overlap_us"] == 0.5 and got["gap_us"] == 1.0 and got["span_us"] == 7.5
    no_ids = [DeviceEvent(e.name, e.category, e.start_us, e.duration_us) for e in events[1:4]]
    assert decode_latency.overlap_stats(no_ids, replays=1)["kernels"] == 3
