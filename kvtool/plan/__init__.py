"""Plans: `kvtool build` output (plan.json + weights.safetensors + tokenizer) and how to load them."""

from kvtool.plan.build import build_plan
from kvtool.plan.cache import default_cache_dir
from kvtool.plan.format import FORMAT_VERSION
from kvtool.plan.load import Plan, is_built_plan, load_plan, resolve_model
from kvtool.plan.options import BuildOptions

__all__ = ["BuildOptions", "FORMAT_VERSION", "Plan", "build_plan", "default_cache_dir", "is_built_plan", "load_plan",
           "resolve_model"]
