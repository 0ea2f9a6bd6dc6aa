"""The replay driver and a bench run over a fake engine with deterministic timings (tests/bench_fakes.py).

The fake engine computes every admitted context in one step costing 10 ms + 1 ms per uncached
prompt token, then emits one token per 10 ms step, on a clock only it and the replay's sleeps
advance; so arrival and token times are exact.
"""

from __future__ import annotations

import csv

import pytest
from bench_fakes import FakeClock, FakeEngine, FakeLLM, FakeTokenizer

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.bench.precheck import request_problems
from kvtool.bench.replay import Replayer, rate_due_times, session_key
from kvtool.bench.runner import run_bench
from kvtool.config import ReplayOptions
from kvtool.errors import DatasetError
from kvtool.flags import configs
from kvtool.workloads.requests import dataset_requests


def dataset_of(tmp_path, lines, name="d.jsonl"):
    return load_dataset(write_jsonl(tmp_path / name, lines))


def flags(**values):
    """The configuration `kvtool bench` builds from these flags: (EngineConfig, ReplayOptions)."""
    return configs(values)


def bench(llm, dataset, config, **kwargs):
    """run_bench of the dataset through the fake LLM, configured as ``config`` (from flags) asks."""
    llm.config, replay = config
    return run_bench(llm, dataset, replay, **kwargs)


def req(ids, out=2, **extra):
    return {"input_ids": list(ids), "output_tokens": out, **extra}


class Harness:
    """A fake engine on a fake clock, and a replayer that records the requests that finished."""

    def __init__(self, options=ReplayOptions(), vocab_size=1000, **engine_kwargs):
        self.clock = FakeClock()
        self.engine = FakeEngine(clock=self.clock, advance=self.clock.advance, vocab_size=vocab_size, **engine_kwargs)
        self.tokenizer = FakeTokenizer(vocab_size)
        self.replayer = Replayer(self.engine, options, clock=self.clock)
        self.finished = []

    def run(self, dataset, *, timed=True, requests=None):
        requests = requests if requests is not None else dataset_requests(dataset, tokenizer=self.tokenizer)
        return self.replayer.run(requests, lambda request, start: self.finished.append(request), timed=timed)


def index(request):
    """The request's position in its dataset (its name in reports, the lines having no request_id)."""
    return int(request.name)


def test_offline_queues_everything_at_the_start_and_times_are_exact(tmp_path):
    h = Harness()
    start = h.run(dataset_of(tmp_path, [req(range(10, 20)), req(range(30, 40))]))
    assert list(h.engine.add_times.values()) == [start, start]
    for done in h.finished:
        # One context step for both: 10 ms + 20 tokens * 1 ms; then one 10 ms decode step.
        assert done.arrival_time == start
        assert done.first_token_time == pytest.approx(start + 0.030)
        assert done.finish_time == pytest.approx(start + 0.040)


def test_sequential_hands_over_the_next_request_when_the_previous_finishes(tmp_path):
    h = Harness(ReplayOptions(mode="sequential"))
    h.run(dataset_of(tmp_path, [req(range(10, 20)), req(range(30, 40)), req(range(50, 60))]))
    assert h.engine.max_in_engine == 1
    for previous, following in zip(h.finished, h.finished[1:]):
        assert following.arrival_time == previous.finish_time
        # Alone in the engine: 10 ms + 10 tokens * 1 ms to the first token.
        assert following.first_token_time - following.arrival_time == pytest.approx(0.020)


def test_concurrency_keeps_n_requests_in_flight(tmp_path):
    h = Harness(ReplayOptions(concurrency=3))
    h.run(dataset_of(tmp_path, [req([10 + i] * 4, out=1 + i % 3) for i in range(10)]))
    assert h.engine.max_in_engine == 3
    assert sorted(index(f) for f in h.finished) == list(range(10))
    # Requests are handed over in dataset order as slots free up.
    issued = sorted(h.finished, key=lambda f: f.request_id)  # engine ids count up as requests are issued
    assert [index(f) for f in issued] == list(range(10))
    # A new request is handed over only when one finished (the 4th waits for the first finish).
    first_finish = min(f.finish_time for f in h.finished)
    assert h.engine.add_times[issued[3].request_id] >= first_finish


