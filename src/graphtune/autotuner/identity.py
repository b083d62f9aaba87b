"""What identifies a runner in a cache key: its class, its configuration and its source code.

* :func:`runner_id` is ``module.QualName``, followed by the runner's ``cache_key_extras()`` as
  canonical JSON when that is not empty. By default the extras are the runner's configuration
  (:func:`runner_config`): every instance attribute whose name does not start with ``_``, minus
  the class's ``identity_excludes``, as ``{name: value}`` in :func:`~graphtune.autotuner.values.
  identity_value` form. So two instances built with ``block_size=128`` and ``block_size=256``
  never share a pick, and an attribute without a stable value raises an error naming it.
  ``cache_key_extras()`` must return a tuple (or list): anything else is an
  :class:`~graphtune.autotuner.values.IdentityError`.
* A runner class defined inside a function (``<locals>`` in its qualified name) is a new class
  object each time the function runs, with one id, and what tells those apart often lives in
  the function's variables, which the id cannot see. Unless such a class overrides
  ``cache_key_extras()`` itself, a tuner refuses (``IdentityError``) a second class object whose
  id equals that of one it has seen but whose definition differs: its methods' code, closure
  values or default argument values, or its class attributes (:class:`LocalClasses`). Across
  processes nothing can tell them apart: a factory of runner classes must put what differs in
  ``cache_key_extras()``.
* :func:`sources_digest` hashes the source files of the modules that define a runner's class and
  its base classes (up to :class:`~graphtune.autotuner.runner.TunableRunner`), plus the modules
  its class lists in ``source_modules`` (for example the module of its Triton kernels). It is
  part of every cache key, so editing a kernel invalidates its picks. Each file is read and
  hashed once per process. A class whose module has no file (``python -c``, a notebook) is
  hashed by its source text (:func:`class_digest`), or warned about once when it has none.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import logging
import sys
import types
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from graphtune.autotuner.values import IdentityError, canonical_text, identity_value

logger = logging.getLogger(__name__)

#: Modules whose classes are never part of a runner's source identity (the interface itself).
_INTERFACE_MODULES = frozenset({"builtins", "abc", "graphtune.autotuner.runner"})


def _attribute_names(obj: Any) -> list[str]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    seen: dict[str, None] = {}
    for name in names:
        if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
            seen.setdefault(name, None)
    return list(seen)


def runner_config(runner: Any) -> dict[str, Any]:
    """The configuration a runner's identity holds by default (see the module docstring): the
    values themselves, each checked to have a stable text.

    The values are returned as they are, not in their identity form: :func:`runner_id` turns
    them into it, and turning a tagged form (``{"__dtype__": ...}``) into it again would read it
    as a plain dict that looks like a tag.

    Raises:
        IdentityError: An attribute's value has no stable text (names the attribute).
    """
    owner = type(runner).__qualname__
    config = {name: getattr(runner, name) for name in identity_attributes(runner)}
    for name, value in config.items():
        identity_value(value, f"attribute {name!r} of {owner}")  # the error names the attribute
    return config


def identity_attributes(runner: Any) -> list[str]:
    """The names of the attributes :func:`runner_config` holds, sorted: the public ones (no
    leading ``_``), minus the class's ``identity_excludes``."""
    excluded = set(getattr(type(runner), "identity_excludes", ()))
    return [
        name
        for name in sorted(_attribute_names(runner))
        if not name.startswith("_") and name not in excluded
    ]


def runner_id(runner: Any) -> str:
    """Stable identity of a runner for cache keys: ``module.QualName`` plus its extras as JSON.

    Raises:
        IdentityError: The extras hold a value without a stable text.
    """
    cls = type(runner)
    ident = f"{cls.__module__}.{cls.__qualname__}"
    extras = runner.cache_key_extras()
    if not isinstance(extras, (tuple, list)):
        # list() of a dict keeps only its keys (runners of other values would share picks)
        raise IdentityError(
            f"cache_key_extras() of {ident} returned a {type(extras).__qualname__}, not a "
            "tuple; return a tuple of the values that tell runners apart, e.g. "
            "({'block': self.block},)."
        )
    if extras:
        ident += canonical_text(identity_value(list(extras), f"cache_key_extras() of {ident}"))
    return ident


