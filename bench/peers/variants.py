"""What bench/peers/run.py runs: each variant is an engine, its cache setting, a dtype and a load
(sequential; N requests in flight; a Poisson schedule), and the command that replays it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# vLLM's CPU backend, as its start-up advice asks: threads pinned to the cores, tcmalloc + Intel OpenMP.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
CONCURRENCY = 8
LOADS = ("sequential", "concurrency", "poisson")


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str
    reuse: bool
    args: tuple[str, ...]
    dtype: str = "float32"
    load: str = "sequential"  # one of LOADS

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")


def _variants() -> tuple[Variant, ...]:
    kvtool = {True: ("--reuse", "on"), False: ("--reuse", "off")}
    vllm = {True: ("--prefix_caching", "on"), False: ("--prefix_caching", "off")}
    variants = [
        Variant("kvtool reuse-on", "kvtool", True, kvtool[True]),
        Variant("kvtool reuse-off", "kvtool", False, kvtool[False]),
        Variant("kvtool reuse-on no-partial", "kvtool", True, (*kvtool[True], "--partial_reuse", "off")),
        Variant("vllm reuse-on", "vllm", True, vllm[True]),
        Variant("vllm reuse-off", "vllm", False, vllm[False]),
        Variant("transformers copied-prefix", "transformers", True, ("--prefix_cache", "copy")),
        Variant("transformers no-cache", "transformers", False, ("--prefix_cache", "off")),
    ]
    for engine, flags in (("kvtool", kvtool), ("vllm", vllm)):
        variants.append(Variant(f"{engine} reuse-on c{CONCURRENCY}", engine, True, flags[True], load="concurrency"))
        variants.append(Variant(f"{engine} reuse-on poisson", engine, True, flags[True], load="poisson"))
    for engine, flags in (("kvtool", kvtool), ("vllm", vllm)):
        for reuse in (True, False):
            variants.append(Variant(f"{engine} bf16 reuse-{'on' if reuse else 'off'}", engine, reuse, flags[reuse],
                                    dtype="bfloat16"))
        variants.append(Variant(f"{engine} bf16 reuse-on c{CONCURRENCY}", engine, True, flags[True], dtype="bfloat16",
                                load="concurrency"))
    return tuple(variants)


VARIANTS = _variants()


def selected(engines: set[str], loads: set[str], dtypes: set[str]) -> list[Variant]:
    return [v for v in VARIANTS if v.engine in engines and v.load in loads and v.dtype in dtypes]


def command(variant: Variant, *, plans: dict[str, Path], checkpoint: Path, datasets: dict[str, Path], output: Path,
            peer_python: str, tokens_per_block: int, head_dim: int) -> list[str]:
    """The replay command: plans by dtype, datasets by load ('poisson': with arrival times)."""
    dataset = datasets["poisson" if variant.load == "poisson" else "fixed"]
    concurrency = {"sequential": 1, "concurrency": CONCURRENCY, "poisson": 0}[variant.load]
    common = ["--dataset", str(dataset), "--output", str(output), "--label", variant.name,
              "--concurrency", str(concurrency), *variant.args]
    if variant.engine == "kvtool":
        return [sys.executable, str(HERE / "kvtool_replay.py"), "--plan", str(plans[variant.dtype]), *common]
    if variant.engine == "vllm":
        return [peer_python, str(HERE / "vllm_replay.py"), "--model", str(checkpoint), "--dtype", variant.dtype,
                "--block_size", str(tokens_per_block), "--head_dim", str(head_dim), *common]
    return [sys.executable, str(HERE / "transformers_replay.py"), "--model", str(checkpoint), *common]


def environment(variant: Variant, peer_python: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    if variant.engine == "vllm":
        # The venv's own lib/ (not the interpreter's: bin/python is a link out of the venv).
        iomp = Path(peer_python).absolute().parent.parent / "lib" / "libiomp5.so"
        env.update(VLLM_ENV, LD_PRELOAD=":".join(str(p) for p in (TCMALLOC, iomp) if Path(p).is_file()))
    return env