def test_request_rate_issues_requests_on_a_seeded_poisson_schedule(tmp_path):
    h = Harness(ReplayOptions(request_rate=20.0, seed=5))
    start = h.run(dataset_of(tmp_path, [req([10 + i] * 8) for i in range(6)]))
    due = rate_due_times(6, 20.0, 5)
    by_index = sorted(h.finished, key=lambda f: index(f))
    assert [f.arrival_time - start for f in by_index] == pytest.approx(due)
    # No request reaches the engine before it is due.
    for done in by_index:
        assert h.engine.add_times[done.request_id] >= done.arrival_time - 1e-12
    assert due[0] == 0.0 and all(b > a for a, b in zip(due, due[1:]))
    assert rate_due_times(6, 20.0, 5) == due and rate_due_times(6, 20.0, 6) != due


def test_poisson_gaps_have_the_requested_mean():
    due = rate_due_times(20001, 4.0, 0)
    assert due[-1] / 20000 == pytest.approx(0.25, rel=0.03)


def test_burstiness_shapes_the_gaps_as_a_gamma_distribution_with_the_same_mean(tmp_path):
    # vllm bench serve's --burstiness: gamma gaps of shape b and mean 1/rate, so their coefficient of
    # variation is 1/sqrt(b); 1 is the Poisson schedule itself.
    assert rate_due_times(50, 4.0, 3, burstiness=1.0) == rate_due_times(50, 4.0, 3)
    for burstiness in (0.25, 4.0):
        due = rate_due_times(40001, 4.0, 0, burstiness)
        gaps = [b - a for a, b in zip(due, due[1:])]
        mean = sum(gaps) / len(gaps)
        spread = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        assert mean == pytest.approx(0.25, rel=0.03)
        assert spread / mean == pytest.approx(burstiness ** -0.5, rel=0.05)
    h = Harness(ReplayOptions(request_rate=20.0, seed=5, burstiness=0.5))
    start = h.run(dataset_of(tmp_path, [req([10 + i] * 8) for i in range(6)]))
    by_index = sorted(h.finished, key=lambda f: index(f))
    assert [f.arrival_time - start for f in by_index] == pytest.approx(rate_due_times(6, 20.0, 5, 0.5))


@pytest.mark.parametrize(("values", "message"), [
    ({"burstiness": 0.5}, "--burstiness 0.5 shapes the gaps of request_rate's arrivals: give a request_rate too"),
    ({"burstiness": 0, "request_rate": 2.0}, r"--burstiness must be a number > 0 \(1: Poisson arrivals"),
    ({"burstiness": "x", "request_rate": 2.0}, "--burstiness must be a number > 0 .* got 'x'"),
])
def test_a_bad_burstiness_is_named(values, message):
    with pytest.raises(ValueError, match=message):
        flags(**values)


def test_dataset_arrival_times_are_honoured(tmp_path):
    h = Harness()
    start = h.run(dataset_of(tmp_path, [req([11] * 4, arrival_time_s=0.5), req([12] * 4, arrival_time_s=0.1),
                                        req([13] * 4)]))
    arrivals = {index(f): f.arrival_time - start for f in h.finished}
    assert arrivals == pytest.approx({0: 0.5, 1: 0.1, 2: 0.0})
    assert h.clock.sleeps  # it waited for the later arrivals instead of spinning


def test_untimed_run_ignores_arrival_times(tmp_path):
    h = Harness(ReplayOptions(request_rate=1.0))
    start = h.run(dataset_of(tmp_path, [req([11] * 4, arrival_time_s=5.0), req([12] * 4)]), timed=False)
    assert [f.arrival_time for f in h.finished] == [start, start]


