"""`--help` reads at 80 columns: every flag name whole, TensorRT-LLM's underscore spelling listed once,
bench's options grouped; the dash spelling still works."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import app

cli = CliRunner()


def commands(group=None, path=()):
    """(argv path, command) of every leaf command."""
    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


ALL_COMMANDS = sorted(commands())


def help_text(path, columns=80) -> str:
    result = cli.invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path, command", ALL_COMMANDS, ids=[" ".join(p) for p, _ in ALL_COMMANDS])
def test_every_flag_is_listed_whole_and_once_at_80_columns(path, command):
    text = help_text(path)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for param in command.params:
        for opt in getattr(param, "opts", []):
            if opt.startswith("--"):
                assert re.search(re.escape(opt) + r"(?![\w-])", text), f"{opt} missing from `{' '.join(path)} --help`"
    # The dash spelling is accepted, not listed (only the note at the end shows one).
    listed = re.findall(r"--[a-z]+(?:-[a-z]+)+", text)
    assert set(listed) <= {"--tokens-per-block"}


def panel_of(text: str, flag: str) -> str:
    title = None
    for line in text.splitlines():
        found = re.match(r"╭─ (.+?) ─", line)
        if found:
            title = found.group(1)
        elif re.search(re.escape(flag) + r"(?![\w-])", line):
            return title
    raise AssertionError(f"{flag} not in the help")


def test_bench_options_are_grouped():
    text = help_text(("bench",))
    expected = {"--plan": "Model and plan", "--model": "Model and plan", "--tokens_per_block": "Model and plan",
                "--enable_kv_cache_reuse": "KV cache", "--kv_host_cache_bytes": "KV cache",
                "--max_tokens_in_paged_kv_cache": "KV cache", "--kv_cache_free_gpu_mem_fraction": "KV cache",
                "--scheduler_policy": "Scheduler", "--max_batch_size": "Scheduler", "--enable_chunked_context":
                "Scheduler", "--dataset": "Workload", "--concurrency": "Workload", "--warmup": "Workload",
                "--output": "Output", "--label": "Output"}
    assert {flag: panel_of(text, flag) for flag in expected} == expected


def test_wide_terminals_cut_nothing_either():
    for path, _ in ALL_COMMANDS:
        assert "…" not in help_text(path, columns=200)


def test_on_off_pairs_that_contradict_are_refused(tmp_path):
    result = cli.invoke(app, ["bench", "--model", "preset:x", "--dataset", str(tmp_path / "d.jsonl"),
                              "--enable-kv-cache-reuse", "--disable_kv_cache_reuse"])
    assert result.exit_code == 2
    assert "--enable_kv_cache_reuse and --disable_kv_cache_reuse contradict each other" in result.output


def test_dash_spellings_of_build_flags_still_work(tmp_path):
    result = cli.invoke(app, ["build", "--model", "preset:tiny-llama", "--output-dir", str(tmp_path / "p"),
                              "--tokens-per-block", "16", "--max-seq-len", "64", "--no-compile-kernels"])
    assert result.exit_code == 0, result.output
    assert "16 tokens per block" in result.output


HEAVY_MODULES = ("torch", "transformers", "pandas", "matplotlib", "fastapi", "uvicorn", "httpx", "safetensors")


def test_help_loads_no_heavy_module():
    """`kvtool --help` and every command's --help answer without importing torch and the like (seconds of
    imports): the CLI imports them where a command runs, not where it is declared."""
    import subprocess
    import sys

    script = ("import sys\nfrom typer.testing import CliRunner\nfrom kvtool.cli import app\n"
              f"paths = {[list(path) for path, _ in ALL_COMMANDS]!r}\n"
              "for args in [[]] + paths:\n"
              "    result = CliRunner().invoke(app, [*args, '--help'])\n"
              "    assert result.exit_code == 0, (args, result.output)\n"
              f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"--help imported {loaded.strip()}"
