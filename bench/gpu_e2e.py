"""End-to-end TTFT figures through kvtool.LLM on a real model's shapes (default preset:qwen3-8b, bf16).

Three figures, each a ratio of two medians measured in one run:
  - shared system prompt: TTFT with reuse off / on for prefix_len shared tokens + a question_len
    question (target >= 10x on a GPU);
  - an identical request sent back to back (all but its last token cached): TTFT / TPOT of the
    same long_len prompt (target <= 1.5: a fully cached prompt costs about one decode step);
  - A,B,A,B with long_len prompts through a primary pool that holds one request and a host cache:
    TTFT recomputing (first round) / onboarding from the host (later rounds) (target >= 8x).

bench/gpu_suite.py runs this as its `e2e` section. It also runs anywhere for a dry run:
    python bench/gpu_e2e.py --model preset:tiny-llama --dtype float32 --long_len 512 --prefix_len 256
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from typing import NamedTuple

import torch

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.plan import BuildOptions

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class E2ERow(NamedTuple):
    case: str
    metric: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None   # higher is better
    target: float | None = None


def _request(llm: LLM, prompt: list[int], params: SamplingParams):
    out = llm.generate(prompt, params)
    if out.error is not None:
        raise RuntimeError(out.error)
    return llm.engine.requests[out.request_id]


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    request = _request(llm, prompt, ONE_TOKEN)
    return (request.first_token_time - request.arrival_time) * 1e3


def tpot_ms(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    request = _request(llm, prompt, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    return (request.finish_time - request.first_token_time) / (num_tokens - 1) * 1e3


def _release(llm: LLM) -> None:
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(model: str = "preset:qwen3-8b", dtype: str = "bfloat16", *, prefix_len: int = 2048,
            question_len: int = 128, long_len: int = 4096, repeats: int = 7, tokens_per_block: int = 32,
            host_cache_bytes: int = 8 << 30) -> list[E2ERow]:
    max_len = max(prefix_len + question_len, long_len) + 64
    build = BuildOptions(dtype=dtype, tokens_per_block=tokens_per_block, max_batch_size=1, max_seq_len=max_len,
                         max_num_tokens=max_len)
    rows: list[E2ERow] = []
    rng = random.Random(0)
    medians: dict[bool, float] = {}
    tokens = None
    for reuse in (False, True):
        llm = LLM(model=model, max_batch_size=1, build_options=build,
                  kv_cache_config=KvCacheConfig(enable_block_reuse=reuse, max_tokens=4 * max_len))
        if tokens is None:
            high = min(30000, llm.plan.model_config.vocab_size)
            tokens = lambda n: [rng.randrange(100, high) for _ in range(n)]  # noqa: E731
            prefix = tokens(prefix_len)
            questions = [tokens(question_len) for _ in range(repeats)]
            long_prompt = tokens(long_len)
            prompt_a, prompt_b = tokens(long_len), tokens(long_len)
        ttft_ms(llm, prefix + tokens(question_len))  # warm-up; caches the prefix when reuse is on
        medians[reuse] = statistics.median(ttft_ms(llm, prefix + q) for q in questions)
        rows.append(E2ERow(f"{prefix_len}-token shared prompt + {question_len}-token question, reuse "
                           f"{'on' if reuse else 'off'}", "median TTFT", medians[reuse], "ms"))
        if reuse:
            decode = tpot_ms(llm, long_prompt, 33)  # also caches long_prompt
            repeat = statistics.median(ttft_ms(llm, long_prompt) for _ in range(repeats))
            rows.append(E2ERow(f"{long_len}-token prompt, decode", "median TPOT", decode, "ms"))
            rows.append(E2ERow(f"identical {long_len}-token prompt back to back (all but the last token cached)",
                               "median TTFT", repeat, "ms"))
            rows.append(E2ERow("TTFT of a fully cached prompt vs TPOT", "TPOT / TTFT", decode / repeat, "x",
                               repeat, decode / repeat, 1 / 1.5))
        _release(llm)
    rows.append(E2ERow("shared prompt: TTFT reuse off / on", "speed-up", medians[False] / medians[True], "x",
                       medians[True], medians[False] / medians[True], 10.0))

    # A primary pool that holds one request: B evicts A to the host, A comes back by onboarding.
    blocks_per_request = -(-(long_len + 1) // tokens_per_block)
    pool_tokens = (blocks_per_request + 1) * tokens_per_block
    llm = LLM(model=model, max_batch_size=1, build_options=build,
              kv_cache_config=KvCacheConfig(max_tokens=pool_tokens, host_cache_size=host_cache_bytes))
    rounds = [[ttft_ms(llm, prompt) for prompt in (prompt_a, prompt_b)] for _ in range(1 + repeats // 2 + 1)]
    stats = llm.get_stats()
    _release(llm)
    if stats["onboarded_blocks"] == 0:
        raise RuntimeError(f"A,B,A,B onboarded no block from the host: {stats}")
    recompute = statistics.median(rounds[0])
    onboard = statistics.median(t for r in rounds[1:] for t in r)
    rows.append(E2ERow(f"A,B,A,B {long_len}-token prompts, first round (recompute)", "median TTFT", recompute, "ms"))
    rows.append(E2ERow(f"A,B,A,B {long_len}-token prompts, later rounds (onboard from host)", "median TTFT",
                       onboard, "ms"))
    rows.append(E2ERow("A,B,A,B: TTFT recompute / onboard", "speed-up", recompute / onboard, "x", onboard,
                       recompute / onboard, 8.0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix_len", type=int, default=2048)
    parser.add_argument("--question_len", type=int, default=128)
    parser.add_argument("--long_len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for row in measure(args.model, args.dtype, prefix_len=args.prefix_len, question_len=args.question_len,
                       long_len=args.long_len, repeats=args.repeats):
        target = f"  (target {row.target:.3g}: {'met' if row.ratio >= row.target else 'missed'})" if row.target else ""
        print(f"{row.case}: {row.metric} = {row.value:.4g} {row.unit}{target}")


if __name__ == "__main__":
    main()
