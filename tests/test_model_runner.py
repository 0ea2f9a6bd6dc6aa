"""ModelRunner.prepare: how a step's requests become the flattened batch the attention layers see."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool import LLM
from kvtool.plan import BuildOptions, build_plan
from kvtool.runtime.model_runner import StepRequest
from kvtool.runtime.step_batch import flatten_step
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, run_steps

TOKENS_PER_BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "tiny-llama"
    build_plan("preset:tiny-llama", out, BuildOptions(tokens_per_block=TOKENS_PER_BLOCK, max_seq_len=64,
                                                       max_batch_size=4, max_num_tokens=64))
    llm = LLM(model=str(out))
    yield llm.engine.executor
    llm.shutdown()


def scheduled(num_new: int, num_cached: int, first_block: int, *, is_context: bool, samples: bool = True):
    num_blocks = -(-(num_new + num_cached) // TOKENS_PER_BLOCK)
    return StepRequest(np.arange(10, 10 + num_new, dtype=np.int32),
                       np.arange(first_block, first_block + num_blocks, dtype=np.int32), num_cached, is_context, samples)


def test_one_token_context_chunks_are_flattened_after_multi_token_chunks(runner):
    requests = [
        scheduled(1, 11, 0, is_context=True),               # a fully cached prompt: only its last token
        scheduled(5, 0, 3, is_context=True),                # a new prompt
        scheduled(3, 4, 5, is_context=True, samples=False),  # a middle chunk of a chunked prompt
        scheduled(1, 6, 7, is_context=False),               # a decode token
    ]
    input_ids, meta, sample_rows = runner.prepare(requests)
    # Flattened: the 5-token and 3-token chunks, then the two one-token rows in their given order.
    assert meta.query_lens.tolist() == [5, 3, 1, 1]
    assert meta.seq_lens.tolist() == [5, 7, 12, 7]
    assert meta.num_context_seqs == 2
    assert (meta.max_seq_len, meta.max_decode_seq_len) == (12, 12)  # the decode grid's split-K bound
    assert meta.block_tables[2, :3].tolist() == [0, 1, 2]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 11, 6]
    assert meta.slot_mapping[8].item() == 2 * TOKENS_PER_BLOCK + 3  # position 11 lives in block 2
    assert input_ids.shape == (10,)
    # Logit rows come back in the order of the given requests (the non-sampling chunk has none).
    assert sample_rows.tolist() == [8, 4, 9]


def test_logits_do_not_depend_on_the_order_requests_are_given_in(runner):
    cached = scheduled(8, 0, 0, is_context=True)
    runner.execute([cached])  # writes the KV of blocks 0-1
    repeat = scheduled(1, 8, 0, is_context=True)._replace(token_ids=np.array([17], dtype=np.int32))
    fresh = scheduled(6, 0, 4, is_context=True)
    one_way = runner.execute([repeat, fresh])
    other_way = runner.execute([fresh, repeat])
    torch.testing.assert_close(one_way, other_way[[1, 0]])


def test_the_decode_grid_is_sized_by_decode_rows_only(runner):
    _, meta, _ = runner.prepare([scheduled(40, 0, 0, is_context=True), scheduled(1, 6, 10, is_context=False)])
    assert (meta.max_seq_len, meta.max_decode_seq_len) == (40, 7)
    _, meta, _ = runner.prepare([scheduled(9, 0, 0, is_context=True)])
    assert meta.max_decode_seq_len == 0


def test_a_cpu_decode_step_of_few_rows_runs_in_one_call_and_gives_the_sampled_rows_logits(runner, monkeypatch):
    decoder = runner.model.cpu_decoder
    runner.execute([scheduled(9, 0, 0, is_context=True), scheduled(6, 0, 4, is_context=True)])
    steps = [[scheduled(1, 9, 0, is_context=False)],
             [scheduled(1, 9, 0, is_context=False), scheduled(1, 6, 4, is_context=False)],
             [scheduled(1, 9, 0, is_context=False, samples=False), scheduled(1, 6, 4, is_context=False)]]
    calls = []
    decode = decoder.decode
    monkeypatch.setattr(decoder, "decode", lambda *args: calls.append(len(args[0])) or decode(*args))
    one_call = [runner.execute(step) for step in steps]
    assert calls == [1, 2, 2]
    monkeypatch.setattr(decoder, "decodes", lambda num_rows: False)  # the forward and the LM head apart
    for step, logits in zip(steps, one_call):
        assert torch.equal(logits, runner.execute(step))
    assert one_call[2].shape[0] == 1  # only the sampled row's logits


@pytest.mark.parametrize("tokens_per_block, max_num_tokens", [(4, 64), (4, 6), (1, 2)])
def test_a_decode_steps_rows_come_from_the_scheduler_as_flatten_step_gives_them(tokens_per_block, max_num_tokens):
    # Prompts of 1-12 tokens and outputs of 1-6, in steps of whole prompts or chunks (one-token middle
    # chunks, which do not sample, with one token a block): the steps whose every request has one new
    # token and samples give decode_rows, equal to what flatten_step makes of their requests; every other
    # step gives None.
    scheduler, model = make_scheduler(tokens_per_block=tokens_per_block, num_primary_blocks=256,
                                      max_num_tokens=max_num_tokens, enable_chunked_context=max_num_tokens < 64)
    for request_id, (length, max_new_tokens) in enumerate([(5, 6), (9, 2), (12, 4), (3, 1), (1, 5)]):
        add(scheduler, request_id, distinct_prompt(request_id, length), max_new_tokens)
    num_steps = {"decode": 0, "other": 0, "padded": 0}
    for batch in run_steps(scheduler, model).batches:
        rows = batch.decode_rows()
        if not all(len(r.token_ids) == 1 and r.samples for r in batch.requests):
            assert rows is None
            num_steps["other"] += 1
            continue
        step = flatten_step(batch.requests, tokens_per_block)
        assert rows.token_ids.tolist() == step.input_ids.tolist() and rows.token_ids.dtype == np.int64
        assert rows.positions.tolist() == step.positions.tolist() and rows.positions.dtype == np.int64
        assert rows.block_tables.tolist() == step.block_tables.tolist() and rows.block_tables.dtype == np.int32
        num_steps["decode"] += 1
        num_steps["padded"] += bool((rows.block_tables == -1).any())
    assert min(num_steps.values()) >= 1, num_steps


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 5, 0.9)])
def test_an_engine_decode_step_on_the_cpu_is_one_call_from_the_schedulers_arrays(tiny_llama_plan, monkeypatch,
                                                                                  temperature, top_k, top_p):
    # Requests take their tokens from the step itself (decode_picks: greedy, or drawn from the same uniform
    # numbers as the sampler draws from the general path's logits).
    from kvtool.config import SamplingParams

    method = "decode_picks"

    def generate(one_call: bool) -> tuple[list[list[int]], list[list[int]]]:
        """The outputs of two prompts, and the positions of each one-call step."""
        with LLM(model=str(tiny_llama_plan)) as llm:
            decoder = llm.engine.executor.model.cpu_decoder
            calls, step = [], getattr(decoder, method)
            monkeypatch.setattr(decoder, method, lambda *args: calls.append(args[1].tolist()) or step(*args))
            if not one_call:  # flatten_step, the forward and the LM head apart
                monkeypatch.setattr(decoder, "decodes", lambda num_rows: False)
            outputs = llm.generate([list(range(10, 19)), list(range(30, 36))],
                                   SamplingParams(max_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p,
                                                  seed=7, ignore_eos=True))
            return [output.outputs[0].token_ids for output in outputs], calls

    outputs, calls = generate(one_call=True)
    assert calls == [[9 + i, 6 + i] for i in range(5)]  # both rows' positions, a step each after the prompts
    assert generate(one_call=False) == (outputs, [])


class LayeredCopies:
    """Pools whose step copies land layer by layer (as a large step's do on a GPU): records each wait."""

    copies_pending_per_layer = True

    def __init__(self, events: list) -> None:
        self.events = events

    def wait_for_layer(self, layer: int) -> None:
        self.events.append(("wait", layer))

    def wait_for_all_copies(self) -> None:
        self.events.append(("wait all", None))


def test_each_decoder_layer_waits_for_its_own_copies_before_it_runs(runner, monkeypatch):
    events = []
    monkeypatch.setattr(runner, "pools", LayeredCopies(events))
    layers = runner.model.layers
    recorders = [layer.register_forward_hook(lambda *_, index=index: events.append(("ran", index)))
                 for index, layer in enumerate(layers)]
    try:
        runner.execute([scheduled(5, 0, 0, is_context=True)])
    finally:
        for recorder in recorders:
            recorder.remove()
    assert events == [event for index in range(len(layers)) for event in (("wait", index), ("ran", index))]
    assert not any(layer._forward_pre_hooks for layer in layers)  # the waits leave with the step


@pytest.mark.parametrize("isa", ["generic", "off", "auto"])
def test_the_cpu_kernels_run_the_instruction_set_asked_for_and_every_row_names_it(tiny_llama_plan, isa):
    from kvtool.config import EngineConfig, SamplingParams
    from kvtool.cpu_kernels import supported_isas

    with LLM(model=str(tiny_llama_plan), config=EngineConfig(cpu_kernels_isa=isa)) as llm:
        expected = {"auto": supported_isas()[0], "off": "off"}.get(isa, isa)
        assert llm.report_columns["cpu_kernels"] == expected
        decoder = llm.engine.executor.model.cpu_decoder
        assert (decoder is None) if isa == "off" else decoder.isa == expected
        output = llm.generate(list(range(10, 40)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert output.error is None and len(output.outputs[0].token_ids) == 3


def test_an_instruction_set_this_cpu_lacks_is_refused_with_the_ones_it_runs(tiny_llama_plan, monkeypatch):
    from kvtool.config import EngineConfig
    from kvtool.errors import KvtoolError
    import kvtool.runtime.model_runner as model_runner

    monkeypatch.setattr(model_runner, "supported_isas", lambda: ["avx2", "generic"])  # an AVX2-only CPU
    with pytest.raises(KvtoolError, match=r"--cpu_kernels_isa avx512: this CPU does not run kvtool's avx512 kernels; "
                                          r"it runs avx2, generic"):
        LLM(model=str(tiny_llama_plan), config=EngineConfig(cpu_kernels_isa="avx512"))