class LocalClasses:
    """The runner classes defined inside a function (``<locals>`` in their qualified name) that
    one tuner has seen, by runner id, to refuse two of them that share an id but not a
    definition.

    Such a function makes a new class object each time it runs, all of one qualified name, and
    what tells them apart often lives in the function's variables (the closure), which the id
    cannot see: two of them with equal ids would be served each other's picks. So the first
    class seen under an id is remembered by its definition (:func:`_definition`: its methods'
    code, the values their closures and default arguments hold, its plain class attributes),
    and a later class object of that id must have the same one (a test that builds the same
    class per parametrization does). A class that overrides ``cache_key_extras()`` states its
    key itself and is trusted."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, ...]] = {}
        self._checked: weakref.WeakSet[type] = weakref.WeakSet()

    def check(self, runners: Sequence[Any], ids: Sequence[str]) -> None:
        """Records the local classes of ``runners`` (whose ids are ``ids``).

        Raises:
            IdentityError: A class of the same id but another definition was seen before.
        """
        for runner, ident in zip(runners, ids, strict=True):
            cls = type(runner)
            if cls in self._checked or "<locals>" not in cls.__qualname__:
                continue
            if not _overrides_extras(cls):
                definition = _definition(cls)
                if self._seen.setdefault(ident, definition) != definition:
                    raise IdentityError(
                        f"runner class {ident} was defined twice inside a function with "
                        "different code, closure or default values, and one id, so their "
                        "picks would be shared; override cache_key_extras() to return what "
                        "tells them apart, e.g. (kind,), or define the class at module level."
                    )
            self._checked.add(cls)


def _definition(cls: type) -> tuple[Any, ...]:
    """What a class made in a function is, beyond its name: per class of its MRO made in a
    function, each attribute's code object, closure values and default argument values
    (functions, methods) or value.
    Values are compared by their stable text where they have one, else by identity, so an
    object that cannot be compared makes two definitions differ (refused, never shared)."""
    parts: list[Any] = []
    for klass in cls.__mro__:
        if "<locals>" not in klass.__qualname__:
            continue
        for name, value in sorted(vars(klass).items()):
            if name in ("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"):
                continue
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            code = getattr(function, "__code__", None)
            if code is None:
                parts.append((name, _comparable(value)))
                continue
            cells: list[Any] = []
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell (a name not bound yet)
                    cells.append(None)
                    continue
                # super()'s __class__ cell holds the class itself: new with every class object
                cells.append("__class__" if content is klass else _comparable(content))
            # Defaults too: `def forward(self, inputs, *, tactic=-1, _block=block)` made in a
            # loop binds the loop's value there, not in a closure.
            # Compared value by value, as closure cells are (a class default is compared by
            # identity, not made the whole tuple's).
            defaults = tuple(map(_comparable, getattr(function, "__defaults__", None) or ()))
            kwdefaults = tuple(
                (key, _comparable(default))
                for key, default in sorted(
                    (getattr(function, "__kwdefaults__", None) or {}).items()
                )
            )
            parts.append((name, code, tuple(cells), defaults, kwdefaults))
    return tuple(parts)


def _overrides_extras(cls: type) -> bool:
    """Whether a class defined in a function (``cls`` or a local base) states its key: an
    override inherited from a module-level base cannot know the closure of ``cls``."""
    return any("<locals>" in c.__qualname__ and "cache_key_extras" in vars(c) for c in cls.__mro__)


def _comparable(value: Any) -> Any:
    if isinstance(value, type):
        return value  # a class compares by identity; a local one inside is checked on its own
    if isinstance(value, types.FunctionType):
        # A lambda or local function (a default `_act=lambda t: t.relu()`) is a new object per
        # factory call: compared by its code, so the same definition built again is the same.
        return ("function", value.__code__)
    try:
        return canonical_text(identity_value(value, "a class attribute"))
    except (IdentityError, TypeError, ValueError, RecursionError):
        return ("object", id(value))


def short_runner_name(ident: str) -> str:
    """The class name part of a runner id, for tables."""
    base, bracket, rest = ident.partition("[")
    return base.rsplit(".", 1)[-1] + (bracket + rest if bracket else "")


@functools.cache
def module_digest(name: str) -> str:
    """SHA-256 of the source file of module ``name`` (``""`` when it has none), once per process.

    A loaded module's ``__file__`` is used; otherwise the file is located without importing it.
    """
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    if not path or not path.endswith(".py"):
        return ""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return ""


#: Per class: the modules behind its source identity, and the classes of its hierarchy whose
#: module has no source file (hashed by their own text). Both depend only on the class (module
#: digests are fixed per process), so the tuner's miss path pays one look-up per runner.
_CLASS_SOURCES: dict[type, tuple[tuple[str, ...], tuple[type, ...]]] = {}


def _class_sources(cls: type) -> tuple[tuple[str, ...], tuple[type, ...]]:
    found = _CLASS_SOURCES.get(cls)
    if found is None:
        classes = [c for c in cls.__mro__ if c.__module__ not in _INTERFACE_MODULES]
        names = {c.__module__ for c in classes}
        names.update(getattr(cls, "source_modules", ()))
        fileless = tuple(c for c in classes if not module_digest(c.__module__))
        found = _CLASS_SOURCES[cls] = (tuple(sorted(names)), fileless)
    return found


def source_modules(runners: Iterable[Any]) -> tuple[str, ...]:
    """Every module whose source is part of these runners' identity, sorted."""
    names: set[str] = set()
    for runner in runners:
        names.update(_class_sources(type(runner))[0])
    return tuple(sorted(names))


