"""A static key/value cache with slots and one scratch slot for padded rows.

Layout (one tensor each for keys and values, allocated once so addresses never change and a
captured CUDA graph can keep pointing at them)::

    [num_layers, max_batch_size + 1, num_kv_heads, max_seq_len, head_dim]

Heads come before positions so that one slot's keys for one head are contiguous: the attention of
a decode step reads ``[batch, kv_heads, max_seq_len, head_dim]`` without a transpose. Slot
``max_batch_size`` is the scratch slot: padded rows of a graph replay write there, so they can
never touch a live request's slot.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from graphtune.engine.config import ModelConfig
from graphtune.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

#: Cache lengths are multiples of this, so attention rows stay aligned.
SEQ_ALIGNMENT = 16


def aligned_seq_len(length: int) -> int:
    """``length`` rounded up to a multiple of :data:`SEQ_ALIGNMENT` (the cache length an engine
    or benchmark allocates for sequences of up to ``length`` tokens)."""
    return -(-length // SEQ_ALIGNMENT) * SEQ_ALIGNMENT


def kv_bytes_per_token(config: ModelConfig, element_size: int) -> int:
    """Bytes of keys plus values for one token of one request across all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.dim_per_head * element_size


def available_host_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory a new allocation can have now, or ``None`` where the system does
    not say. A function so tests can replace it.

    Linux's ``MemAvailable`` (``/proc/meminfo``) counts the page cache the kernel can reclaim,
    which right after loading a checkpoint holds its files; ``os.sysconf``'s available pages
    (``MemFree``) leave that out, so they are only the fallback where there is no
    ``/proc/meminfo``.
    """
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == "MemAvailable" and value.split()[1:] == ["kB"]:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not POSIX, or a name the system lacks
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


class KVCache:
    """Preallocated keys and values for ``max_batch_size`` live requests plus a scratch slot.

    Args:
        config: Model shape (layers, KV heads, head width).
        max_batch_size: Live requests the cache can hold at once.
        max_seq_len: Positions per request: a request of ``P`` prompt tokens generating
            ``N`` uses ``P + N - 1`` (its last generated token is never cached;
            :func:`graphtune.engine.config.request_positions`).
        device: Where to allocate.
        dtype: Element type of keys and values.
        shared_layers: Allocate one layer and let every layer view it. Only for profiling the
            step's activation and graph memory (:mod:`graphtune.engine.memory_plan`), which do
            not depend on the cache's contents; :attr:`nbytes` is then the one layer's bytes.
        size_names: How the caller's user names ``max_batch_size`` and ``max_seq_len`` (a
            command's flags, ``("--batch", "--max-seq-len")``), for the error messages.

    Raises:
        ConfigError: A size is not a positive int, or the cache does not fit: on the CPU it is
            refused before allocating when it needs more than the host memory available now
            (:func:`available_host_memory`; the kernel would kill the process instead of failing
            the allocation), elsewhere when the allocation fails.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_batch_size: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        shared_layers: bool = False,
        size_names: tuple[str, str] = ("max_batch_size", "max_seq_len"),
    ) -> None:
        sizes = zip(size_names, (max_batch_size, max_seq_len), (8, 2048), strict=True)
        for name, value, example in sizes:
            # A bool is an int to Python (True would be one slot); a float reaches torch.zeros.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"the KV cache's {name} must be a positive int, got {value!r}; pass a whole "
                    f"number such as {example}"
                )
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.scratch_slot = max_batch_size
        layers = 1 if shared_layers else config.num_layers
        shape = (
            layers,
            max_batch_size + 1,
            config.num_kv_heads,
            max_seq_len,
            config.dim_per_head,
        )
        need = 2 * math.prod(shape) * dtype.itemsize
        batch_name, seq_name = size_names

        def too_big(why: str, fix: str = "") -> ConfigError:
            return ConfigError(
                f"the KV cache ({batch_name} {max_batch_size} slots x {seq_name} {max_seq_len} "
                f"positions x {layers} layers) needs {need / 2**30:.1f} GiB on "
                f"{device or 'cpu'}, {why}; lower {batch_name} or {seq_name}{fix}"
            )

        if torch.device(device or "cpu").type == "cpu":
            # Linux overcommits: zeros of more than the free memory "succeed" and the
            # out-of-memory killer then ends the process (or another one) with no message.
            free = available_host_memory()
            if free is not None and need > free:
                raise too_big(f"and the host has {free / 2**30:.1f} GiB available")
        # Zeros, not empty: a padded row reads position 0 of the scratch slot and stale NaN bit
        # patterns there would be harmless but confusing in a debugger.
        try:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as exc:  # torch's allocators (OutOfMemoryError too)
            out_of_memory = isinstance(exc, (torch.OutOfMemoryError, MemoryError))
            if not out_of_memory and "allocate" not in str(exc):
                raise
            raise too_big(
                f"which could not be allocated ({' '.join(str(exc).split())[:120]})",
                ", or size it from free memory with gpu_memory_utilization",
            ) from None
        # Per-layer views made once, so the decode step does no view bookkeeping per call.
        self.k_layers = list(self.k.unbind(0)) * (config.num_layers // layers)
        self.v_layers = list(self.v.unbind(0)) * (config.num_layers // layers)
        self._free = list(range(max_batch_size))

    def fill_random(self, seed: int = 0) -> None:
        """Fills every key and value with N(0, 1) values, keys first, from a generator on the
        cache's device seeded with ``seed``: benchmarks never time attention on zeros."""
        gen = torch.Generator(device=self.k.device).manual_seed(seed)
        self.k.normal_(generator=gen)
        self.v.normal_(generator=gen)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together."""
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        """Bytes of keys plus values for one token of one request across all layers."""
        return kv_bytes_per_token(self.config, self.k.element_size())

    @property
    def num_free(self) -> int:
        """Slots not owned by a live request."""
        return len(self._free)

    def allocate(self) -> int:
        """Takes the lowest free slot.

        Raises:
            InputError: Every slot is owned.
        """
        if not self._free:
            raise InputError(
                f"all {self.max_batch_size} KV-cache slots are in use; free a slot or build the "
                "engine with a larger max_batch_size"
            )
        self._free.sort()
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        """Returns ``slot`` to the free list.

        Raises:
            InputError: ``slot`` is out of range, the scratch slot, or already free.
        """
        if not 0 <= slot < self.max_batch_size or slot in self._free:
            raise InputError(f"cannot free KV-cache slot {slot}: not an owned slot")
        self._free.append(slot)

    def clear(self, slot: int) -> None:
        """Zeroes every position of ``slot`` (all layers)."""
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copies the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

    def reset(self) -> None:
        """Frees every slot and zeroes the contents (addresses stay the same)."""
        self._free = list(range(self.max_batch_size))
        self.k.zero_()
        self.v.zero_()
