"""The accuracy target of the tuned step: no worse than the untuned step against float32.

:func:`decode_accuracy` decodes ``steps`` tokens per row at each batch size with three steps on
the same weights, each with its own KV cache: a float32 eager reference (the weights cast to
float32), the untuned step and the tuned step (both in the model's dtype). Every step is fed the
reference's greedy tokens (teacher forcing, so the three see the same sequence and each
accumulates its own K/V rounding), and at every position the logits of the untuned and of the
tuned step are compared with the reference's: the largest absolute difference and the KL
divergence ``KL(p_ref || p)`` of the next-token distribution (float64 softmax). The tuned step
meets the target when its worst error and its mean and worst KL are no larger than the untuned
step's; :attr:`AccuracyResult.ratios` gives the margins. KL values below :data:`KL_FLOOR` count as
equal: a random-weight preset's next-token distribution is nearly one-hot (its logits span
hundreds of units), so both steps' KL is zero up to float64 rounding and only the floor can rank
them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from graphtune.engine.build import build_step
from graphtune.engine.kv_cache import KVCache, aligned_seq_len
from graphtune.engine.model import DecoderModel, LayerWeights
from graphtune.engine.tuning import tune_step
from graphtune.errors import ConfigError

#: KL (nats) below which two KL divergences are not told apart.
KL_FLOOR = 1e-9


@dataclass(frozen=True)
class StepError:
    """One step's logits against the float32 reference over every row and position."""

    max_abs: float
    kl_mean: float
    kl_max: float
    top1_agree: float  # share of (row, position) whose argmax equals the reference's


@dataclass(frozen=True)
class AccuracyResult:
    """:func:`decode_accuracy` at one batch size."""

    batch_size: int
    steps: int
    untuned: StepError
    tuned: StepError

    @property
    def ratios(self) -> dict[str, float]:
        """Tuned over untuned for the worst error and the mean and worst KL (<= 1 meets it)."""

        def ratio(a: float, b: float, floor: float = 0.0) -> float:
            a, b = max(a, floor), max(b, floor)
            return a / b if b > 0 else (1.0 if a == b else float("inf"))

        return {
            "max_abs": ratio(self.tuned.max_abs, self.untuned.max_abs),
            "kl_mean": ratio(self.tuned.kl_mean, self.untuned.kl_mean, KL_FLOOR),
            "kl_max": ratio(self.tuned.kl_max, self.untuned.kl_max, KL_FLOOR),
        }

    @property
    def no_worse(self) -> bool:
        """Whether every ratio is at most 1."""
        return all(value <= 1.0 for value in self.ratios.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly, with the ratios and the verdict."""
        return {**asdict(self), "ratios": self.ratios, "no_worse": self.no_worse}


def float32_copy(model: DecoderModel) -> DecoderModel:
    """``model``'s weights cast to float32 (new tensors; tied embeddings stay tied)."""
    if model.parallel is not None:
        raise ConfigError("the float32 reference needs a whole model, not a tensor-parallel shard")

    def cast(t: torch.Tensor | None) -> Any:
        return None if t is None else t.float()

    embed = model.embed.float()
    layers = [
        LayerWeights(**{name: cast(getattr(layer, name)) for name in vars(layer)})
        for layer in model.layers
    ]
    return DecoderModel(
        config=model.config,
        embed=embed,
        layers=layers,
        final_norm=model.final_norm.float(),
        lm_head=embed if model.lm_head is model.embed else model.lm_head.float(),
        source=f"{model.source} [float32 reference]",
    )


def _errors(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> StepError:
    got = torch.stack(logits).double()
    want = torch.stack(reference).double()
    log_want = torch.log_softmax(want, dim=-1)
    log_got = torch.log_softmax(got, dim=-1)
    # KL is >= 0; float64 rounding leaves -1e-119-sized values for one-hot distributions.
    kl = (log_want.exp() * (log_want - log_got)).sum(-1).clamp_min(0.0)
    return StepError(
        max_abs=float((got - want).abs().max()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agree=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
    )


@torch.inference_mode()
def decode_accuracy(
    model: DecoderModel,
    tuner: Any,
    *,
    batch_sizes: tuple[int, ...] = (1, 8),
    steps: int = 64,
    max_seq_len: int | None = None,
    seed: int = 0,
    reference: DecoderModel | None = None,
) -> list[AccuracyResult]:
    """The tuned step's logits and the untuned step's against a float32 reference.

    Args:
        model: The weights in the dtype served (bf16 on a GPU).
        tuner: The tuner of the tuned step; missing picks are tuned first (:func:`tune_step`
            tunes only what its cache lacks, e.g. attention for a new ``max_seq_len``).
        batch_sizes: Batch sizes to check.
        steps: Decode steps per row, from position 0.
        max_seq_len: The caches' length (default: ``steps + 1`` aligned); use the tuned
            benchmark's to reuse its attention picks.
        seed: Seed of the first tokens.
        reference: The float32 model (default: :func:`float32_copy` of ``model``).

    Raises:
        ConfigError: ``steps`` does not fit ``max_seq_len``.
    """
    seq = max_seq_len or aligned_seq_len(steps + 1)
    if steps >= seq:
        raise ConfigError(f"decode_accuracy: {steps} steps do not fit max_seq_len={seq}")
    reference = reference if reference is not None else float32_copy(model)
    largest = max(batch_sizes)
    device, cfg = model.device, model.config

    def step_for(weights: DecoderModel, dtype: torch.dtype, tuned: Any = None) -> Any:
        cache = KVCache(cfg, largest, seq, device, dtype)
        return build_step(weights, cache, tuner=tuned)

    ref_step = step_for(reference, torch.float32)
    untuned = step_for(model, model.dtype)
    tuned = step_for(model, model.dtype, tuner)
    tune_step(tuned)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for batch in batch_sizes:
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device)
        slots = torch.arange(batch, device=device)
        logits: dict[str, list[torch.Tensor]] = {"ref": [], "untuned": [], "tuned": []}
        for position in range(steps):
            positions = torch.full_like(tokens, position)
            for name, step in (("ref", ref_step), ("untuned", untuned), ("tuned", tuned)):
                logits[name].append(step(tokens, positions, slots).float().clone())
            tokens = logits["ref"][-1].argmax(-1)
        out.append(
            AccuracyResult(
                batch_size=batch,
                steps=steps,
                untuned=_errors(logits["untuned"], logits["ref"]),
                tuned=_errors(logits["tuned"], logits["ref"]),
            )
        )
    return out
