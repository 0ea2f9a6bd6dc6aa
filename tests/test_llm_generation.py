"""The LLM API end to end: outputs never depend on how the KV cache was obtained.

The scenarios shared by every device run once per setup (device x dtype x model): on the CPU in
float32, and on a GPU through kvtool's CUDA kernels in float16 (marked gpu; skipped without one).
float16 rather than bfloat16 on the GPU: reusing a prefix changes which matrix shapes compute the
suffix, hence the rounding of its activations; float16's 3 extra mantissa bits keep such differences
far below the gap between the top two logits, so token identity is a stable check.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtool import (LLM, CapacitySchedulerPolicy, ContextChunkingPolicy, KvCacheConfig, SamplingParams,
                    SchedulerConfig)
from kvtool.layers.attention import TorchPagedAttention
from kvtool.plan import BuildOptions, build_plan
from kvtool.runtime.model_runner import StepRequest

TOKENS_PER_BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


ON_A_GPU = [pytest.mark.gpu]  # skipped, saying what is missing, without a CUDA GPU and CuPy (conftest.py)


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: str
    model: str              # preset:NAME, or a tests/hf_checkpoints.py case (its transformers model is known)
    pool_tokens: int = 64 * TOKENS_PER_BLOCK  # small: a GPU's default pool would take most of its memory


SETUPS = [pytest.param(Setup("cpu", "float32", "preset:tiny-llama"), id="cpu-float32-tiny-llama"),
          # head_dim 64: the smallest shape kvtool's CUDA kernels serve.
          pytest.param(Setup("cuda", "float16", "qwen3_head_dim_64"), id="cuda-float16-qwen3", marks=ON_A_GPU)]


@dataclass(frozen=True)
class Target:
    """A setup with its plan built."""

    setup: Setup
    plan_dir: str

    def llm(self, *, kv_cache_config: KvCacheConfig | None = None, **kwargs) -> LLM:
        """An LLM on the setup's device and pool; the attention backend is the one the device implies."""
        from kvtool.layers.cuda_attention import CudaPagedAttention

        kv_cache_config = kv_cache_config or KvCacheConfig()
        if kv_cache_config.max_tokens is None:
            kv_cache_config = KvCacheConfig(**{**vars(kv_cache_config), "max_tokens": self.setup.pool_tokens})
        llm = LLM(model=self.plan_dir, device=self.setup.device, kv_cache_config=kv_cache_config, **kwargs)
        expected = CudaPagedAttention if self.setup.device == "cuda" else TorchPagedAttention
        assert isinstance(llm.attention_backend, expected), f"the model runs on {type(llm.attention_backend)}"
        return llm


def build(setup: Setup, hf_checkpoint, tmp_path_factory) -> Target:
    source = setup.model if setup.model.startswith("preset:") else str(hf_checkpoint(setup.model).path)
    out = tmp_path_factory.mktemp("plan") / f"{setup.model.removeprefix('preset:')}-{setup.dtype}"
    build_plan(source, out, BuildOptions(dtype=setup.dtype, tokens_per_block=TOKENS_PER_BLOCK, max_seq_len=512,
                                         max_batch_size=8, max_num_tokens=512))
    return Target(setup, str(out))


@pytest.fixture(scope="module", params=SETUPS)
def target(request, hf_checkpoint, tmp_path_factory) -> Target:
    return build(request.param, hf_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """The CPU scenarios' plan."""
    out = tmp_path_factory.mktemp("plan") / "tiny-llama"
    build_plan("preset:tiny-llama", out, BuildOptions(tokens_per_block=TOKENS_PER_BLOCK, max_seq_len=512,
                                                       max_batch_size=8, max_num_tokens=512))
    return str(out)


def shared_prefix_prompts(num_prompts: int = 4, prefix_len: int = 80, suffix_len: int = 23, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 500) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, 500) for _ in range(suffix_len)] for _ in range(num_prompts)]


def greedy_tokens(target: Target, prompts, **llm_kwargs) -> tuple[list[list[int]], dict]:
    llm = target.llm(**llm_kwargs)
    outputs = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    llm.shutdown()
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def reference_tokens(target):
    """Greedy outputs with reuse off, one prompt at a time: nothing shared, nothing evicted."""
    tokens = []
    for prompt in shared_prefix_prompts():
        out, _ = greedy_tokens(target, [prompt], max_batch_size=1,
                               kv_cache_config=KvCacheConfig(enable_block_reuse=False))
        tokens += out
    return tokens


