"""One-line errors for values too long to print: an int past 4300 digits (whose ``repr`` raises
``ValueError``) or of 400 digits is described by its number of digits, at every entry point
that names a bad number (graphtune.finite_json.brief)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from graphtune.errors import CheckpointError, ConfigError
from graphtune.finite_json import brief

HUGE = 10**5000


@pytest.mark.parametrize("value", [HUGE, -HUGE, 10**400], ids=["huge", "negative", "401"])
def test_brief_gives_a_huge_int_by_its_digits(value):
    text = brief(value)
    assert "int of about" in text and "digits" in text and len(text) < 60
    assert ("negative" in text) == (value < 0)


def test_brief_never_raises_and_stays_short():
    assert brief(1e-6) == "1e-06" and brief(True) == "True" and brief(2**100) == repr(2**100)
    assert brief([HUGE]) == "a list"  # repr of the list raises ValueError
    assert brief("x" * 100).endswith("...") and len(brief("x" * 100)) == 40
    assert brief(np.zeros((3, 4))) == "a ndarray of shape (3, 4)"
    assert brief(np.float64(0.5)) == repr(np.float64(0.5))


def entry_points():
    from graphtune.engine import hf_fields
    from graphtune.engine.config import ModelConfig, RopeScaling
    from graphtune.engine.step_refine import refine_in_step
    from graphtune.ops.rmsnorm import check_eps

    step = SimpleNamespace(tuner=object(), model=SimpleNamespace(parallel=None))
    return [
        ("check_eps", lambda v: check_eps("rms_norm", v), ConfigError),
        (
            "hf_float",
            lambda v: hf_fields.hf_float({"rope_theta": v}, "rope_theta"),
            CheckpointError,
        ),
        ("refine_in_step", lambda v: refine_in_step(step, None, band=v), ConfigError),
        ("RopeScaling", lambda v: RopeScaling("linear", factor=v), ConfigError),
        (
            "ModelConfig.rope_theta",
            lambda v: ModelConfig("m", "llama", 256, 64, 128, 2, 4, 2, rope_theta=v),
            ConfigError,
        ),
        (
            "ModelConfig.hidden_size",
            lambda v: ModelConfig("m", "llama", 256, -v, 128, 2, 4, 2),
            ConfigError,
        ),
    ]


@pytest.mark.parametrize("index", range(6))
@pytest.mark.parametrize("value", [HUGE, 10**400], ids=["5001-digits", "401-digits"])
def test_a_huge_int_is_a_one_line_error_at_every_entry_point(index, value):
    # repr() of 10**5000 raised ValueError out of check_eps and hf_float (and str() out of the
    # ModelConfig and RopeScaling checks); 10**400 printed all of its 401 digits.
    name, call, error = entry_points()[index]
    with pytest.raises(error) as caught:
        call(value)
    message = str(caught.value)
    assert "int of about" in message and "digits" in message, (name, message)
    assert "\n" not in message and len(message) < 400, (name, message)
