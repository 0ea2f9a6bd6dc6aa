"""One decoder layer's projections on the CPU: MKL (``F.linear``) vs oneDNN with a packed weight.

Times the four fused projections of a Llama layer (qkv, o, gate_up, down) at several row counts,
the two backends alternated in rounds, and prints the median per row count with the ratio. This
is the measurement behind kvtool/layers/cpu_linear.py's row threshold.

    python bench/cpu_gemm.py [--hidden 576 --intermediate 1536 --num_heads 9 --num_kv_heads 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256, 512, 1056])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    head_dim = args.hidden // args.num_heads
    shapes = [(args.hidden, (args.num_heads + 2 * args.num_kv_heads) * head_dim),
              (args.num_heads * head_dim, args.hidden), (args.hidden, 2 * args.intermediate),
              (args.intermediate, args.hidden)]  # (in_features, out_features)
    weights = [torch.randn(out_f, in_f) for in_f, out_f in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    print(f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; ms per layer "
          f"(4 projections), median of {args.rounds} alternated rounds")
    print(f"{'rows':>6} {'MKL':>9} {'oneDNN':>9} {'MKL/oneDNN':>11}")
    for rows in args.rows:
        inputs = [torch.randn(rows, in_f) for in_f, _ in shapes]
        repeats = max(3, 2000 // rows)

        def mkl():
            for x, w in zip(inputs, weights):
                F.linear(x, w)

        def onednn():
            for x, w in zip(inputs, packed):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        mkl_ms, dnn_ms = [], []
        for _ in range(args.rounds):
            mkl_ms.append(timed(mkl, repeats))
            dnn_ms.append(timed(onednn, repeats))
        a, b = statistics.median(mkl_ms), statistics.median(dnn_ms)
        print(f"{rows:>6} {a:9.3f} {b:9.3f} {a / b:10.2f}x")


if __name__ == "__main__":
    main()
