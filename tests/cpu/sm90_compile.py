"""Compiles graphtune's Triton kernels for an sm_90 GPU with the installed Triton, on the CPU.

Triton's CPU interpreter (how the kernel tests run here) executes a kernel's Python body; it does
not run the code generator, which is stricter: for example it rejects a name bound before a
runtime ``if`` and re-bound to another type inside it, which the interpreter runs happily (that
broke the one-kernel decode attention on the H200's Triton 3.6). This script drives every Triton
runner's real ``launch(..., warmup=True)`` path on CPU tensors with ``run_kernel`` replaced by a
recorder, then compiles each recorded launch for ``cuda:90`` (code generator, LLVM and ``ptxas``:
no GPU needed) through the JIT's own argument specialisation, with ``USE_PDL`` on where a kernel
declares it (the H200 launches them that way).

Run by ``tests/cpu/test_kernels_compile.py`` in a process without ``TRITON_INTERPRET`` (an
interpreted kernel cannot be compiled); prints one JSON object ``{label: error or null}``.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

TARGET = ("cuda", 90, 32)


class Recorder:
    """Stands in for ``graphtune.ops._triton.run_kernel``: keeps each launch, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __call__(
        self, kernel: Any, grid: Any, args: tuple[Any, ...], meta: dict[str, Any], warmup: bool
    ) -> None:
        meta = dict(meta)
        if "USE_PDL" in kernel.arg_names:
            meta.update(USE_PDL=True, launch_pdl=True)
        self.launches.append((kernel, args, meta))


def sm90_source(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple[Any, dict]:
    """The ``ASTSource`` and compile options of one launch, specialised as the JIT would for an
    sm_90 device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget(*TARGET))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, meta, bound, specialization, options
    )
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


def binary_key(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> str:
    """What Triton's compile cache tells binaries apart by within one process (the source with
    its specialisation and constexprs, and the options): launches with one key compile to one
    binary, so one compile answers for all of them."""
    source, options = sm90_source(kernel, args, meta)
    return f"{source.hash()} {sorted(options.items())!r}"


def compile_for_sm90(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> None:
    """Compiles one launch as the JIT would for an sm_90 device (raises on any error)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile

    source, options = sm90_source(kernel, args, meta)
    compile(source, target=GPUTarget(*TARGET), options=options)


def _splits(tactic: Any) -> int:
    """How many slices a tactic cuts its inner loop into (1 for a tactic without a split)."""
    if not isinstance(tactic, dict):
        return 1
    return max(int(tactic.get(key, 1)) for key in ("split_k", "split", "splits"))


def _variant(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every tensor moved to an address that is not a multiple of 16 bytes and every
    int plus one (another class for Triton's ``== 1`` / multiple-of-16 specialisation)."""
    out: list[Any] = []
    for value in args:
        if isinstance(value, torch.Tensor):
            spare = torch.empty(value.numel() + 16, dtype=value.dtype)
            out.append(spare[1 : 1 + value.numel()].view(value.shape))
        elif isinstance(value, int) and not isinstance(value, bool):
            out.append(value + 1)
        else:
            out.append(value)
    return tuple(out)


def launch_key_checks(
    launches: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]],
) -> dict[str, str | None]:
    """``launch_key`` is at least as fine as the JIT's own specialisation: over the recorded
    launches and a variant of each (:func:`_variant`), launches with one key specialise alike."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from graphtune.ops._launch_key import launch_key

    backend = make_backend(GPUTarget(*TARGET))
    binders: dict[int, Any] = {}
    seen: dict[tuple[Any, ...], tuple[str, str]] = {}
    results: dict[str, str | None] = {}
    for label, kernel, args, meta in launches:
        name = f"launch-key {label}"
        results[name] = None
        if id(kernel) not in binders:
            binders[id(kernel)] = create_function_from_signature(
                kernel.signature, kernel.params, backend
            )
        for variant in (args, _variant(args)):
            _, specialization, _ = binders[id(kernel)](*variant, **meta)
            text = repr(specialization)
            first = seen.setdefault(launch_key(kernel, variant, meta), (label, text))
            if first[1] != text:
                results[name] = f"same binary_key as {first[0]}, other specialisation: {text}"
    return results


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print(json.dumps({"error": "run without TRITON_INTERPRET (interpreted kernels)"}))
        return 2
    from graphtune.bench.runner_cases import launches_replaced, runner_cases

    cases = runner_cases()  # imports every runner's module
    recorder = Recorder()
    launches: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []
    errors: dict[str, str | None] = {}
    with launches_replaced(recorder):
        for label, runner, inputs in cases:
            planned = list(runner.tactics_for(inputs))
            # The first and the last tactic (the simplest and the largest tiles of each mode),
            # and the first that splits its inner loop (a split-K epilogue of its own).
            split = [t for t in planned if _splits(t) > 1][:1]
            chosen = {json.dumps(t, sort_keys=True): t for t in planned[:1] + planned[-1:] + split}
            if not chosen:
                errors[label] = "the runner offered no tactics"
            for text, tactic in chosen.items():
                before = len(recorder.launches)
                try:
                    runner.launch(inputs, tactic, warmup=True)
                except Exception as exc:  # a launch that fails before compiling is a finding
                    errors[f"{label} {text}"] = f"launch: {type(exc).__name__}: {exc}"
                    continue
                for kernel, args, meta in recorder.launches[before:]:
                    launches.append((f"{label} {text} {kernel.__name__}", kernel, args, meta))

    def compile_one(item: tuple[str, Any, tuple[Any, ...], dict[str, Any]]) -> str | None:
        _, kernel, args, meta = item
        try:
            compile_for_sm90(kernel, args, meta)
        except Exception as exc:  # every compile error is reported, not raised
            return f"{type(exc).__name__}: {str(exc)[:1500]}"
        return None

    errors.update(launch_key_checks(launches))
    # Each distinct binary once (about half of the launches repeat another's: runners sharing a
    # kernel, a first tactic that is also the last); every label gets its binary's result.
    labels: dict[str, list[str]] = {}
    first: dict[str, tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = {}
    for item in launches:
        key = binary_key(*item[1:])
        labels.setdefault(key, []).append(item[0])
        first.setdefault(key, item)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for key, error in zip(first, pool.map(compile_one, first.values()), strict=True):
            errors.update(dict.fromkeys(labels[key], error))
    print(json.dumps(errors, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
