"""A KV cache too big for the host's free memory is refused before it is allocated (Linux would
let the zeros "succeed" and its out-of-memory killer end the process with no message); the
memory figure is faked here, never exhausted."""

from __future__ import annotations

import pytest

from graphtune.cli.main import main
from graphtune.engine import kv_cache
from graphtune.engine.presets import PRESETS
from graphtune.errors import ConfigError


@pytest.fixture
def little_free_memory(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 64 * 1024)


def test_a_cache_above_the_free_host_memory_is_refused_before_allocating(little_free_memory):
    with pytest.raises(ConfigError) as info:
        kv_cache.KVCache(PRESETS["tiny"], 4, 256, "cpu")
    message = str(info.value)
    assert "\n" not in message and "the host has 0.0 GiB available" in message
    assert "lower max_batch_size or max_seq_len" in message
    kv_cache.KVCache(PRESETS["tiny"], 1, 16, "cpu", shared_layers=True)  # small enough


def test_available_host_memory_is_a_positive_byte_count_or_unknown():
    free = kv_cache.available_host_memory()
    assert free is None or free > 0


def test_available_host_memory_counts_reclaimable_page_cache(tmp_path):
    # MemAvailable, not MemFree: right after a checkpoint is read its files fill the page
    # cache, which the kernel gives back to a new allocation (sysconf's pages are MemFree).
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemFree: 1000 kB\nMemAvailable: 5000000 kB\n")
    assert kv_cache.available_host_memory(str(meminfo)) == 5000000 * 1024
    missing = kv_cache.available_host_memory(str(tmp_path / "none"))  # the sysconf fallback
    assert missing is None or missing > 0


@pytest.mark.parametrize(
    "command,flag,seq",
    [
        (["check-tactics", "--batch", "4", "--max-seq-len", "64"], "--batch 4", "--max-seq-len"),
        (
            ["tune", "--max-batch", "4", "--max-seq-len", "64", "--cache", "{tmp}/c.json"],
            "--max-batch 4",
            "--max-seq-len",
        ),
        # The cache holds --context + 1 positions, rounded up to 16: 64 for --context 63.
        (
            ["bench", "decode", "--batch-sizes", "1,4", "--context", "63"],
            "--batch-sizes 4",
            "--context",
        ),
    ],
)
def test_the_commands_name_their_flags(little_free_memory, tmp_path, capsys, command, flag, seq):
    args = [part.format(tmp=tmp_path) for part in command]
    assert main([*args, "--model", "tiny", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and "available" in line
    assert f"{flag} slots" in line and f"{seq} 64 positions" in line
    assert f"lower {flag.split()[0]} or {seq}" in line and "max_batch_size" not in line
