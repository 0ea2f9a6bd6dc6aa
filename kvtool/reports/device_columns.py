"""Describe the machine a bench ran on, for the summary row (results are only comparable on the same one)."""

from __future__ import annotations


def device_columns(device_description: str) -> dict[str, str]:
    """Columns naming the device: 'device' (the LLM's description of it), 'host' (CPU model and cores,
    which matter for the CPU path and for host offloading) and 'torch'."""
    # Imported when a run reports, not when the CLI starts: torch takes seconds to import (kvtool --help).
    import torch

    from kvtool.runtime.device import host_description

    return {"device": device_description, "host": host_description(), "torch": torch.__version__}
