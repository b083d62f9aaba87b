"""Bad input on the command line as a user runs it (a subprocess): one ``error:`` line that names
the input, the rule and the fix, never a traceback or a quietly different run."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from test_cli_errors import error_line, graphtune

from graphtune.cli.main import main

CPU_BENCH = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1"]
CPU_BENCH += ["--steps", "1", "--repeats", "1", "--context", "8"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_runner_graph_without_cuda_is_refused_not_timed_eagerly():
    result = graphtune(*CPU_BENCH, "--runner", "graph")
    error_line(result, 1, "--runner graph", "CUDA graphs need CUDA", "--runner eager")
    assert "batch 1" not in result.stderr and "eager ms" not in result.stdout  # nothing ran


def test_model_folder_whose_config_json_is_a_folder_says_so(tmp_path):
    (tmp_path / "model" / "config.json").mkdir(parents=True)
    result = graphtune("tune", "--model", str(tmp_path / "model"), "--cache", str(tmp_path / "c"))
    line = error_line(result, 1, str(tmp_path / "model" / "config.json"), "is a folder")
    assert "has no config.json" not in line


GRAPHTUNE_FILES = {
    "cache": '{"format_version": 2, "fingerprint": {}, "entries": []}',
    "misses": '{"format": "graphtune-misses", "version": 1, "misses": []}',
}


@pytest.mark.parametrize("kind", sorted(GRAPHTUNE_FILES))
@pytest.mark.parametrize(
    "command",
    [
        [*CPU_BENCH, "--json"],
        [*CPU_BENCH, "--plot"],
        ["check-tactics", "--model", "tiny", "--device", "cpu", "--batch", "1", "--json"],
    ],
)
def test_results_never_replace_a_tuning_cache_or_misses_file(tmp_path, kind, command):
    target = tmp_path / f"{kind}.json"
    target.write_text(GRAPHTUNE_FILES[kind])
    if command[-1] == "--plot":
        target = target.rename(tmp_path / f"{kind}.png")
    result = graphtune(*command, str(target))
    what = "tuning cache" if kind == "cache" else "misses file"
    error_line(result, 1, f"{command[-1]} {target} is a graphtune {what}", "another path")
    assert target.read_text() == GRAPHTUNE_FILES[kind]


@pytest.mark.parametrize(
    "command",
    [
        [*CPU_BENCH, "--json"],
        ["check-tactics", "--model", "tiny", "--device", "cpu", "--batch", "1", "--json"],
    ],
    ids=["bench-decode", "check-tactics"],
)
def test_json_replaces_an_earlier_result_but_no_other_file(tmp_path, command):
    # A mistyped --json must not destroy a model's weights or any other JSON file.
    weights, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)))
    config.write_text('{"hidden_size": 32}')
    listed = tmp_path / "mine.json"
    listed.write_text("[]")  # a user's empty list passed as check-tactics' result (all([]))
    for target in (weights, config, listed):
        before = target.read_bytes()
        result = graphtune(*command, str(target))
        error_line(result, 1, f"--json {target}", "not an earlier graphtune result")
        assert "choose another path or remove the file" in result.stderr
        assert target.read_bytes() == before
    # The command's own earlier result is replaced: rerunning with the same path works. An
    # empty file (mktemp's) holds no data and is replaced too; it was refused.
    out = tmp_path / "result.json"
    out.write_bytes(b"")
    for _ in range(2):
        result = graphtune(*command, str(out))
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr and out.stat().st_size > 0


def test_plot_without_a_suffix_is_its_own_sentence(tmp_path):
    pytest.importorskip("matplotlib")
    line = error_line(graphtune(*CPU_BENCH, "--plot", str(tmp_path / "p")), 1, "has no suffix")
    assert "it has none is none" not in line and "plot.png" in line


def test_import_without_from_misses_names_both_flags(tmp_path):
    result = graphtune("tune", "--cache", str(tmp_path / "c.json"), "--import", "os")
    error_line(result, 1, "add --from-misses FILE or drop --import")


def test_json_may_replace_an_empty_file_but_not_an_empty_list(tmp_path):
    # A 0-byte file (what `mktemp` makes for --json) holds no data and was refused; a user's
    # `[]` holds data and was replaced, since all([]) made it check-tactics' list of reports.
    from graphtune.cli._args import check_output_path
    from graphtune.errors import ConfigError

    empty, listed = tmp_path / "r.XXXX.json", tmp_path / "mine.json"
    empty.write_bytes(b"")
    listed.write_text("[]")
    check_output_path(empty, "--json", result_json=True)
    with pytest.raises(ConfigError, match="not an earlier graphtune result"):
        check_output_path(listed, "--json", result_json=True)


@pytest.mark.parametrize(
    ("flags", "named", "rule"),
    [
        (["--max-seq-len", "1", "--max-new-tokens", "1"], "--max-seq-len", "must be >= 2"),
        (["--top-k", "5"], "--top-k 5", "needs --temperature > 0"),
        (["--top-p", "0.5"], "--top-p 0.5", "needs --temperature > 0"),
        (["--top-k", "5", "--top-p", "0.5"], "--top-k 5 and --top-p 0.5", "need --temperature"),
        (["--temperature", "1e-300"], "--temperature 1e-300", "smallest normal number"),
    ],
)
def test_generate_refuses_engine_and_sampling_limits_by_their_flags(flags, named, rule):
    # The engine's and SamplingParams' own checks would come after the model loaded, in their
    # field names (max_seq_len, top_k=5) and with exit 1: the CLI checks them first.
    result = graphtune("generate", "--model", "tiny", "--prompt-ids", "1", *flags)
    line = error_line(result, 2, named, rule)
    assert "top_k=" not in line and "top_p=" not in line and "max_seq_len" not in line
    assert not result.stdout  # nothing generated


def _integer_flags() -> dict[str, Any]:
    """Every flag (of every command) whose value is an integer or a list of them, with its type."""
    from test_cli_conventions import _parsers

    from graphtune.cli.main import build_parser

    found = {}
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.type is None:
                continue
            try:
                value = action.type("7")
            except (argparse.ArgumentTypeError, TypeError, ValueError):
                continue  # not a number (a device name, JSON text)
            values = value if isinstance(value, (list, tuple)) else [value]
            if values and all(type(v) is int for v in values):
                found[f"{name} {(action.option_strings or [action.dest])[-1]}"] = action.type
    return found


def test_every_integer_flag_takes_ascii_digits_with_a_sign_only():
    # int() also takes "1_0" (a literal's digit separator) and other scripts' digits, so
    # `--batch-sizes ٣ --steps １` ran batch 3 for 1 step; --prompt-ids and the environment
    # variables refused them. One rule now: graphtune.integer_text.parse_integer.
    flags = _integer_flags()
    named = {"graphtune bench decode --steps", "graphtune bench decode --batch-sizes"}
    named |= {
        "graphtune generate --prompt-ids",
        "graphtune generate --seed",
        "graphtune generate --tp",
    }
    assert named - set(flags) == set(), sorted(flags)
    took = []
    for flag, kind in flags.items():
        for text in ("1_0", "\u0663", "\uff11", "1\u0663", "7.0", "0x7", "", "7 7"):
            try:
                took.append((flag, text, kind(text)))
            except argparse.ArgumentTypeError:
                pass
    assert took == []
    for flag, kind in flags.items():
        assert kind(" 7 ") in (7, [7], (7,)) and kind("+7") in (7, [7], (7,)), flag


def test_integer_text_has_one_rule():
    from graphtune.integer_text import parse_integer

    assert [parse_integer(t) for t in ("0", "-3", "+12", " 5\n")] == [0, -3, 12, 5]
    for text in ("1_0", "\u00b2", "\u0663", "\uff11", "", "-", "1e3", "0x10", "1.0"):
        with pytest.raises(ValueError):
            parse_integer(text)


def test_bench_decode_refuses_underscored_and_non_ascii_counts_before_running(capsys):
    for flags in (["--batch-sizes", "1_0"], ["--steps", "1_0"], ["--batch-sizes", "\u0663"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "decode", "--model", "tiny", "--device", "cpu", *flags])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: argument {flags[0]}: expected") and flags[1] in err


@pytest.mark.parametrize(
    "command",
    [
        ["tune", "--model", "tiny", "--max-batch", "1", "--max-seq-len", "16", "--cache", "-"],
        ["cache", "merge", "a.json", "b.json", "-o", "-"],
        ["bench", "decode", "--model", "tiny", "--tune", "--tuning-cache", "-"],
        ["demo", "--device", "cpu", "--cache", "-"],
        ["generate", "--model", "tiny", "--prompt-ids", "1", "--tuning-cache", "-"],
    ],
)
def test_a_cache_flag_refuses_dash_as_a_usage_error(tmp_path, monkeypatch, capsys, command):
    # `--json -` is stdout, but `--cache -` wrote a file named "-" (and "-.lock") in the cwd.
    monkeypatch.chdir(tmp_path)
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text('{"format_version": 2, "fingerprint": {}, "entries": []}')
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: argument {command[-2]}")
    assert "a tuning cache must be a file, not '-'" in line
    assert not (tmp_path / "-").exists() and not (tmp_path / "-.lock").exists()


def test_graphtune_cache_dash_is_refused_before_any_work(tmp_path, monkeypatch):
    from graphtune.cli._args import tuning_cache_path
    from graphtune.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHTUNE_CACHE", "-")
    with pytest.raises(ConfigError, match=r"GRAPHTUNE_CACHE .*: -: a tuning cache must be a file"):
        tuning_cache_path(None, "--cache")
    assert list(tmp_path.iterdir()) == []
