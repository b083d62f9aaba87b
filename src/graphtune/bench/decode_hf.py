"""``bench decode --compare-hf``: transformers on the same weights, timed in the decode
benchmark's run, with the logits check.

For every batch size the transformers model built on the engine's tensors
(:func:`graphtune.bench.hf_compare.hf_model`) prefills ``context`` random tokens into a static
cache; its first decode step is checked against the engine's untuned step on the same cache, then
its eager step is timed and, when compiling is on, the compiled recipe (static cache +
``torch.compile(mode="reduce-overhead")``). At the smallest batch size the compiled step's
GPU-busy time, kernels per step and kernel families are read too.

Compiling is on by default for dense models on CUDA (the issue-13 anchor) and off for
mixture-of-experts models (compiling transformers' expert loop takes long, and its eager step is
the anchor there); ``DecodeBenchConfig.hf_compile`` forces it either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.hf_compare import hf_model, hf_unavailable, time_hf_decode
from graphtune.engine.step import DecodeStep


def hf_compile_choice(cfg: DecodeBenchConfig, step: DecodeStep) -> tuple[bool, str | None]:
    """Whether the compiled recipe runs (``cfg.hf_compile``, or by default: for a dense model on
    CUDA), and a note when it does not run although it is the default anchor."""
    moe = step.model.config.num_experts > 0
    wanted = cfg.hf_compile if cfg.hf_compile is not None else not moe
    if not wanted:
        if cfg.hf_compile is None:
            return False, "transformers timed eagerly (an MoE model; --hf-compile compiles it too)"
        return False, None
    if step.model.device.type != "cuda":
        return False, (
            "transformers compiled recipe skipped: torch.compile(mode='reduce-overhead') needs "
            "CUDA graphs; its eager step was timed"
        )
    return True, None


def time_hf(
    step: DecodeStep,
    results: list[BatchResult],
    cfg: DecodeBenchConfig,
    report: DecodeBenchReport,
    log: Callable[[str], None],
) -> None:
    """Fills the ``hf_*`` fields of ``results`` (or adds a one-line note why it cannot).

    Runs last in the benchmark: the logits check overwrites cache slots ``[0, B)`` of ``step``.
    """
    import transformers

    device = step.model.device
    reason = hf_unavailable(step.model)
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
    compile_on, note = hf_compile_choice(cfg, step)
    config = hf.config
    experts = getattr(config, "_experts_implementation", None)
    report.notes.append(
        f"transformers {transformers.__version__} on the same weight tensors: attention "
        f"{config._attn_implementation!r}, "
        + (f"experts {experts!r}, " if step.model.config.num_experts else "")
        + "StaticCache"
    )
    if note:
        report.notes.append(note)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    vocab = step.model.config.vocab_size
    for index, result in enumerate(results):
        b = result.batch_size
        prompt = torch.randint(0, vocab, (b, cfg.context), generator=gen, device=device)
        log(f"batch {b}: transformers static cache" + (" + torch.compile" if compile_on else ""))
        timing = time_hf_decode(
            hf,
            prompt,
            steps=cfg.steps,
            repeats=cfg.repeats,
            compile=compile_on,
            measure_busy=index == 0,
            check_step=step,
        )
        result.hf_ms = timing.ms
        result.hf_eager_ms = timing.eager_ms
        result.hf_note = timing.note or None
        result.hf_busy_ms = timing.busy_ms
        result.hf_kernels_per_step = timing.kernels_per_step
        result.hf_kernel_families = timing.families
        result.hf_max_abs_diff = timing.max_abs_diff
        result.hf_argmax_agreement = timing.argmax_agreement
        if timing.check_note and timing.check_note not in report.notes:
            report.notes.append(timing.check_note)
        agree = timing.argmax_agreement
        log(
            f"batch {b}: transformers eager {timing.eager_ms:.3f} ms/step"
            + (f", compiled {timing.ms:.3f} ms/step" if timing.ms is not None else "")
            + (f"; greedy tokens agree on {100 * agree:.0f}% of rows" if agree is not None else "")
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
