"""Bucket combinations -> concrete input shapes -> synthetic inputs.

A :class:`Profile` is one concrete set of input shapes to tune: the live shapes with every dynamic
dimension set to one of its buckets and every constrained dimension inferred. The same function
that builds profiles also maps a live call to its profile, so a lookup and the tuning run that
filled the cache always agree on the key.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.layouts import Layout, layout_text, tensor_layout
from graphtune.errors import ConfigError, InputError, add_context_note

Shape = tuple[int, ...]

# dtypes torch.randn can fill directly; others (float8, ...) are drawn in float32 and cast.
_RANDN_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}


@dataclass(frozen=True)
class Profile:
    """One tuned shape combination.

    Attributes:
        shapes: Shape of each input (``None`` for a non-tensor input).
        dtypes: dtype name of each tensor input, or the type text of a non-tensor
            (:func:`input_type_text`: with its tensors' dtypes and shapes for a container);
            a non-contiguous tensor's also names its layout (:func:`layout_text`).
        layouts: Per input, the :data:`Layout` of a tensor laid out like the live one at this
            profile's shape (:func:`tensor_layout`) where that is not contiguous, else ``None``
            (empty: all ``None``); its synthetic inputs are made with that stride order.
    """

    shapes: tuple[Shape | None, ...]
    dtypes: tuple[str, ...]
    layouts: tuple[Layout | None, ...] = ()

    def get_opt_shapes(self) -> tuple[Shape, ...]:
        """The shapes as TensorRT-LLM's ``OptimizationProfile.get_opt_shapes()`` gives them, for
        runners ported from it: one tuple per input, dynamic dimensions at their bucket, and
        ``(0,)`` for a non-tensor input (where :attr:`shapes` holds ``None``)."""
        return tuple(s if s is not None else (0,) for s in self.shapes)

    def describe(self) -> str:
        """Short human form, e.g. ``64x4096, 4096x4096``; a non-contiguous input adds its
        layout (``4096x64 order(1,0)``), so two layouts of one shape never read as one."""
        layouts = self.layouts or (None,) * len(self.shapes)
        return ", ".join(
            ("x".join(map(str, s)) if s is not None else "-")
            + (f" {layout_text(layout)}" if layout is not None else "")
            for s, layout in zip(self.shapes, layouts, strict=True)
        )


def input_type_text(x: Any) -> str:
    """An input's ``dtypes`` entry in the cache key: a tensor's dtype name (``float16``), a
    non-tensor's type name (``int``, ``NoneType``: its value is not part of the key), and for a
    list, tuple or dict that holds tensors, its type with each element's text, where a nested
    tensor adds its dtype and full shape: ``list(float16[64,128], int)``. (Only containers that
    hold tensors have their elements in the key, so all other keys stay as they were.)"""
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    if not holds_tensor(x):
        return type(x).__name__
    return _element_text(x)


def _element_text(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}[{','.join(map(str, x.shape))}]"
    if isinstance(x, dict):
        items = [f"{_dict_key_text(k)}: {_element_text(v)}" for k, v in x.items()]
    elif isinstance(x, (list, tuple)):
        items = [_element_text(v) for v in x]
    else:
        return type(x).__name__
    return f"{type(x).__name__}({', '.join(items)})"


def _dict_key_text(k: Any) -> str:
    # A repr of another type may hold a memory address, which would differ from run to run.
    return repr(k) if type(k) in (str, int, float, bool, type(None)) else type(k).__name__


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a list, tuple or dict with a tensor somewhere inside."""
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) or holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) or holds_tensor(v) for v in value)
    return False


