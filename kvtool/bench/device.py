"""Describe the machine a bench ran on, for the summary row (results are only comparable on the same one)."""

from __future__ import annotations

import torch

from kvtool.runtime.device import host_description


def device_columns(llm=None) -> dict[str, str]:
    """Columns naming the device: 'device' (the engine's own description when an LLM is given), 'host'
    (CPU model and cores, which matter for the CPU path and for host offloading) and 'torch'."""
    if llm is not None and getattr(llm, "device_description", None):
        device = str(llm.device_description)
    else:
        device = f"cpu: {host_description()}"
    return {"device": device, "host": host_description(), "torch": torch.__version__}
