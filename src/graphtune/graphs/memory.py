"""Graph memory that grows with the largest size: outputs that do not own their storage.

Every size's graph writes its outputs into blocks of the shared pool. If the runner kept those
output tensors as ordinary (owning) tensors, each size's outputs would stay allocated for the
runner's life and the pool would grow with the *sum* of all sizes' outputs (for a decode step,
one row of logits per batch row per graph). An output is only valid until the next call, which
is the documented contract, so the runner keeps every output as a *twin*: a tensor with the same
address, shape and strides whose storage does not own the memory
(``torch._C._construct_storage_from_data_pointer``, the mechanism of PyTorch's own cudagraph
trees). When the capture ends the real tensors are dropped, their blocks go back to the pool, and
the next (smaller) capture may reuse them; the largest graph's blocks then cover all smaller ones.

Dropping the real tensor frees its memory only when nothing else owns it: a tensor the step keeps
(a KV cache it returns, a weight, a static input buffer) keeps its memory, so a twin of it is
always safe. The same holds for the tensors a graph break reads (see breaks.py): they are only
needed during a call and become twins too, but the containers that hold them stay the caller's
objects (:meth:`Disowner.break_args`), since the break runs again at every replay.

After ``release()`` the pool's memory goes back to the device, so a twin a caller still holds
would read freed memory. The backend makes such a read raise instead (see
:meth:`CudaGraphBackend.invalidate`); where it cannot, the runner keeps owning outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.graphs.tree import flatten_with_paths, rebuild_sequence

RELEASED_MESSAGE = (
    "this tensor is an output of a CUDAGraphRunner that was released: graph outputs live in the "
    "runner's memory pool, which release() returns to the device, and are valid only until the "
    "next call or release(); copy outputs you keep (tensor.clone(), or clone_outputs=True)"
)
"""What reading a released graph output raises (where the backend supports it)."""


def can_disown() -> bool:
    """Whether this torch build can build non-owning twins of tensors."""
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def _disownable(value: Any) -> bool:
    if type(value) is not torch.Tensor or value.layout is not torch.strided:
        return False  # subclasses (nn.Parameter included) and sparse tensors keep their objects
    if value.requires_grad or value.device.type == "meta":
        return False
    try:
        return value.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return False


class Disowner:
    """Builds non-owning twins of the tensors one capture produced (outputs, break inputs).

    Tensors that share a storage get twins that share one non-owning storage, so aliasing
    between outputs (``x`` and ``x[:, :3]``, a tensor and its transpose) is preserved.

    Args:
        device_type: The type of the device the graphs capture on (``"cuda"``); tensors on
            another device (a host tensor the step made during capture) are kept as they are,
            since their memory is not the pool's and dropping the owner would free it for good.
            ``None``: every device.

    Attributes:
        storages: The non-owning storages built so far (one per distinct storage).
        kept: Tensors left as they were although they hold memory (subclasses such as
            ``nn.Parameter``, tensors that require grad, sparse tensors, tensors on another
            device): their memory stays allocated, as without sharing.
    """

    def __init__(self, device_type: str | None = None) -> None:
        self._device_type = device_type
        self._twins: dict[tuple[int, int, torch.device], Any] = {}
        self.storages: list[Any] = []  # torch.UntypedStorage
        self.kept = 0

    def tensor(self, value: Any) -> Any:
        """A twin of ``value`` (same address, shape, strides, dtype), or ``value`` itself when it
        is not a plain strided tensor with memory (then it is kept as it is)."""
        if not _disownable(value) or self._device_type not in (None, value.device.type):
            if isinstance(value, torch.Tensor) and value.numel() > 0:
                self.kept += 1
            return value
        storage = value.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), value.device)
        twin_storage = self._twins.get(key)
        if twin_storage is None:
            twin_storage = torch._C._construct_storage_from_data_pointer(
                key[0], value.device, key[1]
            )
            self._twins[key] = twin_storage
            self.storages.append(twin_storage)
        twin = torch.empty(0, dtype=value.dtype, device=value.device)
        return twin.set_(twin_storage, value.storage_offset(), value.size(), value.stride())

    def tree(self, value: Any) -> Any:
        """``value`` (any nesting of tuples, lists and dicts) with every tensor leaf twinned."""
        leaves, _, spec = flatten_with_paths(value)
        return spec.unflatten([self.tensor(leaf) for leaf in leaves])

    def break_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A graph break's recorded arguments with their tensors twinned where that cannot change
        what the break sees.

        The break is called again at every replay, so it must get the caller's containers, not
        copies made at capture: a dict of host state the caller changes later, a list the break
        appends to, a ``defaultdict``. So a list or dict argument is kept as it is, tensors
        included (they keep their memory until the graph is released). Tensor arguments, and
        tensors inside tuples (immutable, so a copy with the same items and type is the same
        value), are twinned so that their blocks go back to the pool; a tuple subclass that
        cannot be rebuilt with its type from its items is kept as it is, like a list.
        """
        new_args = tuple(self._swap(value) for value in args)
        for key in list(kwargs):  # kwargs is the call's own dict
            kwargs[key] = self._swap(kwargs[key])
        return new_args, kwargs

    def _swap(self, value: Any) -> Any:
        """``value`` with its tensors twinned, descending into tuples only (see break_args)."""
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if not isinstance(value, tuple):
            return value
        items = [self._swap(item) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        rebuilt = rebuild_sequence(type(value), items)
        # A subclass that cannot be rebuilt from its items (its own constructor) came back a
        # plain tuple, or as another value: the break gets the caller's tuple, which keeps its
        # tensors' memory until the graph is released (as a list or dict argument does).
        same = type(rebuilt) is type(value) and len(rebuilt) == len(items)
        if not same or any(new is not old for new, old in zip(rebuilt, items, strict=True)):
            return value
        return rebuilt
