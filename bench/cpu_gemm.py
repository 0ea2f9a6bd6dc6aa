"""A decoder step's projections on the CPU: MKL (``F.linear``), oneDNN on a packed weight (what kvtool
runs, kvtool/layers/cpu_linear.py) and MKL's packed sgemm (``torch.ops.mkl._mkl_linear``).

Times the four fused projections of a Llama layer (qkv, o, gate_up, down) for --layers layers of
their own weights (30 by default, SmolLM2-135M's: as in a step, the weights come from memory, not
from the caches a single layer repeated would keep them in) at several row counts, the products
alternated round by round, and prints each one's median time per step with its median ratio to
oneDNN's in the same rounds. This is the measurement behind kvtool/layers/cpu_linear.py's row
threshold and its choice of oneDNN (results/cpu_float32_products.md).

    python bench/cpu_gemm.py [--hidden 576 --intermediate 1536 --num_heads 9 --num_kv_heads 3] \\
        [--layers 30] [--rows 1 32 128 256 512 1056] [--rounds 7] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def products(weights: list[list[torch.Tensor]], inputs: list[torch.Tensor], kind: str) -> Callable[[], None]:
    """One step's products (every layer's four, each result dropped as a step drops it) by ``kind``:
    'mkl', 'onednn' or 'mkl-packed'."""
    if kind == "mkl":
        calls = [(F.linear, (x, w)) for layer in weights for x, w in zip(inputs, layer)]
    elif kind == "onednn":
        op = torch.ops.mkldnn._linear_pointwise
        calls = [(op, (x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], ""))
                 for layer in weights for x, w in zip(inputs, layer)]
    else:
        # MKL lays a weight out the same for any row count; torch takes the packed product when the
        # count it is given is the input's (else F.linear).
        op = torch.ops.mkl._mkl_linear
        calls = [(op, (x, torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w, None, x.shape[0]))
                 for layer in weights for x, w in zip(inputs, layer)]

    def step() -> None:
        for op, operands in calls:
            op(*operands)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30, help="layers of distinct weights a step runs")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256, 512, 1056])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: MKL's packed sgemm has none, so its column is left out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    head_dim = args.hidden // args.num_heads
    shapes = [(args.hidden, (args.num_heads + 2 * args.num_kv_heads) * head_dim),
              (args.num_heads * head_dim, args.hidden), (args.hidden, 2 * args.intermediate),
              (args.intermediate, args.hidden)]  # (in_features, out_features)
    weights = [[torch.randn(out_f, in_f, dtype=dtype) for in_f, out_f in shapes] for _ in range(args.layers)]
    kinds = ["mkl", "onednn"] + (["mkl-packed"] if dtype == torch.float32 and torch.backends.mkl.is_available() else [])
    print(f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, {args.dtype}; ms a step "
          f"({args.layers} layers x 4 projections), median of {args.rounds} alternated rounds; (x): the median of "
          f"each round's time / oneDNN's")
    print(f"{'rows':>6} " + " ".join(f"{kind:>20}" for kind in kinds))
    for rows in args.rows:
        inputs = [torch.randn(rows, in_f, dtype=dtype) for in_f, _ in shapes]
        steps = {kind: products(weights, inputs, kind) for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for step in steps.values():
            step()  # warm-up: primitives made, pages touched
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                start = time.perf_counter()
                steps[kind]()
                times[kind].append((time.perf_counter() - start) * 1e3)
        cells = []
        for kind in kinds:
            ratio = statistics.median(a / b for a, b in zip(times[kind], times["onednn"]))
            cells.append(f"{statistics.median(times[kind]):9.2f} ({ratio:5.3f}x)")
        print(f"{rows:>6} " + " ".join(f"{cell:>20}" for cell in cells))


if __name__ == "__main__":
    main()
