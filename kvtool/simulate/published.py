"""Cost models estimated from a device's published peak figures, for hardware not at hand. Always
labelled estimated: they assume the efficiencies below, which a calibration on the device replaces.

Per step: the weights are read once (memory bound) plus a fixed launch cost per layer; a context
token costs 2 FLOPs per weight (compute bound); an attended query-key pair 4 FLOPs per head
dimension per head per layer; a cached token a context chunk reads its KV; a one-token row 2 FLOPs per weight plus reading its KV; a sampled
row the LM head's FLOPs; a copied byte crosses PCIe.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass

from kvtool.simulate.cost_model import CostModel

COMPUTE_EFFICIENCY = 0.6     # of peak dense FLOP/s reached by large GEMMs and attention
MEMORY_EFFICIENCY = 0.8      # of peak HBM bandwidth reached by streaming reads
PCIE_EFFICIENCY = 0.8        # of the link's bandwidth reached by pinned block copies
LAUNCH_SECONDS_PER_LAYER = 40e-6  # kernel launches and host work per decoder layer and step
MEMORY_FOR_KV_FRACTION = 0.9      # of device memory left to the KV pool after the weights (TensorRT-LLM's default)


@dataclass(frozen=True)
class DeviceSpec:
    """Published figures (vendor datasheets, dense, without sparsity)."""

    name: str
    bf16_flops: float        # FLOP/s, dense tensor cores
    fp32_flops: float        # FLOP/s, without TF32 (torch's default for float32 matmuls)
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    pcie_bandwidth: float    # bytes/s, one direction


DEVICES = {
    "h100": DeviceSpec("NVIDIA H100 SXM5 80GB", 989e12, 67e12, 3.35e12, 80 * 10**9, 64e9),
    "h200": DeviceSpec("NVIDIA H200 SXM 141GB", 989e12, 67e12, 4.8e12, 141 * 10**9, 64e9),
    "l40s": DeviceSpec("NVIDIA L40S 48GB", 362e12, 91.6e12, 0.864e12, 48 * 10**9, 32e9),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 2.039e12, 80 * 10**9, 32e9),
}


def estimate(plan, device: str) -> CostModel:
    """The estimated cost model of ``plan`` (its shapes and dtype) on a device of DEVICES."""
    spec = DEVICES[device]
    config = plan.model_config
    dtype_bytes = 4 if str(plan.build_options.dtype) in ("float32", "torch.float32") else 2
    flops = (spec.fp32_flops if dtype_bytes == 4 else spec.bf16_flops) * COMPUTE_EFFICIENCY
    bandwidth = spec.memory_bandwidth * MEMORY_EFFICIENCY
    hidden, layers = config.hidden_size, config.num_layers
    layer_weights = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden + 3 * hidden * config.intermediate_size
    lm_head = hidden * config.vocab_size
    weight_bytes = (layers * layer_weights + 2 * lm_head) * dtype_bytes  # + the embedding table
    kv_bytes_per_token = 2 * layers * config.kv_size * dtype_bytes
    sampled_row = 2 * lm_head / flops
    coefficients = {
        "step": weight_bytes / bandwidth + layers * LAUNCH_SECONDS_PER_LAYER,
        "context_row": sampled_row,
        "context_token": 2 * layers * layer_weights / flops,
        "context_cached_token": kv_bytes_per_token / bandwidth,
        "context_pair": 4 * config.num_heads * config.head_dim * layers / flops,
        "decode_row": 2 * layers * layer_weights / flops + sampled_row,
        "decode_kv_token": kv_bytes_per_token / bandwidth,
        "copied_byte": 1 / (spec.pcie_bandwidth * PCIE_EFFICIENCY),
    }
    free_bytes = int(spec.memory_bytes * MEMORY_FOR_KV_FRACTION) - weight_bytes
    return CostModel(
        device=f"cuda: {spec.name}", coefficients=coefficients, estimated=True,
        source=(f"estimated from published figures of the {spec.name} (compute {COMPUTE_EFFICIENCY:.0%}, memory "
                f"{MEMORY_EFFICIENCY:.0%}, PCIe {PCIE_EFFICIENCY:.0%} of peak assumed)"),
        plan_digest=plan.manifest.get("plan_digest"),
        created_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        details={"published": asdict(spec), "weight_bytes": weight_bytes, "free_memory_bytes": max(free_bytes, 0),
                 "compute_efficiency": COMPUTE_EFFICIENCY, "memory_efficiency": MEMORY_EFFICIENCY,
                 "pcie_efficiency": PCIE_EFFICIENCY, "launch_seconds_per_layer": LAUNCH_SECONDS_PER_LAYER})
