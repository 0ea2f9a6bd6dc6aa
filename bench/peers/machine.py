"""Which CPU a peers run ran on: its model name, family and model numbers, cores and vector
instruction sets (read from /proc/cpuinfo, never assumed), and the kind its results are filed under
(results/peers/<kind>/).

Pure Python: the peers' own venvs import it too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Best first: the first level whose flags the CPU has names its instruction set.
ISA_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("amx", frozenset({"avx512f", "amx_tile", "amx_bf16"})),
    ("avx512-bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})),
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl"})),
    ("avx2", frozenset({"avx2", "fma"})),
)
ISA_NAMES = {"amx": "AMX (with AVX-512 and AVX512-BF16)", "avx512-bf16": "AVX-512 with AVX512-BF16, no AMX",
             "avx512": "AVX-512, no AVX512-BF16, no AMX", "avx2": "AVX2, no AVX-512", "baseline": "no AVX2"}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    num_cores: int
    flags: frozenset[str]
    # cpuinfo's "cpu family" and "model" (None where it has none): a VM's model name may hide the
    # generation ("AMD EPYC" for a Zen 4 and a Zen 5 alike), whose vector units differ (a Zen 4 runs
    # AVX-512 on 256-bit halves), and so does the speed of the same kernels.
    family: int | None = None
    model_number: int | None = None

    @property
    def isa(self) -> str:
        """'amx', 'avx512-bf16', 'avx512', 'avx2' or 'baseline'."""
        return next((name for name, needed in ISA_LEVELS if needed <= self.flags), "baseline")

    @property
    def generation(self) -> str:
        """'f25m17' (cpu family 25, model 17), or '' where cpuinfo gives neither."""
        if self.family is None or self.model_number is None:
            return ""
        return f"f{self.family}m{self.model_number}"

    @property
    def kind(self) -> str:
        """The model, its family and model numbers and the instruction set, as a directory name:
        'amd-epyc-f25m17-avx512-bf16'."""
        model = re.sub(r"\(r\)|\(tm\)|cpu @.*|processor|\d+-core", "", self.model.lower())
        slug = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "cpu"
        return "-".join(part for part in (slug, self.generation, self.isa) if part)

    def describe(self) -> str:
        """'AMD EPYC (family 25, model 17; 2 cores): AVX-512 with AVX512-BF16, no AMX'."""
        numbers = f"family {self.family}, model {self.model_number}; " if self.generation else ""
        return f"{self.model} ({numbers}{self.num_cores} cores): {ISA_NAMES[self.isa]}"

    def as_row(self) -> dict[str, object]:
        return {"cpu_model": self.model, "cpu_family": self.family, "cpu_model_number": self.model_number,
                "cpu_cores": self.num_cores, "cpu_isa": self.isa, "cpu_kind": self.kind,
                "cpu_flags": " ".join(sorted(f for f in self.flags if f.startswith(("avx", "amx", "fma"))))}


def read_cpu_info(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model name, family and model numbers and flags; ValueError when the file
    has no model name or flags."""
    fields: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends here
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields or "flags" not in fields:
        raise ValueError(f"{path} names no CPU model or flags: cannot tell which instruction sets ran")

    def number(key: str) -> int | None:
        return int(fields[key]) if fields.get(key, "").isdigit() else None

    return CpuInfo(fields["model name"], os.cpu_count() or 1, frozenset(fields["flags"].split()),
                   number("cpu family"), number("model"))
