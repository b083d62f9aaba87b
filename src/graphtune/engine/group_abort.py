"""What a tensor-parallel engine does when one of its calls fails partway: it aborts its
process group, so the other ranks fail at once, and refuses every later call.

The ranks of a tensor-parallel engine meet in a collective at every step. When one rank's call
leaves early (an out-of-memory error on its GPU alone, a failing kernel, an interrupt) and its
process stays alive (a server catches the error), the other ranks wait in their next collective
until the group's timeout (30 minutes by default on gloo, 10 on NCCL): the failed rank cannot tell
them over the group, since they wait in a collective of another shape. Aborting the group in the
failed process closes its connections, and the peers' collectives raise. The group, and the
engine's state across ranks (KV slots, the step the ranks were at), cannot be trusted after that,
so the engine must be rebuilt with a new group.

Errors the ranks agreed on before any step ran (the argument checks of ``Engine.generate``, which
every rank reaches together) leave the group alone: every rank raises, none waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from graphtune.errors import (
    ConfigError,
    DistributedError,
    InputError,
    add_context_note,
    one_line,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What ``Engine.generate``'s agreed argument checks raise: every rank raises together (a rank's
# own error, or a DistributedError naming it), none is left in a collective, so no abort.
AGREED_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InputError, DistributedError)


def abort_group(group: Any) -> None:
    """Aborts ``group`` (``None``: the default group, with every other group) in this process,
    so that the other ranks' pending and later collectives on it raise instead of waiting for the
    group's timeout.

    Uses ``torch.distributed``'s ``_abort_process_group``, which aborts the backends
    (``ncclCommAbort`` on NCCL: it does not wait for collectives in flight, unlike a graceful
    destroy) and drops the group, closing gloo's connections; ``destroy_process_group`` where a
    torch lacks it. A group that is already gone is left as it is (logged).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort(group)
        else:
            dist.destroy_process_group(group)
    except (RuntimeError, ValueError) as exc:  # destroyed already, or a backend that cannot abort
        logger.warning("could not abort the tensor-parallel group: %s", one_line(exc))


class GroupAbort:
    """Aborts a tensor-parallel engine's group when one of its calls fails after the ranks may
    have met in a collective, and refuses the engine's later calls (see the module's docstring).

    Args:
        parallel: The model's ``ParallelContext``; ``None`` (one process) makes every method a
            no-op, so a single-process engine stays usable after an error.
    """

    def __init__(self, parallel: Any) -> None:
        self.parallel = parallel
        self.failure: str | None = None  # the error that aborted the group, once one did

    def check(self, what: str) -> None:
        """Raises when the group was aborted.

        Raises:
            DistributedError: An earlier call on this rank failed and aborted the group.
        """
        if self.failure is not None:
            raise DistributedError(
                f"{what}: the tensor-parallel group was aborted after an error on this rank "
                f"(rank {self.parallel.rank}: {self.failure}), so this engine cannot run; "
                "rebuild the process group (init_process_group) and the Engine"
            )

    def call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` under :meth:`guard`; in one process directly (a step's hot path pays
        no context manager for a group it does not have)."""
        if self.parallel is None:
            return fn(*args)
        with self.guard(what):
            return fn(*args)

    @contextmanager
    def guard(self, what: str, agreed: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Runs the block after :meth:`check`; an exception leaving it aborts the group and marks
        the engine broken, and then propagates (with a note saying so), unless it is one of
        ``agreed``: errors raised before any rank entered a collective, on every rank alike
        (argument checks), which leave no rank waiting."""
        self.check(what)
        try:
            yield
        except agreed:
            raise
        except BaseException as exc:  # any way out (an interrupt too) leaves the peers waiting
            if self.parallel is not None and self.parallel.world_size > 1:
                self._abort(what, exc)
            raise

    def _abort(self, what: str, exc: BaseException) -> None:
        self.failure = f"{type(exc).__name__}: {one_line(exc)}"[:300]
        rank = self.parallel.rank
        logger.error(
            "rank %d: %s failed (%s); aborting the tensor-parallel group so that the other ranks "
            "fail now instead of at the group's timeout",
            rank,
            what,
            self.failure,
        )
        abort_group(self.parallel.group)
        # The peers' error is often the collective library's (a closed connection): this note
        # in each rank's traceback points at the rank that failed first.
        add_context_note(
            exc,
            f"graphtune: rank {rank} aborted its tensor-parallel group after this error; an "
            "error of a collective here means another rank failed first (see its log); rebuild "
            "the process group and the Engine",
        )
