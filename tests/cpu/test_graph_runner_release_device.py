"""After release(), the next capture resolves its device again from its own inputs."""

from __future__ import annotations

import torch

from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend


class FollowsInputs(SimulatedGraphBackend):
    """Resolves the device as the CUDA backend does: the argument, else the first input's."""

    def __init__(self):
        super().__init__()
        self.guarded = []

    def resolve_device(self, device, leaves):
        if device is not None:
            return device
        return next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))

    def device_guard(self, device):
        self.guarded.append(device)
        return super().device_guard(device)


def test_a_capture_after_release_uses_the_new_inputs_device():
    backend = FollowsInputs()
    runner = CUDAGraphRunner(lambda x: x + 1, max_batch_size=4, backend=backend)
    runner.capture(torch.randn(4, 2))
    assert backend.guarded[-1] == torch.device("cpu")
    runner.release()
    runner.capture(torch.randn(4, 2, device="meta"))
    assert backend.guarded[-1] == torch.device("meta")


def test_a_device_given_explicitly_is_kept_across_release():
    backend = FollowsInputs()
    runner = CUDAGraphRunner(lambda x: x + 1, max_batch_size=4, backend=backend, device="cpu")
    runner.capture(torch.randn(4, 2))
    runner.release()
    runner.capture(torch.randn(4, 2, device="meta"))
    assert backend.guarded[-1] == "cpu"
