"""``graphtune generate`` sizes its engine the way ``graphtune tune`` tunes (tiny preset, CPU):
a tuning cache's picks are found for any prompt count and with the default ``--max-seq-len``;
``--top-k`` / ``--top-p`` are refused where greedy decoding would ignore them."""

from __future__ import annotations

import logging
import re
from argparse import Namespace

import pytest

from graphtune.cli.main import main

GENERATE = ["generate", "--model", "tiny", "--max-new-tokens", "3", "--device", "cpu"]
GENERATE += ["--runner", "eager", "--ignore-eos"]


@pytest.fixture
def tune(tmp_path, monkeypatch, capsys):
    """Runs ``graphtune tune`` on the tiny preset with the given flags; returns the cache path."""
    import graphtune.engine.engine
    from graphtune.autotuner.tuner import AutoTuner
    from graphtune.ops import _triton

    # A test that patched graphtune.autotuner.AutoTuner may have been the engine's first import.
    monkeypatch.setattr(graphtune.engine.engine, "AutoTuner", AutoTuner)
    # The CPU runs torch only, and tuning does not interpret Triton kernels for minutes.
    monkeypatch.setattr(_triton, "kernels_interpreted", lambda: False)
    monkeypatch.delenv("GRAPHTUNE_CACHE", raising=False)
    monkeypatch.delenv("GRAPHTUNE_MISSES", raising=False)

    def run(*flags: str):
        cache = tmp_path / "c.json"
        assert (
            main(["tune", "--model", "tiny", "--cache", str(cache), "--device", "cpu", *flags]) == 0
        )
        capsys.readouterr()
        return cache

    return run


def _generate(capsys, *flags: str) -> tuple[list[str], str]:
    """The ``tokens:`` lines and the whole stdout of one ``generate`` run (exit code 0)."""
    assert main([*GENERATE, *flags]) == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith("tokens: ")], out


def _misses(out: str) -> tuple[int, int]:
    hits, misses = re.search(r"look-ups: (\d+) hits, (\d+) misses", out).groups()  # type: ignore[union-attr]
    return int(hits), int(misses)


@pytest.mark.parametrize("count", [3, 5])
def test_any_prompt_count_finds_the_picks_of_the_power_of_two_buckets(tune, capsys, count):
    # tune covers buckets 1, 2, 4, 8: 3 prompts look up bucket 2, 5 prompts bucket 4.
    cache = tune("--max-batch", "8", "--max-seq-len", "64")
    prompts = [flag for i in range(count) for flag in ("--prompt-ids", str(i + 1))]
    untuned, _ = _generate(capsys, *prompts, "--max-seq-len", "64")
    tuned, out = _generate(
        capsys, *prompts, "--max-seq-len", "64", "--tuning-cache", str(cache), "--stats"
    )
    hits, misses = _misses(out)
    assert (hits > 0, misses) == (True, 0)
    assert tuned == untuned and len(tuned) == count


def test_the_default_kv_cache_length_with_a_tuning_cache_is_tunes_default(tune, capsys):
    cache = tune("--max-batch", "1")  # tune's default --max-seq-len
    _, out = _generate(capsys, "--prompt-ids", "1,2", "--tuning-cache", str(cache), "--stats")
    hits, misses = _misses(out)
    assert (hits > 0, misses) == (True, 0)


def test_a_kv_cache_that_cannot_take_tunes_default_length_warns(caplog):
    from graphtune.cli.generate import check_lengths
    from graphtune.cli.tune import DEFAULT_MAX_SEQ_LEN
    from graphtune.engine import get_preset

    config = get_preset("tiny")
    args = Namespace(max_new_tokens=3, max_seq_len=None)
    assert check_lengths(args, config, [[5] * 4], tuned=True) == DEFAULT_MAX_SEQ_LEN
    assert check_lengths(args, config, [[5] * 4]) == 6  # no tuning cache: what the prompt needs
    assert not caplog.records
    short = config.replace(max_position_embeddings=24)
    with caplog.at_level(logging.WARNING):
        assert check_lengths(args, short, [[5] * 4], tuned=True) == 6
    assert "--max-seq-len" in caplog.text and "max_position_embeddings=24" in caplog.text


@pytest.mark.parametrize("flag", [["--top-k", "5"], ["--top-p", "0.9"]])
def test_top_k_and_top_p_need_a_temperature(capsys, flag):
    # SamplingParams' rule, checked by the CLI before any work in the flags' words (exit 2).
    with pytest.raises(SystemExit) as exited:
        main([*GENERATE, "--prompt-ids", "1", *flag])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith(f"error: {flag[0]} {flag[1]} needs --temperature")
    tokens, _ = _generate(capsys, "--prompt-ids", "1", *flag, "--temperature", "0.7")
    assert len(tokens) == 1