# -- every setup ----------------------------------------------------------------------------

def test_greedy_outputs_identical_with_reuse_on_and_off(target, reference_tokens):
    # One request at a time: each later request finds the shared prefix cached.
    tokens, stats = greedy_tokens(target, shared_prefix_prompts(), max_batch_size=1,
                                  kv_cache_config=KvCacheConfig(enable_block_reuse=True))
    assert tokens == reference_tokens
    assert stats["reused_blocks"] == 3 * 5  # 80-token prefix = 5 blocks, for each of 3 later requests


def test_batched_requests_reuse_a_prefix_as_soon_as_its_first_chunk_is_computed(target, reference_tokens):
    # Chunks of at most 48 tokens a step. The others wait while the first computes the prefix they
    # share (in-batch prefix reuse), then all three are admitted while it still runs: each reuses the
    # 5 prefix blocks early.
    tokens, stats = greedy_tokens(target, shared_prefix_prompts(), max_num_tokens=48,
                                  scheduler_config=SchedulerConfig(enable_chunked_context=True))
    assert tokens == reference_tokens
    assert (stats["early_reused_blocks"], stats["reused_blocks"]) == (3 * 5, 3 * 5)


@pytest.mark.parametrize("layered_copies", [False, True])
def test_greedy_outputs_identical_when_host_offloading_forces_evictions(target, reference_tokens, layered_copies):
    # 8 blocks hold one request (103 prompt + 6 generated tokens = 7 blocks; its 6 full prompt blocks
    # stay cached): every request beyond the second evicts the oldest cached suffix block to the host.
    # Round 1: requests 3 and 4 offload one each. Round 2: each request onboards its own suffix block
    # and offloads another: 4 more offloads, 4 onboards. Layered: each layer's copies get an event
    # that layer's attention waits for (as a large step's copies run on a GPU).
    prompts = shared_prefix_prompts()
    llm = target.llm(max_batch_size=1, kv_cache_config=KvCacheConfig(
        max_tokens=8 * TOKENS_PER_BLOCK, host_cache_size=1 << 20, layered_copy_min_bytes=0 if layered_copies else None))
    tokens = [llm.generate(p, GREEDY).outputs[0].token_ids for p in prompts + prompts]
    stats = llm.get_stats()
    llm.shutdown()
    assert tokens == reference_tokens + reference_tokens
    assert (stats["offloaded_blocks"], stats["onboarded_blocks"]) == (2 + 4, 4)