def copy_tree(value: Any) -> Any:
    """``value`` with every tensor in it copied, inside lists, tuples and dicts too (so that a
    candidate never writes the caller's tensors, and a tensor shared by runs that are compared
    is not compared with itself)."""
    if isinstance(value, torch.Tensor):
        return _same_layout_copy(value)
    if isinstance(value, dict):
        return {k: copy_tree(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
        return type(value)(*(copy_tree(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tree(v) for v in value)
    return value


def _same_layout_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy with ``x``'s strides (``clone()`` makes a strided view contiguous, and a runner
    that mishandles strides would then pass the check); a layout that cannot be written
    element by element (a stride of 0) is cloned."""
    copy = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    try:
        return copy.copy_(x)
    except RuntimeError:
        return x.clone()


def nested_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or those in its lists, tuples and dicts, recursively."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in nested_tensors(v)]
    return []


def _resolve_dim(config_owner: str, inputs: Sequence[Any], input_idx: int, dim_idx: int) -> int:
    """Checks that the spec points at an existing tensor dimension; returns the non-negative dim."""
    if input_idx >= len(inputs):
        raise InputError(
            f"{config_owner}(input_idx={input_idx}) but choose_one got {len(inputs)} inputs; "
            "fix the spec's input_idx or pass the inputs in the order the specs assume."
        )
    x = inputs[input_idx]
    if not isinstance(x, torch.Tensor):
        raise InputError(
            f"{config_owner}(input_idx={input_idx}) points at a {type(x).__name__}, not a tensor; "
            "dynamic and constrained dimensions must belong to tensor inputs."
        )
    if not -x.dim() <= dim_idx < x.dim():
        raise InputError(
            f"{config_owner}(input_idx={input_idx}, dim_idx={dim_idx}) but input {input_idx} has "
            f"{x.dim()} dims (shape {tuple(x.shape)}); fix dim_idx."
        )
    return dim_idx % x.dim()


def _apply(config: TuningConfig, inputs: Sequence[Any], sizes: Sequence[int]) -> Profile:
    shapes: list[list[int] | None] = [
        list(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs
    ]
    for spec, size in zip(config.dynamic_specs, sizes, strict=True):
        dim = _resolve_dim("DynamicTensorSpec", inputs, spec.input_idx, spec.dim_idx)
        shapes[spec.input_idx][dim] = size  # type: ignore[index]
    for constraint in config.constraint_specs:
        dim = _resolve_dim("ConstraintSpec", inputs, constraint.input_idx, constraint.dim_idx)
        frozen = [tuple(s) if s is not None else None for s in shapes]
        try:
            value = constraint.infer(frozen)
        except Exception as exc:
            # The user's error keeps its type; the note says which spec failed on what.
            add_context_note(
                exc,
                f"in ConstraintSpec(input_idx={constraint.input_idx}, dim_idx="
                f"{constraint.dim_idx}).infer(shapes={frozen}) (None marks an input that is "
                "not a tensor)",
            )
            raise
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"ConstraintSpec(input_idx={constraint.input_idx}, dim_idx={constraint.dim_idx})"
                f".infer returned {value!r} for shapes {frozen}; it must return a non-negative int."
            )
        shapes[constraint.input_idx][dim] = value  # type: ignore[index]
    # Each input's layout at this profile's shape, not the live one's: at bucket 1 a transposed
    # input is contiguous, as a live batch-1 call of it is.
    layouts = tuple(
        tensor_layout(x, shape) if isinstance(x, torch.Tensor) and shape is not None else None
        for x, shape in zip(inputs, shapes, strict=True)
    )
    dtypes = tuple(
        input_type_text(x) + (f" {layout_text(layout)}" if layout is not None else "")
        for x, layout in zip(inputs, layouts, strict=True)
    )
    return Profile(
        shapes=tuple(tuple(s) if s is not None else None for s in shapes),
        dtypes=dtypes,
        # () when every input is contiguous: such a profile equals one made before layouts
        layouts=layouts if any(layout is not None for layout in layouts) else (),
    )


def _live_sizes(config: TuningConfig, inputs: Sequence[Any]) -> list[int]:
    """The live size of each dynamic dimension, after checking that no two specs name one
    dimension (``TuningConfig`` refuses equal indices; 0 and -2 of a 2-D input meet only here)."""
    sizes = []
    seen: dict[tuple[int, int], str] = {}
    for spec in config.dynamic_specs:
        dim = _resolve_dim("DynamicTensorSpec", inputs, spec.input_idx, spec.dim_idx)
        label = f"DynamicTensorSpec dim_idx={spec.dim_idx}"
        first = seen.setdefault((spec.input_idx, dim), label)
        if first != label:  # one dim, swept twice
            raise ConfigError(
                f"{first} and dim_idx={spec.dim_idx} of input "
                f"{spec.input_idx} (shape {tuple(inputs[spec.input_idx].shape)}) name the same "
                "dimension; give each dimension one spec."
            )
        sizes.append(int(inputs[spec.input_idx].shape[dim]))
    for constraint in config.constraint_specs:
        where = constraint.input_idx
        dim = _resolve_dim("ConstraintSpec", inputs, where, constraint.dim_idx)
        if (where, dim) in seen:  # a constraint would overwrite the dynamic size (or another)
            raise ConfigError(
                f"{seen[where, dim]} and ConstraintSpec dim_idx={constraint.dim_idx} of "
                f"input {where} (shape {tuple(inputs[where].shape)}) name the same dimension; "
                "give each dimension one spec (a dynamic dimension cannot also be constrained)."
            )
        seen[where, dim] = f"ConstraintSpec dim_idx={constraint.dim_idx}"
    return sizes


def profile_for(config: TuningConfig, inputs: Sequence[Any]) -> Profile | None:
    """The profile whose tuning result a live call uses (each dynamic dim mapped to its bucket),
    or ``None`` when a mapper gives a size no bucket (0): such a call always runs the fallback."""
    live = _live_sizes(config, inputs)
    buckets = [config.bucket_of(s, n) for s, n in zip(config.dynamic_specs, live, strict=True)]
    if 0 in buckets:
        return None
    return _apply(config, inputs, buckets)


def generate_profiles(config: TuningConfig, inputs: Sequence[Any]) -> list[Profile]:
    """Every profile to tune: the Cartesian product of each dynamic dim's sweep values.

    Sweep values are the spec's buckets capped by ``max_value`` plus the live size's bucket, so
    the call that triggered tuning is always covered. Profiles come out in ascending size order.
    """
    live = _live_sizes(config, inputs)
    axes = [config.sweep_values(s, n) for s, n in zip(config.dynamic_specs, live, strict=True)]
    profiles: list[Profile] = []
    seen: set[Profile] = set()
    for sizes in itertools.product(*axes):
        profile = _apply(config, inputs, sizes)
        if profile not in seen:  # two bucket combos can infer the same shapes
            seen.add(profile)
            profiles.append(profile)
    return profiles


def synthesize_inputs(
    config: TuningConfig,
    live_inputs: Sequence[Any],
    profile: Profile,
    *,
    seed: int = 0,
    memo: dict[Any, Any] | None = None,
) -> list[Any]:
    """Random inputs shaped like ``profile`` on each live input's device and dtype.

    Floats and complex: standard normal. Integers: uniform in ``[min(0, live.min()), live.max()]``
    so index-like inputs stay valid for what they index (with at least two values when the live
    tensor allows it: never all zeros unless the live tensor is). Bools: fair coin. Non-tensor
    inputs are passed through, except that a list, tuple or dict holding tensors is passed as a
    copy with its tensors copied (values kept: they are not in the profile). Then
    ``config.inputs_pre_hook`` is applied.

    Never zeros, because timing on zeros is known to flatter some kernels (sparsity shortcuts,
    power states).

    ``memo``: tensors made by earlier calls, by (input index, shape, dtype, device, seed), for
    the inputs whose shape is the same in every profile of the op (``memo["static"]``, a set of
    input indices, says which): a tensor of the same key has the same values, so it is reused
    instead of drawn again (the weight of a GEMM is one tensor for all buckets). Pass one dict
    per op, from :func:`static_inputs_memo`.
    """
    out: list[Any] = []
    cache: dict[Any, Any] = memo if memo is not None else {"static": frozenset()}
    layouts = profile.layouts or (None,) * len(profile.shapes)
    for x, shape, layout in zip(live_inputs, profile.shapes, layouts, strict=True):
        if not isinstance(x, torch.Tensor):
            out.append(copy_tree(x) if holds_tensor(x) else x)  # never the caller's tensors
            continue
        assert shape is not None
        key = (len(out), shape, x.dtype, str(x.device), seed, layout)
        shared = len(out) in cache["static"]
        if shared and key in cache:
            out.append(cache[key])
            continue
        gen = torch.Generator(device=x.device)
        gen.manual_seed(seed + len(out))
        live_shape = shape
        if layout is not None:
            # The live call's layout class: made dense in its stride order, then permuted
            # back, so get_valid_tactics and the timed forward see that order (not its gaps).
            shape = tuple(live_shape[d] for d in layout[0])
        if x.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen, device=x.device).bool()
        elif x.dtype.is_floating_point or x.dtype.is_complex:
            draw = x.dtype if x.dtype in _RANDN_DTYPES else torch.float32
            t = torch.randn(shape, generator=gen, device=x.device, dtype=draw).to(x.dtype)
        else:
            low, high = 0, 2
            if x.numel():
                low = min(0, int(x.min()))
                high = max(int(x.max()) + 1, low + 1)
            t = torch.randint(low, high, shape, generator=gen, device=x.device, dtype=x.dtype)
        if layout is not None:
            t = t.permute([layout[0].index(d) for d in range(len(live_shape))])
        if shared:
            cache[key] = t
        out.append(t)
    if config.inputs_pre_hook is not None:
        out = list(config.inputs_pre_hook(out))
    return out


def static_inputs_memo(profiles: Sequence[Profile]) -> dict[Any, Any]:
    """A ``memo`` for :func:`synthesize_inputs` over ``profiles``: the inputs whose shape is the
    same in all of them are made once (only those, so per-profile tensors are still freed)."""
    if not profiles:
        return {"static": frozenset()}
    first = profiles[0].shapes
    static = {
        i
        for i, shape in enumerate(first)
        if shape is not None and all(p.shapes[i] == shape for p in profiles)
    }
    return {"static": frozenset(static)}


def profile_bytes(live_inputs: Sequence[Any], profile: Profile) -> int:
    """Bytes of one synthetic input set of ``profile``, counted without making it."""
    return sum(
        math.prod(shape) * x.element_size()
        for x, shape in zip(live_inputs, profile.shapes, strict=True)
        if isinstance(x, torch.Tensor) and shape is not None
    ) + input_bytes([x for x in live_inputs if not isinstance(x, torch.Tensor)])


def input_bytes(inputs: Sequence[Any]) -> int:
    """Total bytes of the tensors in one input list (in lists, tuples and dicts too)."""
    return sum(t.numel() * t.element_size() for x in inputs for t in nested_tensors(x))


def input_sets(
    config: TuningConfig,
    live_inputs: Sequence[Any],
    profile: Profile,
    device: torch.device,
    count: int,
    max_bytes: int,
    first: list[Any] | None = None,
    memo: dict[Any, Any] | None = None,
) -> list[list[Any]]:
    """The synthetic input sets one profile is timed on (each from :func:`synthesize_inputs`).

    With ``config.cold_l2`` enough copies to overflow the device's L2
    (:func:`~graphtune.autotuner.timing.cold_l2_copies`), rotated call by call; otherwise up to
    ``count`` distinct sets (fresh values and allocations, one per measurement round), fewer when
    they would take more than ``max_bytes`` together (at least one). ``first``: the first set,
    when it was already made; ``memo``: as for :func:`synthesize_inputs`.
    """
    if first is None:
        first = synthesize_inputs(config, live_inputs, profile, memo=memo)
    if config.cold_l2:
        from graphtune.autotuner import timing

        count = max(1, int(timing.cold_l2_copies(input_bytes(first), device)))
    else:
        count = max(1, min(count, max_bytes // max(1, input_bytes(first))))
    return [first] + [
        synthesize_inputs(config, live_inputs, profile, seed=1000 * k, memo=memo)
        for k in range(1, count)
    ]
