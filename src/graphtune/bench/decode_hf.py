"""``bench decode --compare-hf``: the Hugging Face recipe timed in the decode benchmark's run.

For every batch size the transformers model built on the engine's tensors
(:func:`graphtune.bench.hf_compare.hf_model`) prefills ``context`` random tokens into a static
cache and its compiled decode step is timed like the engine's steps; at the smallest batch size
its GPU-busy time, kernels per step and kernel families are read too, and the prefill logits of
one prompt are compared with the engine's (same weights, so they agree to bf16 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.hf_compare import hf_model, hf_unavailable, time_hf_decode
from graphtune.engine.step import DecodeStep, prefill


def time_hf(
    step: DecodeStep,
    results: list[BatchResult],
    cfg: DecodeBenchConfig,
    report: DecodeBenchReport,
    log: Callable[[str], None],
) -> None:
    """Fills the ``hf_*`` fields of ``results`` (or adds a one-line note why it cannot)."""
    device = step.model.device
    reason = hf_unavailable(step.model, device)
    if reason is not None:
        report.notes.append(reason)
        log(reason)
        return
    try:
        hf = hf_model(step.model)
    except Exception as exc:  # a transformers release that cannot take the weights: a note
        note = f"--compare-hf skipped: building the transformers model failed: {exc}"
        report.notes.append(note)
        log(note)
        return
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    vocab = step.model.config.vocab_size
    for index, result in enumerate(results):
        prompt = torch.randint(
            0, vocab, (result.batch_size, cfg.context), generator=gen, device=device
        )
        if index == 0:
            try:
                report.hf_logits_check = _same_logits(hf, step, prompt[:1])
            except Exception as exc:  # reported, and the timing still runs
                report.notes.append(f"Hugging Face logits check failed: {exc}")
        log(f"batch {result.batch_size}: Hugging Face static cache + torch.compile (compiling)")
        timing = time_hf_decode(
            hf, prompt, steps=cfg.steps, repeats=cfg.repeats, measure_busy=index == 0
        )
        result.hf_ms = timing.ms
        result.hf_note = timing.note
        result.hf_busy_ms = timing.busy_ms
        result.hf_kernels_per_step = timing.kernels_per_step
        result.hf_kernel_families = timing.families
        if timing.ms is not None:
            log(f"batch {result.batch_size}: Hugging Face compiled {timing.ms:.3f} ms/step")
        torch.compiler.reset()  # drop the compiled graphs (and their memory) of this size
        torch.cuda.empty_cache()


def _same_logits(hf: torch.nn.Module, step: DecodeStep, prompt: torch.Tensor) -> dict[str, Any]:
    """The last-position logits of one prompt from both models: largest difference, largest
    logit, whether the top token agrees. The engine's prefill writes cache slot 0 (random
    contents in this benchmark; nothing reads it afterwards)."""
    want = prefill(step, prompt[0], 0).float()
    got = hf(input_ids=prompt).logits[0, -1].float()
    return {
        "max_abs_diff": float((got - want).abs().max()),
        "max_abs_logit": float(want.abs().max()),
        "top1_agree": bool(got.argmax() == want.argmax()),
        "positions": int(prompt.shape[1]),
    }
