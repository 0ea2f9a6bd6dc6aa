"""TTFT of a prompt served from each KV tier against computing it (CPU, small-llama), and whether the
greedy output is the same whatever tier served it.

One engine per tier, configured as a user would (kvtool.LLM with KvCacheConfig's host cache, disk
cache or remote cache: --kv_host_cache_bytes, --kv_disk_cache_dir, --kv_remote_cache). Each round
sends a new prompt of --prompt_tokens tokens (a miss: computed), then, for the host, disk and remote
tiers, unrelated prompts that push it out of the primary pool (host) or through the host tier into
the third tier (disk, remote), then the same prompt again (a hit of that tier); for the primary tier
the same prompt right away. Requests run one at a time; TTFT includes the third tier's staging.
Redis: a redis-server started here on a free loopback port (tests/redis_servers.py).

    .venv/bin/python bench/tier_ttft.py --output results/tiers/ttft_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.runtime.device import default_device, describe_device
from kvtool.units import format_bytes
from kvtool.version import __version__, git_revision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiers import load_redis_servers  # noqa: E402 - bench/ is not a package

TIERS = ("primary", "host", "disk", "remote")


def prompt(round_index: int, length: int, salt: int = 0) -> list[int]:
    """A prompt no other round or filler shares a block with (token ids < 4096, small-llama's vocabulary)."""
    return [(31 * i + 977 * round_index + 7919 * salt) % 4000 + 10 for i in range(length)]


def blocks_per_prompt(args) -> int:
    return -(-args.prompt_tokens // args.tokens_per_block)


def host_blocks(tier: str, args) -> int:
    """None for the primary tier; big enough to keep what the fillers push out of the primary pool (host);
    just big enough to stage a prompt (disk, remote: the rest spills to the third tier)."""
    per_prompt = blocks_per_prompt(args)
    return {"primary": 0, "host": args.primary_blocks + 2 * per_prompt}.get(tier, per_prompt + 8)


def num_fillers(tier: str, args) -> int:
    """Prompts that push the measured one out of the primary pool (host), and of the host tier too (disk,
    remote): one more than fills what lies above the tier."""
    above = args.primary_blocks + (host_blocks(tier, args) if tier in ("disk", "remote") else 0)
    return 0 if tier == "primary" else -(-above // blocks_per_prompt(args)) + 1


def engine(model: str, tier: str, args, block_bytes: int, directory: Path, redis_url: str | None) -> LLM:
    third = {"disk": {"disk_cache_dir": str(directory / "disk"), "disk_cache_size": args.disk_bytes},
             "remote": {"remote_cache_url": redis_url}}.get(tier, {})
    return LLM(model=model, max_batch_size=1, max_seq_len=args.prompt_tokens + 64,
               kv_cache_config=KvCacheConfig(max_tokens=args.primary_blocks * args.tokens_per_block,
                                             tokens_per_block=args.tokens_per_block,
                                             host_cache_size=host_blocks(tier, args) * block_bytes, **third))


def timed(llm: LLM, token_ids: list[int], params: SamplingParams) -> tuple[float, list[int], dict]:
    """TTFT (ms), the greedy output, and the cache counters' change."""
    before = llm.get_stats()
    out = llm.generate(token_ids, params)
    assert out.error is None, out.error
    after = llm.get_stats()
    request = out.request
    change = {key: after[key] - before.get(key, 0) for key in after if isinstance(after[key], (int, float))}
    return (request.first_token_time - request.arrival_time) * 1e3, out.outputs[0].token_ids, change


def run_tier(llm: LLM, tier: str, args) -> dict:
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    miss_ms, hit_ms, staging_ms, served, identical = [], [], [], [], 0
    for r in range(args.rounds):
        token_ids = prompt(r, args.prompt_tokens)
        ttft, reference, _ = timed(llm, token_ids, params)
        miss_ms.append(ttft)
        for k in range(num_fillers(tier, args)):
            llm.generate(prompt(r, args.prompt_tokens, salt=k + 1), params)
        if tier in ("disk", "remote"):
            llm.engine.tier3.store.flush()  # the spills reached the store (a later round reads them, not the queue)
        ttft, output, change = timed(llm, token_ids, params)
        hit_ms.append(ttft)
        staging_ms.append(change.get("tier3_staging_s", 0.0) * 1e3)
        served.append({t: change[f"{t}_hit_blocks"] for t in TIERS if change.get(f"{t}_hit_blocks")})
        identical += output == reference
    return dict(tier=tier, miss_ms=miss_ms, hit_ms=hit_ms, staging_ms=staging_ms, served=served,
                identical=identical, rounds=args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:small-llama")
    parser.add_argument("--prompt_tokens", type=int, default=1024)
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--output_tokens", type=int, default=8, help="greedy tokens compared across tiers")
    parser.add_argument("--primary_blocks", type=int, default=96)
    parser.add_argument("--disk_bytes", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--directory", default=None, help="where the disk tier's files go (default: a temp dir "
                                                          "under /var/tmp, on the disk)")
    parser.add_argument("--output", default=None, help="write a Markdown report here")
    args = parser.parse_args()

    redis_servers = load_redis_servers()
    if redis_servers.REDIS_SERVER is None:
        sys.exit("bench/tier_ttft.py: no redis-server: `make setup` installs it")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.directory or "/var/tmp") as tmp:
        server = redis_servers.RedisServer(Path(tmp) / "redis", maxmemory="2gb", maxmemory_policy="allkeys-lru")
        try:
            results, block_bytes = [], 0  # the first engine (primary: no host tier) tells the block size
            for tier in TIERS:
                llm = engine(args.model, tier, args, block_bytes, Path(tmp), server.url)
                block_bytes = llm.pool_sizes.block_bytes
                results.append(run_tier(llm, tier, args))
                device = describe_device(default_device())
                llm.shutdown()
        finally:
            server.stop()
    report = render(results, args, block_bytes, device, load_before, os.getloadavg()[0])
    print(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(report)


def render(results: list[dict], args, block_bytes: int, device: str, load_before: float, load_after: float) -> str:
    med = statistics.median
    misses = [ms for result in results for ms in result["miss_ms"]]
    lines = [
        "# TTFT of a hit from each KV tier against a miss (CPU)",
        "",
        f"- Machine: {device}; {os.cpu_count()} cores, shared with other work while measured (1-minute load "
        f"average {load_before:.1f} at the start, {load_after:.1f} at the end); Python {platform.python_version()}; "
        f"kvtool {__version__} ({git_revision() or 'no git'})",
        f"- Command: `python bench/tier_ttft.py {shlex.join(sys.argv[1:])}`",
        f"- Model {args.model}, prompts of {args.prompt_tokens} tokens, {args.tokens_per_block} tokens per block "
        f"({format_bytes(block_bytes)} of KV per block, "
        f"{format_bytes(block_bytes * (args.prompt_tokens // args.tokens_per_block))} per prompt), "
        f"{args.rounds} rounds per tier, one request at a time; disk tier on the machine's disk "
        "(direct I/O), Redis on loopback. TTFT includes staging from the third tier.",
        "",
        "| served from | TTFT median (ms) | min..max (ms) | vs miss | staging median (ms) | blocks served by | "
        "greedy output = miss's |",
        "|---|---:|---:|---:|---:|---|---:|",
        f"| miss (computed) | {med(misses):.1f} | {min(misses):.1f}..{max(misses):.1f} | 1.00x | | | |",
    ]
    for result in results:
        hits = result["hit_ms"]
        served = result["served"][-1]
        lines.append(
            f"| {result['tier']} | {med(hits):.1f} | {min(hits):.1f}..{max(hits):.1f} | "
            f"{med(misses) / med(hits):.2f}x faster | "
            f"{med(result['staging_ms']):.1f} | " + ", ".join(f"{n} {t}" for t, n in served.items()) +
            f" | {result['identical']} of {result['rounds']} |")
    lines += ["", f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
