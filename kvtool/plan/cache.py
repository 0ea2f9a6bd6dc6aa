"""The plan cache: where models given as a checkpoint or ``preset:NAME`` are built on the fly
(kvtool.plan.resolve_model), one directory per source and build options. Listed and emptied by
`kvtool plans`."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.plan.format import PLAN_FILE

BUILDING_MARK = ".building-"  # staging directories of builds in progress (or interrupted)


def default_cache_dir() -> Path:
    """Where plans built on the fly live: $KVTOOL_CACHE_DIR, else ~/.cache/kvtool/plans."""
    configured = os.environ.get("KVTOOL_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kvtool" / "plans"


@dataclass(frozen=True)
class CachedPlan:
    """One entry of the cache: a plan, or what an interrupted build left (``complete=False``)."""

    plan_id: str                 # the directory name
    path: Path
    source: str                  # 'preset:tiny-llama (seed 0)', a checkpoint path, or '?'
    tokens_per_block: int | None
    dtype: str | None
    size_bytes: int
    created_at: str
    complete: bool


def _size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def _describe(path: Path) -> CachedPlan:
    try:
        manifest = json.loads((path / PLAN_FILE).read_text())
        source, options = manifest.get("source") or {}, manifest.get("build_options") or {}
        if source.get("kind") == "preset":
            origin = f"preset:{source.get('name')} (seed {source.get('seed')})"
        else:
            origin = str(source.get("path", "?"))
        return CachedPlan(path.name, path, origin, options.get("tokens_per_block"), options.get("dtype"),
                          _size(path), str(manifest.get("created_at", "")), complete=True)
    except (OSError, ValueError, AttributeError):
        return CachedPlan(path.name, path, "? (interrupted or unreadable build)", None, None, _size(path), "",
                          complete=False)


def cached_plans(cache_dir: Path | None = None) -> list[CachedPlan]:
    """Every entry of the cache, oldest first (an absent cache is empty)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    if not cache_dir.is_dir():
        return []
    entries = [_describe(path) for path in cache_dir.iterdir()
               if path.is_dir() and ((path / PLAN_FILE).is_file() or BUILDING_MARK in path.name)]
    return sorted(entries, key=lambda entry: (entry.created_at, entry.plan_id))


def select_cached_plans(cache_dir: Path | None, plan_ids: list[str]) -> list[CachedPlan]:
    """The entries named by ids or unique id prefixes (as `kvtool plans list` shows them)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    entries = cached_plans(cache_dir)
    chosen: list[CachedPlan] = []
    for wanted in plan_ids:
        matches = [entry for entry in entries if entry.plan_id.startswith(wanted)]
        if len(matches) != 1:
            what = "no cached plan" if not matches else f"{len(matches)} cached plans"
            raise KvtoolError(f"{what} in {cache_dir} start with {wanted!r}: give an id from `kvtool plans list`")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def remove_cached_plan(entry: CachedPlan) -> None:
    shutil.rmtree(entry.path)
