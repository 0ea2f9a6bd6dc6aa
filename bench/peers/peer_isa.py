"""vLLM's CPU kernels held to the instruction set a run is limited to (bench/peers/run.py --isa).

run.py limits torch's and oneDNN's own code by ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, but vLLM
picks its compiled kernels (_C with AVX512-BF16 and AMX, _C_AVX512, _C_AVX2) and its attention ISA
('amx', 'vec') from torch.cpu's CPU feature queries, which read the CPU itself: on an AVX-512 machine
run as AVX2, vLLM kept its AVX-512 kernels, and the stand-in compared kvtool's AVX2 code with vLLM's
AVX-512 attention. Called before vLLM is imported (in the replay process and in the engine processes
vLLM starts, which import the replay script again), the queries answer as a CPU with only
ONEDNN_MAX_CPU_ISA's instruction set would, so vLLM loads the build it loads on such a CPU.
"""

from __future__ import annotations

import os

# ONEDNN_MAX_CPU_ISA (run.py's LIBRARY_ISA) -> the torch.cpu queries that answer False under it.
_ABOVE_AVX2 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
HIDDEN_FEATURES = {"SSE41": _ABOVE_AVX2, "AVX2": _ABOVE_AVX2, "AVX512_CORE": _ABOVE_AVX2[1:],
                   "AVX512_CORE_BF16": _ABOVE_AVX2[2:]}


def limit_torch_cpu_queries() -> tuple[str, ...]:
    """Makes torch.cpu's feature queries above ONEDNN_MAX_CPU_ISA answer False (none when it is unset);
    returns the queries changed."""
    hidden = HIDDEN_FEATURES.get(os.environ.get("ONEDNN_MAX_CPU_ISA", ""), ())
    if hidden:
        import torch

        for name in hidden:
            setattr(torch.cpu, name, lambda: False)
    return hidden


def loaded_vllm_kernels() -> str | None:
    """The file name of vLLM's compiled kernels mapped into this process, e.g. '_C_AVX2.abi3.so'."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/vllm/_C" in path:
                return os.path.basename(path)
    return None