def test_a_fully_cached_prompt_batched_with_a_new_prompt_gives_the_same_outputs(target):
    # 97 tokens: a second time, 6 blocks are reused and the context chunk is the last token only.
    # It is scheduled ahead of the new prompt's 103-token chunk and attended as a one-token row
    # after it, like a decode token (on a GPU, by the decode kernel).
    repeated, new = shared_prefix_prompts()[0][:97], shared_prefix_prompts()[1]
    alone = [greedy_tokens(target, [p], kv_cache_config=KvCacheConfig(enable_block_reuse=False))[0][0]
             for p in (repeated, new)]
    llm = target.llm(max_batch_size=4)
    llm.generate(repeated, GREEDY)
    outputs = llm.generate([repeated, new], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert outputs[0].request.num_reused_tokens == 96


@pytest.mark.parametrize("max_batch_size", [3, 8])
def test_greedy_outputs_identical_with_cuda_graphs_on_and_off(target, reference_tokens, max_batch_size):
    # 3: the first three prompts decode in the bucket of 3, the last alone in the bucket of 1; 8: all
    # four in the bucket of 4. Decode steps replay graphs (prompts too: tests/test_cuda_graphs_gpu.py).
    if target.setup.device != "cuda":
        pytest.skip("CUDA graphs replay decode steps on a GPU only")
    eager, _ = greedy_tokens(target, shared_prefix_prompts(), max_batch_size=max_batch_size, cuda_graphs=False)
    llm = target.llm(max_batch_size=max_batch_size)
    graphs = llm.engine.executor.decode_graphs
    assert llm.cuda_graphs and graphs is not None
    replayed = []
    run = graphs.run
    graphs.run = lambda batch: replayed.append(len(batch.input_ids)) or run(batch)
    outputs = llm.generate(shared_prefix_prompts(), GREEDY)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == eager == reference_tokens
    assert len(replayed) >= 5 and max(replayed) == min(max_batch_size, 4)  # 5 decode steps a request


@pytest.mark.parametrize("setup, tolerance", [
    pytest.param(Setup("cpu", "float32", "qwen3_head_dim_64"), 1e-4, id="cpu-float32-qwen3"),
    pytest.param(Setup("cuda", "float16", "qwen3_head_dim_64"), 2e-2, id="cuda-float16-qwen3", marks=ON_A_GPU)])
def test_prompt_logits_match_transformers(setup, tolerance, hf_checkpoint, tmp_path_factory):
    target = build(setup, hf_checkpoint, tmp_path_factory)
    prompt = shared_prefix_prompts()[0]
    llm = target.llm()
    num_blocks = -(-len(prompt) // TOKENS_PER_BLOCK)
    request = StepRequest(np.asarray(prompt, dtype=np.int32), np.arange(num_blocks, dtype=np.int32), 0, True, True)
    ours = llm.engine.executor.execute([request])[0].cpu()  # [vocab] float32
    llm.shutdown()
    with torch.no_grad():
        reference = hf_checkpoint(setup.model).model(torch.tensor([prompt])).logits[0, -1].float()
    assert float((ours - reference).abs().max() / reference.abs().max()) <= tolerance


@pytest.mark.parametrize("policy", list(ContextChunkingPolicy))
def test_greedy_outputs_identical_with_chunked_context(target, reference_tokens, policy):
    tokens, _ = greedy_tokens(target, shared_prefix_prompts(), max_num_tokens=32,
                              scheduler_config=SchedulerConfig(enable_chunked_context=True,
                                                               context_chunking_policy=policy))
    assert tokens == reference_tokens


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_greedy_outputs_identical_under_every_capacity_policy(target, reference_tokens, policy):
    tokens, _ = greedy_tokens(target, shared_prefix_prompts(), max_batch_size=3,
                              scheduler_config=SchedulerConfig(capacity_scheduler_policy=policy))
    assert tokens == reference_tokens


# -- the CPU --------------------------------------------------------------------------------

def test_max_utilization_pauses_and_still_produces_the_same_outputs(plan_dir):
    # 15 blocks: the first two prompts (7 blocks each) start together but cannot both grow to 123
    # tokens (8 blocks each), so MAX_UTILIZATION pauses the second, once, and resumes it when the
    # first finishes; each later prompt then finishes before the next one needs its 8th block.
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM(model=plan_dir, max_batch_size=4,
              kv_cache_config=KvCacheConfig(enable_block_reuse=False, max_tokens=15 * TOKENS_PER_BLOCK),
              scheduler_config=SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION))
    outputs = llm.generate(prompts, params)
    assert [o.request.num_pauses for o in outputs] == [0, 1, 0, 0]
    unconstrained = LLM(model=plan_dir, max_batch_size=1).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in unconstrained]


def test_second_request_with_same_five_block_prefix_reuses_five_blocks(plan_dir):
    rng = random.Random(1)
    prefix = [rng.randrange(10, 1000) for _ in range(5 * TOKENS_PER_BLOCK)]
    llm = LLM(model=plan_dir, kv_cache_config=KvCacheConfig(enable_partial_reuse=False))
    llm.generate(prefix + [11, 12, 13], GREEDY)
    second = llm.generate(prefix + [21, 22, 23], GREEDY).request
    assert second.num_reused_blocks == 5
    assert second.num_reused_tokens == 5 * TOKENS_PER_BLOCK


def test_cache_salt_prevents_reuse(plan_dir):
    prompt = shared_prefix_prompts(1)[0]
    llm = LLM(model=plan_dir)
    outputs = [llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, cache_salt=salt))
               for salt in ("tenant-a", "tenant-b", "tenant-a")]
    # The third request shares the first's 6 full blocks (103 prompt tokens: 6 blocks and 7 tokens).
    assert [o.request.num_reused_tokens for o in outputs] == [0, 0, 6 * TOKENS_PER_BLOCK]


def test_extra_ids_prevent_reuse_across_prompt_tables(plan_dir):
    prompt = shared_prefix_prompts(1)[0]
    table_1 = [1] * 16 + [0] * (len(prompt) - 16)
    table_2 = [2] * 16 + [0] * (len(prompt) - 16)
    llm = LLM(model=plan_dir)
    params = SamplingParams(max_tokens=2, temperature=0)
    outputs = [llm.generate([prompt], params, extra_ids=[table])[0] for table in (table_1, table_2, table_1)]
    assert [o.request.num_reused_tokens for o in outputs] == [0, 0, 6 * TOKENS_PER_BLOCK]


