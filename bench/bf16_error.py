"""How far bfloat16 logits sit from float32's: kvtool's CPU kernels against torch's bfloat16 path and
transformers' bfloat16 model, on the prompts and float32 greedy outputs of a `make peers` run.

Each request's prompt, then --steps of its float32 greedy ids fed back one at a time (teacher forcing,
so every path sees the same tokens): each path's logits at the prompt's last position and after each
fed token, against the float32 plan's on the torch path. Prints each path's relative error (per
position: |logits - float32| / |float32|; median, mean, max) and how often its argmax is float32's.
The greedy ids of bfloat16 runs part from float32's somewhere (peers' table.md says where); this says
whether kvtool's part sooner because its rounding is worse, or only where any bfloat16 path would.

    python bench/bf16_error.py --work /tmp/pw1 [--requests 8] [--steps 24] [--isas auto avx2]

--work: a `bench/peers/run.py --work` directory with both dtypes run (plan, plan-bf16, checkpoint,
dataset.jsonl, cycle-0/kvtool-reuse-on/outputs.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvtool.cpu_kernels.decoder import CpuDecoder
from kvtool.layers.attention import TorchPagedAttention
from kvtool.plan import load_plan

# The tests' minimal paged driver runs a kvtool model step by step without the runtime.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from paged_driver import PagedDriver  # noqa: E402


def teacher_forced_logits(model, prompt: list[int], fed: list[int], tokens_per_block: int) -> torch.Tensor:
    """[1 + len(fed), vocab] float32: the prompt's last position, then one row per fed token."""
    driver = PagedDriver(model, tokens_per_block=tokens_per_block,
                         num_blocks=-(-(len(prompt) + len(fed)) // tokens_per_block) + 1)
    seq = driver.add_sequence(list(prompt))
    rows = [driver.step(context=[(seq, len(prompt))])[0][-1:]]
    for token in fed:
        seq.append(token)
        rows.append(driver.step(decode=[seq])[0])
    return torch.cat(rows).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a peers run's --work directory")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="float32 greedy ids fed back a request")
    parser.add_argument("--isas", nargs="+", default=["auto"], help="kvtool kernel builds to check")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    args = parser.parse_args()
    outputs_path = args.work / "cycle-0" / "kvtool-reuse-on" / "outputs.jsonl"
    for needed in (args.work / "plan", args.work / "plan-bf16", args.work / "checkpoint",
                   args.work / "dataset.jsonl", outputs_path):
        if not needed.exists():
            parser.error(f"--work {args.work}: {needed} is missing; run `python bench/peers/run.py --work "
                         f"{args.work} --engines kvtool --dtypes float32,bfloat16` first")
    torch.set_num_threads(2)

    lines = [json.loads(line) for line in (args.work / "dataset.jsonl").read_text().splitlines()]
    measured = [line for line in lines if line.get("request_id") != "warmup"][:args.requests]
    greedy = {row["request_id"]: row["output_token_ids"]
              for row in map(json.loads, outputs_path.read_text().splitlines())}
    float32 = load_plan(args.work / "plan").load_model("cpu", TorchPagedAttention())
    bf16 = load_plan(args.work / "plan-bf16").load_model("cpu", TorchPagedAttention())
    hf = AutoModelForCausalLM.from_pretrained(args.work / "checkpoint", dtype=torch.bfloat16).eval()
    kernels = {f"kvtool kernels ({isa})": CpuDecoder(bf16, isa=isa, num_threads=2) for isa in args.isas}

    errors: dict[str, list[torch.Tensor]] = {name: [] for name in [*kernels, "kvtool torch path", "transformers"]}
    same_argmax: dict[str, list[torch.Tensor]] = {name: [] for name in errors}
    for line in measured:
        prompt, fed = line["input_ids"], greedy[line["request_id"]][:args.steps]
        with torch.no_grad():
            reference = teacher_forced_logits(float32, prompt, fed, args.tokens_per_block)
            got = {}
            for name, decoder in [*kernels.items(), ("kvtool torch path", None)]:
                bf16.cpu_decoder = decoder
                got[name] = teacher_forced_logits(bf16, prompt, fed, args.tokens_per_block)
            # [1 + steps, vocab]: the prompt's last position and each fed token's.
            got["transformers"] = hf(torch.tensor([prompt + fed])).logits[0, len(prompt) - 1:].float()
        for name, logits in got.items():
            errors[name].append((logits - reference).norm(dim=-1) / reference.norm(dim=-1))
            same_argmax[name].append((logits.argmax(-1) == reference.argmax(-1)).float())
        print(f"{line['request_id']}: " + ", ".join(f"{n} {float(e[-1].median()):.4f}" for n, e in errors.items()),
              file=sys.stderr, flush=True)

    positions = len(measured) * (1 + args.steps)
    print(f"bfloat16 logits against float32, {len(measured)} requests x {1 + args.steps} positions ({positions}):\n")
    print("| path | relative error: median | mean | max | argmax as float32's |")
    print("|---|---:|---:|---:|---:|")
    for name in errors:
        e, same = torch.cat(errors[name]), torch.cat(same_argmax[name])
        print(f"| {name} | {float(e.median()):.4f} | {float(e.mean()):.4f} | {float(e.max()):.4f} | "
              f"{float(same.mean()):.3f} |")


if __name__ == "__main__":
    main()
