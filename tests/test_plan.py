"""Plans: what `build_plan` writes is what `load_plan` gives back, and anything tampered with,
truncated or from another format version is refused with advice to rebuild."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvtool.errors import PlanError
from kvtool.layers.attention import TorchPagedAttention
from kvtool.models.model_config import weight_shapes
from kvtool.models.presets import preset_config
from kvtool.plan import FORMAT_VERSION, BuildOptions, build_plan, load_plan, resolve_model
from kvtool.plan.format import write_manifest


@pytest.fixture
def plan_copy(tiny_llama_plan, tmp_path):
    """A private copy of the tiny-llama plan that a test may damage."""
    return shutil.copytree(tiny_llama_plan, tmp_path / "plan")


def test_preset_plan_round_trip(tiny_llama_plan):
    plan = load_plan(tiny_llama_plan)
    assert plan.model_config == preset_config("tiny-llama")
    assert plan.build_options == BuildOptions(tokens_per_block=16, max_seq_len=1024, kv_cache_dtype="float32")
    assert plan.manifest["format_version"] == FORMAT_VERSION
    assert plan.manifest["kernel_artifacts"] == []
    # The file is plain safetensors: an independent reader sees exactly the config's tensors.
    with safe_open(str(plan.weights_path), framework="pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == weight_shapes(plan.model_config)
    model = plan.load_model("cpu", TorchPagedAttention())
    on_disk = load_file(str(plan.weights_path))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, on_disk[name]), name
    assert plan.tokenizer.decode(plan.tokenizer.encode("hello, plan")) == "hello, plan"


def test_preset_weights_are_seeded(tmp_path):
    def checksum(seed: int, name: str) -> str:
        return load_plan(build_plan("preset:tiny-qwen3", tmp_path / name, BuildOptions(seed=seed))).manifest[
            "weights"]["checksum"]

    assert checksum(0, "a") == checksum(0, "b")
    assert checksum(0, "a") != checksum(1, "c")


def test_default_max_seq_len_is_capped_at_4096_and_by_the_model(tmp_path):
    plan = load_plan(build_plan("preset:small-llama", tmp_path / "p", BuildOptions()))
    assert plan.build_options.max_seq_len == 4096
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_plan("preset:tiny-llama", tmp_path / "q", BuildOptions(max_seq_len=8192))


def test_half_precision_plan_stores_and_loads_in_that_dtype(tmp_path):
    plan = load_plan(build_plan("preset:tiny-llama", tmp_path / "p",
                                BuildOptions(dtype="bfloat16", kv_cache_dtype="float16")))
    assert plan.dtype == torch.bfloat16 and plan.kv_cache_dtype == torch.float16
    model = plan.load_model("cpu", TorchPagedAttention())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert plan.load_model("cpu", TorchPagedAttention(), dtype=torch.float32).norm.weight.dtype == torch.float32


def test_checkpoint_plan_fuses_qkv_and_gate_up(hf_checkpoint, plan_from_checkpoint):
    hf = hf_checkpoint("qwen2_qkv_bias_tied").model.state_dict()
    plan = load_plan(plan_from_checkpoint("qwen2_qkv_bias_tied"))
    weights = load_file(str(plan.weights_path))
    layer = "model.layers.1."
    assert torch.equal(weights["layers.1.attention.qkv_proj.weight"], torch.cat(
        [hf[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(weights["layers.1.attention.qkv_proj.bias"], torch.cat(
        [hf[layer + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(weights["layers.1.mlp.gate_up_proj.weight"], torch.cat(
        [hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]]))
    assert "lm_head.weight" not in weights  # tied: the embedding is the LM head
    assert plan.source["kind"] == "checkpoint"
    assert plan.manifest["tokenizer"]["kind"] == "byte_level"  # the checkpoint has no tokenizer


def test_generation_config_eos_ids_join_the_model_eos(hf_checkpoint, tmp_path):
    checkpoint = shutil.copytree(hf_checkpoint("llama_llama3_rope_gqa").path, tmp_path / "ckpt")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    plan = load_plan(build_plan(str(checkpoint), tmp_path / "plan", BuildOptions()))
    assert plan.model_config.eos_token_ids == [2, 7, 9]
    assert plan.tokenizer.eos_token_ids == [2, 7, 9]


def test_pickled_only_checkpoint_is_refused_without_unpickling(hf_checkpoint, tmp_path):
    checkpoint = tmp_path / "pickled"
    checkpoint.mkdir()
    shutil.copy(hf_checkpoint("llama_llama3_rope_gqa").path / "config.json", checkpoint)
    marker = tmp_path / "unpickled"
    # Unpickling this file would create `marker`.
    (checkpoint / "pytorch_model.bin").write_bytes(pickle.dumps(_TouchOnUnpickle(str(marker))))
    with pytest.raises(PlanError, match="never unpickles"):
        build_plan(str(checkpoint), tmp_path / "plan", BuildOptions())
    assert not marker.exists()
    assert not (tmp_path / "plan").exists()


class _TouchOnUnpickle:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_build_rejects_bad_sources_and_options(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny-llama"):
        build_plan("preset:nope", tmp_path / "p", BuildOptions())
    with pytest.raises(ValueError, match="power of 2"):
        BuildOptions(tokens_per_block=48)
    with pytest.raises(ValueError, match="dtype 'float64'"):
        BuildOptions(dtype="float64")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        build_plan(str(tmp_path / "missing"), tmp_path / "p", BuildOptions())
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="no config.json"):
        build_plan(str(tmp_path / "empty"), tmp_path / "p", BuildOptions())


def test_build_never_overwrites_a_directory_that_is_not_a_plan(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a plan"):
        build_plan("preset:tiny-llama", tmp_path / "notes", BuildOptions())
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# -- refusals ---------------------------------------------------------------------------------


def test_truncated_weights_are_refused(plan_copy):
    weights = plan_copy / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(PlanError, match="truncated.*rebuild it with `kvtool build --model preset:tiny-llama"):
        load_plan(plan_copy)


def test_modified_weights_are_refused_by_checksum(plan_copy):
    weights = plan_copy / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PlanError, match="checksum.*rebuild"):
        load_plan(plan_copy)


def test_missing_weights_are_refused(plan_copy):
    (plan_copy / "weights.safetensors").unlink()
    with pytest.raises(PlanError, match="missing.*rebuild"):
        load_plan(plan_copy)


def test_hand_edited_plan_json_is_refused(plan_copy):
    manifest = json.loads((plan_copy / "plan.json").read_text())
    manifest["build_options"]["tokens_per_block"] = 64
    (plan_copy / "plan.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanError, match="edited.*rebuild"):
        load_plan(plan_copy)


def test_other_format_version_is_refused(plan_copy):
    manifest = json.loads((plan_copy / "plan.json").read_text())
    write_manifest(plan_copy, {**manifest, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(PlanError, match=f"format version {FORMAT_VERSION + 1}.*rebuild"):
        load_plan(plan_copy)


def test_config_that_does_not_match_the_weights_is_refused(plan_copy):
    manifest = json.loads((plan_copy / "plan.json").read_text())
    manifest["model_config"]["num_layers"] = 3
    write_manifest(plan_copy, manifest)
    with pytest.raises(PlanError, match="does not hold the tensors.*rebuild"):
        load_plan(plan_copy)


def test_unparsable_or_missing_plan_json_is_refused(plan_copy, tmp_path):
    (plan_copy / "plan.json").write_text("{not json")
    with pytest.raises(PlanError, match="does not parse.*rebuild"):
        load_plan(plan_copy)
    (plan_copy / "plan.json").unlink()
    with pytest.raises(PlanError, match="no plan.json"):
        load_plan(plan_copy)
    with pytest.raises(PlanError, match="does not exist.*kvtool build"):
        load_plan(tmp_path / "nowhere")


def test_recorded_kernel_artifacts_are_verified(plan_copy):
    from kvtool.plan.format import file_checksum

    artifact = plan_copy / "kernels.bin"
    artifact.write_bytes(b"\x00" * 64)
    manifest = json.loads((plan_copy / "plan.json").read_text())
    manifest["kernel_artifacts"] = [{"file": "kernels.bin", "size_bytes": 64, "checksum": file_checksum(artifact)}]
    write_manifest(plan_copy, manifest)
    assert load_plan(plan_copy).manifest["kernel_artifacts"][0]["file"] == "kernels.bin"
    artifact.write_bytes(b"\x01" * 64)
    with pytest.raises(PlanError, match="kernels.bin does not match its recorded checksum"):
        load_plan(plan_copy)


# -- resolve_model: what LLM(model=...) calls -------------------------------------------------


def test_resolve_preset_builds_once_into_the_cache(tmp_path):
    options = BuildOptions(tokens_per_block=16)
    first = resolve_model("preset:tiny-llama", options=options, cache_dir=tmp_path)
    built_at = first.weights_path.stat().st_mtime_ns
    second = resolve_model("preset:tiny-llama", options=options, cache_dir=tmp_path)
    assert second.path == first.path and second.weights_path.stat().st_mtime_ns == built_at
    other = resolve_model("preset:tiny-llama", options=BuildOptions(tokens_per_block=32), cache_dir=tmp_path)
    assert other.path != first.path and other.build_options.tokens_per_block == 32


def test_resolve_rebuilds_a_damaged_cached_plan(tmp_path):
    plan = resolve_model("preset:tiny-llama", cache_dir=tmp_path)
    plan.weights_path.write_bytes(b"garbage")
    assert load_plan(resolve_model("preset:tiny-llama", cache_dir=tmp_path).path).path == plan.path


def test_resolve_plan_dir_and_checkpoint_dir(tiny_llama_plan, hf_checkpoint, tmp_path):
    assert resolve_model(str(tiny_llama_plan), cache_dir=tmp_path).path == tiny_llama_plan
    plan = resolve_model(str(hf_checkpoint("qwen3_qk_norm").path), cache_dir=tmp_path)
    assert plan.path.parent == tmp_path and plan.model_config.qk_norm


def test_resolve_refuses_unknown_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown preset.*qwen3-8b"):
        resolve_model("preset:gpt-5", cache_dir=tmp_path)
    with pytest.raises(PlanError, match="neither a plan directory"):
        resolve_model(str(tmp_path / "nothing-here"), cache_dir=tmp_path)


def test_skipping_the_checksum_still_checks_size_and_shapes(plan_copy):
    weights = plan_copy / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert load_plan(plan_copy, verify_checksum=False).path == plan_copy
    weights.write_bytes(bytes(data[:-8]))
    with pytest.raises(PlanError, match="truncated"):
        load_plan(plan_copy, verify_checksum=False)


def test_sharded_checkpoint_builds_the_same_weights(hf_checkpoint, plan_from_checkpoint, tmp_path):
    case = hf_checkpoint("llama_mha_tied_bias")
    sharded = tmp_path / "sharded"
    case.model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    # A file outside the index (as some repos ship) is not part of the model.
    shutil.copy(plan_from_checkpoint("qwen3_qk_norm") / "weights.safetensors", sharded / "consolidated.safetensors")
    plan = load_plan(build_plan(str(sharded), tmp_path / "plan", BuildOptions(tokens_per_block=8, max_seq_len=512)))
    reference = load_plan(plan_from_checkpoint("llama_mha_tied_bias"))
    assert plan.manifest["weights"]["checksum"] == reference.manifest["weights"]["checksum"]
