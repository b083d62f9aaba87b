#!/usr/bin/env python3
"""CUDAGraphRunner against eager, a hand-written CUDA graph, and the GPU-busy limit.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/graph_runner.py --out benchmarks/results [--quick]

The step is a Llama-3.2-1B-shaped decode step in bf16 with random weights: token embedding
(vocab 128256, tied LM head), 16 layers of RMSNorm, fused QKV (32 query heads, 8 KV heads, head
dim 64), rotary embedding, a persistent KV cache written by (slot, position) index, attention by
``torch.nn.functional.scaled_dot_product_attention`` over a fixed 512-token context, output
projection, RMSNorm and a SiLU-gated MLP (8192), then the final norm and logits.

Per batch size: eager ms, runner ms (padding, copy-in and slicing included), a hand-written
``torch.cuda.graph`` of the step at exactly that size (no padding, no copies), and the GPU-busy
time (sum of the step's CUDA kernel durations from ``torch.profiler``). Then the capture time and
pool memory of the default size list up to 256, and pool memory with one pool per graph.

Targets (H200): runner <= 1.05x hand-written at every captured size; full default-list capture
<= 5 s; shared pool <= 0.7x separate pools. Times are CUDA-event medians over repeats after
warm-up, on random inputs. Writes ``graph-runner-<gpu>.json`` into ``--out``, prints a one-line
JSON summary and the table last. Exits 2 without CUDA, 1 if a target failed, else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from graphtune import bench
from graphtune.graphs import CUDAGraphRunner, default_capture_sizes, graph_break
from graphtune.reporting import render_table

DT = torch.bfloat16
MIB = 1024 * 1024
TARGET_RATIO, TARGET_CAPTURE_S, TARGET_POOL = 1.05, 5.0, 0.7


class LlamaDecodeStep:
    """Llama-1B-shaped decode step; batch row i reads cache slot i, writes ``cache[slot, pos]``.

    With ``breaks=True`` each layer's attention runs through ``graph_break`` (eagerly between
    captured pieces); benchmarks/graph_capture.py measures what that costs.
    """

    def __init__(
        self,
        max_batch: int,
        *,
        breaks=False,
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        inter=8192,
        vocab=128256,
        ctx=512,
        seed=0,
    ):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.breaks = breaks
        d = hidden // heads
        self.h, self.heads, self.kv, self.d, self.ctx = hidden, heads, kv_heads, d, ctx

        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(DT)

        self.emb = w(vocab, hidden, scale=1.0)
        self.layers = [
            dict(
                n1=w(hidden, scale=0.05) + 1,
                qkv=w(hidden, (heads + 2 * kv_heads) * d, scale=hidden**-0.5),
                o=w(heads * d, hidden, scale=(heads * d) ** -0.5),
                n2=w(hidden, scale=0.05) + 1,
                gu=w(hidden, 2 * inter, scale=hidden**-0.5),
                down=w(inter, hidden, scale=inter**-0.5),
            )
            for _ in range(layers)
        ]
        self.norm = w(hidden, scale=0.05) + 1
        self.slots = max_batch + 1  # the last slot is scratch: padded rows write there
        shape = (layers, self.slots, kv_heads, ctx, d)
        self.cache_k, self.cache_v = w(*shape, scale=1.0), w(*shape, scale=1.0)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        angles = torch.outer(torch.arange(ctx, device="cuda").float(), inv)
        self.cos, self.sin = angles.cos().to(DT), angles.sin().to(DT)

    @staticmethod
    def _rms(x, weight):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(DT) * weight

    def _rope(self, x, cos, sin):  # x [b, heads, d]; cos/sin [b, 1, d/2]
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def __call__(self, ids, slot, pos):
        b = ids.shape[0]
        x = self.emb[ids]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        group = self.heads // self.kv
        for i, p in enumerate(self.layers):
            qkv = self._rms(x, p["n1"]) @ p["qkv"]
            q, k, v = qkv.split([self.heads * self.d, self.kv * self.d, self.kv * self.d], -1)
            q = self._rope(q.view(b, self.heads, self.d), cos, sin)
            k = self._rope(k.view(b, self.kv, self.d), cos, sin)
            self.cache_k[i][slot, :, pos] = k
            self.cache_v[i][slot, :, pos] = v.view(b, self.kv, self.d)
            # GQA: the `group` query heads of one KV head attend as `group` query rows.
            q = q.view(b, self.kv, group, self.d)
            attn = graph_break(self._attend, q, i) if self.breaks else self._attend(q, i)
            x = x + attn.reshape(b, self.heads * self.d) @ p["o"]
            gate, up = (self._rms(x, p["n2"]) @ p["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ p["down"]
        return self._rms(x, self.norm) @ self.emb.t()

    def _attend(self, q, layer):
        b = q.shape[0]
        return F.scaled_dot_product_attention(q, self.cache_k[layer][:b], self.cache_v[layer][:b])

    def inputs(self, b, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.randint(0, self.emb.shape[0], (b,), generator=gen, device="cuda")
        pos = torch.randint(0, self.ctx, (b,), generator=gen, device="cuda")
        return ids, torch.arange(b, device="cuda"), pos


def time_ms(fn, *, reps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean per-call time of ``reps`` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def hand_written_graph(step, inputs):
    """The baseline: the step captured at exactly this size, no padding, no copies."""
    static = tuple(t.clone() for t in inputs)
    side, current = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    return graph, out


def reserved_clean() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def capture_run(step, max_batch, example, *, share_pool):
    runner = CUDAGraphRunner(
        step, max_batch_size=max_batch, share_pool=share_pool, pad={"1": step.slots - 1}
    )
    before = reserved_clean()
    start = time.perf_counter()
    runner.capture(*example)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    info = {
        "sizes": len(runner.capture_sizes),
        "graphs": runner.stats.graphs,
        "failed": [r.error for r in runner.stats.failed_captures],
        "capture_wall_s": wall,
        "capture_s": runner.stats.capture_seconds,
        "warmup_s": runner.stats.warmup_seconds,
        "pool_mib": runner.stats.pool_bytes / MIB,
        "reserved_growth_mib": (torch.cuda.memory_reserved() - before) / MIB,
    }
    return runner, info, before


def measure_size(step, runner, b, *, captured, reps, repeats) -> dict:
    """Eager, runner, hand-written graph and GPU-busy time of one batch size."""
    inputs = step.inputs(b, seed=b)
    eager_ms = time_ms(lambda: step(*inputs), reps=max(2, reps // 2), repeats=repeats)
    runner_ms = time_ms(lambda: runner(*inputs), reps=reps, repeats=repeats)
    got = runner(*inputs).clone()
    graph, hand_out = hand_written_graph(step, inputs)
    hand_ms = time_ms(graph.replay, reps=reps, repeats=repeats)
    graph.replay()
    # Same kernels on the same data: at a captured size the outputs must be identical.
    same = bool(torch.equal(got, hand_out)) if captured else None
    del graph, hand_out
    busy = bench.cupti_kernel_time(lambda i: step(*inputs), calls=3, warmup=1)
    return {
        "batch": b,
        "captured": captured,
        "eager_ms": eager_ms,
        "runner_ms": runner_ms,
        "hand_graph_ms": hand_ms,
        "gpu_busy_ms": busy.per_call_us / 1000,
        "kernels_per_step": busy.kernels_per_call,
        "runner_vs_hand": runner_ms / hand_ms,
        "runner_equals_hand_graph": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args()
    device = bench.require_cuda_or_exit("graph_runner.py")
    torch.backends.cuda.matmul.allow_tf32 = False

    max_batch = 256
    sizes = [1, 8, 64, 3] if args.quick else [1, 8, 32, 64, 128, 256, 3, 50]
    reps, repeats = (5, 3) if args.quick else (10, 5)
    step = LlamaDecodeStep(max_batch)
    captured = set(default_capture_sizes(max_batch))
    print(f"graph_runner: Llama-1B-shaped decode step on {torch.cuda.get_device_name(device)}")

    # Capture the default list into one shared pool (timed), then keep this runner for timing.
    runner, shared, before = capture_run(
        step, max_batch, step.inputs(max_batch, 0), share_pool=True
    )
    print(
        f"  captured {shared['graphs']} sizes in {shared['capture_wall_s']:.2f} s, "
        f"pool {shared['pool_mib']:.0f} MiB"
    )

    rows, results = [], []
    for b in sizes:
        entry = measure_size(step, runner, b, captured=b in captured, reps=reps, repeats=repeats)
        results.append(entry)
        same = entry["runner_equals_hand_graph"]
        rows.append(
            (
                b,
                "yes" if entry["captured"] else "padded",
                entry["eager_ms"],
                entry["runner_ms"],
                entry["hand_graph_ms"],
                entry["gpu_busy_ms"],
                entry["runner_vs_hand"],
                "-" if same is None else str(same),
            )
        )
        print(
            f"  batch {b}: eager {entry['eager_ms']:.2f} ms, runner {entry['runner_ms']:.3f} ms, "
            f"hand graph {entry['hand_graph_ms']:.3f} ms, busy {entry['gpu_busy_ms']:.3f} ms"
        )

    replays = runner.stats.replays
    runner.release()
    after_release = reserved_clean()
    separate_runner, separate, _ = capture_run(
        step, max_batch, step.inputs(max_batch, 0), share_pool=False
    )
    separate_runner.release()

    pool_ratio = shared["pool_mib"] / separate["pool_mib"] if separate["pool_mib"] else math.nan
    worst = max(r["runner_vs_hand"] for r in results if r["captured"])
    targets = {
        "runner_vs_hand_max": {
            "value": worst,
            "target": TARGET_RATIO,
            "pass": worst <= TARGET_RATIO,
        },
        "capture_s": {
            "value": shared["capture_wall_s"],
            "target": TARGET_CAPTURE_S,
            "pass": shared["capture_wall_s"] <= TARGET_CAPTURE_S,
        },
        "shared_vs_separate_pool": {
            "value": pool_ratio,
            "target": TARGET_POOL,
            "pass": pool_ratio <= TARGET_POOL,
        },
        "replay_equals_hand_graph": {
            "value": all(r["runner_equals_hand_graph"] is not False for r in results),
            "target": True,
        },
    }
    targets["replay_equals_hand_graph"]["pass"] = targets["replay_equals_hand_graph"]["value"]
    ok = all(t["pass"] for t in targets.values())
    payload = {
        "benchmark": "graph_runner",
        "quick": args.quick,
        "provenance": bench.provenance(args.commit, device),
        "step": {
            "shape": "llama-3.2-1b",
            "layers": 16,
            "hidden": 2048,
            "heads": 32,
            "kv_heads": 8,
            "mlp": 8192,
            "vocab": 128256,
            "context": 512,
            "dtype": "bf16",
        },
        "timing": {"method": "CUDA events, median of repeats", "reps": reps, "repeats": repeats},
        "sizes": results,
        "capture_shared_pool": shared,
        "capture_separate_pools": separate,
        "memory": {
            "reserved_before_capture_mib": before / MIB,
            "reserved_after_release_mib": after_release / MIB,
        },
        "runner_replays": replays,
        "targets": targets,
        "pass": ok,
    }
    slug = payload["provenance"]["gpu_slug"] or "unknown"
    path = bench.write_json(args.out / f"graph-runner-{slug}.json", payload)
    summary = {
        k: (
            round(v["value"], 4) if isinstance(v["value"], float) else v["value"],
            "pass" if v["pass"] else "FAIL",
        )
        for k, v in targets.items()
    }
    print(json.dumps({"graph_runner": summary, "pass": ok, "json": str(path)}))
    table = render_table(
        "graph runner vs eager vs hand-written graph (ms per step)",
        [
            "batch",
            "captured",
            "eager",
            "runner",
            "hand graph",
            "GPU busy",
            "runner/hand",
            "== hand",
        ],
        rows,
    )
    memory = render_table(
        "capture of the default size list (up to 256)",
        ["pool", "graphs", "capture s", "pool MiB", "target"],
        [
            (
                "shared",
                shared["graphs"],
                shared["capture_wall_s"],
                shared["pool_mib"],
                f"capture <= {TARGET_CAPTURE_S} s: "
                f"{'pass' if targets['capture_s']['pass'] else 'FAIL'}",
            ),
            (
                "separate",
                separate["graphs"],
                separate["capture_wall_s"],
                separate["pool_mib"],
                f"shared/separate {pool_ratio:.2f} <= {TARGET_POOL}: "
                f"{'pass' if targets['shared_vs_separate_pool']['pass'] else 'FAIL'}",
            ),
        ],
    )
    print(memory)
    print(
        f"runner/hand-written worst at captured sizes: {worst:.3f} (target <= {TARGET_RATIO}: "
        f"{'pass' if targets['runner_vs_hand_max']['pass'] else 'FAIL'})"
    )
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
