"""Replay a kvtool dataset through plain transformers, one request at a time, into kvtool's report columns.

Two modes: ``--prefix_cache off`` computes every prompt from scratch; ``--prefix_cache copy`` keeps
each finished prompt's KV cache and starts a new request from a copy of the cache of the earlier
prompt that shares the longest prefix with it (the last prompt token is always computed), as a
hand-written prefix cache would. Greedy, EOS ignored, float32, the first line an uncounted warm-up.
Every token's time is taken when its id is on the host.

    .venv/bin/python bench/peers/transformers_replay.py --model CHECKPOINT_DIR --dataset D.jsonl \
        --output DIR --label transformers-copy --prefix_cache copy
"""

from __future__ import annotations

import time

import torch
import transformers
from common import RunReport, load_requests, replay_arguments, request_row
from machine import read_cpu_info
from transformers import AutoModelForCausalLM

ENGINE = "transformers"


def common_prefix_len(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class PrefixCache:
    """Finished prompts' keys and values; a lookup copies those of the earlier prompt sharing the
    longest prefix, cut to that prefix, into a new cache."""

    def __init__(self) -> None:
        # (prompt ids, per layer (keys, values) [1, num_kv_heads, prompt_len, head_dim])
        self._entries: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def lookup(self, prompt: list[int]):
        best, best_len = None, 0
        for ids, layers in self._entries:
            length = min(common_prefix_len(ids, prompt), len(prompt) - 1)
            if length > best_len:
                best, best_len = layers, length
        if best is None:
            return None, 0
        cache = transformers.DynamicCache()
        for index, (keys, values) in enumerate(best):
            cache.update(keys[:, :, :best_len].clone(), values[:, :, :best_len].clone(), index)
        return cache, best_len

    def add(self, prompt: list[int], cache) -> None:
        # Only the prompt is a reusable prefix: the generated tokens' entries are left out.
        self._entries.append((list(prompt), [(layer.keys[:, :, :len(prompt)], layer.values[:, :, :len(prompt)])
                                             for layer in cache.layers]))


@torch.inference_mode()
def generate(model, prompt: list[int], num_tokens: int, cache, num_cached: int):
    """Greedy decoding from ``cache`` (holding prompt[:num_cached]); returns the ids, each token's
    host time and the cache."""
    if cache is None:
        cache = transformers.DynamicCache()
    ids = torch.tensor([prompt[num_cached:]])
    positions = torch.arange(num_cached, len(prompt)).unsqueeze(0)
    tokens, times = [], []
    for _ in range(num_tokens):
        logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        times.append(time.perf_counter())
        tokens.append(token)
        next_position = positions[0, -1].item() + 1
        ids, positions = torch.tensor([[token]]), torch.tensor([[next_position]])
    return tokens, times, cache


def main() -> None:
    parser = replay_arguments(__doc__, model_help="a Hugging Face checkpoint directory (float32 weights)")
    parser.add_argument("--prefix_cache", choices=("off", "copy"), required=True)
    args = parser.parse_args()
    if args.concurrency != 1:
        parser.error(f"--concurrency {args.concurrency}: this replay runs one request at a time (--concurrency 1)")

    requests = load_requests(args.dataset)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prefix_cache = PrefixCache() if args.prefix_cache == "copy" else None

    def run(request):
        arrival = time.perf_counter()
        cache, num_cached = prefix_cache.lookup(request.input_ids) if prefix_cache is not None else (None, 0)
        tokens, times, cache = generate(model, request.input_ids, request.output_tokens, cache, num_cached)
        if prefix_cache is not None:
            prefix_cache.add(request.input_ids, cache)
        return arrival, tokens, times, num_cached

    for request in requests[:args.warmup]:
        run(request)
    report = RunReport(args.output, label=args.label, engine=ENGINE)
    bench_start = time.perf_counter()
    for request in requests[args.warmup:]:
        arrival, tokens, times, num_cached = run(request)
        report.add(request_row(label=args.label, engine=ENGINE, request=request, bench_start=bench_start,
                               arrival=arrival, ttft_s=times[0] - arrival, finish=times[-1], token_times=times,
                               output_token_ids=tokens, cached_tokens=num_cached))
    row = report.finish({
        "engine_version": transformers.__version__, "torch": torch.__version__, "model": args.model,
        "dtype": "float32", "enable_kv_cache_reuse": args.prefix_cache == "copy",
        "prefix_cache": args.prefix_cache, "attn_implementation": model.config._attn_implementation,
        "mode": "sequential", "warmup": args.warmup, "num_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), **read_cpu_info().as_row()})
    print(f"{args.label}: {row['num_requests']} requests, TTFT p50 {row['ttft_ms_p50']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
