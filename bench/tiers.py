"""Copy cost of the third KV tier on this machine (not a test): host <-> disk and host <-> Redis on
loopback, per block and in bytes per second, through kvtool's own stores (kvtool/runtime/disk_store.py,
remote_store.py). These are the figures a simulation of the tiers is calibrated from.

For each block size, --total_mib of blocks (random bytes) are:
- spilled (host -> tier): the time each write() takes on the step path (with the writer thread it
  copies the block into a staging buffer and returns), and the throughput until flush() returns;
- fetched back (tier -> host) in stagings of --batch blocks and of one block: time per staging, per
  block, and throughput. Disk reads go to the device: direct I/O, or, buffered, after the files'
  pages were dropped from the page cache (posix_fadvise DONTNEED);
- looked up (remote): count_present of --batch keys.
A host -> host copy of the same blocks is the baseline. Disk modes: direct I/O or buffered, writer
thread or synchronous. Redis: a redis-server started here on a free loopback port (or --redis_url).

    .venv/bin/python bench/tiers.py --output results/tiers.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtool.runtime.disk_store import DiskStore
from kvtool.runtime.remote_store import RemoteStore
from kvtool.runtime.tier3_store import plan_digest

ROOT = Path(__file__).resolve().parents[1]
PLAN = plan_digest(weights_digest="sha256:bench", kv_dtype="bfloat16", tokens_per_block=32, num_layers=1,
                   num_kv_heads=1, head_dim=1)


def load_redis_servers():
    """tests/ is not a package: the test suite's redis-server launcher, imported by path."""
    path = ROOT / "tests" / "redis_servers.py"
    spec = importlib.util.spec_from_file_location("redis_servers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def make_blocks(num_blocks: int, block_bytes: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, block_bytes, dtype=np.uint8)) for _ in range(num_blocks)]


def mb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e6


def measure_writes(store, blocks, slots) -> dict:
    """Per-call latency on the step path, and throughput until everything is written. A first pass
    warms the store's staging buffers (a fresh buffer page-faults once); the second is measured."""
    for slot, block in zip(slots, blocks):
        store.write(slot, key(slot), block)
    store.flush()
    latencies = []
    started = time.perf_counter()
    for slot, block in zip(slots, blocks):
        t = time.perf_counter()
        store.write(slot, key(slot), block)
        latencies.append(time.perf_counter() - t)
    store.flush()
    total = time.perf_counter() - started
    num_bytes = len(blocks) * blocks[0].numel()
    return dict(step_us=statistics.median(latencies) * 1e6, p90_step_us=np.percentile(latencies, 90) * 1e6,
                mb_s=mb_per_s(num_bytes, total))


def measure_reads(store, blocks, slots, batch: int, seed: int = 0) -> dict:
    """Fetches in stagings of `batch` blocks, in random order (a prompt's blocks are anywhere in the
    tier, and sequential reads would be served by the kernel's readahead); checks every block."""
    outs = [torch.zeros_like(b) for b in blocks]  # touched: host blocks in use are, too
    order = np.random.default_rng(seed).permutation(len(blocks))
    per_staging = []
    started = time.perf_counter()
    for first in range(0, len(blocks), batch):
        requests = [(slots[i], key(slots[i]), outs[i]) for i in order[first:first + batch]]
        t = time.perf_counter()
        ok = store.read(requests)
        per_staging.append(time.perf_counter() - t)
        assert all(ok), "a fetch failed"
    total = time.perf_counter() - started
    assert all(torch.equal(a, b) for a, b in zip(outs, blocks)), "a block came back different"
    num_bytes = len(blocks) * blocks[0].numel()
    return dict(staging_us=statistics.median(per_staging) * 1e6, block_us=total / len(blocks) * 1e6,
                mb_s=mb_per_s(num_bytes, total))


def drop_page_cache(store: DiskStore) -> None:
    for fd in store._fds:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def bench_disk(directory: Path, blocks, batch: int) -> list[dict]:
    rows = []
    slots = list(range(len(blocks)))
    block_bytes = blocks[0].numel()
    for direct_io in (True, False):
        for writer_thread in (True, False):
            with DiskStore(directory, len(blocks), block_bytes, PLAN, direct_io=direct_io,
                           writer_thread=writer_thread) as store:
                mode = ("direct I/O" if store.direct_io else "buffered") + (", writer thread" if writer_thread
                                                                              else ", synchronous")
                write = measure_writes(store, blocks, slots)
                drop_page_cache(store)
                read = measure_reads(store, blocks, slots, batch)
                drop_page_cache(store)
                single = measure_reads(store, blocks, slots, 1)
            rows.append(dict(tier="disk", mode=mode, write=write, read=read, single=single))
    return rows


def bench_redis(url: str, blocks, batch: int) -> list[dict]:
    rows = []
    block_bytes = blocks[0].numel()
    for writer_thread in (True, False):
        with RemoteStore(url, block_bytes, PLAN, timeout_s=5.0, writer_thread=writer_thread) as store:
            store._client.flushall()
            numbered = list(range(len(blocks)))
            write = measure_writes(store, blocks, numbered)
            read = measure_reads(store, blocks, numbered, batch)
            single = measure_reads(store, blocks, numbered, 1)
            keys = [key(n) for n in numbered[:batch]]
            lookups = []
            for _ in range(50):
                t = time.perf_counter()
                assert store.count_present(keys) == len(keys)
                lookups.append(time.perf_counter() - t)
            rows.append(dict(tier="redis (loopback)", mode="writer thread" if writer_thread else "synchronous",
                             write=write, read=read, single=single, lookup_us=statistics.median(lookups) * 1e6))
    return rows


def bench_memcpy(blocks) -> dict:
    outs = [torch.zeros_like(b) for b in blocks]
    latencies = []
    started = time.perf_counter()
    for src, dst in zip(blocks, outs):
        t = time.perf_counter()
        np.copyto(dst.numpy(), src.numpy())  # one memcpy, as the stores' own copies
        latencies.append(time.perf_counter() - t)
    total = time.perf_counter() - started
    return dict(block_us=statistics.median(latencies) * 1e6, mb_s=mb_per_s(len(blocks) * blocks[0].numel(), total))


def median_of(runs: list):
    """The runs' median of every number (the same structure, figure by figure): the cores are shared,
    and one run can be slowed by other work."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, list):
        return [median_of([r[i] for r in runs]) for i in range(len(first))]
    if isinstance(first, float):
        return statistics.median(runs)
    return first


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
        flags = next(line for line in lscpu.splitlines() if line.startswith("Flags"))
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
        cpu += f" ({isa}), {os.cpu_count()} cores"
    except (OSError, StopIteration):
        pass
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block_kib", default="256,1024,4096", help="block sizes in KiB, comma-separated")
    parser.add_argument("--total_mib", type=int, default=256, help="MiB of blocks per measurement")
    parser.add_argument("--batch", type=int, default=16, help="blocks per staging")
    parser.add_argument("--directory", default=None, help="where the disk tier's files go (default: a temp dir)")
    parser.add_argument("--redis_url", default=None, help="a Redis server to use (default: start one here)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--output", default=None, help="write a Markdown report here")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    redis_servers = load_redis_servers()
    server = None
    with tempfile.TemporaryDirectory(prefix="kvtool-tiers-", dir=args.directory) as tmp:
        url = args.redis_url
        if url is None:
            if redis_servers.REDIS_SERVER is None:
                sys.exit("bench/tiers.py: no redis-server: `make setup` installs it, or give --redis_url")
            server = redis_servers.RedisServer(Path(tmp) / "redis", maxmemory="2gb", maxmemory_policy="noeviction")
            url = server.url
        results = []
        try:
            for kib in (int(k) for k in args.block_kib.split(",")):
                block_bytes = kib * 1024
                blocks = make_blocks(max(args.total_mib * 1024 // kib, 2 * args.batch), block_bytes, seed=kib)
                print(f"{kib} KiB blocks x {len(blocks)}", flush=True)
                runs = [dict(memcpy=bench_memcpy(blocks), rows=bench_disk(Path(tmp) / f"disk-{kib}", blocks, args.batch)
                             + bench_redis(url, blocks, args.batch)) for _ in range(args.repeat)]
                results.append(dict(kib=kib, num_blocks=len(blocks), **median_of(runs)))
        finally:
            if server is not None:
                server.stop()
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    report = render(results, args, machine(), load_before, os.getloadavg()[0],
                    next((w for w in redis_version if w.startswith("v=")), "v=?")[2:])
    print(report)
    if args.output:
        Path(args.output).write_text(report)


def render(results, args, cpu: str, load_before: float, load_after: float, redis_version: str) -> str:
    lines = [
        "# Third KV tier: copy cost per tier",
        "",
        f"- Machine: {cpu}, KVM guest; disk: virtio block device (ext4); 2 cores shared with other work while "
        f"measured (1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end); "
        f"Python {platform.python_version()}; redis-server {redis_version} on loopback, no persistence",
        f"- Command: `python bench/tiers.py {shlex.join(sys.argv[1:])}`",
        f"- Per block size, {args.total_mib} MiB of random blocks; each figure is the median of "
        f"{args.repeat} runs. Spill: the time of each store.write() "
        "on the step path (median, p90) and the throughput until flush() returns. Fetch: stagings of "
        f"{args.batch} blocks (median time per staging, mean per block, throughput) and of one block "
        "(median: the latency a one-block hit waits for), blocks in random order. Disk reads hit the device "
        "(direct I/O, or buffered after the files' pages were dropped). Lookup: count_present of "
        f"{args.batch} keys (one pipelined EXISTS round trip).",
        "",
        "| block | tier | mode | spill µs/block on step path (p90) | spill MB/s | fetch µs/staging | "
        "fetch µs/block | fetch MB/s | one-block fetch µs | lookup µs |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        kib = result["kib"]
        memcpy = result["memcpy"]
        lines.append(f"| {kib} KiB | host (baseline) | host -> host copy | {memcpy['block_us']:.0f} | "
                     f"{memcpy['mb_s']:.0f} | | | | | |")
        for row in result["rows"]:
            w, r, s = row["write"], row["read"], row["single"]
            lookup = f"{row['lookup_us']:.0f}" if "lookup_us" in row else ""
            lines.append(f"| {kib} KiB | {row['tier']} | {row['mode']} | {w['step_us']:.0f} ({w['p90_step_us']:.0f}) "
                         f"| {w['mb_s']:.0f} | {r['staging_us']:.0f} | {r['block_us']:.0f} | {r['mb_s']:.0f} | "
                         f"{s['staging_us']:.0f} | {lookup} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