def test_a_session_turn_extends_the_previous_prompt_and_answer(tmp_path):
    h = Harness()
    h.run(dataset_of(tmp_path, [
        {"session_id": "a", "turn": 0, "input_ids": [11, 12, 13], "output_tokens": 2},
        {"session_id": "b", "turn": 0, "input_ids": [21, 22], "output_tokens": 1},
        {"session_id": "a", "turn": 1, "input_ids": [14, 15], "output_tokens": 2},
        {"session_id": "a", "turn": 2, "input_ids": [16], "output_tokens": 1},
    ]))
    by_key = {session_key(f): f for f in h.finished}
    turn0, turn1, turn2 = by_key[("a", 0)], by_key[("a", 1)], by_key[("a", 2)]
    prompt0 = turn0.prompt_token_ids
    prompt1 = turn1.prompt_token_ids
    assert prompt1 == list(prompt0) + turn0.output_token_ids + [14, 15]
    assert turn2.prompt_token_ids == prompt1 + turn1.output_token_ids + [16]
    # Each turn is handed over only after the previous one finished, and arrives then.
    assert h.engine.add_times[turn1.request_id] >= turn0.finish_time
    assert turn1.arrival_time == h.engine.add_times[turn1.request_id]
    assert h.engine.add_times[turn2.request_id] >= turn1.finish_time


def test_session_history_carries_over_from_warmup_to_the_measured_run(tmp_path):
    h = Harness()
    dataset = dataset_of(tmp_path, [{"session_id": "a", "turn": 0, "input_ids": [11, 12], "output_tokens": 2},
                                    {"session_id": "a", "turn": 1, "input_ids": [13], "output_tokens": 1}])
    requests = dataset_requests(dataset, tokenizer=h.tokenizer)
    h.run(dataset, requests=requests[:1], timed=False)
    h.run(dataset, requests=requests[1:])
    first, second = h.finished
    assert second.prompt_token_ids == [11, 12] + first.output_token_ids + [13]


def test_extra_ids_follow_the_tokens_across_turns(tmp_path):
    h = Harness()
    h.run(dataset_of(tmp_path, [
        {"session_id": "a", "turn": 0, "input_ids": [11, 12], "output_tokens": 2},
        {"session_id": "a", "turn": 1, "input_ids": [13, 14], "extra_ids": [7, 0], "output_tokens": 1}]))
    first, second = h.finished
    assert first.extra_ids is None
    assert second.extra_ids == [0, 0, 0, 0, 7, 0]  # history and answer are normal tokens


def test_later_followups_go_before_new_requests_under_a_concurrency_limit(tmp_path):
    h = Harness(ReplayOptions(concurrency=1))
    h.run(dataset_of(tmp_path, [{"session_id": "a", "turn": 0, "input_ids": [11], "output_tokens": 1},
                                req([20, 21], out=1),
                                {"session_id": "a", "turn": 1, "input_ids": [12], "output_tokens": 1}]))
    assert [index(f) for f in h.finished] == [0, 2, 1]


def test_dataset_requests_are_greedy_ignore_eos_and_carry_priority_and_salt(tmp_path):
    h = Harness()
    h.run(dataset_of(tmp_path, [req([11, 12], out=5, priority=90, cache_salt="alice"), req([13], out=1)]))
    first, second = (f.sampling_params for f in sorted(h.finished, key=index))
    assert (first.max_tokens, first.temperature, first.ignore_eos, first.priority, first.cache_salt) == \
        (5, 0.0, True, 90, "alice")
    assert second.priority == 35 and second.cache_salt is None  # the engine's defaults


def test_text_prompts_are_tokenized_and_later_turns_get_no_second_bos(tmp_path):
    class BosTokenizer(FakeTokenizer):
        bos_token_id = 1

        def encode(self, text):
            return [self.bos_token_id] + super().encode(text)

    h = Harness()
    h.tokenizer = BosTokenizer(1000)
    h.run(dataset_of(tmp_path, [{"session_id": "a", "turn": 0, "prompt": "hi", "max_tokens": 1},
                                {"session_id": "a", "turn": 1, "prompt": "yo", "max_tokens": 1}]))
    first, second = h.finished
    assert first.prompt_token_ids == [1, ord("h"), ord("i")]
    assert second.prompt_token_ids == [1, ord("h"), ord("i")] + first.output_token_ids + [ord("y"), ord("o")]


def test_token_ids_outside_the_vocabulary_name_the_line(tmp_path):
    dataset = dataset_of(tmp_path, [req([1, 2]), req([3, 5000])], name="v.jsonl")
    requests = dataset_requests(dataset, tokenizer=FakeTokenizer(1000))
    assert request_problems(requests, FakeEngine()) == [
        f"{tmp_path / 'v.jsonl'} line 2: token id 5000 is outside the model's vocabulary [0, 1000)"]


