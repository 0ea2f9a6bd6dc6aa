"""What the machine allows, measured on the spot: the floors kvtool's decode and prefill are held to.

- memory floor of a decode step at batch 1: the bytes one step reads (every weight once, the LM
  head included, one embedding row, and the KV of the context) / the read bandwidth, measured by
  kvtool's CPU kernels streaming 1 GiB with the run's threads;
- compute floor of a miss: the prompt's FLOPs (2 per weight per token in the projections, plus
  causal attention and the LM head's one row) / the peak GEMM rate of what kvtool's prompts use, per
  dtype: the faster of torch's oneDNN on a packed weight and, where the decoder takes them (bfloat16
  with AMX), kvtool's tile products (kvtool.cpu_kernels.tile_products), each 2,048 x 2,048 x 2,048.

Best of several tries each: a floor is what the machine can do, not what it did under load.

Also each core's own rate (not a floor): one thread pinned to each CPU in turn, a bfloat16 product of
a prompt's shape (1,024 x 576 x 3,072, oneDNN on a packed weight; float32 where oneDNN has no
bfloat16). On the 2-core Intel Xeon VM one core's rate dropped to a quarter of the other's for
minutes at a time while the other held (its host's other tenants, sharing the physical cores): a
product split evenly between the two threads (oneDNN's) then takes the slow core's time, so a run's
figures say little unless its cores' rates are known.

    .venv/bin/python bench/peers/floors.py --plan PLAN_F32 [--plan PLAN_BF16] --prompt_len 1056 \
        --context_len 1090 --output floors.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from kvtool.cpu_kernels import CpuKernels
from kvtool.cpu_kernels.step_buffers import StepBuffers
from kvtool.cpu_kernels.tile_products import tile_product, tile_weight
from kvtool.layers.cpu_linear import can_pack_dtype
from kvtool.models.model_config import ModelConfig, weight_shapes
from kvtool.plan import load_plan

GIB = 1 << 30
BANDWIDTH_BYTES = GIB
GEMM_SIZE = 2048
TRIES = 5


class BandwidthProbe:
    """A streaming read of ``num_bytes`` by kvtool's CPU kernels on ``num_threads`` threads; the buffers are
    made once, so a probe costs only its reads.

    Each try reads the next of ``num_buffers`` buffers. A buffer read again right away is partly still
    in the last-level cache unless it is many times larger: on the family 25 model 17 EPYC (32 MB L3),
    at its faster memory rate, a 64 MB buffer's second read in a row gave 62-76 GB/s where its first
    and a 1 GiB read gave 59-64 (at its slower rate, ~35, the two alike)."""

    def __init__(self, num_threads: int, num_bytes: int = BANDWIDTH_BYTES, num_buffers: int = 1) -> None:
        self.buffers = [torch.ones(num_bytes // 4) for _ in range(num_buffers)]
        self.next_buffer = 0
        self.kernels = CpuKernels("auto", num_threads)

    def read(self, tries: int = TRIES) -> float:
        """Bytes per second, best of ``tries``."""
        best = math.inf
        for _ in range(tries):
            data = self.buffers[self.next_buffer]
            self.next_buffer = (self.next_buffer + 1) % len(self.buffers)
            start = time.perf_counter()
            self.kernels.sum(data.data_ptr(), data.numel())
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best


def read_bandwidth(num_threads: int) -> float:
    """Bytes per second of a streaming read of BANDWIDTH_BYTES, best of TRIES."""
    return BandwidthProbe(num_threads).read()


def best_rate(run, flops: float) -> float:
    """FLOP/s of ``run()`` (``flops`` a call), best of TRIES after one uncounted call (which creates
    oneDNN's kernel, or touches a buffer the first time)."""
    best = math.inf
    for _ in range(TRIES + 1):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best


def packed_product_rate(rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> float:
    """FLOP/s of oneDNN's product of random [rows, in_features] inputs and a packed [out_features,
    in_features] weight (what kvtool's projections run), best of TRIES, on the threads torch has."""
    x = torch.randn(rows, in_features).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_features, in_features).to(dtype), None)
    return best_rate(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                     2 * rows * in_features * out_features)


def gemm_rate(dtype: torch.dtype) -> float | None:
    """FLOP/s of oneDNN's product on a packed weight, GEMM_SIZE cubed, best of TRIES; None where oneDNN
    has no native product in this dtype."""
    return packed_product_rate(GEMM_SIZE, GEMM_SIZE, GEMM_SIZE, dtype) if can_pack_dtype(dtype) else None


