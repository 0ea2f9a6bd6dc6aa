"""The sampler on a device: a step's rows drawn at once (kvtool.layers.sampler.draw_rows, what `sample`
runs on a GPU) against the row-by-row draws (`draw`, a host sync each, what a GPU's steps ran before),
on random logits of a large vocabulary, at a few batch sizes and samplings. Times are host wall time
until the tokens are on the host (each path syncs), medians of --reps calls after --warmup.

    python bench/gpu_sampler.py --output out/gpu_sampler [--device cuda] [--vocab_size 151936]

`make gpu-check`'s bench step runs it; on a CPU (--device cpu) it runs too, for a check of the script.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_reports import write_rows_csv

from kvtool.config import SamplingParams
from kvtool.layers.sampler import draw, draw_rows

SAMPLINGS = {
    "temperature 1.0": SamplingParams(temperature=1.0),
    "top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
}


class SamplerRow(NamedTuple):
    sampling: str
    num_rows: int
    rows_at_once_us: float
    row_by_row_us: float
    speedup: float


def median_us(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab_size", type=int, default=151_936, help="Qwen3's by default")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, params in SAMPLINGS.items():
        for num_rows in args.batch_sizes:
            logits = (torch.randn(num_rows, args.vocab_size, generator=generator) * 4).to(device)
            uniforms = torch.rand(num_rows, dtype=torch.float64, generator=generator).numpy()
            step_params = [params] * num_rows
            at_once = draw_rows(logits, step_params, uniforms).tolist()
            one_by_one = [draw(row, params, float(u)) for row, u in zip(logits, uniforms)]
            # The same tokens both ways (but where rounding puts a number at the edge of two tokens).
            mismatches = sum(a != b for a, b in zip(at_once, one_by_one))
            if mismatches > max(1, num_rows // 16):
                raise SystemExit(f"{name}, {num_rows} rows: {mismatches} draws differ between the two paths")
            rows_us = median_us(lambda: draw_rows(logits, step_params, uniforms).tolist(), args.reps, args.warmup)
            loop_us = median_us(lambda: [draw(row, params, float(u)) for row, u in zip(logits, uniforms)],
                                args.reps, args.warmup)
            rows.append(SamplerRow(name, num_rows, round(rows_us, 1), round(loop_us, 1), round(loop_us / rows_us, 2)))
            print(f"{name:>16}, {num_rows:3d} rows: at once {rows_us:9.1f} us, row by row {loop_us:9.1f} us "
                  f"({loop_us / rows_us:.2f}x)", flush=True)
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "vocab_size": str(args.vocab_size), "torch": torch.__version__}
    write_rows_csv(args.output / "gpu_sampler.csv", rows, header)
    lines = [f"# The sampler on {header['device']}: a step's rows drawn at once vs row by row",
             "", f"Random logits, vocabulary {args.vocab_size:,}; host us until the tokens are on the host, "
             f"medians of {args.reps} calls.", "",
             "| sampling | rows | at once (us) | row by row (us) | row by row / at once |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.sampling} | {r.num_rows} | {r.rows_at_once_us:,.1f} | {r.row_by_row_us:,.1f} | {r.speedup:.2f}x |"
              for r in rows]
    (args.output / "gpu_sampler.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output / 'gpu_sampler.md'}")


if __name__ == "__main__":
    main()
