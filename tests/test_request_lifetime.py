"""A finished request leaves nothing behind: the scheduler forgets it once removed, the engine once it
finishes, so a long-lived LLM or `kvtool serve` holds memory for what runs, not for what ran.

"Flat" is checked four ways after a run: the requests each side still counts (the C++ scheduler's
records, the engine's), the Request objects still alive (found by the garbage collector), the Python
allocator's live blocks (sys.getallocatedblocks: whatever else a kept request would hold) and, where
glibc tells it, the bytes malloc has handed out (the C++ side's records and vectors). Before finished
requests were dropped, each one kept ~14 Python blocks and ~320 C++ bytes; the block limits below
allow under one a request (allocator and library caches settling), not a kept request.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import sys

import httpx
import numpy as np
import pytest
import torch
from serve_helpers import tiny_llm
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, run_steps

from kvtool import KvCacheConfig, SamplingParams, SchedulerConfig, _core
from kvtool.layers.sampler import make_generator, sample, step_picks
from kvtool.runtime.engine import Engine
from kvtool.runtime.request import Request
from kvtool.serve import create_app

State = _core.RequestState
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _malloc_in_use():
    """Bytes malloc has handed out and not had back (glibc's mallinfo2), or None where it cannot say."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: mallinfo2().uordblks


def _num_alive(cls: type) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is cls)


class Footprint:
    """What the process holds, before and after a run of requests."""

    def __init__(self) -> None:
        self._heap = _malloc_in_use()
        gc.collect()
        self.num_requests_alive = _num_alive(Request)
        self.blocks = sys.getallocatedblocks()
        self.heap = self._heap() if self._heap else None

    def assert_flat(self, num_requests: int, *, max_blocks: int, max_heap_bytes: int) -> None:
        gc.collect()
        assert _num_alive(Request) <= self.num_requests_alive
        grown_blocks = sys.getallocatedblocks() - self.blocks
        assert grown_blocks <= max_blocks, (f"{grown_blocks} more Python blocks after {num_requests} requests "
                                            f"({grown_blocks / num_requests:.2f} a request)")
        if self.heap is not None:
            grown = self._heap() - self.heap
            assert grown <= max_heap_bytes, (f"malloc holds {grown} more bytes after {num_requests} requests "
                                             f"({grown / num_requests:.1f} a request)")


# -- the scheduler --------------------------------------------------------------------------

def test_a_removed_request_is_unknown_and_its_record_is_gone():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 6), 3)
    run_steps(scheduler, model)
    assert scheduler.request_state(0) == State.FINISHED and scheduler.num_requests() == 1  # kept until removed
    scheduler.remove_request(0)
    assert scheduler.num_requests() == 0
    for call in (scheduler.request_state, scheduler.request_stats, scheduler.remove_request, scheduler.finish_request):
        with pytest.raises(KeyError, match="request 0"):
            call(0)


def test_removing_a_running_request_finishes_it_and_frees_its_blocks():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 10), 50)
    add(scheduler, 1, distinct_prompt(1, 10), 50)
    run_steps(scheduler, model, until=lambda run: len(run.batches) == 3)
    scheduler.remove_request(0)  # e.g. a client that went away
    assert scheduler.num_running_requests() == 1 and scheduler.num_requests() == 1
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 3  # request 1's 12 tokens
    scheduler.remove_request(1)
    assert not scheduler.has_unfinished_requests() and scheduler.num_requests() == 0
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0
    assert scheduler.cache_manager.check_invariants() == []


def test_a_request_removed_while_its_step_runs_is_skipped_when_the_step_completes():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 4), 1)
    add(scheduler, 1, distinct_prompt(1, 4), 1)
    batch = scheduler.schedule()
    request_ids, token_ids = model.execute(batch)
    scheduler.remove_request(1)
    finished = scheduler.complete_step(np.array(request_ids, dtype=np.int64), np.array(token_ids, dtype=np.int32))
    assert finished == [0] and scheduler.num_requests() == 1
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0


def test_a_queued_request_removed_never_runs():
    scheduler, model = make_scheduler(max_batch_size=1)
    add(scheduler, 0, distinct_prompt(0, 4), 2)
    add(scheduler, 1, distinct_prompt(1, 4), 2)
    scheduler.remove_request(1)
    run = run_steps(scheduler, model)
    assert all(r.request_id == 0 for batch in run.batches for r in batch.requests)
    assert scheduler.num_queued_requests() == 0


# -- the engine, 100,000 requests -----------------------------------------------------------

