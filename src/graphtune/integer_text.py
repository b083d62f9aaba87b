"""The one rule for an integer written as text, as every command-line flag and environment
variable of graphtune takes it: ASCII digits with an optional leading sign (``12``, ``+3``,
``-1``), blanks around them ignored.

Python's ``int()`` alone is too lenient for input a person types: it also takes ``1_0`` (a
literal's digit separator) and the digits of other scripts (``٣``, the full-width ``１``), so a
slip would run a quietly different command. A value's range (``>= 1``, a rank below the world
size) is each caller's own check. The standard library only: the command's parser imports this
without torch.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?[0-9]+")


def parse_integer(text: str) -> int:
    """The integer ``text`` spells under the module's rule.

    Raises:
        ValueError: ``text`` is not ASCII digits with an optional leading sign (blanks around
            them aside); the message quotes it.
    """
    stripped = text.strip()
    if not _INTEGER.fullmatch(stripped):
        raise ValueError(f"not an integer (ASCII digits with an optional sign): {text!r}")
    return int(stripped)
