"""graphtune.finite_json: JSON without NaN and Infinity, with the field that held one named."""

from __future__ import annotations

import pytest

from graphtune.finite_json import NonFiniteNumber, finite_float, parse_json


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


@pytest.mark.parametrize(
    "text, constant, field",
    [
        ('{"rope_theta": 1' + "0" * 400 + "}", "1000000000... (401 digits)", "rope_theta"),
        ("[-2" + "0" * 308 + "]", "-2000000000... (309 digits)", None),
    ],
)
def test_integers_too_large_for_a_float_are_refused_naming_their_field(text, constant, field):
    # json reads them as ints, and float() of one raised OverflowError wherever it was used.
    with pytest.raises(NonFiniteNumber) as info:
        parse_json(text)
    assert (info.value.constant, info.value.field) == (constant, field)
    assert "too large for a float" in str(info.value) and len(str(info.value)) < 100
    largest = int(1.7976931348623157e308)
    assert parse_json(f"[{largest}, -{largest}]") == [largest, -largest]


def test_finite_float_is_false_for_what_is_no_finite_float():
    for value in (1, -2.5, 0, 10**300):
        assert finite_float(value)
    for value in (10**400, -(10**400), float("nan"), float("inf"), True, "1", None):
        assert not finite_float(value)


def test_finite_json_and_the_strings_nan_and_infinity_pass():
    doc = parse_json('{"a": [1, 2.5, "NaN", {"b": "Infinity"}], "c": null, "d": 1e308}')
    assert doc == {"a": [1, 2.5, "NaN", {"b": "Infinity"}], "c": None, "d": 1e308}
    assert type(doc["a"][2]) is str  # a plain string, not the parser's marker


def test_text_that_is_not_json_is_a_value_error_of_its_own():
    with pytest.raises(ValueError) as info:
        parse_json('{"a": ')
    assert not isinstance(info.value, NonFiniteNumber)