class _ArgmaxZeroRunner:
    """An executor whose forward costs nothing: zero logits, so greedy sampling gives token 0."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def execute_step(self, batch, requests, generators):
        if not len(batch):
            return None
        params = [r.sampling_params for r in requests]
        picks = step_picks(params, generators)
        return sample(torch.zeros(len(requests), self.vocab_size), params, picks and picks.uniforms)

    def make_generator(self, params):
        return make_generator(params)


def _engine_with_a_free_forward(vocab_size: int = 64) -> Engine:
    cache = KvCacheConfig().to_core(tokens_per_block=16, num_primary_blocks=16, num_secondary_blocks=0,
                                    max_attention_window=None)
    scheduler = SchedulerConfig().to_core(max_batch_size=8, max_num_tokens=64, max_seq_len=64)
    return Engine(_ArgmaxZeroRunner(vocab_size), cache, scheduler, vocab_size=vocab_size, eos_token_ids=[],
                  bytes_per_token=1)


def test_engine_memory_is_flat_over_100000_requests():
    # The engine's own code on every request (add, schedule, sample, complete, finish); only the
    # model's forward is free, so 100,000 requests take seconds, not the minutes of a real forward.
    engine = _engine_with_a_free_forward()

    def run(num_requests: int) -> None:
        for i in range(num_requests):
            engine.add_request(Request([i % 64], ONE_TOKEN))
            while engine.has_unfinished_requests():
                engine.step()

    run(1000)  # warm-up: the allocator's pools, the cache's first blocks
    footprint = Footprint()
    run(100_000)
    assert engine.num_requests == 0 and engine.scheduler.num_requests() == 0
    footprint.assert_flat(100_000, max_blocks=1000, max_heap_bytes=1 << 20)


# -- the LLM API and kvtool serve, each with the tiny model's real forward ------------------

@pytest.fixture(scope="module")
def llm(tiny_llama_plan):
    # One torch thread: on a 2-core machine shared with other work, a 2-thread forward of the tiny model
    # waits for the descheduled thread at every op (measured: 70 ms a step instead of 3).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llm(tiny_llama_plan, max_batch_size=8)
    torch.set_num_threads(threads)


def test_llm_memory_is_flat_over_4000_requests(llm):
    # 8 one-token prompts a call (one step each); every output is dropped before the next call.
    def run(num_calls: int) -> None:
        for i in range(num_calls):
            outputs = llm.generate([[(8 * i + j) % 1000 + 1] for j in range(8)], ONE_TOKEN)
            assert all(o.finished and len(o.outputs[0].token_ids) == 1 for o in outputs)

    run(50)
    footprint = Footprint()
    run(500)
    assert llm.engine.num_requests == 0 and llm.engine.scheduler.num_requests() == 0
    footprint.assert_flat(4000, max_blocks=4000, max_heap_bytes=256 << 10)


def test_a_finished_output_keeps_the_request_record_the_engine_let_go(llm):
    output = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    record = output.request
    assert record.request_id == output.request_id and record.finish_reason == "length"
    assert record.output_token_ids == output.outputs[0].token_ids and len(record.token_times) == 3
    with pytest.raises(KeyError):
        llm.engine.scheduler.request_stats(output.request_id)


def test_closing_a_stream_early_aborts_its_request(llm):
    stream = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    first = next(stream)
    stream.close()
    assert first.request.finish_reason == "abort" and len(first.request.output_token_ids) < 50
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.num_requests() == 0
    assert llm.engine.scheduler.cache_manager.stats().primary.num_used_blocks == 0


def test_serve_memory_is_flat_over_1000_sequential_requests(llm):
    app = create_app(llm, served_model_name="tiny")
    body = {"model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0, "ignore_eos": True}

    async def run(client: httpx.AsyncClient, num_requests: int) -> None:
        for i in range(num_requests):
            body["prompt"] = [i % 1000 + 1]
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            body["stream"] = not body.get("stream")  # every other request streamed

    async def main() -> None:
        # The app's lifespan starts and stops its engine task, as under uvicorn; requests go in
        # without a socket.
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvtool") as client:
            await run(client, 300)  # warm-up: the app's and the libraries' caches settle
            footprint = Footprint()
            await run(client, 1000)
            engine = app.state.serve.engine_loop.engine
            assert engine.num_requests == 0 and engine.scheduler.num_requests() == 0
            footprint.assert_flat(1000, max_blocks=1000, max_heap_bytes=256 << 10)

    asyncio.run(main())
