"""``graphtune generate`` sizes its engine the way ``graphtune tune`` tunes (tiny preset, CPU):
a tuning cache's picks are found for any prompt count and with the default ``--max-seq-len``;
``--top-k`` / ``--top-p`` are refused where greedy decoding would ignore them."""

from __future__ import annotations

import pytest

from graphtune.cli.main import main

GENERATE = ["generate", "--model", "tiny", "--max-new-tokens", "3", "--device", "cpu"]
GENERATE += ["--runner", "eager", "--ignore-eos"]


def _generate(capsys, *flags: str) -> tuple[list[str], str]:
    """The ``tokens:`` lines and the whole stdout of one ``generate`` run (exit code 0)."""
    assert main([*GENERATE, *flags]) == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith("tokens: ")], out


@pytest.mark.parametrize("flag", [["--top-k", "5"], ["--top-p", "0.9"]])
def test_top_k_and_top_p_need_a_temperature(capsys, flag):
    assert main([*GENERATE, "--prompt-ids", "1", *flag]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith(f"error: {flag[0]} {flag[1]} needs --temperature")
    tokens, _ = _generate(capsys, "--prompt-ids", "1", *flag, "--temperature", "0.7")
    assert len(tokens) == 1
