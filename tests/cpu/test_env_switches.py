"""The on/off ``GRAPHTUNE_*`` variables: the documented on and off spellings, empty as unset, and
anything else refused in one line that names the variable, its value and the allowed values."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_cli_errors import ENV, error_line

from graphtune import env
from graphtune.errors import ConfigError

READERS = {
    "GRAPHTUNE_DEBUG": env.debug_checks,
    "GRAPHTUNE_DISABLE_GRAPHS": env.graphs_disabled,
    "GRAPHTUNE_STRICT_CACHE": env.strict_cache,
    "GRAPHTUNE_CACHE_ONLY": env.cache_only,
    "GRAPHTUNE_NO_PROGRESS": env.progress_disabled,
}


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize("value,on", [("1", True), (" Yes ", True), ("ON", True), ("true", True)])
def test_on_spellings(monkeypatch, name, value, on):
    monkeypatch.setenv(name, value)
    assert READERS[name]() is on


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize("value", ["0", "false", "No", "off", "", "  "])
def test_off_spellings_and_empty(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert READERS[name]() is False


@pytest.mark.parametrize("name", [*sorted(READERS), "GRAPHTUNE_PDL"])
@pytest.mark.parametrize("value", ["enabled", "2", "Y"])
def test_junk_values_are_refused_naming_variable_value_and_choices(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    read = READERS.get(name, env.pdl_allowed)
    with pytest.raises(ConfigError) as info:
        read()
    message = str(info.value)
    assert "\n" not in message and f"{name}={value!r}" in message
    assert "1, on, true, yes" in message and "0, false, no, off" in message


def test_pdl_stays_on_unless_switched_off(monkeypatch):
    for value, allowed in (("", True), ("1", True), ("off", False), ("0", False)):
        monkeypatch.setenv("GRAPHTUNE_PDL", value)
        assert env.pdl_allowed() is allowed


def _run(code_or_args: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_args],
        capture_output=True,
        text=True,
        env={**ENV, **extra},
        timeout=120,
    )


def test_import_works_with_a_junk_value_and_the_cli_refuses_it_in_one_line(tmp_path):
    imported = _run(["-c", "import graphtune, graphtune.cli.main"], GRAPHTUNE_STRICT_CACHE="2")
    assert imported.returncode == 0, imported.stderr
    cache = tmp_path / "c.json"
    result = _run(
        ["-m", "graphtune", "tune", "--model", "tiny", "--device", "cpu", "--cache", str(cache)],
        GRAPHTUNE_STRICT_CACHE="enabled",
    )
    error_line(result, 1, "GRAPHTUNE_STRICT_CACHE='enabled'", "unset it")
    assert not cache.exists()  # refused before any work


def test_tuning_refuses_a_junk_switch_instead_of_failing_every_kernel_tactic(
    monkeypatch, tmp_path
) -> None:
    # The kernels read GRAPHTUNE_PDL at every launch: with a junk value each Triton tactic
    # raised, the tuner counted that as a failed tactic, and torch's pick was saved for good.
    import torch

    from graphtune.autotuner import AutoTuner, TunableRunner, TuningConfig, autotune

    class Launches(TunableRunner):
        def get_valid_tactics(self, inputs, profile, **kwargs):
            return [0, 1]

        def forward(self, inputs, *, tactic=-1, **kwargs):
            env.pdl_allowed()  # as graphtune.ops' launches do
            return inputs[0] * 2

    monkeypatch.setenv("GRAPHTUNE_PDL", "enabled")
    path = tmp_path / "c.json"
    tuner = AutoTuner(show_progress=False)
    with pytest.raises(ConfigError, match="GRAPHTUNE_PDL"), autotune(path, tuner):
        tuner.choose_one("op", [Launches()], TuningConfig(), [torch.ones(4)])
    assert not path.exists() and tuner.stats.tactic_failures == {}
