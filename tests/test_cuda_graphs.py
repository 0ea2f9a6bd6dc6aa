"""Steps replayed from CUDA graphs: which steps qualify and what a padded graph batch holds.

The replay itself needs a GPU: tests/test_llm_generation.py and tests/test_cuda_graphs_gpu.py check
that greedy outputs are the same with graphs on and off there. These check the host side, which runs
anywhere (the padded prefill / mixed metadata itself: tests/test_step_batch.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_model_runner import TOKENS_PER_BLOCK, runner  # noqa: F401 - the fixture: a CPU tiny-llama's runner

from kvtool.runtime.cuda_graphs import DecodeBatch, StaticInputs, batch_buckets, pad_decode_batch
from kvtool.runtime.model_runner import StepRequest
from kvtool.runtime.step_batch import graph_layouts, layout_for


@pytest.fixture
def graphs_of_four(runner, monkeypatch):  # noqa: F811 - runner is the fixture
    """The runner as if graphs for batches of up to 4 and 8 blocks per row had been captured (a CPU
    runner has none: it runs eagerly)."""
    assert runner.decode_graphs is None
    monkeypatch.setattr(runner, "decode_graphs", SimpleNamespace(max_batch_size=4, max_blocks=8))
    return runner


def decode_row(token: int, num_cached: int, first_block: int, *, samples: bool = True) -> StepRequest:
    num_blocks = -(-(num_cached + 1) // TOKENS_PER_BLOCK)
    return StepRequest(np.array([token], np.int32), np.arange(first_block, first_block + num_blocks, dtype=np.int32),
                       num_cached, False, samples)


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_buckets(0)


def test_a_decode_step_becomes_the_same_metadata_the_eager_path_builds(graphs_of_four):
    requests = [decode_row(11, 5, 0), decode_row(12, 8, 10), decode_row(13, 0, 20)]
    batch = graphs_of_four._graph_batch(requests)
    input_ids, meta, _ = graphs_of_four.prepare(requests)
    assert batch.input_ids.tolist() == input_ids.tolist() == [11, 12, 13]
    assert batch.positions.tolist() == meta.positions.tolist()
    assert batch.seq_lens.tolist() == meta.seq_lens.tolist() == [6, 9, 1]
    assert batch.slot_mapping.tolist() == meta.slot_mapping.tolist() == [1 * 4 + 1, 12 * 4 + 0, 20 * 4 + 0]
    assert batch.block_tables.tolist() == meta.block_tables.tolist()


@pytest.mark.parametrize("why, requests, layered_copies", [
    ("a multi-token context chunk", [decode_row(11, 5, 0), StepRequest(np.arange(3, dtype=np.int32),
                                                                          np.arange(4, 6, dtype=np.int32), 0, True, True)],
     False),
    ("more rows than the largest graph", [decode_row(11, 5, 4 * i) for i in range(5)], False),
    ("a row longer than the graphs' block tables", [decode_row(11, 40, 0)], False),
    ("copies landing layer by layer", [decode_row(11, 5, 0)], True),
])
def test_steps_a_graph_cannot_replay_run_eagerly(graphs_of_four, monkeypatch, why, requests, layered_copies):
    monkeypatch.setattr(graphs_of_four.pools, "_layer_events", [object()] if layered_copies else None)
    assert graphs_of_four._graph_batch(requests) is None, why


def test_padding_rows_repeat_the_first_row_and_write_no_kv():
    batch = DecodeBatch(np.array([7, 8]), np.array([5, 9]), np.array([6, 10], np.int32),
                        np.array([[3, 4, -1], [5, 6, 7]], np.int32), np.array([13, 29]))
    padded = pad_decode_batch(batch, num_rows=4, max_blocks=5)
    assert padded.input_ids.tolist() == [7, 8, 7, 7]
    assert padded.positions.tolist() == [5, 9, 5, 5]
    assert padded.seq_lens.tolist() == [6, 10, 6, 6]
    assert padded.slot_mapping.tolist() == [13, 29, -1, -1]  # the append kernel skips slot -1
    assert padded.block_tables.tolist() == [[3, 4, -1, -1, -1], [5, 6, 7, -1, -1], [3, 4, -1, -1, -1],
                                            [3, 4, -1, -1, -1]]


def test_a_batch_larger_than_its_bucket_is_refused():
    batch = DecodeBatch(np.arange(3), np.arange(3), np.ones(3, np.int32), np.zeros((3, 1), np.int32), np.arange(3))
    with pytest.raises(ValueError, match="3 rows"):
        pad_decode_batch(batch, num_rows=2, max_blocks=1)
    with pytest.raises(ValueError, match="blocks"):
        pad_decode_batch(batch, num_rows=4, max_blocks=0)


# ---- prefill / mixed steps ----

class RecordingMixedGraphs:
    """Stands in for MixedGraphs on a CPU runner: the real bucket layouts, replays recorded."""

    def __init__(self, max_batch_size: int, max_seq_len: int, max_num_tokens: int) -> None:
        max_blocks = -(-max_seq_len // TOKENS_PER_BLOCK)
        self.layouts = graph_layouts(max_num_tokens, max_batch_size, max_blocks)
        self.replayed: list[tuple[int, int]] = []  # (step tokens, bucket tokens)

    def layout(self, step):
        return layout_for(self.layouts, step)

    def run(self, step, layout):
        self.replayed.append((step.num_tokens, layout.num_tokens))
        return torch.zeros(len(step.sample_rows), 8)


def prompt(num_new: int, num_cached: int, first_block: int) -> StepRequest:
    num_blocks = -(-(num_new + num_cached) // TOKENS_PER_BLOCK)
    return StepRequest(np.arange(num_new, dtype=np.int32) % 50,
                       np.arange(first_block, first_block + num_blocks, dtype=np.int32), num_cached, True, True)


@pytest.fixture
def mixed_graphs(runner, monkeypatch):  # noqa: F811 - runner is the fixture
    graphs = RecordingMixedGraphs(max_batch_size=4, max_seq_len=64, max_num_tokens=64)
    monkeypatch.setattr(runner, "mixed_graphs", graphs)
    return graphs


def test_a_prompt_over_a_cached_prefix_replays_the_graph_of_its_token_bucket(runner, mixed_graphs):  # noqa: F811
    logits = runner.execute([prompt(20, 8, 0)])
    assert mixed_graphs.replayed == [(20, 24)]
    assert logits.shape == (1, 8)


def test_a_mixed_step_of_context_chunks_and_decode_rows_replays_one_graph(runner, mixed_graphs):  # noqa: F811
    runner.execute([prompt(10, 0, 0), decode_row(7, 5, 4), prompt(3, 0, 8)])
    assert mixed_graphs.replayed == [(14, 16)]


def test_steps_no_mixed_graph_holds_run_eagerly(runner, mixed_graphs, monkeypatch):  # noqa: F811
    runner.execute([prompt(60, 0, 0)])  # 60 tokens: within the 64-token limit, bucket 64
    assert mixed_graphs.replayed == [(60, 64)]
    mixed_graphs.layouts = [layout for layout in mixed_graphs.layouts if layout.num_tokens < 64]  # largest: 48
    eager = runner.execute([prompt(60, 0, 0)])
    assert mixed_graphs.replayed == [(60, 64)] and eager.shape[0] == 1
    monkeypatch.setattr(runner.pools, "_layer_events", [object()])  # copies landing layer by layer
    waited = []
    monkeypatch.setattr(runner.pools, "wait_for_layer", waited.append)
    runner.execute([prompt(10, 0, 0)])
    assert waited == list(range(len(runner.model.layers)))
    assert mixed_graphs.replayed == [(60, 64)]


def test_static_inputs_are_views_of_one_buffer_filled_by_one_upload():
    fields = {"ids": ((5,), torch.int64), "lens": ((3,), torch.int32), "table": ((3, 2), torch.int32)}
    inputs = StaticInputs(fields, torch.device("cpu"))
    offsets = [t.data_ptr() - inputs.device_buffer.data_ptr() for t in inputs.tensors.values()]
    assert offsets == [0, 48, 64]  # each field 16-byte aligned
    inputs.upload({"ids": np.arange(5), "lens": np.array([1, 2, 3]), "table": np.array([[1, -1], [2, 3], [4, 5]])})
    assert inputs.tensors["ids"].tolist() == [0, 1, 2, 3, 4]
    assert inputs.tensors["table"].tolist() == [[1, -1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="exactly the fields"):
        inputs.upload({"ids": np.arange(5)})


def test_graphs_are_captured_with_the_garbage_collector_off(monkeypatch):
    # A collection inside a capture would run finalizers (an earlier LLM's graphs, streams) on the
    # capturing thread, whose CUDA calls invalidate the capture: the H100 run lost two LLMs to it.
    import gc

    from kvtool.runtime import cuda_graphs

    class FakeCapture:  # torch.cuda.graph's context, without a GPU
        def __init__(self, graph, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    collector_on = []

    def step():
        collector_on.append(gc.isenabled())
        return torch.zeros(1)

    assert gc.isenabled()
    graph, _ = cuda_graphs._capture(step, pool=None, device=torch.device("cpu"))
    assert graph == "graph"
    assert collector_on == [True, False]  # the eager warm-up as usual, the capture without collections
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graphs.gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()
