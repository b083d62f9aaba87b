"""Autograd and the graph runner: which calls must run ``fn`` eagerly to keep their gradients.

A replay records no autograd graph: its outputs are graph memory written by kernels autograd
never saw. So with autograd on, a call runs eagerly when an input requires grad, and when the
key's outputs require grad (``fn`` holds parameters that require grad) or nothing has shown yet
whether they do. A capture with autograd on shows it, and so does an eager call of the key
with autograd on whose inputs were checked as a replay's (a warm-up, an undecided-rows or an
output-requires-grad call), so the most recent such run decides. The
outputs a capture keeps are detached: a call with autograd off gets what eager code gives it, not
tensors tied to the capture's autograd graph (whose saved tensors the next replay overwrites).
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.errors import InputError
from graphtune.graphs.tree import flatten_with_paths


def inputs_need_grad(inputs: tuple) -> bool:
    """Whether a tensor of ``inputs`` requires grad (with autograd on, a replay would drop its
    gradients)."""
    leaves, _, _ = flatten_with_paths(inputs)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def outputs_need_grad(outputs: Any) -> bool:
    """Whether a tensor of ``outputs`` was computed under autograd (has a ``grad_fn``): ``fn``
    read something that requires grad. A tensor that requires grad itself (a parameter ``fn``
    returns) is not counted: every call returns that very tensor, as eager code does."""
    leaves, _, _ = flatten_with_paths(outputs)
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in leaves)


def detached(outputs: Any) -> Any:
    """``outputs`` with every tensor that has a ``grad_fn`` detached (the same memory), so the
    capture's autograd graph and the tensors it saved are freed."""
    leaves, _, spec = flatten_with_paths(outputs)
    return spec.unflatten(
        [t.detach() if isinstance(t, torch.Tensor) and t.grad_fn is not None else t for t in leaves]
    )


def needs_grad_error() -> InputError:
    """The error of ``capture()`` given an example input that requires grad under autograd."""
    return InputError(
        "capture() got an example input that requires grad while autograd is on: graphs replay "
        "without autograd, so outputs would carry no gradients. Capture (and call) under "
        "torch.inference_mode() or torch.no_grad(), or pass detached tensors"
    )
