"""The ``graphtune`` command as a user runs it (a subprocess): bad input is one ``error:`` line
and exit 2 (usage) or 1 (failure), never a traceback; Ctrl-C is one line, exit 130, and what
finished is kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The command as a user runs it: other test modules switch on Triton's interpreter in this
# process, which would make CPU tuning time interpreted Triton tactics for minutes.
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
ENV.update(PYTHONPATH=str(ROOT / "src"), GRAPHTUNE_NO_PROGRESS="1")


def graphtune(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphtune", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


def error_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Asserts the exit code, exactly one ``error:`` line and no traceback; returns the line."""
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama checkpoint saved by transformers, with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=24,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    vocab = {"[UNK]": 0, "hello": 5, "2024": 6, "world": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for file in folder.iterdir():
        (dest / file.name).write_bytes(file.read_bytes())
    return dest


# -- usage errors: argparse, exit 2, before torch is imported ---------------------------------


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["generate", "--model", "tiny", "--prompt-ids", "1", "--max-new-tokens", "-5"],
            "--max-new-tokens: must be >= 1, got -5",
        ),
        (
            ["generate", "--model", "tiny", "--prompt-ids", "1", "--max-seq-len", "0"],
            "--max-seq-len: must be >= 2, got 0",
        ),
        (
            ["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "bogus"],
            "'bogus' is not a device",
        ),
        (["generate", "--model", "tiny", "--prompt-ids", "1", "--dtype", "int8"], "--dtype"),
        (["generate", "--model", "tiny", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["bench", "decode", "--dtype", "int8"], "--dtype"),
        (["bench", "decode", "--device", "bogus"], "--device"),
        (["bench", "decode", "--steps", "0"], "--steps"),
        (["tune", "--model", "tiny", "--cache", "c.json", "--dtype", "int8"], "--dtype"),
        (["demo", "--device", "bogus"], "--device"),
        (["cache", "unblock", "c.json", "--tactic", "{bad"], "--tactic"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, fragment):
    error_line(graphtune(*args), 2, fragment)


def test_bare_group_behaves_like_bare_graphtune():
    bare, bench = graphtune(), graphtune("bench")
    assert bare.returncode == bench.returncode == 0
    assert "usage: graphtune" in bare.stdout and "decode" in bench.stdout
    assert not bare.stderr and not bench.stderr


# -- failures: exit 1, one line ------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "tiny", "--prompt-ids", "1"],
        ["bench", "decode", "--model", "tiny"],
        ["tune", "--model", "tiny", "--cache", "unused.json"],
        ["demo"],
    ],
)
def test_cuda_device_without_cuda_is_one_line(args, tmp_path):
    result = graphtune(*args, "--device", "cuda")
    error_line(result, 1, "CUDA is not available", "--device cpu")
    assert not (tmp_path / "unused.json").exists()


def test_missing_folder_is_not_called_an_unknown_preset(tmp_path):
    line = error_line(
        graphtune("generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"),
        1,
        "is not an existing folder and not a preset",
    )
    assert "unknown model preset" not in line


