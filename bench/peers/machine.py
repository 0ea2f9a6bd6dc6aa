"""Which CPU a peers run ran on: its model name, cores and vector instruction sets (read from
/proc/cpuinfo, never assumed), and the kind its results are filed under (results/peers/<kind>/).

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

    @property
    def isa(self) -> str:
        """'amx', 'avx512-bf16', 'avx512', 'avx2' or 'baseline'."""
        return next((name for name, needed in ISA_LEVELS if needed <= self.flags), "baseline")

    @property
    def kind(self) -> str:
        """The model and the instruction set, as a directory name: 'amd-epyc-avx512-bf16'."""
        model = re.sub(r"\(r\)|\(tm\)|cpu @.*|processor|\d+-core", "", self.model.lower())
        slug = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "cpu"
        return f"{slug}-{self.isa}"

    def describe(self) -> str:
        """'AMD EPYC (2 cores): AVX-512 with AVX512-BF16, no AMX'."""
        return f"{self.model} ({self.num_cores} cores): {ISA_NAMES[self.isa]}"

    def as_row(self) -> dict[str, object]:
        return {"cpu_model": self.model, "cpu_cores": self.num_cores, "cpu_isa": self.isa, "cpu_kind": self.kind,
                "cpu_flags": " ".join(sorted(f for f in self.flags if f.startswith(("avx", "amx", "fma"))))}


def read_cpu_info(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model name and flags; ValueError when the file has neither."""
    model, flags = None, None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
    if model is None or flags is None:
        raise ValueError(f"{path} names no CPU model or flags: cannot tell which instruction sets ran")
    return CpuInfo(model, os.cpu_count() or 1, flags)
