"""Which device the runtime runs on, how much memory it has, and how to name it in reports."""

from __future__ import annotations

import os
import platform

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype() -> str:
    """The dtype of a model built on the fly without a dtype asked for: bfloat16 where a GPU runs it
    (kvtool's CUDA kernels take 16-bit KV caches, and real checkpoints ship in bfloat16), float32 on
    a CPU (the CPU runtime's fast path)."""
    return "bfloat16" if torch.cuda.is_available() else "float32"


def available_host_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def free_device_memory_bytes(device: torch.device) -> int:
    """Memory free on the device now (after the weights are loaded)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_host_memory_bytes()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_description() -> str:
    """The host CPU and its core count, e.g. 'AMD EPYC ... (2 cores)'."""
    return f"{_cpu_model()} ({os.cpu_count()} cores)"


def describe_device(device: torch.device) -> str:
    """One line naming the device, e.g. 'cuda: NVIDIA H100 80GB HBM3' or 'cpu: <model> (2 cores)'."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {host_description()}"
