"""End-to-end TTFT figures through kvtool.LLM on a real model's shapes (default preset:qwen3-8b, bf16).

Figures, each a ratio of two medians measured in one run:
  - shared system prompt: TTFT with reuse off / on for prefix_len shared tokens + a question_len
    question (target >= 10x on a GPU), batch 1; the hit's TTFT against its `floor`, computed in the
    same run from measured figures: the weights' bytes / the measured device-to-device bandwidth + the
    step's GEMM FLOPs / the measured bf16 torch.matmul rate (target: hit <= 1.5x floor); the same
    hit launched eagerly (no CUDA graphs), to show what the graphs save;
  - TPOT at batch 1 against its byte floor: (weights + the context's KV bytes) / the D2D bandwidth
    (target: TPOT <= 1.2x floor), and with decode graphs set aside;
  - an identical request sent back to back (all but its last token cached): TTFT / TPOT of the
    same long_len prompt (target <= 1.5: a fully cached prompt costs about one decode step);
  - A,B,A,B with long_len prompts through a primary pool that holds one request and a host cache:
    TTFT recomputing (first round) / onboarding from the host (later rounds) (target >= 8x);
  - launches and host time per step, graphs on and off (bench/gpu_steps.py; gpu_steps.csv).

The plan is resolved (built on the first run, then taken from the plan cache) once and shared by
every LLM of the run. ``--plan_options bench`` (the default) builds it with the options `kvtool bench
--model MODEL` uses on this machine (the device's dtype, 32-token blocks, its default limits), so that one 16 GB
build serves both; the runtime limits stay the e2e's own, so the figures do not change. The e2e's
max_seq_len (its longest prompt + 64) must then fit the bench's (4096 for qwen3-8b), else the plan
is built admitting it and `kvtool bench ... --max_seq_len N` (printed) is the run that shares it.
The long prompts are 4,000 tokens by default: the longest that leave room to decode in 4,096.
``--plan_options e2e`` builds a plan for exactly the e2e's requests instead.

bench/gpu_suite.py runs this as its `e2e` section. It also runs anywhere for a dry run:
    python bench/gpu_e2e.py --model preset:tiny-llama --dtype float32 --long_len 512 --prefix_len 256
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_reports import median_gpu_ms, write_rows_csv
from gpu_steps import measure_steps
from gpu_steps import write_reports as write_step_reports

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.config import EngineConfig
from kvtool.plan import BuildOptions, Plan, resolve_model
from kvtool.plan.build_options import DEFAULT_MAX_SEQ_LEN_CAP
from kvtool.plan.load import on_the_fly_build_options
from kvtool.runtime.device import default_dtype

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
    return out.request


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    request = _request(llm, prompt, ONE_TOKEN)
    return (request.first_token_time - request.arrival_time) * 1e3


def tpot_ms(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    request = _request(llm, prompt, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    return (request.finish_time - request.first_token_time) / (num_tokens - 1) * 1e3


class HardwareRates(NamedTuple):
    """The device's measured rates the floors divide by."""

    d2d_gbps: float       # device-to-device copy, read + write bytes per second / 1e9
    matmul_tflops: float  # bf16 torch.matmul of 8192 x 8192 x 8192


def _copy_gbps(reps: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_gpu_ms(lambda: dst.copy_(src), reps, warmup=3) * 1e-3) / 1e9  # read + write, as decode counts