def test_prompt_longer_than_max_seq_len_fails_alone(plan_dir):
    prompts = shared_prefix_prompts(2)
    too_long = list(range(10, 10 + 600))
    llm = LLM(model=plan_dir)
    outputs = llm.generate([prompts[0], too_long, prompts[1]], GREEDY)
    assert outputs[1].error is not None and "max_seq_len" in outputs[1].error
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert outputs[2].error is None and len(outputs[2].outputs[0].token_ids) == GREEDY.max_tokens


def test_reuse_on_plan_without_paged_context_is_refused(tmp_path):
    out = tmp_path / "no-paged"
    build_plan("preset:tiny-llama", out, BuildOptions(use_paged_context_fmha=False, max_seq_len=256))
    with pytest.raises(Exception, match="use_paged_context_fmha"):
        LLM(model=str(out), kv_cache_config=KvCacheConfig(enable_block_reuse=True))
    # Without reuse the same plan serves requests.
    llm = LLM(model=str(out), kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    assert len(llm.generate([5, 6, 7], GREEDY).outputs[0].token_ids) == GREEDY.max_tokens


def test_primary_pool_smaller_than_one_request_is_a_clear_error(plan_dir):
    llm = LLM(model=plan_dir, kv_cache_config=KvCacheConfig(max_tokens=2 * TOKENS_PER_BLOCK))
    output = llm.generate(list(range(10, 110)), GREEDY)
    assert output.error is not None and "primary pool" in output.error


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="preset"):
        LLM(model="preset:no-such-model")


def test_tokens_per_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        KvCacheConfig(tokens_per_block=48)
    with pytest.raises(ValueError, match="power of 2"):
        BuildOptions(tokens_per_block=48)


def test_tokens_per_block_is_checked_against_the_plan(plan_dir):
    with pytest.raises(Exception, match="tokens_per_block"):
        LLM(model=plan_dir, kv_cache_config=KvCacheConfig(tokens_per_block=64))


def test_streaming_yields_each_token_as_it_is_produced(plan_dir):
    llm = LLM(model=plan_dir)
    seen = [len(out.outputs[0].token_ids) for out in llm.generate_async([5, 6, 7, 8], GREEDY, streaming=True)]
    assert seen == list(range(1, GREEDY.max_tokens + 1))


def test_a_seed_repeats_its_samples_and_another_seed_samples_others(plan_dir):
    llm = LLM(model=plan_dir)
    prompt = [5, 6, 7, 8]

    def sampled(seed: int, *others) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate([prompt, *others], [params] + [GREEDY] * len(others))[0].outputs[0].token_ids

    first = sampled(123)
    assert sampled(123) == first
    assert sampled(123, [9, 10, 11]) == first  # whatever else is in the batch
    assert sampled(124) != first


def test_text_prompt_round_trips_through_the_tokenizer(plan_dir):
    llm = LLM(model=plan_dir)
    out = llm.generate("Hello, kvtool!", GREEDY)
    assert out.prompt == "Hello, kvtool!"
    assert isinstance(out.outputs[0].text, str) and len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_all_blocks_released_after_generation(plan_dir):
    llm = LLM(model=plan_dir)
    llm.generate(shared_prefix_prompts(), GREEDY)
    stats = llm.get_stats()
    assert stats["primary_used_blocks"] == 0
    assert list(llm.engine.scheduler.cache_manager.check_invariants()) == []


def test_offloading_example_turns_second_round_misses_into_host_hits():
    from examples.kv_cache_offloading import run  # noqa: PLC0415

    without = run("preset:tiny-llama", enable_offloading=False, prompt_len=160, max_tokens=4, seed=0)
    with_offload = run("preset:tiny-llama", enable_offloading=True, prompt_len=160, max_tokens=4, seed=0)
    assert without["rounds"][1]["reused_blocks"] == 0 and without["second_round_hit_rate"] == 0.0
    # Of each 160-token prompt's 10 blocks, the 9 before the last prompt token come back from host memory.
    second_round = with_offload["rounds"][1]
    assert (second_round["reused_blocks"], second_round["onboarded_blocks"], second_round["missed_blocks"]) == (
        2 * 9, 2 * 9, 2)
    # Offloading changes where KV comes from, never what the model says.
    assert with_offload["rounds"][1]["outputs"] == without["rounds"][1]["outputs"]
    assert with_offload["rounds"][0]["outputs"] == without["rounds"][0]["outputs"]
