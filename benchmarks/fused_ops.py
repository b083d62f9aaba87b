"""Fused decode stages (graphtune.ops.fused) against the unfused tuned path, on one GPU.

For the Llama-3.2-1B shape at M = 1 and 8, and the Llama-3-8B and Qwen2.5-7B shapes at M = 1
(bf16, context 512), every stage of a decode layer is tuned with graphtune's tuner (graph timer;
the fused op's first runner is the unfused path, whose inner ops are tuned on the way), then
measured by CUPTI inside a CUDA graph (``bench.cupti_graph_time``: kernel durations plus the
gaps between a graph's kernels, per call):

* per stage: the unfused path with its tuned inner picks, and the fused kernel's best tactic
  (from the tuner's own measurements), with PDL on and off; achieved GB/s over the weight (and,
  for attention, K/V) bytes;
* one pass of ``--layers`` layers (QKV stage, attention, O-projection, MLP stage, down
  projection per layer, then the LM head), every stage as the unfused path, as the fused kernel
  and as the tuner's pick, with PDL on and off: the kernel boundaries PDL overlaps only show
  here. A pass launches the same kernels every call, so it is timed as one call
  (``calls_per_graph=2``), and its per-layer share is the pass minus the LM head stage, over the
  layers.

Calls rotate over ``--layers`` copies of the weights so they stream from DRAM as in a real step.
Run on the GPU machine from the repository root::

    PYTHONPATH=src python3 benchmarks/fused_ops.py --out OUT

It prints a short table last and writes ``OUT/fused-ops-<gpu>.json``. The JSON is written with
``bench.write_json`` (an atomic plain write) for now; it moves onto the ``graphtune.bench``
results writer when that lands.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.autotuner import AutoTuner, autotune
from graphtune.cli._args import (
    Parser,
    check_script_output,
    non_negative_int,
    positive_int,
    report_written,
)
from graphtune.ops import attention
from graphtune.ops.fused import (
    add_projection,
    add_projection_runners,
    norm_gate_up_silu,
    norm_gate_up_silu_runners,
    norm_linear,
    norm_linear_runners,
    norm_qkv_rope,
    norm_qkv_rope_runners,
)

# name: (hidden, intermediate, heads, kv_heads, head_dim, vocab, qkv bias)
SHAPES = {
    "llama-1b": (2048, 8192, 32, 8, 64, 128256, False),
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256, False),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064, True),
}
CASES = ("llama-1b:1", "llama-1b:8")
ALL_CASES = (*CASES, "llama-3-8b:1", "qwen2.5-7b:1")
STAGES = ("qkv", "attention", "o_proj", "mlp", "down", "lm_head")
ATTENTION_RUNNERS = ("sdpa", "matmul", "split+merge", "one-kernel")
SEQ, EPS = 512, 1e-5
BF16 = torch.bfloat16


class Layer:
    """One case's weights (``layers`` copies), KV cache, tables and the stage calls."""

    def __init__(self, shape: tuple, m: int, layers: int, tuner: AutoTuner) -> None:
        hidden, inter, heads, kv, dim, vocab, has_bias = shape
        self.m, self.layers, self.tuner = m, layers, tuner
        self.heads, self.kv, self.dim, self.hidden = heads, kv, dim, hidden

        def randn(*s: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*s, device="cuda") * scale).to(BF16)

        rows = (heads + 2 * kv) * dim
        self.w = [
            dict(
                attn_norm=1 + 0.1 * randn(hidden),
                mlp_norm=1 + 0.1 * randn(hidden),
                qkv=randn(rows, hidden, scale=hidden**-0.5),
                bqkv=randn(rows) if has_bias else None,
                o=randn(hidden, heads * dim, scale=(heads * dim) ** -0.5),
                gate_up=randn(2 * inter, hidden, scale=hidden**-0.5),
                down=randn(hidden, inter, scale=inter**-0.5),
            )
            for _ in range(layers)
        ]
        self.final_norm = 1 + 0.1 * randn(hidden)
        self.head = randn(vocab, hidden, scale=hidden**-0.5)
        self.cos, self.sin = randn(SEQ, dim), randn(SEQ, dim)
        self.k = [randn(m * kv * SEQ, dim) for _ in range(layers)]
        self.v = [randn(m * kv * SEQ, dim) for _ in range(layers)]
        self.positions = torch.full((m,), SEQ // 2, device="cuda")
        slots = torch.arange(m, device="cuda")[:, None] * kv + torch.arange(kv, device="cuda")
        self.write_rows = (slots * SEQ + SEQ // 2).reshape(-1)
        visible = torch.arange(SEQ, device="cuda")[None, :] <= self.positions[:, None]
        self.mask = torch.where(visible, 0.0, float("-inf")).to(BF16)[:, None, None, :]
        self.x = randn(m, hidden)
        self.q = randn(m, heads, dim)
        self.attn = randn(m, heads * dim)
        self.act = randn(m, inter)
        self.config = attention.tuning_config(m)
        self.bytes = {
            "qkv": self.w[0]["qkv"].numel() * 2,
            "attention": 2 * m * kv * SEQ * dim * 2,
            "o_proj": self.w[0]["o"].numel() * 2,
            "mlp": self.w[0]["gate_up"].numel() * 2,
            "down": self.w[0]["down"].numel() * 2,
            "lm_head": self.head.numel() * 2,
        }

    # Each stage as (op name, runners, inputs) for layer l, as the fused op functions build them.
    def stage(self, name: str, layer: int) -> tuple[str, tuple, list[Any]]:
        w, t, m = self.w[layer], self.tuner, self.m
        if name == "qkv":
            runners = norm_qkv_rope_runners(self.heads, self.kv, True, tuner=t, max_m=m)
            inputs = [self.x, w["attn_norm"], w["qkv"], w["bqkv"], self.positions, self.cos]
            inputs += [self.sin, self.k[layer], self.v[layer], self.write_rows, EPS, None]
            return "graphtune.norm_qkv_rope", runners, inputs
        if name == "attention":
            keys = self.k[layer].view(m, self.kv, SEQ, self.dim)
            values = self.v[layer].view(m, self.kv, SEQ, self.dim)
            q = self.q.view(m, self.kv, self.heads // self.kv, self.dim)
            return attention.OP_NAME, attention.RUNNERS, [q, keys, values, self.mask]
        if name in ("o_proj", "down"):
            a, weight = (self.attn, w["o"]) if name == "o_proj" else (self.act, w["down"])
            return (
                "graphtune.add_projection",
                add_projection_runners(tuner=t, max_m=m),
                [
                    self.x,
                    a,
                    weight,
                ],
            )
        if name == "mlp":
            runners = norm_gate_up_silu_runners(tuner=t, max_m=m)
            return (
                "graphtune.norm_gate_up_silu",
                runners,
                [self.x, w["mlp_norm"], w["gate_up"], EPS],
            )
        runners = norm_linear_runners(tuner=t, max_m=m)
        return "graphtune.norm_linear", runners, [self.x, self.final_norm, self.head, None, EPS]

    def tune(self) -> None:
        """Runs every stage once under autotune (nested: the inner ops are tuned too)."""
        t, m = self.tuner, self.m
        w = self.w[0]
        # tune=True: this must tune; GRAPHTUNE_CACHE_ONLY (meant for serving) would skip it.
        with autotune(tuner=t, tune=True):
            norm_qkv_rope(
                self.x, w["attn_norm"], EPS, w["qkv"], w["bqkv"], self.positions, self.cos,
                self.sin, self.k[0], self.v[0], self.write_rows, num_heads=self.heads,
                num_kv_heads=self.kv, signed_sin=True, tuner=t, max_m=m,
            )  # fmt: skip
            op, runners, inputs = self.stage("attention", 0)
            t.choose_one(op, runners, self.config, inputs)
            add_projection(self.x, self.attn, w["o"], tuner=t, max_m=m)
            norm_gate_up_silu(self.x, w["mlp_norm"], EPS, w["gate_up"], tuner=t, max_m=m)
            add_projection(self.x, self.act, w["down"], tuner=t, max_m=m)
            norm_linear(self.x, self.final_norm, EPS, self.head, tuner=t, max_m=m)

    def choices(self, name: str) -> dict[str, tuple[int, Any]]:
        """(runner index, tactic) of the unfused path, the best fused tactic and the pick."""
        op, runners, inputs = self.stage(name, 0)
        record = next(
            r
            for r in reversed(self.tuner.history)
            if r.op == op and r.profile.split("x")[0] == str(self.m)
        )
        ok = [c for c in record.candidates if c.failed is None]
        pick = record.candidates[record.winner_index]
        if name == "attention":  # unfused: split + merge kernel; fused: merged in-kernel
            two = [c for c in ok if c.runner_index == 2] or ok
            one = [c for c in ok if c.runner_index == 3] or two
            unfused, fused = (
                min(two, key=lambda c: c.median_us),
                min(one, key=lambda c: c.median_us),
            )
        else:
            unfused = next(c for c in ok if c.runner_index == 0)
            fused = min((c for c in ok if c.runner_index == 1), key=lambda c: c.median_us)
        return {
            kind: (c.runner_index, c.tactic, c.median_us)
            for kind, c in (("unfused", unfused), ("fused", fused), ("pick", pick))
        }

    def call(self, name: str, choice: tuple[int, Any, float], layer: int) -> None:
        op, runners, inputs = self.stage(name, layer)
        runners[choice[0]].forward(inputs, tactic=choice[1])


def _time(fn, calls: int) -> dict[str, Any]:
    result = bench.cupti_graph_time(fn, calls_per_graph=calls, replays=10, event_check=False)
    return result.as_dict()


def _set_pdl(on: bool) -> None:
    # The library reads GRAPHTUNE_PDL at every launch (graphtune.env); a script may set it.
    os.environ["GRAPHTUNE_PDL"] = "1" if on else "0"


def run_case(name: str, m: int, layers: int, tuner: AutoTuner) -> dict[str, Any]:
    layer = Layer(SHAPES[name], m, layers, tuner)
    start = time.perf_counter()
    _set_pdl(True)
    layer.tune()
    tuned_s = time.perf_counter() - start
    choices = {s: layer.choices(s) for s in STAGES}
    stages: dict[str, Any] = {}
    for stage in STAGES:
        row: dict[str, Any] = {"bytes": layer.bytes[stage], "tuner_us": {}}
        # The unfused path's PDL on/off differ only where it runs a PDL kernel: timed with PDL on.
        for kind, pdls in (("unfused", (True,)), ("fused", (True, False))):
            choice = choices[stage][kind]
            row["tuner_us"][kind] = choice[2]
            row[f"{kind}_tactic"] = [choice[0], choice[1]]
            for pdl in pdls:
                _set_pdl(pdl)
                t = _time(lambda i, c=choice, s=stage: layer.call(s, c, i % layers), 4 * layers)
                row[f"{kind}_pdl_{'on' if pdl else 'off'}"] = t
        row["pick"] = [choices[stage]["pick"][0], choices[stage]["pick"][1]]
        stages[stage] = row

    def one_pass(kind: str):
        def run(_: int) -> None:
            for index in range(layers):
                for stage in STAGES[:-1]:
                    layer.call(stage, choices[stage][kind], index)
            layer.call("lm_head", choices["lm_head"][kind], 0)

        return run

    passes: dict[str, Any] = {}
    for kind, pdls in (("unfused", (True,)), ("fused", (True, False)), ("pick", (True, False))):
        for pdl in pdls:
            _set_pdl(pdl)
            # Every pass launches the same kernels, so the graph's calls split evenly.
            passes[f"{kind}_pdl_{'on' if pdl else 'off'}"] = _time(one_pass(kind), 2)
    _set_pdl(True)
    head = stages["lm_head"]

    def head_us(key: str) -> float:
        """The LM head stage's time under a pass's (kind, PDL) setting."""
        kind, _, pdl = key.partition("_pdl_")
        if kind == "pick":
            kind = "unfused" if choices["lm_head"]["pick"][0] == 0 else "fused"
        return head[f"{kind}_pdl_{pdl}" if kind == "fused" else "unfused_pdl_on"]["per_call_us"]

    per_layer = {k: (v["per_call_us"] - head_us(k)) / layers for k, v in passes.items()}
    return {"shape": name, "m": m, "layers": layers, "tuning_s": tuned_s, "stages": stages,
            "pass": passes, "per_layer_us": per_layer,
            "seconds": time.perf_counter() - start}  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "case            stage      unfused us  fused us (PDL on/off)  fused GB/s  pick",
        "-" * 84,
    ]
    for case in results:
        label = f"{case['shape']}:M={case['m']}"
        for stage, row in case["stages"].items():
            fon = row["fused_pdl_on"]["per_call_us"]
            foff = row["fused_pdl_off"]["per_call_us"]
            gbs = row["bytes"] / fon / 1e3 if fon else float("nan")
            names = ATTENTION_RUNNERS if stage == "attention" else ("unfused", "fused")
            pick = names[row["pick"][0]]
            unf = row["unfused_pdl_on"]["per_call_us"]
            lines.append(
                f"{label:15} {stage:10} {unf:10.2f}  {fon:8.2f} / {foff:6.2f}"
                f"      {gbs:8.0f}  {pick}"
            )
        per = case["per_layer_us"]
        lines.append(
            f"{label:15} {'layer':10} {per['unfused_pdl_on']:10.2f}  {per['fused_pdl_on']:8.2f} / "
            f"{per['fused_pdl_off']:6.2f}      pick {per['pick_pdl_on']:.2f} / "
            f"{per['pick_pdl_off']:.2f} us (PDL on/off)"
        )
    return "\n".join(lines)


def fused_cases(text: str) -> list[tuple[str, int]]:
    """``argparse`` type of ``--cases``: ``SHAPE:M,...``, each SHAPE of :data:`SHAPES` and each M
    an integer >= 1, so a bad case is refused before the first case runs."""
    cases = []
    for case in text.split(","):
        name, colon, m = case.strip().partition(":")
        if not colon or name not in SHAPES:
            raise argparse.ArgumentTypeError(
                f"{case!r} is not SHAPE:M with SHAPE one of {','.join(SHAPES)} (e.g. llama-1b:8)"
            )
        try:
            cases.append((name, positive_int(m)))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{case!r}: M {exc}") from None
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument(
        "--cases",
        type=fused_cases,
        default=",".join(CASES),
        help=f"SHAPE:M,... to run (all: {','.join(ALL_CASES)})",
    )
    parser.add_argument(
        "--layers", type=non_negative_int, default=0, help="weight copies (0: 4 / 2 for 8B)"
    )
    args = parser.parse_args(argv)
    device = bench.require_cuda_or_exit("fused_ops.py")
    target = args.out / f"fused-ops-{bench.gpu_slug(torch.cuda.get_device_name(device))}.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    tuner = AutoTuner(show_progress=False)  # one tuner: shapes shared between cases tune once
    results = []
    start = time.perf_counter()
    for name, m in args.cases:
        case = f"{name}:{m}"
        layers = args.layers or (4 if name == "llama-1b" else 2)
        print(f"{case}: tuning and timing ({layers} weight copies)", flush=True)
        results.append(run_case(name, m, layers, tuner))
        done = results[-1]
        print(f"{case}: tuned in {done['tuning_s']:.0f} s, done in {done['seconds']:.0f} s")
        torch.cuda.empty_cache()
    payload = {
        "provenance": bench.provenance(device=device),
        "seconds": time.perf_counter() - start,
        "cases": results,
        "tuner_stats": vars(tuner.stats),
    }
    path = bench.write_json(target, payload)  # target, or the fallback file it went to instead
    print(f"done in {payload['seconds']:.0f} s")
    print(table(results))
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if report_written("--out", target, path) else 1


if __name__ == "__main__":
    raise SystemExit(main())
