"""A decode step of one or two rows runs every layer in one C++ call (the kernels' DecoderStack) and
computes exactly what the Python layer loop computes with the same kernels: the same logits and the
same KV written, bit for bit, in float32 and bfloat16, with biases and Qwen3's q/k norms. (The stack
is held to transformers' logits by tests/test_cpu_decoder.py, whose decode steps take it.)
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtool.config import SamplingParams
from kvtool.cpu_kernels.decoder import MAX_ROW_PRODUCT_ROWS, CpuDecoder
from kvtool.layers.sampler import sample, step_picks
from hf_checkpoints import TEST_TOKENS_PER_BLOCK as T
from paged_driver import PagedDriver
from test_model_vs_transformers import random_prompt


class CountingStack:
    """Stands in for a decoder's stack and counts the steps given to it."""

    def __init__(self, stack) -> None:
        self.stack, self.num_calls = stack, 0
        self.max_rows = stack.max_rows

    def forward(self, *args) -> None:
        self.num_calls += 1
        self.stack.forward(*args)

    def __getattr__(self, name: str):
        return getattr(self.stack, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_qk_norm", "qwen2_qkv_bias_tied"])
def test_decode_steps_of_one_and_two_rows_run_in_one_call_and_match_the_layer_loop(models, name, dtype):
    ours, _ = models(name)
    model = ours.to(dtype)
    try:
        model.cpu_decoder = CpuDecoder(model, num_threads=2)
        driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
        assert_stack_steps_match_the_layer_loop(driver, [2 * T + 5, T + 9])
    finally:
        model.cpu_decoder = None
        model.to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_shared_by_a_team_of_threads_matches_the_layer_loop(models, dtype):
    """Projections this wide, and attention over ~1,000 cached tokens, are shared among the threads: in
    the stack by one team of them for the whole step (one row's attention split by keys in two and
    merged, two rows' a sequence a thread), in the layer loop by each kernel call's own. The same
    logits and KV, bit for bit."""
    ours, _ = models("llama_threads_medium")
    model = ours.to(dtype)
    try:
        model.cpu_decoder = CpuDecoder(model, num_threads=2)
        if model.cpu_decoder.kernels.num_threads < 2:
            pytest.skip("needs two threads")
        driver = PagedDriver(model, tokens_per_block=T, num_blocks=260)
        assert_stack_steps_match_the_layer_loop(driver, [1000, 990])
    finally:
        model.cpu_decoder = None
        model.to(torch.float32)


def assert_stack_steps_match_the_layer_loop(driver: PagedDriver, prompt_lengths: list[int]) -> None:
    """Two sequences of these prompt lengths prefilled, then decode steps of the first, both, the
    second and both, each run by the stack and again (from the same state) by the layer loop."""
    decoder = driver.model.cpu_decoder
    stack = CountingStack(decoder.stack)
    seqs = [driver.add_sequence(random_prompt(length, seed=length)) for length in prompt_lengths]
    for seq, logits in zip(seqs, driver.step(context=[(seq, len(seq.token_ids)) for seq in seqs])):
        seq.append(int(logits[-1].argmax()))
    for step in ([seqs[0]], seqs, [seqs[1]], seqs):
        results, computed = [], [seq.num_computed for seq in step]
        for use_stack in (True, False):
            for seq, num_computed in zip(step, computed):  # the same step again, from the same state
                seq.num_computed = num_computed
            decoder.stack = stack if use_stack else None
            calls = stack.num_calls
            logits = driver.step(decode=step)
            assert stack.num_calls == calls + use_stack
            results.append((torch.cat(logits), driver.pool.clone()))
        decoder.stack = stack.stack
        (stacked, stacked_pool), (looped, looped_pool) = results
        assert torch.equal(stacked, looped)
        # (the pool's unwritten slots hold NaN)
        torch.testing.assert_close(stacked_pool, looped_pool, rtol=0, atol=0, equal_nan=True)
        for seq, logits in zip(step, stacked.split(1)):
            seq.append(int(logits[-1].argmax()))


def decode_arrays(seqs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decode step of ``seqs`` (each its next token) as the engine flattens it: input_ids, positions,
    block_tables (-1 padded)."""
    max_blocks = max(len(seq.block_ids) for seq in seqs)
    return (np.array([seq.token_ids[seq.num_computed] for seq in seqs], dtype=np.int64),
            np.array([seq.num_computed for seq in seqs], dtype=np.int64),
            np.array([seq.block_ids + [-1] * (max_blocks - len(seq.block_ids)) for seq in seqs], dtype=np.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_qk_norm", "qwen2_qkv_bias_tied", "mistral_sliding_window"])
def test_a_decode_step_in_one_call_gives_the_logits_and_kv_of_forward_and_the_lm_head(models, name, dtype):
    # decode() embeds the tokens, finds the slots and the attention plan from the block tables, and runs
    # the stack and the LM head (tied or not) in C++: the same logits and KV, bit for bit. The same step
    # by decode_picks picks in C++, from the head's output split among the threads, what NumPy's argmax
    # of those logits picks, and writes the same KV; with temperatures, what the sampler draws from those
    # logits with the same uniform numbers.
    ours, _ = models(name)
    model = ours.to(dtype)
    try:
        decoder = model.cpu_decoder = CpuDecoder(model, num_threads=2)
        driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
        seqs = [driver.add_sequence(random_prompt(length, seed=length)) for length in (2 * T - 1, T + 9)]
        for seq, logits in zip(seqs, driver.step(context=[(seq, len(seq.token_ids)) for seq in seqs])):
            seq.append(int(logits[-1].argmax()))
        for step in ([seqs[0]], seqs, seqs, [seqs[1]]):  # the first crosses into a new block
            computed, pool = [seq.num_computed for seq in step], driver.pool.clone()
            expected = torch.cat(driver.step(decode=step))  # allocates the blocks the step needs
            expected_pool = driver.pool.clone()
            driver.pool.copy_(pool)
            for seq, num_computed in zip(step, computed):
                seq.num_computed = num_computed
            logits = decoder.decode(*decode_arrays(step), driver.kv_caches)
            assert logits.dtype == torch.float32 and torch.equal(logits, expected)
            torch.testing.assert_close(driver.pool, expected_pool, rtol=0, atol=0, equal_nan=True)
            driver.pool.copy_(pool)
            picks = decoder.decode_picks(*decode_arrays(step), driver.kv_caches)
            assert picks.dtype == np.int64 and picks.tolist() == logits.numpy().argmax(axis=-1).tolist()
            torch.testing.assert_close(driver.pool, expected_pool, rtol=0, atol=0, equal_nan=True)
            # Sampled rows, a greedy one beside a sampled one, top_k and top_p, at a few uniform numbers.
            for u, rows in ((0.02, ((0.7, 0, 1.0), (0.0, 0, 1.0))), (0.5, ((1.5, 0, 1.0), (0.9, 3, 1.0))),
                            (0.97, ((1.0, 0, 0.8), (0.6, 20, 0.5))), (0.3, ((0.0, 0, 1.0), (1.0, 0, 0.3)))):
                params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in rows[:len(step)]]
                sampling = step_picks(params, [None] * len(step))  # None: every row greedy
                if sampling is not None:
                    sampling = sampling._replace(uniforms=np.array([u] * len(step)))
                driver.pool.copy_(pool)
                drawn = decoder.decode_picks(*decode_arrays(step), driver.kv_caches, sampling)
                assert drawn.tolist() == sample(logits, params, sampling and sampling.uniforms), rows
            for seq, token_id in zip(step, picks.tolist()):
                seq.num_computed += 1
                seq.append(token_id)
    finally:
        model.cpu_decoder = None
        model.to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_pick_takes_the_first_of_tied_logits_and_the_first_nan_across_the_threads_parts(models, dtype):
    # Each thread picks from its part of the vocabulary (two parts here, split at vocab / 2); the parts'
    # picks then give the row's: the first of equal largest logits, wherever they lie, and the first
    # NaN over any number (NumPy's argmax). LM head rows copied or set to NaN make the logits so.
    ours, _ = models("qwen3_qk_norm")
    model = ours.to(dtype)
    head = model.lm_head.weight
    original = head.clone()
    try:
        decoder = model.cpu_decoder = CpuDecoder(model, num_threads=2)
        if decoder.kernels.num_threads < 2:
            pytest.skip("needs two threads")
        driver = PagedDriver(model, tokens_per_block=T, num_blocks=8)
        seq = driver.add_sequence(random_prompt(T + 3, seed=3))
        driver.step(context=[(seq, len(seq.token_ids))])
        seq.append(5)
        driver.step(decode=[seq])  # the step's block, then the same step again each time
        seq.num_computed -= 1
        vocab = head.shape[0]

        def pick_and_argmax() -> tuple[int, int]:
            logits = decoder.decode(*decode_arrays([seq]), driver.kv_caches)
            return int(decoder.decode_picks(*decode_arrays([seq]), driver.kv_caches)[0]), int(
                logits.numpy().argmax())

        with torch.no_grad():
            largest, _ = pick_and_argmax()
            other_part = vocab - 1 if largest < vocab // 2 else 0
            head[other_part] = head[largest]  # a tie across the parts
            assert pick_and_argmax() == (min(largest, other_part),) * 2
            head[vocab - 2] = float("nan")
            assert pick_and_argmax() == (vocab - 2, vocab - 2)
            head[vocab // 2 - 1] = float("nan")  # an earlier NaN, in the first part
            assert pick_and_argmax() == (vocab // 2 - 1, vocab // 2 - 1)
    finally:
        with torch.no_grad():
            head.copy_(original)
        model.cpu_decoder = None
        model.to(torch.float32)


def test_a_decode_step_refuses_tokens_and_positions_it_cannot_serve(models):
    ours, _ = models("qwen3_qk_norm")
    decoder = CpuDecoder(ours, num_threads=1)
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=4)
    input_ids, positions, block_tables = np.array([5]), np.array([T + 1]), np.array([[0, 1]], dtype=np.int32)
    vocab = ours.config.vocab_size
    with pytest.raises(ValueError, match=f"token {vocab} of row 0 is outside the vocabulary of {vocab}"):
        decoder.decode(np.array([vocab]), positions, block_tables, driver.kv_caches)
    with pytest.raises(ValueError, match=f"row 0's position {2 * T} has no block in its table of 2 blocks"):
        decoder.decode(input_ids, np.array([2 * T]), block_tables, driver.kv_caches)
    with pytest.raises(ValueError, match=f"row 0's position {T} has no block"):
        decoder.decode(input_ids, np.array([T]), np.array([[0, -1]], dtype=np.int32), driver.kv_caches)
    with pytest.raises(ValueError, match="has block id 7 at index 0"):
        decoder.decode(input_ids, positions, np.array([[7, 1]], dtype=np.int32), driver.kv_caches)
    over = MAX_ROW_PRODUCT_ROWS + 1
    with pytest.raises(ValueError, match=f"{over} rows; the stack takes 1 to {MAX_ROW_PRODUCT_ROWS}"):
        decoder.decode(np.full(over, 5), np.full(over, T), np.zeros((over, 2), dtype=np.int32), driver.kv_caches)


def test_the_python_loop_runs_steps_of_more_rows_than_the_stack_takes(models):
    ours, _ = models("qwen3_qk_norm")
    decoder = CpuDecoder(ours, num_threads=2)
    ours.cpu_decoder = decoder
    try:
        stack = decoder.stack = CountingStack(decoder.stack)
        driver = PagedDriver(ours, tokens_per_block=T, num_blocks=32)
        seqs = [driver.add_sequence(random_prompt(T + i, seed=i)) for i in range(MAX_ROW_PRODUCT_ROWS + 1)]
        for step in ({"context": [(seq, len(seq.token_ids)) for seq in seqs]}, {"decode": seqs},
                     {"decode": seqs[:MAX_ROW_PRODUCT_ROWS]}):
            stepped = [seq for seq, _ in step.get("context", [])] + step.get("decode", [])
            for seq, logits in zip(stepped, driver.step(**step)):
                seq.append(int(logits[-1].argmax()))
            assert stack.num_calls == (1 if len(stepped) <= MAX_ROW_PRODUCT_ROWS else 0)
    finally:
        ours.cpu_decoder = None


def test_the_stack_refuses_a_step_it_was_not_built_for(models):
    ours, _ = models("qwen3_qk_norm")
    decoder = CpuDecoder(ours, num_threads=1)
    stack, config = decoder.stack, ours.config
    assert (stack.num_layers, stack.max_rows) == (config.num_layers, MAX_ROW_PRODUCT_ROWS)
    plan = decoder.kernels.plan_attention(np.arange(2, dtype=np.int32), np.ones(1, dtype=np.int32),
                                          np.zeros((1, 1), dtype=np.int32), 1, config.num_heads,
                                          config.num_kv_heads, config.head_dim, T, 0, decoder.kernel_dtype)
    caches = np.zeros(config.num_layers, dtype=np.int64)
    over = MAX_ROW_PRODUCT_ROWS + 1
    with pytest.raises(ValueError, match=f"{over} rows; the stack takes 1 to {MAX_ROW_PRODUCT_ROWS}"):
        stack.forward(decoder.kernels, plan, 0, 0, over, 0, 0, 0, 0, caches, 0, 0, 0, 0, T, decoder.kernel_dtype)
    with pytest.raises(ValueError, match=f"1 KV caches for {config.num_layers} layers"):
        stack.forward(decoder.kernels, plan, 0, 0, 1, 0, 0, 0, 0, caches[:1], 0, 0, 0, 0, T, decoder.kernel_dtype)


def test_a_model_whose_weights_the_stack_cannot_read_keeps_the_layer_loop(models):
    ours, _ = models("qwen3_qk_norm")
    o_proj = ours.layers[0].attention.o_proj
    weight = o_proj.weight
    prompt = random_prompt(T + 3, seed=7)
    results = []
    try:
        for contiguous in (True, False):
            # The same values, the rows of the second strided (a transposed copy seen transposed back).
            o_proj.weight = torch.nn.Parameter(weight if contiguous else weight.t().contiguous().t(),
                                               requires_grad=False)
            decoder = ours.cpu_decoder = CpuDecoder(ours, num_threads=2)
            assert (decoder.stack is not None) == contiguous
            driver = PagedDriver(ours, tokens_per_block=T, num_blocks=8)
            seq = driver.add_sequence(prompt)
            seq.append(int(driver.step(context=[(seq, len(prompt))])[0][-1].argmax()))
            results.append(driver.step(decode=[seq])[0])
        torch.testing.assert_close(results[1], results[0])
    finally:
        o_proj.weight = weight
        ours.cpu_decoder = None


def test_one_decoder_steps_two_pools_in_turn_each_in_its_own_cache(models):
    # The stack keeps the layers' cache addresses between steps: a step on another pool must read and
    # write that pool's caches, as the Python loop (which reads them every step) does.
    ours, _ = models("qwen3_qk_norm")
    ours.cpu_decoder = decoder = CpuDecoder(ours, num_threads=2)
    stack = decoder.stack
    try:
        results = []
        for use_stack in (True, False):
            decoder.stack = stack if use_stack else None
            drivers = [PagedDriver(ours, tokens_per_block=T, num_blocks=16) for _ in range(2)]
            seqs = [driver.add_sequence(random_prompt(T + 3 + 4 * i, seed=i)) for i, driver in enumerate(drivers)]
            logits = []
            for step in range(4):
                for driver, seq in zip(drivers, seqs):
                    step_logits = driver.step(context=[(seq, len(seq.token_ids))]) if step == 0 else \
                        driver.step(decode=[seq])
                    logits.append(step_logits[-1][-1])
                    seq.append(int(logits[-1].argmax()))
            results.append((torch.stack(logits), [driver.pool.clone() for driver in drivers]))
        (stacked, stacked_pools), (looped, looped_pools) = results
        assert torch.equal(stacked, looped)
        for stacked_pool, looped_pool in zip(stacked_pools, looped_pools):
            torch.testing.assert_close(stacked_pool, looped_pool, rtol=0, atol=0, equal_nan=True)
    finally:
        ours.cpu_decoder = None


def test_without_native_bfloat16_products_the_row_product_takes_every_product(models, monkeypatch):
    # An AVX2-only CPU: oneDNN has no bfloat16 product and torch emulates it, 2-2.5x the row product's time.
    import kvtool.cpu_kernels.decoder as decoder_module
    from kvtool.cpu_kernels import ops
    from kvtool.cpu_kernels.decoder import MAX_UNPACKED_STACK_ROWS, projection

    kernels = CpuDecoder(models("qwen3_qk_norm")[0], num_threads=2).kernels
    weight = torch.randn(48, 64).to(torch.bfloat16)

    def emulated(x):
        raise AssertionError("a product left to torch")

    product = projection(SimpleNamespace(weight=weight, bias=None, forward=emulated), kernels, max_rows=None)
    for rows in (1, 3, 100):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        expected = ops.linear(kernels, x, weight, None, torch.empty(rows, 48, dtype=torch.bfloat16))
        assert torch.equal(product(x), expected)

    ours, _ = models("qwen3_qk_norm")
    model = ours.to(torch.bfloat16)
    try:
        reference = CpuDecoder(model, num_threads=2, row_products=False)  # oneDNN's native product here
        monkeypatch.setattr(decoder_module, "can_pack_dtype", lambda dtype: dtype == torch.float32)
        decoder = CpuDecoder(model, num_threads=2)
        assert decoder.max_row_product_rows is None and decoder.stack.max_rows == MAX_UNPACKED_STACK_ROWS
        stack = decoder.stack = CountingStack(decoder.stack)
        results = []
        for active in (decoder, reference):
            model.cpu_decoder = active
            driver = PagedDriver(model, tokens_per_block=T, num_blocks=64)
            seqs = [driver.add_sequence(random_prompt(T + 3 * i, seed=i)) for i in range(6)]
            logits = driver.step(context=[(seq, len(seq.token_ids)) for seq in seqs])  # a prompt step of 141 rows
            for seq, row in zip(seqs, logits):
                seq.append(int(row[-1].argmax()))
            pool = driver.pool.clone()
            logits += driver.step(decode=seqs)  # 6 decode rows: the stack
            results.append(torch.cat([row[-1:] for row in logits]).float())
            if active is decoder:  # the engine's call for the same step: the same logits and KV
                expected_pool = driver.pool.clone()
                driver.pool.copy_(pool)
                for seq in seqs:
                    seq.num_computed -= 1
                assert torch.equal(decoder.decode(*decode_arrays(seqs), driver.kv_caches), results[0][len(seqs):])
                torch.testing.assert_close(driver.pool, expected_pool, rtol=0, atol=0, equal_nan=True)
        assert stack.num_calls == 1
        torch.testing.assert_close(results[0], results[1], rtol=0.05, atol=0.05)
    finally:
        model.cpu_decoder = None
        model.to(torch.float32)