def test_broken_checkpoint_files_are_one_line(checkpoint, tmp_path):
    truncated = _copy(checkpoint, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    error_line(
        graphtune(
            "generate",
            "--model",
            str(truncated),
            "--prompt-ids",
            "1",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
        ),
        1,
        "model.safetensors",
        "truncated",
    )
    bad_config = _copy(checkpoint, tmp_path / "config")
    (bad_config / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    error_line(
        graphtune("tune", "--model", str(bad_config), "--cache", str(tmp_path / "c.json")),
        1,
        "config.json",
        "not valid JSON",
    )
    bad_index = _copy(checkpoint, tmp_path / "index")
    (bad_index / "model.safetensors").unlink()  # read before any index, as transformers does
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    error_line(
        graphtune(
            "generate",
            "--model",
            str(bad_index),
            "--prompt-ids",
            "1",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
        ),
        1,
        "model.safetensors.index.json",
    )
    refused = _copy(checkpoint, tmp_path / "refused")
    doc = json.loads((refused / "config.json").read_text())
    (refused / "config.json").write_text(json.dumps({**doc, "attention_bias": True}))
    error_line(
        graphtune(
            "generate",
            "--model",
            str(refused),
            "--prompt-ids",
            "1",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
        ),
        1,
        "attention_bias=True",
    )


def test_prompt_is_text_when_a_tokenizer_exists(checkpoint):
    common = ["--model", str(checkpoint), "--device", "cpu", "--max-new-tokens", "3"]
    text = graphtune("generate", *common, "--prompt", "2024", "--ignore-eos")
    assert text.returncode == 0, text.stderr
    ids = graphtune("generate", *common, "--prompt-ids", "6", "--ignore-eos")
    tokens = [line for line in text.stdout.splitlines() if line.startswith("tokens:")]
    assert tokens == [line for line in ids.stdout.splitlines() if line.startswith("tokens:")]
    # As ids, 2024 is outside the 64-token vocabulary: refused before the weights load.
    error_line(graphtune("generate", *common, "--prompt-ids", "2024"), 1, "outside [0, 64)")


def test_sequence_length_rules_are_one_line(checkpoint):
    common = ["--model", str(checkpoint), "--device", "cpu"]
    ids = ",".join(["5"] * 20)
    # One rule, one wording, for generate and bench: max_position_embeddings is 24.
    gen = error_line(
        graphtune("generate", *common, "--prompt-ids", ids, "--max-new-tokens", "8"),
        1,
        "max_position_embeddings=24",
    )
    bench = error_line(
        graphtune("bench", "decode", *common, "--context", "30"), 1, "max_position_embeddings=24"
    )
    assert gen.split("more than")[1] == bench.split("more than")[1]
    error_line(
        graphtune(
            "generate",
            *common,
            "--prompt-ids",
            "5,6",
            "--max-new-tokens",
            "4",
            "--max-seq-len",
            "4",
        ),
        1,
        "--max-seq-len 4 is too small",
        "raise --max-seq-len",
    )


def test_bench_output_paths_are_checked_before_the_run(tmp_path):
    common = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1"]
    missing = graphtune(*common, "--json", str(tmp_path / "no" / "such" / "r.json"))
    error_line(missing, 1, "--json", "does not exist")
    assert "batch 1" not in missing.stderr  # nothing ran
    if os.access("/sys", os.W_OK) and Path("/sys").is_dir() and os.geteuid() != 0:
        pytest.skip("needs an unwritable folder")
    unwritable = graphtune(*common, "--plot", "/sys/graphtune-test.png")
    error_line(unwritable, 1, "--plot", "cannot write")
    assert "batch 1" not in unwritable.stderr


def test_bench_json_to_stdout_puts_the_table_on_stderr():
    result = graphtune(
        "bench",
        "decode",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--context",
        "8",
        "--json",
        "-",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    assert "eager ms" in result.stderr and "eager ms" not in result.stdout


def test_tune_refine_in_step_off_cuda_is_refused_before_any_tuning(tmp_path):
    cache = tmp_path / "c.json"
    result = graphtune(
        "tune", "--model", "tiny", "--cache", str(cache), "--device", "cpu", "--refine-in-step"
    )
    error_line(result, 1, "--refine-in-step", "drop it")
    assert not cache.exists()


def test_cache_lock_failure_is_immediate_and_names_the_reason(tmp_path):
    if not Path("/sys").is_dir():
        pytest.skip("needs /sys")
    result = graphtune(
        "tune", "--model", "tiny", "--cache", "/sys/graphtune.json", "--device", "cpu", timeout=60
    )
    error_line(result, 1, "--cache", "cannot write")


def test_cache_verify_of_missing_and_binary_files(tmp_path):
    error_line(graphtune("cache", "verify", str(tmp_path / "missing.json")), 1, "does not exist")
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(256)))
    error_line(graphtune("cache", "verify", str(binary)), 1, "not UTF-8")


# -- Ctrl-C ----------------------------------------------------------------------------------------


def test_ctrl_c_during_bench_keeps_finished_batch_sizes(tmp_path):
    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphtune",
            "bench",
            "decode",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,256,512",
            "--context",
            "1024",
            "--steps",
            "50",
            "--repeats",
            "5",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("batch 1: eager"):
            proc.send_signal(signal.SIGINT)
            break
    stdout, rest = proc.communicate(timeout=120)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(seen) + rest)
    line = error_line(result, 130, "interrupted (Ctrl-C)", "finished batch sizes [1]")
    assert "eager ms" in stdout  # the table of what finished
    data = json.loads(out.read_text())
    assert data["results"][0]["eager_ms"] > 0 and data["results"][2]["eager_ms"] is None
    assert str(out) in line


