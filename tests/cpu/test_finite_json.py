"""graphtune.finite_json: JSON without NaN and Infinity, with the field that held one named."""

from __future__ import annotations

import pytest

from graphtune.finite_json import NonFiniteNumber, parse_json


@pytest.mark.parametrize(
    "text, constant, field",
    [
        ('{"time_us": NaN}', "NaN", "time_us"),
        ('{"a": {"factor": Infinity}}', "Infinity", "factor"),
        ('{"times": [1.0, [2.0, -Infinity]]}', "-Infinity", "times"),
        ("[1, NaN]", "NaN", None),
        ("NaN", "NaN", None),
        # A number too large for a float parsed as inf before.
        ('{"time_ms": 1e999}', "1e999", "time_ms"),
        ('{"eps": [-1e400]}', "-1e400", "eps"),
    ],
)
def test_non_finite_constants_are_refused_naming_their_field(text, constant, field):
    with pytest.raises(NonFiniteNumber) as info:
        parse_json(text)
    assert (info.value.constant, info.value.field) == (constant, field)
    assert isinstance(info.value, ValueError)  # callers that catch bad JSON catch it too


def test_finite_json_and_the_strings_nan_and_infinity_pass():
    doc = parse_json('{"a": [1, 2.5, "NaN", {"b": "Infinity"}], "c": null, "d": 1e308}')
    assert doc == {"a": [1, 2.5, "NaN", {"b": "Infinity"}], "c": None, "d": 1e308}
    assert type(doc["a"][2]) is str  # a plain string, not the parser's marker


def test_text_that_is_not_json_is_a_value_error_of_its_own():
    with pytest.raises(ValueError) as info:
        parse_json('{"a": ')
    assert not isinstance(info.value, NonFiniteNumber)
