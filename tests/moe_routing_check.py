"""The check the CPU and GPU tests of the fused MoE router share (tests/ is on their path)."""

from __future__ import annotations

import torch

from graphtune.ops.moe import torch_route_top_k


def assert_routed_as_float64(got_w, got_ids, h, weight, top_k, renormalize, label):
    """float32: the same probabilities as the float64 product's routing (ties may swap ids).
    bfloat16: a logit rounded from a float32 sum may land one unit in the last place away from
    the float64 product's, so the chosen experts are a top-k up to that, largest first, and the
    weights are the probabilities of the experts chosen."""
    exact = h.double() @ weight.double().T
    logits = exact.to(h.dtype)
    probs = torch.softmax(logits.double(), dim=-1)
    if h.dtype == torch.float32:
        want_w, want_ids = torch_route_top_k(
            logits, top_k, renormalize=renormalize, weights_dtype=got_w.dtype
        )
        assert torch.equal(probs.gather(1, got_ids), probs.gather(1, want_ids)), label
        torch.testing.assert_close(got_w.float(), want_w.float(), rtol=1e-5, atol=1e-5)
        return
    ulp = exact.abs().amax(dim=1, keepdim=True) * 2.0**-7
    chosen = exact.gather(1, got_ids)
    others = exact.scatter(1, got_ids, float("-inf"))
    assert (chosen.amin(dim=1, keepdim=True) >= others.amax(dim=1, keepdim=True) - ulp).all(), label
    assert (chosen[:, :-1] >= chosen[:, 1:] - ulp).all(), label  # largest first
    want = probs.gather(1, got_ids)
    if renormalize:
        want = want / want.sum(dim=1, keepdim=True)
    torch.testing.assert_close(got_w.double(), want, rtol=2e-2, atol=2e-2)
