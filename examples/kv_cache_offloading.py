"""Host offloading, shown with the A, B, A, B pattern (as TensorRT-LLM's kv_cache_offloading example).

Two long prompts are sent one at a time, twice. The primary KV pool holds one request only, so
serving B evicts A's blocks. Without offloading they are dropped and the second round reuses
nothing; with --enable_offloading they move to host memory and the second round onboards them.

    python examples/kv_cache_offloading.py                      # second round: 0 reused blocks
    python examples/kv_cache_offloading.py --enable_offloading  # second round: blocks from the host
"""

from __future__ import annotations

import argparse
import random

from kvtool import LLM, KvCacheConfig, SamplingParams

TOKENS_PER_BLOCK = 16


def run(model: str, enable_offloading: bool, prompt_len: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt_a = [rng.randrange(10, 1000) for _ in range(prompt_len)]
    prompt_b = [rng.randrange(10, 1000) for _ in range(prompt_len)]
    # The primary pool holds exactly one request: its prompt plus its generated tokens.
    pool_tokens = -(-(prompt_len + max_tokens) // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    kv_cache_config = KvCacheConfig(
        enable_block_reuse=True, max_tokens=pool_tokens, tokens_per_block=TOKENS_PER_BLOCK,
        host_cache_size=(64 << 20) if enable_offloading else 0)
    llm = LLM(model=model, max_batch_size=1, kv_cache_config=kv_cache_config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rounds = []
    for round_index in range(2):
        before = llm.get_stats()
        texts = [llm.generate(prompt, params).outputs[0].token_ids for prompt in (prompt_a, prompt_b)]
        after = llm.get_stats()
        rounds.append({
            "round": round_index + 1,
            "reused_blocks": after["reused_blocks"] - before["reused_blocks"],
            "missed_blocks": after["missed_blocks"] - before["missed_blocks"],
            "onboarded_blocks": after["onboarded_blocks"] - before["onboarded_blocks"],
            "outputs": texts,
        })
    stats = llm.get_stats()
    llm.shutdown()
    second = rounds[1]
    total = second["reused_blocks"] + second["missed_blocks"]
    return {
        "rounds": rounds,
        "second_round_hit_rate": second["reused_blocks"] / total if total else 0.0,
        "offloaded_blocks": stats["offloaded_blocks"],
        "onboarded_blocks": stats["onboarded_blocks"],
        "cache_hit_rate": stats["cache_hit_rate"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny-llama")
    parser.add_argument("--enable_offloading", "--enable-offloading", action="store_true")
    parser.add_argument("--prompt_len", "--prompt-len", type=int, default=160)
    parser.add_argument("--max_tokens", "--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = run(args.model, args.enable_offloading, args.prompt_len, args.max_tokens, args.seed)
    mode = "with host offloading" if args.enable_offloading else "without host offloading"
    print(f"A,B,A,B {mode} (tokens_per_block={TOKENS_PER_BLOCK}, primary pool holds one request)")
    for r in result["rounds"]:
        print(f"  round {r['round']}: reused {r['reused_blocks']} blocks, missed {r['missed_blocks']}, "
              f"onboarded {r['onboarded_blocks']} from the host")
    print(f"  second-round hit rate: {result['second_round_hit_rate']:.2f}; "
          f"offloaded {result['offloaded_blocks']} blocks, onboarded {result['onboarded_blocks']}")


if __name__ == "__main__":
    main()
