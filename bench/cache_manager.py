"""Per-request cost of the C++ KV cache manager through its Python API (not a test).

Synthetic trace: requests of 2,048 tokens (tokens_per_block 32); half of them start with one of
16 shared 1,024-token prefixes, the rest are random. A 100,000-block primary pool with a
20,000-block host tier. Requests are processed one at a time: add_sequence (prefix match +
allocation), allocate one more token slot, mark_computed, take_copy_ops, release; each request
is timed. Once the pools are full (after about 1,600 requests) every new block evicts a primary
block to the host tier, which drops a host block. The trace runs --repeat times with reuse on
(the machine's cores are shared: each run's median is reported), once with reuse off. The same
trace's first requests also run through the pure-Python reference model
(tests/reference_kv_cache.py) for a speed ratio, and their reuse results are compared.

    .venv/bin/python bench/cache_manager.py --output results/cache_manager.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from kvtool._core import CacheConfig, KVCacheManager

ROOT = Path(__file__).resolve().parents[1]


def load_reference():
    """tests/ is not a package: import the reference model by path."""
    path = ROOT / "tests" / "reference_kv_cache.py"
    spec = importlib.util.spec_from_file_location("reference_kv_cache", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_kv_cache"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ReferenceKVCache


def make_trace(num_requests, num_tokens, num_prefixes, prefix_len, vocab_size, seed):
    """[num_requests] int32 arrays of num_tokens tokens; every other request starts with a shared prefix."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, vocab_size, size=(num_prefixes, prefix_len), dtype=np.int32)
    trace = []
    for i in range(num_requests):
        if i % 2 == 0:
            suffix = rng.integers(0, vocab_size, size=num_tokens - prefix_len, dtype=np.int32)
            trace.append(np.concatenate([prefixes[rng.integers(num_prefixes)], suffix]))
        else:
            trace.append(rng.integers(0, vocab_size, size=num_tokens, dtype=np.int32))
    return trace


def run_manager(manager, trace, misses=None):
    """Per-request wall times (ns) and reused token counts; each request's miss reasons appended to
    misses ({reason: blocks}) when given."""
    times, reused = np.empty(len(trace), dtype=np.int64), []
    clock = time.perf_counter_ns
    for seq_id, tokens in enumerate(trace):
        n = len(tokens)
        start = clock()
        result = manager.add_sequence(seq_id, tokens, n)
        manager.allocate(seq_id, n + 1)  # room for the first generated token
        manager.mark_computed(seq_id, n)
        manager.take_copy_ops()
        manager.release(seq_id)
        times[seq_id] = clock() - start
        reused.append(result.num_reused_tokens)
        if misses is not None:
            misses.append(result.missed.to_dict())
    return times, reused


def run_reference(reference, trace, misses):
    times, reused = np.empty(len(trace), dtype=np.int64), []
    clock = time.perf_counter_ns
    for seq_id, tokens in enumerate(trace):
        tokens = tokens.tolist()
        n = len(tokens)
        start = clock()
        result = reference.add_sequence(seq_id, tokens, n)
        reference.allocate(seq_id, n + 1)
        reference.mark_computed(seq_id, n)
        reference.release(seq_id)
        times[seq_id] = clock() - start
        reused.append(result["num_reused_tokens"])
        misses.append(result["missed"])
    return times, reused


