"""The plan cache: the suite builds outside the user's cache; `kvtool plans` lists and removes entries."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.kernels.compiler import default_cache_dir as kernel_cache_dir
from kvtool.plan import BuildOptions, default_cache_dir, resolve_model

cli = CliRunner()


def invoke(*args):
    result = cli.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_suite_never_builds_into_the_users_caches(tmp_path_factory):
    session_tmp = tmp_path_factory.getbasetemp()
    for cache in (default_cache_dir(), kernel_cache_dir()):
        assert session_tmp in cache.parents
        assert Path.home() / ".cache" not in cache.parents


def test_plans_lists_sources_and_sizes_and_removes_them(tmp_path, hf_checkpoint):
    cache = tmp_path / "cache"
    preset = resolve_model("preset:tiny-llama", options=BuildOptions(tokens_per_block=16, max_seq_len=64),
                           cache_dir=cache)
    checkpoint = resolve_model(str(hf_checkpoint("qwen3_qk_norm").path), options=BuildOptions(max_seq_len=64),
                               cache_dir=cache)
    (cache / f".{'a' * 24}.building-x").mkdir()  # what an interrupted build leaves
    listing = invoke("plans", "list", "--plan_cache_dir", cache)
    assert preset.path.name[:12] in listing and checkpoint.path.name[:12] in listing
    assert "preset:tiny-llama (seed 0)" in listing and str(hf_checkpoint("qwen3_qk_norm").path) in listing
    assert "interrupted" in listing and "3 plans" in listing
    size_mib = sum(f.stat().st_size for f in preset.path.rglob("*") if f.is_file()) / (1 << 20)
    assert f"{size_mib:,.1f} MiB" in listing

    removed = invoke("plans", "remove", preset.path.name[:8], "--plan-cache-dir", cache)
    assert f"removed {preset.path.name}" in removed and not preset.path.exists() and checkpoint.path.exists()
    invoke("plans", "remove", "--all", "--plan_cache_dir", cache)
    assert os.listdir(cache) == []
    assert "no cached plans" in invoke("plans", "list", "--plan_cache_dir", cache)


def test_plans_alone_lists_the_default_cache():
    assert f"in {default_cache_dir()}" in " ".join(invoke("plans").split())


def test_removing_an_unknown_or_ambiguous_id_is_a_clear_error(tmp_path):
    result = cli.invoke(app, ["plans", "remove", "beef", "--plan_cache_dir", str(tmp_path)])
    assert result.exit_code == 2 and "no cached plan" in result.output and "start with 'beef'" in result.output
    result = cli.invoke(app, ["plans", "remove", "--plan_cache_dir", str(tmp_path)])
    assert result.exit_code == 2 and "or --all" in result.output
