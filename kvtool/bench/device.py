"""Describe the machine a bench ran on, for the summary row (results are only comparable on the same one)."""

from __future__ import annotations

import os
import platform


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
    """The host CPU and its core count, e.g. 'Intel Xeon ... (16 cores)'."""
    return f"{_cpu_model()} ({os.cpu_count()} cores)"


def describe_device(llm=None) -> dict[str, str]:
    """Columns naming the device: 'device' (the engine's own description when an LLM is given), 'host'
    (CPU model and cores, which matter for the CPU path and for host offloading) and 'torch'."""
    if llm is not None and getattr(llm, "device_description", None):
        device = str(llm.device_description)
    else:
        device = f"cpu: {host_description()}"
    columns = {"device": device, "host": host_description()}
    try:
        import torch  # already imported by the engine; only its version is read here

        columns["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return columns