def _matmul_tflops(reps: int, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / (median_gpu_ms(lambda: torch.matmul(a, b), reps, warmup=3) * 1e-3) / 1e12


def measure_hardware(reps: int = 10) -> HardwareRates:
    """Median of ``reps`` timed runs of a 1 GiB device-to-device copy and of an 8192^3 bf16 matmul."""
    rates = HardwareRates(_copy_gbps(reps), _matmul_tflops(reps))
    torch.cuda.empty_cache()
    return rates


class ModelCosts(NamedTuple):
    """What a forward step of the model reads and computes, from its parameters."""

    weight_bytes: int     # read once per step: every weight but the embedding table (unless it is the LM head)
    linear_params: int    # the decoder layers' projection weights (qkv, o, gate_up, down)
    lm_head_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int

    def step_flops(self, new_tokens: int, cached_tokens: int, sampled_rows: int = 1) -> float:
        """GEMM FLOPs of a step: the projections of the new tokens, the LM head of the sampled rows,
        and attention's two matmuls over the cached prefix plus the causal half of the new tokens."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * new_tokens * (
            cached_tokens + (new_tokens + 1) / 2)
        return 2 * new_tokens * self.linear_params + 2 * sampled_rows * self.lm_head_params + attention


def model_costs(llm: LLM) -> ModelCosts:
    model = llm.engine.executor.model
    config = model.config
    tied = model.lm_head is None
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if tied or not name.startswith("embed_tokens."))
    linear_params = sum(p.numel() for name, p in model.named_parameters()
                        if name.startswith("layers.") and name.endswith("_proj.weight"))
    shape = llm.engine.executor.pools.shape
    return ModelCosts(weight_bytes, linear_params, config.vocab_size * config.hidden_size, config.num_layers,
                      config.num_heads, config.head_dim, shape.bytes_per_token)


def floor_rows(costs: ModelCosts, rates: HardwareRates, *, prefix_len: int, question_len: int, hit_ms: float,
               decode_context: int, tpot: float) -> list[E2ERow]:
    """The hit's TTFT floor and the TPOT byte floor, each with the measured figure's ratio to it."""
    bandwidth = rates.d2d_gbps * 1e9
    flops = costs.step_flops(question_len, prefix_len)
    ttft_floor = (costs.weight_bytes / bandwidth + flops / (rates.matmul_tflops * 1e12)) * 1e3
    decode_bytes = costs.weight_bytes + costs.kv_bytes_per_token * decode_context
    tpot_floor = decode_bytes / bandwidth * 1e3
    return [
        E2ERow(f"floor: {question_len} tokens over a cached {prefix_len:,}-token prefix = {costs.weight_bytes / 1e9:.2f} GB "
               f"of weights / {rates.d2d_gbps:,.0f} GB/s + {flops / 1e12:.2f} TFLOP / {rates.matmul_tflops:,.0f} "
               "TFLOP/s", "TTFT floor", ttft_floor, "ms"),
        E2ERow("reuse on: TTFT floor / measured TTFT (hit <= 1.5x floor)", "floor / measured", ttft_floor / hit_ms,
               "x", hit_ms, ttft_floor / hit_ms, 1 / 1.5),
        E2ERow(f"floor: decode at batch 1 over {decode_context:,} tokens = ({costs.weight_bytes / 1e9:.2f} GB of weights "
               f"+ {costs.kv_bytes_per_token * decode_context / 1e9:.2f} GB of KV) / {rates.d2d_gbps:,.0f} GB/s",
               "TPOT byte floor", tpot_floor, "ms"),
        E2ERow("decode: TPOT byte floor / measured TPOT (TPOT <= 1.2x floor)", "floor / measured", tpot_floor / tpot,
               "x", tpot, tpot_floor / tpot, 1 / 1.2),
    ]


def _release(llm: LLM) -> None:
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_request_len(prefix_len: int, question_len: int, long_len: int) -> int:
    """The runtime max_seq_len / max_num_tokens of the e2e: its longest prompt, with room to decode."""
    return max(prefix_len + question_len, long_len) + 64


def plan_build_options(dtype: str, tokens_per_block: int, max_len: int, *, like_bench: bool = False) -> BuildOptions:
    """What the e2e's plan is built with: just what it needs (one request of at most max_len tokens),
    or (``like_bench``) what `kvtool bench --model MODEL` builds on this machine, admitting max_len
    where the bench's defaults do not (the bench's flags passing those limits build the same)."""
    if not like_bench:
        return BuildOptions(dtype=dtype, tokens_per_block=tokens_per_block, max_batch_size=1, max_seq_len=max_len,
                            max_num_tokens=max_len)
    # As kvtool.plan.load builds a model for an engine: the device's dtype unless another is asked for.
    return on_the_fly_build_options(EngineConfig(tokens_per_block=tokens_per_block, max_batch_size=1,
                                                 max_seq_len=max_len, max_num_tokens=max_len), dtype=dtype)


def bench_command(model: str, options: BuildOptions) -> str:
    """The `kvtool bench` flags that resolve the same plan as ``options`` (from plan_build_options)."""
    flags = [f"--model {model}", f"--tokens_per_block {options.tokens_per_block}"]
    if options.max_seq_len is not None and options.max_seq_len > DEFAULT_MAX_SEQ_LEN_CAP:
        flags.append(f"--max_seq_len {options.max_seq_len}")
    note = "" if options.dtype == default_dtype() else f" (it builds {default_dtype()} here, not {options.dtype})"
    return "kvtool bench " + " ".join(flags) + note


class E2EPrompts(NamedTuple):
    """The run's token ids (seeded: bench/gpu_peer_transformers.py sends a peer the very same)."""

    prefix: list[int]                 # the shared system prompt
    questions: list[list[int]]        # timed, after it
    spare_questions: list[list[int]]  # warm-ups and other fresh questions (a repeated one would be a full hit)
    long_prompt: list[int]            # decode (TPOT) and the back-to-back repeat
    prompt_a: list[int]               # A,B,A,B
    prompt_b: list[int]


