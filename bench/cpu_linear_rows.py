"""A decode step's projections on the CPU at a few rows: oneDNN's product on its packed weight vs
kvtool's row product (kvtool.cpu_kernels ops.linear), then whole decode steps of a plan both ways.

1. Products: a Llama layer's four fused projections and the LM head, with as many distinct weights as
   the model has layers (so they stream from memory as in a step), at --rows rows, float32 and
   bfloat16, the two alternated over --rounds rounds; medians per call and per step (all layers).
2. Steps (with --plan): one decode token after a --prompt_len prompt through kvtool's CPU decoder with
   single-row projections on the row product ('rows') and on oneDNN ('onednn'), alternated, median of
   the steps. With part 1 at 1 to 8 rows, the measurement behind kvtool.cpu_kernels.decoder taking the
   row product for decode steps of up to eight rows.

    python bench/cpu_linear_rows.py [--plan PLAN] [--rows 1 2 4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from kvtool.cpu_kernels import CpuKernels, ops
from kvtool.layers.cpu_linear import PackedLinear, can_pack_dtype


def products(args, dtype: torch.dtype, kernels: CpuKernels) -> None:
    head_dim = args.hidden // args.num_heads
    shapes = {"qkv": ((args.num_heads + 2 * args.num_kv_heads) * head_dim, args.hidden),
              "o": (args.hidden, args.num_heads * head_dim), "gate_up": (2 * args.intermediate, args.hidden),
              "down": (args.hidden, args.intermediate), "lm_head": (args.vocab, args.hidden)}
    for rows in args.rows:
        totals = {"onednn": 0.0, "rows": 0.0}
        for name, (out_f, in_f) in shapes.items():
            count = 1 if name == "lm_head" else args.num_layers
            weights = [(torch.randn(out_f, in_f) / in_f ** 0.5).to(dtype) for _ in range(count)]
            packed = [PackedLinear(w, None, None) for w in weights]
            x, out = torch.randn(rows, in_f).to(dtype), torch.empty(rows, out_f, dtype=dtype)
            times: dict[str, list[float]] = {"onednn": [], "rows": []}
            for r in range(args.rounds):
                for path in (("onednn", "rows") if r % 2 else ("rows", "onednn")):
                    start = time.perf_counter()
                    if path == "onednn":
                        for p in packed:
                            p(x)
                    else:
                        for w in weights:
                            ops.linear(kernels, x, w, None, out)
                    times[path].append((time.perf_counter() - start) / count)
            medians = {path: statistics.median(values) for path, values in times.items()}
            for path, seconds in medians.items():
                totals[path] += seconds * count
            gb_s = {path: out_f * in_f * x.element_size() / seconds / 1e9 for path, seconds in medians.items()}
            print(f"  {str(dtype)[6:]:9s} rows {rows}  {name:8s} {out_f:>6}x{in_f:<5}  oneDNN {medians['onednn'] * 1e6:8.1f}"
                  f" us ({gb_s['onednn']:5.1f} GB/s)  rows {medians['rows'] * 1e6:8.1f} us ({gb_s['rows']:5.1f} GB/s)")
        print(f"  {str(dtype)[6:]:9s} rows {rows}  a step's products: oneDNN {totals['onednn'] * 1e3:.2f} ms, rows "
              f"{totals['rows'] * 1e3:.2f} ms, rows / oneDNN {totals['rows'] / totals['onednn']:.2f}")


def steps(plan: str, prompt_len: int, rounds: int) -> None:
    from kvtool import LLM, KvCacheConfig
    from kvtool.cpu_kernels.decoder import CpuDecoder
    from kvtool.runtime.model_runner import StepRequest

    llm = LLM(model=plan, kv_cache_config=KvCacheConfig(enable_block_reuse=False, max_tokens=2 * (prompt_len + 64)))
    runner = llm.engine.executor
    model = runner.model
    decoders = {"rows": CpuDecoder(model, row_products=True), "onednn": CpuDecoder(model, row_products=False)}
    rng = random.Random(0)
    token_ids = np.array([rng.randrange(100, 10_000) for _ in range(prompt_len + 1)], dtype=np.int32)
    block_ids = np.arange(-(-(prompt_len + 1) // runner.tokens_per_block), dtype=np.int32)
    model.cpu_decoder = decoders["rows"]
    runner.execute([StepRequest(token_ids[:prompt_len], block_ids, 0, True, True)])
    decode = [StepRequest(token_ids[prompt_len:], block_ids, prompt_len, False, True)]
    times: dict[str, list[float]] = {path: [] for path in decoders}
    for r in range(rounds):
        for path in (list(decoders) if r % 2 else list(decoders)[::-1]):
            model.cpu_decoder = decoders[path]
            for i in range(3):  # the first after a switch is not counted
                start = time.perf_counter()
                runner.execute(decode)
                if i:
                    times[path].append(time.perf_counter() - start)
    medians = {path: statistics.median(values) * 1e3 for path, values in times.items()}
    print(f"  {plan} ({model.embed_tokens.weight.dtype}): decode step after {prompt_len} tokens, median of "
          f"{len(times['rows'])}: rows {medians['rows']:.2f} ms, oneDNN {medians['onednn']:.2f} ms, rows / oneDNN "
          f"{medians['rows'] / medians['onednn']:.3f}")
    llm.shutdown()


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """A Llama layer's sizes, SmolLM2-135M's by default (bench/cpu_tile_linear.py takes them too)."""
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--num_layers", type=int, default=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", nargs="*", default=[], help="plans whose decode steps to time both ways")
    parser.add_argument("--prompt_len", type=int, default=1056)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    add_shape_arguments(parser)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = CpuKernels("auto", torch.get_num_threads())
    print(f"{torch.get_num_threads()} threads; kvtool's kernels in {kernels.isa}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for dtype in (torch.float32, torch.bfloat16):
        if can_pack_dtype(dtype):
            products(args, dtype, kernels)
    for plan in args.plan:
        steps(plan, args.prompt_len, 3 * args.rounds)


if __name__ == "__main__":
    main()
