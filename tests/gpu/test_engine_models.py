"""Model features on CUDA: Qwen3 (per-head q/k norms), MLP biases and a non-SiLU activation.

Each model is a random tiny checkpoint saved by transformers: logits equal transformers' in
float32 on the GPU, the graph runner's equal the eager step's, and the tuned step (Triton kernels
where they apply; SiLU-and-mul only for SiLU models) stays within bf16 rounding of the untuned one.
"""

from __future__ import annotations

import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.engine import DecodeStep, KVCache, build_runner, load_checkpoint, prefill
from graphtune.engine.tuning import tune_step

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CASES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=64)),
    "llama-mlp-bias-gelu": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(mlp_bias=True, hidden_act="gelu_pytorch_tanh"),
    ),
}


def _checkpoint(kind: str, tmp_path):
    config_cls, model_cls, extra = CASES[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**TINY, **extra)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            scale = 0.1 if "norm" in name else 0.3 if "embed" in name else param.shape[-1] ** -0.5
            param.copy_(
                (1.0 if "norm" in name else 0.0) + scale * torch.randn(param.shape, generator=gen)
            )
    hf.save_pretrained(tmp_path / kind, safe_serialization=True)
    return hf, tmp_path / kind


@pytest.mark.parametrize("kind", sorted(CASES))
def test_float32_logits_match_transformers_on_cuda(kind, tmp_path):
    hf, folder = _checkpoint(kind, tmp_path)
    ours = load_checkpoint(folder, device="cuda", dtype=torch.float32)
    step = DecodeStep(ours, KVCache(ours.config, 2, 64, device="cuda"))
    seq = torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.to("cuda")(seq[None].cuda()).logits[0].float()
    with torch.inference_mode():
        got = prefill(step, seq[:8].cuda(), 1, all_logits=True)
        torch.testing.assert_close(got, want[:8], rtol=2e-3, atol=2e-3)
        for pos in range(8, 12):
            logits = step(*(torch.tensor([v], device="cuda") for v in (seq[pos], pos, 1)))
            torch.testing.assert_close(logits[0], want[pos], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_graph_and_tuned_steps_match_eager_in_bf16(kind, tmp_path):
    _, folder = _checkpoint(kind, tmp_path)
    model = load_checkpoint(folder, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(model.config, 8, 64, device="cuda", dtype=torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    eager = DecodeStep(model, cache, contiguous_slots=True)
    runner = build_runner(eager, "graph", capture_sizes=[1, 2, 4, 8], device=torch.device("cuda"))
    tuned = DecodeStep(model, cache, contiguous_slots=True, tuner=AutoTuner())
    with torch.inference_mode():
        runner.capture(*eager.example_inputs(8))
        tune_step(tuned)
        for batch in (1, 3, 8):
            tokens = torch.randint(0, TINY["vocab_size"], (batch,), device="cuda")
            positions = torch.full((batch,), 20, device="cuda")
            slots = torch.arange(batch, device="cuda")
            want = eager(tokens, positions, slots).float()
            # Padded sizes (3 -> 4) may run other GEMM kernels: equal up to bf16 rounding.
            graph = runner(tokens, positions, slots).float()
            torch.testing.assert_close(graph, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
            got = tuned(tokens, positions, slots).float()
            assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert tuned.tuner.stats.fallbacks == {}
    runner.release()