def tile_gemm_rate(dtype: torch.dtype) -> float | None:
    """FLOP/s of kvtool's tile product (what the decoder runs a bfloat16 prompt's projections on with
    AMX), GEMM_SIZE cubed, best of TRIES, on the threads torch has; None where the decoder takes none."""
    kernels = CpuKernels("auto", torch.get_num_threads())
    weight = tile_weight(torch.nn.Linear(GEMM_SIZE, GEMM_SIZE, bias=False, dtype=dtype)) \
        if kernels.has_tile_products else None
    if weight is None:
        return None
    product = tile_product(kernels, weight, StepBuffers(dtype), "out")
    x = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
    return best_rate(lambda: product(x), 2 * GEMM_SIZE ** 3)


CORE_GEMM_SHAPE = (1024, 576, 3072)  # rows x in_features x out_features: a prompt's gate_up product


def core_gemm_rates() -> dict[str, float]:
    """GFLOP/s of one thread pinned to each CPU this process may use, best of TRIES each: CORE_GEMM_SHAPE
    on oneDNN's packed weight (bfloat16, or float32 where oneDNN has no bfloat16 product)."""
    dtype = torch.bfloat16 if can_pack_dtype(torch.bfloat16) else torch.float32
    cpus, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    rates = {}
    torch.set_num_threads(1)
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            rates[f"cpu{cpu}"] = packed_product_rate(*CORE_GEMM_SHAPE, dtype) / 1e9
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    return rates


def decode_bytes(config: ModelConfig, element_size: int, kv_element_size: int, context_len: int) -> int:
    """Bytes one decode step at batch 1 reads: every weight but the embedding table, which gives one
    row (and, tied, serves as the LM head, read whole), and the KV of the context."""
    shapes = weight_shapes(config)
    elements = sum(math.prod(shape) for name, shape in shapes.items() if name != "embed_tokens.weight")
    elements += config.hidden_size + (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_element_size
    return elements * element_size + context_len * kv_per_token


def prompt_flops(config: ModelConfig, prompt_len: int) -> float:
    """FLOPs of a whole prompt from position 0 (causal attention counts each visible key once)."""
    c = config
    projection = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size + \
        3 * c.intermediate_size * c.hidden_size
    attention = 2 * c.num_heads * c.head_dim * prompt_len * (prompt_len + 1)  # QK and PV over L(L+1)/2 pairs
    return c.num_layers * (2 * projection * prompt_len + attention) + 2 * c.vocab_size * c.hidden_size


def floors(plans: list[Path], prompt_len: int, context_len: int) -> dict:
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth(threads)
    result = {"threads": threads, "read_bandwidth_gb_s": bandwidth / 1e9, "gemm_size": GEMM_SIZE,
              "prompt_len": prompt_len, "context_len": context_len, "core_gemm_gflop_s": core_gemm_rates(),
              "models": {}}
    for path in plans:
        plan = load_plan(path, verify_checksum=False)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[plan.build_options.dtype]
        kv_dtype = plan.kv_cache_dtype
        onednn_rate, tile_rate = gemm_rate(dtype), tile_gemm_rate(dtype)
        rate = max((r for r in (onednn_rate, tile_rate) if r is not None), default=None)
        config = plan.model_config
        step_bytes = decode_bytes(config, torch.tensor([], dtype=dtype).element_size(),
                                  torch.tensor([], dtype=kv_dtype).element_size(), context_len)
        flops = prompt_flops(config, prompt_len)
        result["models"][plan.build_options.dtype] = {
            "plan": str(path), "gemm_gflop_s": None if rate is None else rate / 1e9,
            "onednn_gemm_gflop_s": None if onednn_rate is None else onednn_rate / 1e9,
            "tile_gemm_gflop_s": None if tile_rate is None else tile_rate / 1e9,
            "decode_bytes": step_bytes, "memory_floor_ms": step_bytes / bandwidth * 1e3,
            "miss_flops": flops, "compute_floor_ms": None if rate is None else flops / rate * 1e3}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, action="append", required=True, help="a plan (repeat: one per dtype)")
    parser.add_argument("--prompt_len", type=int, required=True, help="tokens of a missed prompt")
    parser.add_argument("--context_len", type=int, required=True, help="tokens a decode step attends to")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    result = floors(args.plan, args.prompt_len, args.context_len)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
