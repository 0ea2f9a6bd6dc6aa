"""`kvtool build --compile_kernels` puts the plan's CUDA kernels in the plan (compiles here; runs on a GPU)."""

from __future__ import annotations

import shutil

import pytest

from kvtool.errors import PlanError
from kvtool.plan import BuildOptions, build_plan, load_plan

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA kernels")


def test_build_compiles_kernels_into_the_plan_and_load_verifies_them(tmp_path):
    plan_dir = build_plan("preset:small-llama", tmp_path / "plan",
                          BuildOptions(dtype="float16", max_seq_len=256, tokens_per_block=32),
                          compile_kernels=True)
    plan = load_plan(plan_dir)
    artifacts = plan.manifest["kernel_artifacts"]
    assert plan.manifest["kernel_target"] == "sm_90"
    # Attention (context, decode at each partition size), KV append, block copy, the fused kernels.
    assert len(artifacts) == 10 and all((plan_dir / a["file"]).is_file() for a in artifacts)
    # A cubin that changed after the build is refused like edited weights.
    (plan_dir / artifacts[0]["file"]).write_bytes(b"not a cubin")
    with pytest.raises(PlanError, match="rebuild"):
        load_plan(plan_dir)