def e2e_prompts(vocab_size: int, *, prefix_len: int, question_len: int, long_len: int, repeats: int,
                seed: int = 0) -> E2EPrompts:
    rng = random.Random(seed)
    high = min(30000, vocab_size)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, high) for _ in range(n)]

    return E2EPrompts(tokens(prefix_len), [tokens(question_len) for _ in range(repeats)],
                      [tokens(question_len) for _ in range(8)], tokens(long_len), tokens(long_len), tokens(long_len))


def resolve_plan(model: str | Plan, options: BuildOptions) -> Plan:
    """The plan every LLM of a run shares: built or verified once, not once per LLM."""
    return resolve_model(model, options=options)


def measure(model: str | Plan = "preset:qwen3-8b", dtype: str = "bfloat16", *, prefix_len: int = 2048,
            question_len: int = 128, long_len: int = 4000, repeats: int = 7, tokens_per_block: int = 32,
            host_cache_bytes: int = 8 << 30, like_bench: bool = True, steps_output: Path | None = None,
            steps_header: dict[str, str] | None = None) -> list[E2ERow]:
    """The rows above; with ``steps_output``, also gpu_steps.{csv,md} there (launches and host time per step)."""
    max_len = max_request_len(prefix_len, question_len, long_len)
    rates = measure_hardware() if torch.cuda.is_available() else None
    rows: list[E2ERow] = []
    if rates is not None:
        rows.append(E2ERow("hardware: device-to-device copy of 1 GiB", "bandwidth (read+write)", rates.d2d_gbps,
                           "GB/s"))
        rows.append(E2ERow("hardware: bf16 torch.matmul 8192 x 8192 x 8192", "rate", rates.matmul_tflops, "TFLOP/s"))
    plan = resolve_plan(model, plan_build_options(dtype, tokens_per_block, max_len, like_bench=like_bench))
    tokens_per_block = plan.build_options.tokens_per_block  # a plan directory brings its own
    # The e2e's own runtime limits whatever the plan admits: the same schedule, pools and graphs.
    limits = dict(max_batch_size=1, max_seq_len=max_len, max_num_tokens=max_len)
    prompts = e2e_prompts(plan.model_config.vocab_size, prefix_len=prefix_len, question_len=question_len,
                          long_len=long_len, repeats=repeats)
    prefix, questions, long_prompt = prompts.prefix, prompts.questions, prompts.long_prompt
    prompt_a, prompt_b = prompts.prompt_a, prompts.prompt_b
    spare = iter(prompts.spare_questions)
    medians: dict[bool, float] = {}
    for reuse in (False, True):
        llm = LLM(model=plan, **limits,
                  kv_cache_config=KvCacheConfig(enable_block_reuse=reuse, max_tokens=4 * max_len))
        ttft_ms(llm, prefix + next(spare))  # warm-up; caches the prefix when reuse is on
        medians[reuse] = statistics.median(ttft_ms(llm, prefix + q) for q in questions)
        rows.append(E2ERow(f"{prefix_len}-token shared prompt + {question_len}-token question, reuse "
                           f"{'on' if reuse else 'off'}", "median TTFT", medians[reuse], "ms"))
        if reuse:
            runner = llm.engine.executor
            mixed, runner.mixed_graphs = runner.mixed_graphs, None
            if mixed is not None:  # the hit's step launched kernel by kernel: what its graph saves
                # New questions: a repeated one would be a fully cached prompt (one token), not this step.
                eager_hit = statistics.median(ttft_ms(llm, prefix + next(spare)) for _ in range(3))
                runner.mixed_graphs = mixed
                rows.append(E2ERow(f"{prefix_len}-token shared prompt + {question_len}-token question, reuse on, "
                                   "without CUDA graphs", "median TTFT", eager_hit, "ms"))
                rows.append(E2ERow("CUDA graphs: hit TTFT eager / replayed", "speed-up", eager_hit / medians[True],
                                   "x", medians[True], eager_hit / medians[True]))
            decode = tpot_ms(llm, long_prompt, 33)  # also caches long_prompt
            graphs, runner.decode_graphs = runner.decode_graphs, None
            if graphs is not None:  # the same steps launched kernel by kernel: what the graphs save
                eager = statistics.median(tpot_ms(llm, long_prompt, 33) for _ in range(3))
                runner.decode_graphs = graphs
                decode = statistics.median([decode] + [tpot_ms(llm, long_prompt, 33) for _ in range(2)])
                rows.append(E2ERow(f"{long_len}-token prompt, decode without CUDA graphs", "median TPOT", eager,
                                   "ms"))
                rows.append(E2ERow("CUDA graphs: TPOT eager / replayed", "speed-up", eager / decode, "x", decode,
                                   eager / decode))
            repeat = statistics.median(ttft_ms(llm, long_prompt) for _ in range(repeats))
            rows.append(E2ERow(f"{long_len}-token prompt, decode", "median TPOT", decode, "ms"))
            rows.append(E2ERow(f"identical {long_len}-token prompt back to back (all but the last token cached)",
                               "median TTFT", repeat, "ms"))
            rows.append(E2ERow("TTFT of a fully cached prompt vs TPOT", "TPOT / TTFT", decode / repeat, "x",
                               repeat, decode / repeat, 1 / 1.5))
            if rates is not None:
                rows += floor_rows(model_costs(llm), rates, prefix_len=prefix_len, question_len=question_len,
                                   hit_ms=medians[True], decode_context=long_len + 16, tpot=decode)
            if steps_output is not None and torch.cuda.is_available():  # last: the steps write scratch blocks
                write_step_reports(measure_steps(llm, context_len=prefix_len, question_len=question_len,
                                                 prefill_len=prefix_len), steps_output, steps_header or {})
        _release(llm)
    rows.append(E2ERow("shared prompt: TTFT reuse off / on", "speed-up", medians[False] / medians[True], "x",
                       medians[True], medians[False] / medians[True], 10.0))

    # A primary pool that holds one request: B evicts A to the host, A comes back by onboarding.
    blocks_per_request = -(-(long_len + 1) // tokens_per_block)
    pool_tokens = (blocks_per_request + 1) * tokens_per_block
    llm = LLM(model=plan, **limits,
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


def write_reports(rows: list[E2ERow], output: Path, header: dict[str, str]) -> None:
    """gpu_e2e.csv (one line per figure, the run's header repeated) and gpu_e2e.md."""
    write_rows_csv(output / "gpu_e2e.csv", rows, header)
    fmt = lambda x: "" if x is None else f"{x:.4g}"  # noqa: E731
    lines = ["# kvtool end-to-end TTFT", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| case | metric | value | unit | baseline | ratio | target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "" if r.ratio is None or r.target is None else (" (met)" if r.ratio >= r.target else " (missed)")
        lines.append(f"| {r.case} | {r.metric} | {r.value:.4g} | {r.unit} | {fmt(r.baseline)} | "
                     f"{fmt(r.ratio)}{verdict} | {fmt(r.target)} |")
    (output / "gpu_e2e.md").write_text("\n".join(lines) + "\n")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the requests of the e2e (bench/gpu_peer_transformers.py takes the same)."""
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix_len", type=int, default=2048)
    parser.add_argument("--question_len", type=int, default=128)
    parser.add_argument("--long_len", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens_per_block", type=int, default=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--plan_options", choices=("e2e", "bench"), default="bench",
                        help="build the plan with just what the e2e needs, or as `kvtool bench` does (shared)")
    parser.add_argument("--output", type=Path, default=None, help="write gpu_e2e.csv and gpu_e2e.md there")
    args = parser.parse_args()
    like_bench = args.plan_options == "bench"
    max_len = max_request_len(args.prefix_len, args.question_len, args.long_len)
    options = plan_build_options(args.dtype, args.tokens_per_block, max_len, like_bench=like_bench)
    plan = resolve_plan(args.model, options)
    print(f"plan {plan.path}" + (f", shared with `{bench_command(args.model, options)}`" if like_bench else ""))
    header = {"model": args.model, "dtype": plan.build_options.dtype, "plan": str(plan.path),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    rows = measure(plan, args.dtype, prefix_len=args.prefix_len, question_len=args.question_len,
                   long_len=args.long_len, repeats=args.repeats, tokens_per_block=args.tokens_per_block,
                   steps_output=args.output, steps_header=header)
    for row in rows:
        target = f"  (target {row.target:.3g}: {'met' if row.ratio >= row.target else 'missed'})" if row.target else ""
        print(f"{row.case}: {row.metric} = {row.value:.4g} {row.unit}{target}")
    if args.output is not None:
        write_reports(rows, args.output, header)
        print(f"reports in {args.output}")


if __name__ == "__main__":
    main()
