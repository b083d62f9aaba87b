"""What the tuner requires of a runner's methods, checked where a call fails: ``get_valid_tactics``
returns a sequence of tactics, and ``get_valid_tactics(inputs, profile, **kwargs)`` and
``forward(inputs, tactic=..., **kwargs)`` take the calls the tuner makes (TensorRT-LLM's runner
signatures; ``kwargs`` are ``choose_one``'s extra keyword arguments)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from graphtune.errors import ConfigError

_DECLARATIONS = {
    "get_valid_tactics": (
        "get_valid_tactics(inputs, profile, **kwargs)",
        "get_valid_tactics(self, inputs, profile, **kwargs)",
    ),
    "forward": (
        "forward(inputs, tactic=..., **kwargs)",
        "forward(self, inputs, *, tactic=-1, **kwargs)",
    ),
}


#: Parameter names of the calls graphtune makes, ``get_valid_tactics(inputs, profile, **kw)``
#: and ``forward(inputs, tactic=..., **kw)``: a ``choose_one`` keyword argument of one of these
#: names would reach the runner twice (a ``TypeError`` deep in tuning, counted as a failed
#: tactic, or an error blaming the runner's signature).
RESERVED_KEYWORDS = ("inputs", "profile", "tactic")


def refuse_reserved_keywords(caller: str, op: str, kwargs: dict[str, Any]) -> None:
    """Checks that no keyword argument of ``caller`` (``choose_one``, ``check_tactics``) for
    ``op`` uses a name of :data:`RESERVED_KEYWORDS`.

    Raises:
        ConfigError: One does (the error names it and says to rename it).
    """
    taken = [name for name in RESERVED_KEYWORDS if name in kwargs]
    if taken:
        raise ConfigError(
            f"{caller}({op!r}): keyword argument {taken[0]!r} is a name graphtune passes "
            "itself (get_valid_tactics(inputs, profile, **kwargs), forward(inputs, tactic=..., "
            f"**kwargs)), so the runner would get it twice; rename it (e.g. {taken[0]}_arg=...)."
        )


def tactic_list(runner: Any, found: Any) -> list[Any]:
    """What ``get_valid_tactics`` returned, as a list; :class:`ConfigError` when it is no
    sequence of tactics (a string would otherwise be tuned letter by letter)."""
    if isinstance(found, (str, bytes, dict, set, frozenset)) or not isinstance(found, Iterable):
        raise ConfigError(
            f"{type(runner).__qualname__}.get_valid_tactics must return a list of tactics, got "
            f"{type(found).__name__} {found!r:.60}"
        )
    return list(found)


def takes(method: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``method`` can be called with these arguments (a signature that cannot be read,
    a builtin's, counts as yes)."""
    try:
        inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def signature_error(where: str, runner: Any, method: str, kwargs: dict[str, Any]) -> ConfigError:
    """The error for a runner whose ``method`` (``"get_valid_tactics"`` or ``"forward"``) cannot
    take the tuner's call (:func:`takes` said no), naming the declaration to use."""
    call, declaration = _DECLARATIONS[method]
    return ConfigError(
        f"{where}: {type(runner).__qualname__}.{method} cannot take the call graphtune makes, "
        f"{call} with choose_one's keyword arguments {sorted(kwargs)}; declare {declaration}."
    )
