"""A prompt's bfloat16 projections on the CPU: oneDNN's product on its packed weight vs kvtool's AMX tile
product (kvtool.cpu_kernels.tile_products), the amx kernels only (an Intel Xeon with AMX).

A Llama layer's four projections at --rows rows (a prompt's miss, a hit's new tokens), with as many
distinct weights as the model has layers, as in a step; gate_up as the decoder runs it each way: oneDNN's
product then kvtool's silu_mul kernel, or one gated tile product. The two alternate over --rounds rounds;
medians per call, GFLOP/s, and tiles / oneDNN for the layers' products together. Whole steps both ways:
``python bench/cpu_forward.py --plan PLAN --paths kernels,kernels-no-tiles``.

    python bench/cpu_tile_linear.py [--rows 1053 32] [--rounds 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_linear_rows import add_shape_arguments
from kvtool.cpu_kernels import CpuKernels, ops
from kvtool.cpu_kernels.step_buffers import StepBuffers
from kvtool.cpu_kernels.tile_products import tile_product, tile_weight
from kvtool.layers.cpu_linear import PackedLinear


def layer_products(args, rows: int, kernels: CpuKernels) -> None:
    head_dim = args.hidden // args.num_heads
    shapes = {"qkv": ((args.num_heads + 2 * args.num_kv_heads) * head_dim, args.hidden),
              "o": (args.hidden, args.num_heads * head_dim), "gate_up": (2 * args.intermediate, args.hidden),
              "down": (args.hidden, args.intermediate)}
    totals = {"onednn": 0.0, "tiles": 0.0}
    outputs = StepBuffers(torch.bfloat16)
    for name, (out_f, in_f) in shapes.items():
        gated = name == "gate_up"
        modules = [torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16) for _ in range(args.num_layers)]
        packed = [PackedLinear(m.weight, None, None) for m in modules]
        tiles = [tile_product(kernels, tile_weight(m, gated=gated), outputs, name) for m in modules]
        x = torch.randn(rows, in_f).bfloat16()
        activation = torch.empty(rows, args.intermediate, dtype=torch.bfloat16)

        def onednn() -> None:
            for p in packed:
                y = p(x)
                if gated:
                    ops.silu_mul(kernels, y, activation)

        def tiled() -> None:
            for t in tiles:
                t(x)

        times: dict[str, list[float]] = {"onednn": [], "tiles": []}
        for r in range(args.rounds):
            for path, run in ((("onednn", onednn), ("tiles", tiled)) if r % 2 else
                              (("tiles", tiled), ("onednn", onednn))):
                start = time.perf_counter()
                run()
                times[path].append((time.perf_counter() - start) / args.num_layers)
        medians = {path: statistics.median(values) for path, values in times.items()}
        for path, seconds in medians.items():
            totals[path] += seconds * args.num_layers
        gflop_s = {path: 2 * rows * out_f * in_f / seconds / 1e9 for path, seconds in medians.items()}
        print(f"  rows {rows:5d}  {name:8s} {out_f:>5}x{in_f:<5} oneDNN {medians['onednn'] * 1e3:7.3f} ms "
              f"({gflop_s['onednn']:5.0f} GFLOP/s)  tiles {medians['tiles'] * 1e3:7.3f} ms "
              f"({gflop_s['tiles']:5.0f} GFLOP/s)  tiles / oneDNN {medians['tiles'] / medians['onednn']:.2f}")
    print(f"  rows {rows:5d}  a step's products ({args.num_layers} layers): oneDNN {totals['onednn'] * 1e3:.1f} ms, "
          f"tiles {totals['tiles'] * 1e3:.1f} ms, tiles / oneDNN {totals['tiles'] / totals['onednn']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1053, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    add_shape_arguments(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = CpuKernels("auto", torch.get_num_threads())
    if not kernels.has_tile_products:
        raise SystemExit(f"the tile products need the amx kernels; this CPU runs {kernels.isa}")
    print(f"{torch.get_num_threads()} threads; kvtool's kernels in {kernels.isa}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for rows in args.rows:
        layer_products(args, rows, kernels)


if __name__ == "__main__":
    main()
