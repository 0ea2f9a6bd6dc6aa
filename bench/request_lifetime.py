"""What a finished request leaves behind, and what a stop string costs to find (CPU, tiny-llama).

1. Memory retained per request: many 1-token requests through one LLM (8 a call, every output
   dropped), then the Python bytes still allocated (tracemalloc, the run's growth over the number of
   requests) and the bytes malloc still hands out (glibc's mallinfo2: the C++ scheduler's records,
   and Python's larger objects).
2. Decoding: one long greedy generation with a stop string that never matches: how many tokens
   went through the tokenizer's decode, and the seconds spent in it (the engine's stop-string check
   and the final text together).

    python bench/request_lifetime.py --output results/request_lifetime.md
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.plan import BuildOptions, build_plan
from kvtool.runtime.device import describe_device
from kvtool.version import __version__, git_revision


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out (glibc), or None elsewhere."""
    mallinfo2 = getattr(ctypes.CDLL("libc.so.6"), "mallinfo2", None) if sys.platform == "linux" else None
    if mallinfo2 is None:
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2
    return mallinfo2().uordblks


def retained_per_request(llm: LLM, num_requests: int) -> tuple[float, float | None]:
    """(Python bytes, malloc bytes) still held after ``num_requests`` finished, per request."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run(num_calls: int) -> None:
        for i in range(num_calls):
            llm.generate([[(8 * i + j) % 1000 + 1] for j in range(8)], params)

    run(100)  # warm-up
    gc.collect()
    heap_before = malloc_in_use()
    tracemalloc.start()
    python_before = tracemalloc.get_traced_memory()[0]
    run(num_requests // 8)
    gc.collect()
    python_after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()  # its own records are freed before malloc is read
    heap_after = malloc_in_use()
    heap = None if heap_before is None else (heap_after - heap_before) / num_requests
    return (python_after - python_before) / num_requests, heap


def decode_cost(llm: LLM, max_tokens: int) -> tuple[int, int, float, float]:
    """(tokens generated, tokens decoded, seconds in decode, seconds in all) of one generation with a stop string."""
    tokenizer = llm.tokenizer
    decode = tokenizer.decode
    counts = {"tokens": 0, "seconds": 0.0}

    def counting_decode(token_ids):
        start = time.perf_counter()
        text = decode(token_ids)
        counts["seconds"] += time.perf_counter() - start
        counts["tokens"] += len(token_ids)
        return text

    tokenizer.decode = counting_decode  # the engine and the LLM API decode through this tokenizer object
    try:
        start = time.perf_counter()
        output = llm.generate([5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                        stop=["kvtool: this never appears"]))
        total = time.perf_counter() - start
    finally:
        del tokenizer.decode
    return len(output.outputs[0].token_ids), counts["tokens"], counts["seconds"], total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_requests", type=int, default=8000)
    parser.add_argument("--max_tokens", type=int, default=4000)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plan = build_plan("preset:tiny-llama", Path(tmp) / "plan",
                          BuildOptions(dtype="float32", tokens_per_block=16, max_seq_len=args.max_tokens + 16,
                                       max_batch_size=8))
        llm = LLM(model=str(plan), device="cpu", kv_cache_config=KvCacheConfig(max_tokens=args.max_tokens + 256))
        python_bytes, heap_bytes = retained_per_request(llm, args.num_requests)
        generated, decoded, decode_s, total_s = decode_cost(llm, args.max_tokens)
    heap = "n/a (not glibc)" if heap_bytes is None else f"{heap_bytes:.0f}"
    lines = [
        f"# Request lifetime: memory retained and stop-string decoding (kvtool {__version__}, {git_revision()})",
        "",
        f"{describe_device(torch.device('cpu'))}; tiny-llama preset, float32, byte-level tokenizer.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| requests run (1-token prompts and outputs, 8 a call) | {args.num_requests} |",
        f"| Python bytes retained per request (tracemalloc) | {python_bytes:.0f} |",
        f"| malloc bytes retained per request (mallinfo2) | {heap} |",
        f"| tokens generated with a stop string that never matches | {generated} |",
        f"| tokens passed to the tokenizer's decode | {decoded} ({decoded / max(generated, 1):.1f} a token) |",
        f"| seconds in decode / in the whole generation | {decode_s:.3f} / {total_s:.2f} |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