def cpu_model():
    """'AMD EPYC (VM, AVX2)': the model, and whether it runs under a hypervisor and has AVX2."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    notes = [name for flag, name in (("hypervisor", "VM"), ("avx2", "AVX2")) if flag in flags]
    return f"{model} ({', '.join(notes)})" if notes else model


def us(ns):
    return ns / 1000.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--num-tokens", type=int, default=2048)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--num-primary-blocks", type=int, default=100_000)
    parser.add_argument("--num-secondary-blocks", type=int, default=20_000)
    parser.add_argument("--reference-requests", type=int, default=500,
                        help="first requests of the trace also run through the Python reference")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of the whole trace with reuse on (fresh managers): the machine is shared, "
                             "so each run's median is reported and the table gives the median of all requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write a markdown result here")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    config = dict(tokens_per_block=args.tokens_per_block, num_primary_blocks=args.num_primary_blocks,
                  num_secondary_blocks=args.num_secondary_blocks)
    trace = make_trace(args.num_requests, args.num_tokens, args.num_prefixes, args.prefix_len, 32_000, args.seed)

    run_times = []
    for _ in range(max(1, args.repeat)):
        manager = KVCacheManager(CacheConfig(**config))
        run, reused = run_manager(manager, trace)
        run_times.append(run)
        problems = manager.check_invariants()
        if problems:
            raise SystemExit("invariant violations after the run: " + "; ".join(problems[:5]))
    times = np.concatenate(run_times)
    stats = manager.stats()

    # The same trace without reuse: allocation and release only, the floor set by the Python calls.
    plain_times, _ = run_manager(KVCacheManager(CacheConfig(**config, enable_block_reuse=False)), trace)

    sample = trace[: args.reference_requests]
    sample_manager = KVCacheManager(CacheConfig(**config))
    sample_misses, ref_misses = [], []
    sample_times, sample_reused = run_manager(sample_manager, sample, sample_misses)
    ref_times, ref_reused = run_reference(load_reference()(**config), sample, ref_misses)
    if ref_reused != sample_reused or sample_reused != reused[: len(sample)]:
        raise SystemExit("the reference model and the C++ manager disagree on reused tokens")
    if ref_misses != sample_misses:
        raise SystemExit("the reference model and the C++ manager disagree on why blocks were missed")

    median, p90 = np.median(times), np.percentile(times, 90)
    sample_median, ref_median = np.median(sample_times), np.median(ref_times)
    rows = [
        (f"C++ manager, all requests ({len(run_times)} runs)", len(times), us(median), us(p90)),
        ("C++ manager, block reuse off (allocation only)", len(plain_times), us(np.median(plain_times)),
         us(np.percentile(plain_times, 90))),
        (f"C++ manager, first {len(sample)}", len(sample), us(sample_median), us(np.percentile(sample_times, 90))),
        (f"Python reference, first {len(sample)}", len(sample), us(ref_median), us(np.percentile(ref_times, 90))),
    ]
    lines = [
        "# KV cache manager: cost per request",
        "",
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores, shared with other work while measured "
        f"(1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"this process uses one core); Python {platform.python_version()}",
        f"- Command: `{' '.join(shlex.quote(a) for a in [Path(sys.executable).name, 'bench/cache_manager.py', *sys.argv[1:]])}`",
        f"- Trace: {args.num_requests} requests of {args.num_tokens} tokens, tokens_per_block "
        f"{args.tokens_per_block}; every other request starts with one of {args.num_prefixes} shared "
        f"{args.prefix_len}-token prefixes, the rest are random (seed {args.seed}).",
        f"- Pools: {args.num_primary_blocks} primary blocks, {args.num_secondary_blocks} secondary (host) blocks.",
        "- Per request, timed: add_sequence (prefix match + allocation) + allocate (one more token) + "
        "mark_computed + take_copy_ops + release, through the Python API.",
        "",
        "| path | requests | median µs/request | p90 µs/request |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {n} | {m:.2f} | {p:.2f} |" for name, n, m, p in rows],
        "",
        "Median of each run with reuse on: " + ", ".join(f"{us(np.median(t)):.2f}" for t in run_times) +
        " µs (runs differ by the load other work puts on the shared cores and memory).",
        "",
        f"Speed-up over the pure-Python reference on the same requests: **{ref_median / sample_median:.0f}x** "
        "(both give the same reused-token counts and miss reasons).",
        "",
        f"Cache hit rate: {stats.cache_hit_rate:.3f} ({stats.reused_blocks} reused / {stats.missed_blocks} missed "
        f"blocks); offloaded {stats.offloaded_blocks}, onboarded {stats.onboarded_blocks}, evicted "
        f"{stats.evicted_blocks} blocks; early reuse {stats.early_reused_blocks}, partial reuse "
        f"{stats.partial_reused_blocks}. Missed blocks by reason: "
        + ", ".join(f"{reason} {count}" for reason, count in stats.missed.to_dict().items()) + ".",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + kept_measurements(args.output))


MEASUREMENTS_HEADING = "## Micro-optimisation measurements"


def kept_measurements(path: Path) -> str:
    """The hand-measured section of an existing report (from MEASUREMENTS_HEADING on): a rerun of
    the table must not lose it."""
    if not path.exists():
        return ""
    old = path.read_text()
    start = old.find("\n" + MEASUREMENTS_HEADING)
    return "" if start < 0 else old[start:]


if __name__ == "__main__":
    main()
