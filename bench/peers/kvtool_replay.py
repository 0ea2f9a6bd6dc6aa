"""Replay a kvtool dataset through kvtool itself, as `kvtool bench --warmup 1` does (the same
run_bench), and also keep every request's output ids for the cross-engine check. --concurrency 1 is
`--mode sequential`; N > 1 is `--concurrency N`; 0 replays the dataset's arrival times (`--mode
offline`, in flight unlimited).

Also measures, in this process, the read bandwidth just before and after the replay
(bandwidth.json): on the VMs this was built on the rate flips between two or three rates (~33 and
~60 GB/s, or ~35, ~50 and ~83), each held for seconds to minutes, so a decode step is held to the
floor of the memory its own process reads around it. A sequential replay also reads PROBE_BYTES after
each measured request, before the next is handed over (its timings exclude it; the run's duration, and
so its tokens/s, grows by ~1 ms a request), so that each request's TPOT can be held to the rate read
just before and after it (after_each_request_gb_s, in the order requests.csv lists them; report.py
checks the requests of each rate apart).

    .venv/bin/python bench/peers/kvtool_replay.py --plan PLAN --dataset D.jsonl --output DIR \
        --label kvtool-reuse-on --reuse on [--partial_reuse off] [--concurrency 8]
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from common import replay_arguments, write_outputs
from floors import BandwidthProbe
from machine import read_cpu_info

from kvtool import LLM
from kvtool.bench.runner import run_bench
from kvtool.flags import configs
from kvtool.reports.csv_report import write_summary_csv
from kvtool.workloads.datasets import load_dataset

PROBE_BYTES = 64 << 20  # more than the last-level cache; ~1 ms at this VM's rates
# The reads after a request take the best of two buffers, each read once: the second read of one
# buffer found part of it in the last-level cache (floors.BandwidthProbe), and a request's floor at
# that rate came out 10-20% too low. A request's own streaming leaves neither buffer cached.
PROBE_BUFFERS = 2


def main() -> None:
    parser = replay_arguments(__doc__, model_help="a plan directory (kvtool build)")
    parser.add_argument("--reuse", choices=("on", "off"), required=True)
    parser.add_argument("--partial_reuse", choices=("on", "off"), default="on",
                        help="KvCacheConfig.enable_partial_reuse: copy a partially matching block (default on)")
    parser.add_argument("--cpu_kernels_isa", default="auto", help="kvtool bench --cpu_kernels_isa (default auto)")
    args = parser.parse_args()

    flags = {"enable_kv_cache_reuse": args.reuse == "on", "warmup": args.warmup,
             "cpu_kernels_isa": args.cpu_kernels_isa}
    if args.concurrency == 1:
        flags["mode"] = "sequential"
    elif args.concurrency > 1:
        flags["concurrency"] = args.concurrency
    engine, replay = configs(flags)
    engine = dataclasses.replace(engine, kv_cache_config=dataclasses.replace(
        engine.kv_cache_config, enable_partial_reuse=args.partial_reuse == "on"))
    args.output.mkdir(parents=True, exist_ok=True)
    with LLM(model=args.model, config=engine) as llm:
        columns = {"model": args.model, "enable_partial_reuse": args.partial_reuse == "on",
                   "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), **read_cpu_info().as_row()}
        # One buffer each for the reads around the replay and those between its requests, made once.
        around, probe, after_each = BandwidthProbe(torch.get_num_threads()), \
            BandwidthProbe(torch.get_num_threads(), PROBE_BYTES, PROBE_BUFFERS), []
        before = around.read()
        result = run_bench(llm, load_dataset(args.dataset), replay, label=args.label,
                           requests_csv=args.output / "requests.csv", config_columns=columns,
                           on_request_done=(lambda _: after_each.append(probe.read(PROBE_BUFFERS) / 1e9))
                           if args.concurrency == 1 else None)
        after = around.read()
    (args.output / "bandwidth.json").write_text(json.dumps(
        {"threads": torch.get_num_threads(), "before_gb_s": before / 1e9, "after_gb_s": after / 1e9,
         "after_each_request_gb_s": after_each or None}) + "\n")
    write_summary_csv(args.output / "summary.csv", [result.row])
    write_outputs(args.output / "outputs.jsonl", result.requests)
    row = result.row
    print(f"{args.label}: {row['num_requests']} requests, TTFT p50 {row['ttft_ms_p50']:.1f} ms, TPOT p50 "
          f"{row['tpot_ms_p50']:.1f} ms, {row['output_tokens_per_s']:.1f} output tokens/s, reused / missed blocks "
          f"{row.get('reused_blocks')} / {row.get('missed_blocks')}", flush=True)


if __name__ == "__main__":
    main()