def test_every_request_the_engine_would_refuse_is_listed_before_anything_runs(tmp_path):
    lines = [req([11]), req([12] * 7), req([13]), req([14] * 9)] + [req([15] * 8) for _ in range(6)]
    dataset = dataset_of(tmp_path, lines, name="long.jsonl")
    llm, clock = fake_llm(max_seq_len=8)
    with pytest.raises(DatasetError) as error:
        bench(llm, dataset, flags(), label="x", requests_csv=tmp_path / "r.csv")
    message = str(error.value)
    assert message.startswith(f"8 of the 10 requests in {tmp_path / 'long.jsonl'} cannot run")
    assert "long.jsonl line 2: 7 prompt tokens + 2 output tokens exceed max_seq_len 8" in message
    assert "long.jsonl line 4: 9 prompt tokens" in message and "... and 3 more" in message
    assert "line 1:" not in message and "line 3:" not in message
    assert llm.engine.num_steps == 0 and not (tmp_path / "r.csv").exists()  # nothing ran, nothing written


def test_a_session_turn_is_checked_with_its_history(tmp_path):
    # Turn 1's prompt: 3 + 2 generated + 3 new = 8 tokens, + 2 to generate = 10 > max_seq_len 9.
    dataset = dataset_of(tmp_path, [req([11] * 3, session_id="s", turn=0), req([12] * 3, session_id="s", turn=1)],
                         name="chat.jsonl")
    requests = dataset_requests(dataset, tokenizer=FakeTokenizer(1000))
    problem, = request_problems(requests, FakeEngine(max_seq_len=9))
    assert problem.endswith("chat.jsonl line 2: 8 prompt tokens + 2 output tokens exceed max_seq_len 9")


def test_a_request_refused_during_the_run_is_an_error_row_and_the_run_goes_on(tmp_path):
    refuse = lambda prompt: "no room today" if prompt[0] == 12 else None  # noqa: E731
    dataset = dataset_of(tmp_path, [req([11]), req([12] * 3), req([13]), req([12] * 2, session_id="s", turn=0),
                                    req([14], session_id="s", turn=1)], name="d.jsonl")
    llm, clock = fake_llm(refuse_when_added=refuse)
    result = bench(llm, dataset, flags(mode="sequential"), label="x", requests_csv=tmp_path / "r.csv")
    rows = {row["request_id"]: row for row in read_rows(tmp_path / "r.csv")}
    assert set(rows) == {"0", "1", "2", "3", "4"}
    assert "d.jsonl line 2: the engine refused the request (3 prompt tokens): request" in rows["1"]["error"]
    assert "no room today" in rows["1"]["error"] and rows["1"]["ttft_ms"] == ""
    assert "not sent: turn 0 of session 's' failed" in rows["4"]["error"]
    assert rows["0"]["error"] == rows["2"]["error"] == ""
    assert result.row["num_requests"] == 2 and result.row["num_errors"] == 3 and not result.interrupted


def test_an_error_that_stops_the_engine_keeps_what_finished(tmp_path):
    dataset = dataset_of(tmp_path, [req([11 + i] * 4, out=2) for i in range(6)])
    llm, clock = fake_llm(fail_at_step=5)
    result = bench(llm, dataset, flags(mode="sequential"), label="f", requests_csv=tmp_path / "r.csv")
    assert result.interrupted and "step 5: the engine failed" in str(result.failure)
    assert result.row["run_error"] == "step 5: the engine failed" and result.row["num_requests"] == 2
    assert [row["request_id"] for row in read_rows(tmp_path / "r.csv")] == ["0", "1"]


def test_schedule_validation():
    with pytest.raises(ValueError, match="mode 'batch' is unknown"):
        ReplayOptions(mode="batch")
    with pytest.raises(ValueError, match="contradicts concurrency 4"):
        ReplayOptions(mode="sequential", concurrency=4)
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        ReplayOptions(request_rate=0)
    assert ReplayOptions(mode="SEQUENTIAL").max_in_flight == 1
    assert ReplayOptions(concurrency=2, request_rate=1.5).describe() == "concurrency=2,rate=1.5/s"


# -- a whole bench run ------------------------------------------------------------------------

def fake_llm(**kwargs):
    clock = FakeClock()
    llm = FakeLLM(clock=clock, **kwargs)
    return llm, clock


