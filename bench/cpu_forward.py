"""Forward-step latency of a plan on the CPU, for the step kinds a TTFT and a TPOT are made of.

Drives the ModelRunner directly (no scheduler), one step at a time, on a prompt of random token ids:
- miss: the whole prompt from position 0 (reuse off, or nothing cached);
- partial-miss: the prompt after a few cached tokens (a partial block copied from another prompt);
- hit: the last --hit_tokens tokens after a cached prefix (a reused system prompt);
- decode: one token after the prompt; decode-8: one token for each of 8 sequences whose prompts
  share all but their last block (as a system prompt's requests do).
Each kind runs --repeats times, kinds and paths interleaved in one process (so a changing load
touches every path alike); prints medians (ms). --paths compares the forward through kvtool's CPU
kernels ('kernels', in each --isa) with the torch path ('torch'), with the kernels whose single-row
projections run oneDNN's product instead of kvtool's row product ('kernels-onednn'), or with the
kernels whose prompt projections run oneDNN's product instead of AMX tile products ('kernels-no-tiles'). --clock cpu measures process
CPU time instead of wall time; --profile prints torch.profiler's top operators per kind.

    python bench/cpu_forward.py --plan PLAN [--paths kernels,torch] [--isa avx512,avx2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from kvtool import LLM, KvCacheConfig
from kvtool.cpu_kernels.decoder import CpuDecoder
from kvtool.runtime.model_runner import StepRequest

BATCH = 8


def step_kinds(prompt_len: int, hit_tokens: int, partial_tokens: int) -> dict[str, tuple[int, int, int]]:
    """kind -> (num_cached_tokens, num_new_tokens, sequences)."""
    return {"miss": (0, prompt_len, 1), "partial-miss": (partial_tokens, prompt_len - partial_tokens, 1),
            "hit": (prompt_len - hit_tokens, hit_tokens, 1), "decode": (prompt_len, 1, 1),
            f"decode-{BATCH}": (prompt_len, 1, BATCH)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--prompt_len", type=int, default=1056)
    parser.add_argument("--hit_tokens", type=int, default=32)
    parser.add_argument("--partial_tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default="kernels", help="kernels, kernels-onednn, kernels-no-tiles, torch (comma-separated: compared)")
    parser.add_argument("--isa", default="auto", help="the kernels' instruction sets (comma-separated)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line of medians")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    llm = LLM(model=args.plan, max_batch_size=BATCH, kv_cache_config=KvCacheConfig(
        enable_block_reuse=False, max_tokens=(BATCH + 1) * (args.prompt_len + 64)))
    runner = llm.engine.executor
    model = runner.model
    paths = {}
    for path in args.paths.split(","):
        if path == "torch":
            paths["torch"] = None
        elif path == "kernels-onednn":
            paths[path] = CpuDecoder(model, row_products=False)
        elif path == "kernels-no-tiles":
            paths[path] = CpuDecoder(model, tile_products=False)
        else:
            paths.update({f"kernels-{isa}" if isa != "auto" else "kernels": CpuDecoder(model, isa=isa)
                          for isa in args.isa.split(",")})
    rng = random.Random(0)
    blocks_per_seq = -(-(args.prompt_len + 1) // runner.tokens_per_block)
    token_ids = np.array([rng.randrange(100, 10_000) for _ in range(args.prompt_len + 1)], dtype=np.int32)
    shared = np.arange(blocks_per_seq - 1, dtype=np.int32)
    sequences = [np.append(shared, blocks_per_seq - 1 + s).astype(np.int32) for s in range(BATCH)]
    model.cpu_decoder = next(iter(paths.values()))
    for block_ids in sequences:  # fills every sequence's blocks (the shared ones with the same KV each time)
        runner.execute([StepRequest(token_ids[:args.prompt_len], block_ids, 0, True, True)])

    def requests(num_cached: int, num_new: int, num_seqs: int) -> list[StepRequest]:
        return [StepRequest(token_ids[num_cached:num_cached + num_new], sequences[s], num_cached, num_new > 1, True)
                for s in range(num_seqs)]

    kinds = step_kinds(args.prompt_len, args.hit_tokens, args.partial_tokens)
    times: dict[tuple[str, str], list[float]] = {(p, k): [] for p in paths for k in kinds}
    for repeat in range(args.repeats):
        for kind, shape in kinds.items():
            # Paths in turn, their order reversed every other repeat: a step runs slower right after some
            # others (caches), and which path comes first must not decide the comparison.
            for path, decoder in (list(paths.items()) if repeat % 2 else list(paths.items())[::-1]):
                model.cpu_decoder = decoder
                step = requests(*shape)
                start = clock()
                runner.execute(step)
                times[(path, kind)].append((clock() - start) * 1e3)
    medians = {f"{path} {kind}": statistics.median(values) for (path, kind), values in times.items()}
    if args.json:
        print(json.dumps(medians))
    else:
        print(f"{args.clock} ms per step, median of {args.repeats} (threads {torch.get_num_threads()}):")
        header = "".join(f"{path:>18s}" for path in paths)
        print(f"  {'':13s}{header}")
        for kind in kinds:
            print(f"  {kind:13s}" + "".join(f"{medians[f'{path} {kind}']:18.1f}" for path in paths))
    if args.profile:
        for kind, shape in kinds.items():
            for path, decoder in paths.items():
                model.cpu_decoder = decoder
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    runner.execute(requests(*shape))
                print(f"\n## {path}: {kind}\n")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    llm.shutdown()


if __name__ == "__main__":
    main()
