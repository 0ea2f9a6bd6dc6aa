"""Plans: `kvtool build` output (plan.json + weights.safetensors + tokenizer) and how to load them."""

from __future__ import annotations

import importlib

__all__ = ["BuildOptions", "FORMAT_VERSION", "Plan", "build_plan", "default_cache_dir", "is_built_plan", "load_plan",
           "resolve_model"]

# Each name is imported from its module when first asked for: building and loading need torch, which
# takes seconds to import, and the CLI imports kvtool.plan.build_options before it knows what it will run.
_MODULES = {"BuildOptions": "build_options", "FORMAT_VERSION": "format", "Plan": "load", "build_plan": "builder",
            "default_cache_dir": "cache", "is_built_plan": "load", "load_plan": "load", "resolve_model": "load"}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'kvtool.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtool.plan.{_MODULES[name]}"), name)
