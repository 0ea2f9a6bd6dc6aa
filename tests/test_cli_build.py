"""`kvtool build` on the command line: builds plans from presets and checkpoints with either flag
spelling; user mistakes are one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import pickle
import shutil

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.plan import load_plan

runner = CliRunner()


def build(*args: str):
    return runner.invoke(app, ["build", *args])


def test_build_preset_with_underscore_flags(tmp_path):
    result = build("--model", "preset:tiny-llama", "--output", str(tmp_path / "plan"), "--tokens_per_block", "16",
                   "--max_batch_size", "4", "--max_seq_len", "512", "--max_num_tokens", "256",
                   "--use_paged_context_fmha", "disable", "--dtype", "bfloat16", "--kv_cache_dtype", "float16")
    assert result.exit_code == 0, result.output
    assert "tiny-llama" in result.output and "KV reuse not possible" in result.output
    options = load_plan(tmp_path / "plan").build_options
    assert (options.tokens_per_block, options.max_batch_size, options.max_seq_len, options.max_num_tokens) == \
        (16, 4, 512, 256)
    assert not options.use_paged_context_fmha
    assert (options.dtype, options.kv_cache_dtype) == ("bfloat16", "float16")


def test_build_checkpoint_with_dash_flags(hf_checkpoint, tmp_path):
    result = build("--model", str(hf_checkpoint("qwen3_qk_norm").path), "--output", str(tmp_path / "plan"),
                   "--tokens-per-block", "64", "--max-batch-size", "2", "--max-seq-len", "256",
                   "--max-num-tokens", "128", "--use-paged-context-fmha", "enable", "--kv-cache-dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan")
    assert plan.model_config.family == "qwen3" and plan.model_config.qk_norm
    options = plan.build_options
    assert (options.tokens_per_block, options.max_batch_size, options.max_seq_len, options.max_num_tokens) == \
        (64, 2, 256, 128)
    assert options.use_paged_context_fmha and (options.dtype, options.kv_cache_dtype) == ("float32", "bfloat16")


def _pickled_checkpoint(path, config_json):
    path.mkdir()
    shutil.copy(config_json, path / "config.json")
    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": 1}))
    return path


@pytest.mark.parametrize("case,args,message", [
    ("unknown preset", ["--model", "preset:nope"], "unknown preset 'nope'"),
    ("block size", ["--model", "preset:tiny-llama", "--tokens_per_block", "48"], "power of 2"),
    ("missing dir", ["--model", "/definitely/not/here"], "is not a directory"),
    ("pickled weights", ["--model", "{pickled}"], "never unpickles weights"),
    ("too long", ["--model", "preset:tiny-llama", "--max_seq_len", "100000"], "max_position_embeddings"),
    ("incomplete config", ["--model", "{incomplete}"], "config.json lacks"),
])
def test_user_errors_exit_2_with_one_line_and_no_traceback(hf_checkpoint, tmp_path, case, args, message):
    pickled = _pickled_checkpoint(tmp_path / "pickled", hf_checkpoint("llama_mha_tied_bias").path / "config.json")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text('{"model_type": "llama"}')
    args = [a.replace("{incomplete}", str(incomplete)) for a in args]
    args = [a.replace("{pickled}", str(pickled)) for a in args]
    result = build(*args, "--output", str(tmp_path / "plan"))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().startswith("Error:")
    assert not (tmp_path / "plan").exists()