#: Runs the CLI with Ctrl-C arriving as the decode step runs for the N-th time (argv[1]).
_INTERRUPT_AT_STEP = """
import sys
import graphtune.engine.step as step
real = step.DecodeStep.decode
calls, at = [], int(sys.argv.pop(1))
def interrupted(self, *args):
    calls.append(1)
    if len(calls) == at:
        raise KeyboardInterrupt
    return real(self, *args)
step.DecodeStep.decode = interrupted
from graphtune.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_tune_keeps_the_finished_picks(tmp_path):
    cache = tmp_path / "partial.json"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _INTERRUPT_AT_STEP,
            "3",
            "tune",
            "--model",
            "tiny",
            "--cache",
            str(cache),
            "--device",
            "cpu",
            "--max-batch",
            "2",
            "--max-seq-len",
            "64",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
    )
    error_line(result, 130, "interrupted (Ctrl-C)", "picks kept in")
    # Run 1 records the step's op calls, run 2 (batch 1, tuning mode, single ops) tunes every
    # bucket of every single op, run 3 (batch 2) is interrupted: those picks are kept.
    assert len(json.loads(cache.read_text())["entries"]) > 0


def test_ctrl_c_during_tune_with_a_failing_save_says_where_the_picks_went(tmp_path):
    cache = tmp_path / "partial.json"
    # The cache's disk is full when autotune() saves after the interrupt; the temp folder is not.
    failing_save = _INTERRUPT_AT_STEP.replace(
        "from graphtune.cli.main import main",
        "import graphtune.autotuner.persist as persist\n"
        "def full(tmp): raise OSError(28, 'No space left on device')\n"
        "persist._after_temp_write = full\n"
        "from graphtune.cli.main import main",
    )
    args = ["tune", "--model", "tiny", "--cache", str(cache), "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, "-c", failing_save, "3", *args, "--max-batch", "2", "--max-seq-len", "64"],
        capture_output=True,
        text=True,
        env={**ENV, "TMPDIR": str(tmp_path)},
        timeout=240,
    )
    error_line(result, 130, "interrupted (Ctrl-C)", "could not be saved to")
    assert "kept in" not in result.stderr and not cache.exists()
    (kept,) = tmp_path.glob("graphtune-*-partial.json")
    assert str(kept) in result.stderr and json.loads(kept.read_text())["entries"]


def test_ctrl_c_during_generate_is_one_line():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _INTERRUPT_AT_STEP,
            "2",
            "generate",
            "--model",
            "tiny",
            "--prompt-ids",
            "1,2",
            "--device",
            "cpu",
            "--runner",
            "eager",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
    )
    error_line(result, 130, "interrupted (Ctrl-C)")


def test_generate_from_weights_with_nan_is_a_failure_not_empty_output(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from graphtune.cli.main import main

    folder = _copy(checkpoint, tmp_path / "nan")
    (weights_file,) = folder.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, weights_file, metadata={"format": "pt"})
    args = ["generate", "--model", str(folder), "--prompt-ids", "1,2", "--device", "cpu"]
    assert main([*args, "--max-new-tokens", "2"]) == 1
    captured = capsys.readouterr()
    assert "tokens: \n" in captured.out  # what it had, printed: nothing
    (error,) = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert "1 of 1 requests stopped early" in error and "not finite" in error
