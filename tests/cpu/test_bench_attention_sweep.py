"""benchmarks/attention_sweep.py's tactic space, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import attention_sweep  # noqa: E402

from graphtune.ops import attention  # noqa: E402


def _key(tactic: dict) -> tuple:
    return tuple(sorted(tactic.items()))


def test_space_holds_every_offered_tactic_and_only_valid_ones():
    for batch in (1, 8, 32, 128):
        space = attention_sweep.space_for(batch, 8, 528, 64, 132)
        keys = [_key(t) for t in space]
        assert len(keys) == len(set(keys))
        assert all(attention.check_decode_tactic(t) is None for t in space)
        offered = attention.decode_attention_tactics(batch, 8, 528, 64, sm_count=132)
        assert {_key(t) for t in offered} <= set(keys), batch


def test_space_limits_splits_by_programs_and_tiles():
    large = attention_sweep.space_for(128, 8, 528, 64, 132)
    assert {t["splits"] for t in large} == {1}  # 1024 programs already fill 132 SMs
    small = attention_sweep.space_for(1, 8, 528, 64, 132)
    assert max(t["splits"] for t in small) == 64  # block_n 16: 33 tiles, 66 programs a row
    assert {t["splits"] for t in small if t["block_n"] == 128} == {1, 2, 4, 8}  # 5 tiles


def test_context_past_the_cache_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        attention_sweep.main(["--out", str(tmp_path), "--context", "528", "--seq", "528"])
    assert exited.value.code == 2
    assert "--context must be in [0, --seq=528)" in capsys.readouterr().err


def test_an_unknown_model_is_a_usage_error_naming_the_presets(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        attention_sweep.main(["--out", str(tmp_path), "--model", "llama-9b"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--model: unknown model preset 'llama-9b'" in err and "llama-3-8b-shape" in err