def read_rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_warmup_requests_run_first_uncounted_and_stats_reset_after_them(tmp_path):
    prefix = list(range(100, 116))
    dataset = dataset_of(tmp_path, [req(prefix + [i], out=2, request_id=f"r{i}") for i in range(5)])
    llm, clock = fake_llm()
    result = bench(llm, dataset, flags(warmup=2), label="w", requests_csv=tmp_path / "r.csv")
    rows = read_rows(tmp_path / "r.csv")
    assert [row["request_id"] for row in rows] == ["r2", "r3", "r4"]
    assert llm.engine.num_resets == 1
    assert result.row["num_requests"] == 3 and result.row["num_measured_requests"] == 3
    # The warm-up cached the shared 16-token prefix (4 blocks of 4): every measured request reuses it.
    assert [int(row["reused_tokens"]) for row in rows] == [16, 16, 16]
    assert result.row["reused_blocks"] == 12 and result.row["missed_blocks"] == 0


def test_warmup_counts_in_stats_keeps_the_counters(tmp_path):
    dataset = dataset_of(tmp_path, [req([11] * 8) for _ in range(3)])
    llm, clock = fake_llm()
    bench(llm, dataset, flags(warmup=1, warmup_counts_in_stats=True), label="w",
              requests_csv=tmp_path / "r.csv")
    assert llm.engine.num_resets == 0


def test_num_requests_limits_the_measured_requests(tmp_path):
    dataset = dataset_of(tmp_path, [req([11 + i] * 4) for i in range(6)])
    llm, clock = fake_llm()
    result = bench(llm, dataset, flags(warmup=1, num_requests=2), label="n",
                       requests_csv=tmp_path / "r.csv")
    assert [row["request_id"] for row in read_rows(tmp_path / "r.csv")] == ["1", "2"]
    assert result.row["num_requests_limit"] == 2


def test_summary_row_records_configuration_metrics_stats_device_and_version(tmp_path):
    dataset = dataset_of(tmp_path, [req(range(10, 20)), req(range(30, 40))])
    llm, clock = fake_llm()
    result = bench(llm, dataset, flags(kv_host_cache_bytes="1GiB", scheduler_policy="MAX_UTILIZATION"),
                       label="cfg", requests_csv=tmp_path / "r.csv",
                       config_columns={"model": "preset:fake"})
    row = result.row
    assert row["label"] == "cfg" and row["interrupted"] is False and row["model"] == "preset:fake"
    assert row["plan_path"] == "plans/fake" and row["plan_tokens_per_block"] == 4 and row["plan_dtype"] == "float32"
    assert row["tokens_per_block"] == 4
    assert row["kv_host_cache_bytes"] == 1 << 30 and row["scheduler_policy"] == "max_utilization"
    assert row["enable_kv_cache_reuse"] is True and row["replay"] == "offline"
    assert row["ttft_ms_mean"] == pytest.approx(30.0) and row["e2e_ms_p99"] == pytest.approx(40.0)
    assert row["output_tokens_per_s"] == pytest.approx(4 / 0.040)
    assert row["device"] == "fake: deterministic test engine"
    assert row["kvtool_version"] and row["git_revision"]
    assert "cache_hit_rate" in row and "host" in row


def test_interrupted_run_keeps_finished_rows_and_summarizes_them(tmp_path):
    dataset = dataset_of(tmp_path, [req([11 + i] * 4, out=2) for i in range(6)])
    llm, clock = fake_llm(interrupt_at_step=5)
    result = bench(llm, dataset, flags(mode="sequential"), label="int", requests_csv=tmp_path / "r.csv")
    # Two steps per request: requests 0 and 1 finished before the Ctrl-C during step 5.
    assert result.interrupted and result.row["interrupted"] is True
    assert [row["request_id"] for row in read_rows(tmp_path / "r.csv")] == ["0", "1"]
    assert result.row["num_requests"] == 2
    assert result.row["ttft_ms_mean"] == pytest.approx(10 + 4 * 1)


def test_nothing_to_measure_is_a_clear_error(tmp_path):
    dataset = dataset_of(tmp_path, [req([11])])
    llm, clock = fake_llm()
    with pytest.raises(ValueError, match="nothing to measure"):
        bench(llm, dataset, flags(warmup=1), label="x", requests_csv=tmp_path / "r.csv")
