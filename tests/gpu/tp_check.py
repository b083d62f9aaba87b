"""TP=2 checks on two GPUs, run under torchrun by ``test_tp_decode_gpu.py`` (prints one JSON line).

``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2
tests/gpu/tp_check.py``: rank 0 first decodes with the whole model (TP=1), then both ranks decode
with their shards through captured graphs (the all-reduces inside every graph: symmetric-memory
one-shot when available, and NCCL) and eagerly, and with the tuned step (tuned with ``agree``).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from graphtune.engine import Engine, load_model
from graphtune.engine.parallel import ParallelContext, init_from_torchrun

SIZES = [1, 2, 4, 8]


def _max_abs_diffs(
    want_engine: Engine, got_engine: Engine, device: torch.device
) -> dict[int, float]:
    """Max |logit difference| of one step at every size in SIZES (token 11 at position 0)."""
    diffs = {}
    for b in SIZES:
        args = (
            torch.full((b,), 11, device=device, dtype=torch.long),
            torch.zeros(b, device=device, dtype=torch.long),
            torch.arange(b, device=device),
        )
        want = want_engine.step(*args).clone()
        diffs[b] = (got_engine.step(*args) - want).abs().max().item()
    return diffs


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama-1b-shape"  # "tiny": CPU smoke run
    parallel, device = init_from_torchrun(
        2, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(5 + i)] for i in range(6)]
    out: dict = {}
    with torch.inference_mode():
        if parallel.rank == 0:
            whole = load_model(model, device=device, dtype=torch.float32, seed=0)
            engine = Engine(whole, runner="eager", max_batch_size=8, max_seq_len=64)
            out["tp1"] = engine.generate(prompts, 12, stop_token_ids=[])
            del engine, whole
            torch.cuda.empty_cache()
        shard = load_model(model, device=device, dtype=torch.float32, seed=0, parallel=parallel)
        graph = Engine(shard, runner="graph", max_batch_size=8, max_seq_len=64, capture_sizes=SIZES)
        out["tp2_graph"] = graph.generate(prompts, 12, stop_token_ids=[])
        eager = Engine(shard, runner="eager", max_batch_size=8, max_seq_len=64)
        out["graph_vs_eager_max_abs"] = _max_abs_diffs(eager, graph, device)
        stats = graph.stats
        out["captured"] = sorted(r.size for r in stats.records if r.ok)
        out["fallbacks"] = {str(k): v for k, v in dict(stats.fallbacks).items()}
        gathered = [None, None]
        dist.all_gather_object(gathered, out["tp2_graph"])
        out["ranks_agree"] = gathered[0] == gathered[1]
        out["all_reduce"] = graph.step_fn.reducer.name
        out["fused_norm"] = bool(getattr(graph.step_fn.reducer, "fused", False))
        graph.release()
        # The same decode with NCCL all-reduces in the graphs.
        nccl = ParallelContext(parallel.group, parallel.rank, parallel.world_size, "nccl")
        shard_nccl = load_model(model, device=device, dtype=torch.float32, seed=0, parallel=nccl)
        engine = Engine(
            shard_nccl, runner="graph", max_batch_size=8, max_seq_len=64, capture_sizes=SIZES
        )
        out["tp2_graph_nccl"] = engine.generate(prompts, 12, stop_token_ids=[])
        engine.release()
        # The tuned step (tuned with 'agree' over the group), captured.
        tuned = Engine(
            shard, runner="graph", max_batch_size=8, max_seq_len=64, capture_sizes=SIZES, tune=True
        )
        picks = sorted(
            f"{k.op}|{k.shapes}|{e.runner_id}|{e.tactic}" for k, e in tuned.tuner.cache.items()
        )
        views = [None, None]
        dist.all_gather_object(views, picks)
        out["tuned_picks_agree"] = views[0] == views[1]
        out["tuned_picks"] = len(picks)
        out["tuned_vs_eager_max_abs"] = _max_abs_diffs(eager, tuned, device)
        out["tuned_fallbacks"] = dict(tuned.tuning_stats.fallbacks)
        out["tuned_tokens"] = tuned.generate(prompts, 12, stop_token_ids=[])
        tuned.release()
    if parallel.rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
