"""The decode step's input kernel (graphtune.ops.step_inputs) under Triton's interpreter: the same
bits as the engine's torch code (embedding gather, KV write rows, causal mask with and without a
sliding window), and the tuned step runs it and gives the untuned step's logits exactly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model  # noqa: E402
from graphtune.engine import step as step_module  # noqa: E402
from graphtune.engine.attention import causal_mask  # noqa: E402
from graphtune.errors import InputError  # noqa: E402
from graphtune.ops import _triton, step_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


@pytest.mark.parametrize(
    "hidden,max_seq,kv_heads,window,dtype",
    [
        (96, 40, 2, None, torch.float32),  # one block: hidden and the keys share it
        (1500, 2100, 3, None, torch.bfloat16),  # three blocks, kv_heads not a power of two
        (64, 1030, 1, 16, torch.float16),  # a sliding window; the mask spans two blocks
    ],
)
def test_one_kernel_gives_the_torch_codes_bits(hidden, max_seq, kv_heads, window, dtype):
    gen = torch.Generator().manual_seed(hidden)
    vocab, batch = 50, 5
    embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
    tokens = torch.randint(0, vocab, (batch,), generator=gen)
    positions = torch.randint(0, max_seq, (batch,), generator=gen)
    positions[0] = 0
    positions[1] = max_seq - 1
    slots = torch.randperm(batch, generator=gen)
    x, rows, mask = step_inputs.decode_inputs(
        tokens,
        positions,
        slots,
        embed,
        kv_heads=kv_heads,
        max_seq=max_seq,
        window=window,
        mask_dtype=dtype,
    )
    assert torch.equal(x, F.embedding(tokens, embed))
    heads = torch.arange(kv_heads)[None, :]
    want_rows = ((slots[:, None] * kv_heads + heads) * max_seq + positions[:, None]).reshape(-1)
    assert rows.dtype == torch.long and torch.equal(rows, want_rows)
    zero, neg_inf = torch.tensor(0.0, dtype=dtype), torch.tensor(float("-inf"), dtype=dtype)
    want_mask = causal_mask(positions, torch.arange(max_seq), zero, neg_inf, window)
    assert mask.shape == (batch, 1, 1, max_seq) and mask.dtype == dtype
    assert torch.equal(mask[:, 0, 0], want_mask)


def test_an_empty_batch_launches_nothing():
    embed = torch.randn(8, 16)
    empty = torch.zeros(0, dtype=torch.long)
    x, rows, mask = step_inputs.decode_inputs(
        empty, empty, empty, embed, kv_heads=2, max_seq=4, window=None, mask_dtype=embed.dtype
    )
    assert x.shape == (0, 16) and rows.shape == (0,) and mask.shape == (0, 1, 1, 4)


def test_the_tuned_step_runs_the_kernel_and_gives_the_untuned_logits(monkeypatch):
    model = load_model("tiny", seed=3)
    calls = []
    kernel = step_inputs.decode_inputs

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(step_module, "decode_inputs", counted)
    tuned = DecodeStep(model, KVCache(model.config, 3, 32), tuner=AutoTuner(show_progress=False))
    untuned = DecodeStep(model, KVCache(model.config, 3, 32))
    tokens, positions, slots = torch.tensor([5, 9]), torch.tensor([0, 0]), torch.tensor([2, 0])
    with torch.inference_mode():
        want = untuned(tokens, positions, slots)
        got = tuned.decode(tuned.ops.unfused(), tokens, positions, slots)
    assert calls == [2] and torch.equal(got, want)


def test_strided_index_views_give_the_contiguous_bits():
    # The kernel reads element b at offset b: read so, a strided view (the last column of a
    # token history) gives other rows' embeddings and cache rows, silently.
    embed = torch.randn(10, 8)
    history = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    tokens = history[:, -1]
    positions = torch.tensor([[2, 0], [5, 0], [9, 0]])[:, 0]
    slots = torch.tensor([[0, 7], [1, 7], [2, 7]])[:, 0]
    kwargs = dict(kv_heads=2, max_seq=16, window=None, mask_dtype=torch.float32)
    got = step_inputs.decode_inputs(tokens, positions, slots, embed, **kwargs)
    want = step_inputs.decode_inputs(
        tokens.contiguous(), positions.contiguous(), slots.contiguous(), embed, **kwargs
    )
    assert torch.equal(got[0], F.embedding(tokens, embed))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(embed=torch.randn(16, 10).t()), "embed must be a .vocab, hidden. float16"),
        (dict(embed=torch.randn(10)), "embed must be a .vocab, hidden. float16"),
        # The same dtype rule as decode_inputs_supported, which sends such tables to torch.
        (dict(embed=torch.randn(10, 16, dtype=torch.float64)), "bfloat16 or float32 table"),
        (dict(embed=torch.ones(10, 16, dtype=torch.int64)), "bfloat16 or float32 table"),
        (dict(mask_dtype=torch.int64), "mask_dtype must be a float"),
        (dict(mask_dtype="float32"), "mask_dtype must be a float"),
        (dict(tokens=torch.tensor([1.0, 2.0])), "got tokens"),
        (dict(tokens=torch.tensor(1)), "got tokens"),
        (dict(positions=torch.tensor([0, 1], device="meta")), "got positions"),
        (dict(slots=torch.tensor([0, 1, 2])), "got slots"),
        # Sizes: torch's own TypeError from inside torch.empty before.
        (dict(kv_heads=2.0), "kv_heads must be an int >= 1"),
        (dict(kv_heads=0), "kv_heads must be an int >= 1"),
        (dict(max_seq=True), "max_seq must be an int >= 1"),
        (dict(window=2.5), "window must be None or an int"),
    ],
)
def test_bad_inputs_are_refused(change, match):
    args = dict(
        tokens=torch.tensor([1, 2]),
        positions=torch.tensor([0, 1]),
        slots=torch.tensor([0, 1]),
        embed=torch.randn(10, 16),
        mask_dtype=torch.float32,
        kv_heads=2,
        max_seq=8,
        window=None,
    )
    args.update(change)
    with pytest.raises(InputError, match=match):
        step_inputs.decode_inputs(**args)