def sources_digest(runners: Sequence[Any]) -> str:
    """A 16-hex-digit hash of the source files behind ``runners`` (see the module docstring).

    A class of a module without a source file (defined in ``python -c``, a notebook, an
    interactive session) is hashed by its own source text instead (:func:`class_digest`).
    """
    names: set[str] = set()
    fileless: list[type] = []
    for runner in runners:
        modules, classes = _CLASS_SOURCES.get(type(runner)) or _class_sources(type(runner))
        names.update(modules)
        fileless += classes
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(f"{name}={module_digest(name)};".encode())
    if fileless:
        for cls in sorted(dict.fromkeys(fileless), key=lambda c: (c.__module__, c.__qualname__)):
            h.update(f"{cls.__module__}.{cls.__qualname__}={class_digest(cls)};".encode())
    return h.hexdigest()[:16]


_CLASS_DIGESTS: dict[type, str] = {}


def class_digest(cls: type) -> str:
    """SHA-256 of ``cls``'s source text, once per class; ``""`` when none can be found, with one
    warning, since editing such a class cannot invalidate its cached picks.

    ``inspect.getsource`` finds the class through its module's file; a class of a notebook cell
    has none, but its methods' code names the cell, whose text ``linecache`` holds, so the
    methods' sources are hashed then.
    """
    found = _CLASS_DIGESTS.get(cls)
    if found is None:
        text = _class_source(cls)
        found = _CLASS_DIGESTS[cls] = hashlib.sha256(text.encode()).hexdigest() if text else ""
        if not text:
            logger.warning(
                "Runner class %s.%s has no source graphtune can read (defined in `python -c` or "
                "an interactive session?), so editing it will not invalidate its cached picks; "
                "define it in a module file, or re-tune after each edit.",
                cls.__module__,
                cls.__qualname__,
            )
    return found


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        pass
    parts = []
    for name, value in sorted(vars(cls).items()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value):
            try:
                parts.append(f"{name}:{inspect.getsource(value)}")
            except (OSError, TypeError):
                continue
    return "\n".join(parts)
