"""`kvtool bench --endpoint URL` replays a dataset against an OpenAI-compatible server (here kvtool serve
on 127.0.0.1) and reports what the in-process replay reports: the same generated token ids and the
same reuse, per request and in the summary; errors the server answers become error rows."""

from __future__ import annotations

import csv
import re
import time

import pytest
from endpoint_servers import AsAnotherServer, serving
from serve_helpers import running_server, tiny_llm
from typer.testing import CliRunner

from kvtool import KvCacheConfig
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.bench.endpoint import EndpointLLM, EndpointOptions
from kvtool.bench.replay import rate_due_times
from kvtool.bench.runner import run_bench
from kvtool.cli import app
from kvtool.config import ReplayOptions, SamplingParams
from kvtool.runtime.request import MISS_REASONS, Request
from kvtool.serve import create_app

POOL = KvCacheConfig(max_tokens=1024)
SYSTEM = list(range(300, 348))  # 3 blocks of 16 shared by every request of the first group


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def read_rows(path):
    with open(path, newline="") as source:
        return list(csv.DictReader(source))


@pytest.fixture
def shared_prefix_dataset(tmp_path):
    lines = [{"input_ids": SYSTEM + [20 + i] * 5, "output_tokens": 4} for i in range(4)]
    lines += [{"input_ids": list(range(500, 540)) + [i], "output_tokens": 3} for i in range(3)]
    return write_jsonl(tmp_path / "shared.jsonl", lines)


@pytest.fixture
def sessions_dataset(tmp_path):
    return write_jsonl(tmp_path / "sessions.jsonl", [
        {"session_id": "a", "turn": 0, "input_ids": list(range(100, 140)), "output_tokens": 6},
        {"session_id": "b", "turn": 0, "input_ids": list(range(200, 230)), "output_tokens": 5},
        {"session_id": "a", "turn": 1, "input_ids": [7] * 12, "output_tokens": 4},
        {"session_id": "b", "turn": 1, "input_ids": [8] * 20, "output_tokens": 4},
        {"session_id": "a", "turn": 2, "input_ids": [9] * 9, "output_tokens": 2},
    ])


def replay_both(plan, dataset_path, replay: ReplayOptions, tmp_path):
    """The same replay in-process and through kvtool serve (each with a fresh cache of the same size)."""
    dataset = load_dataset(dataset_path)
    in_process_llm = tiny_llm(plan, kv_cache_config=POOL)
    in_process = run_bench(in_process_llm, dataset, replay, label="in-process", requests_csv=tmp_path / "a.csv")
    with running_server(tiny_llm(plan, kv_cache_config=POOL)) as server:
        endpoint_llm = EndpointLLM(EndpointOptions(url=server.url), timed=False)
        try:
            endpoint = run_bench(endpoint_llm, dataset, replay, label="endpoint", requests_csv=tmp_path / "b.csv")
        finally:
            endpoint_llm.shutdown()
    return in_process, endpoint


@pytest.mark.parametrize("replay", [ReplayOptions(mode="sequential"), ReplayOptions(concurrency=1, warmup=1)],
                         ids=["sequential", "warmup"])
def test_endpoint_and_in_process_replays_agree_on_tokens_and_reuse(tiny_llama_plan, shared_prefix_dataset, tmp_path,
                                                                   replay):
    in_process, endpoint = replay_both(tiny_llama_plan, shared_prefix_dataset, replay, tmp_path)

    def per_request(result):
        return [(r.request_id, r.input_tokens, r.output_token_ids, r.reused_tokens) for r in result.requests]

    assert per_request(endpoint) == per_request(in_process)
    assert all(r.ok and r.engine == "kvtool@endpoint" for r in endpoint.requests)
    for column in ("reused_blocks", "missed_blocks", "num_requests", "num_errors", "total_reused_tokens",
                   "token_hit_rate"):
        assert endpoint.row[column] == in_process.row[column], column
    assert endpoint.row["reused_blocks"] > 0
    # The server's cached_tokens as a share of the prompt tokens, as in-process runs count their reuse.
    assert endpoint.row["token_hit_rate"] == pytest.approx(
        sum(r.reused_tokens for r in endpoint.requests) / sum(r.input_tokens for r in endpoint.requests))


def test_token_id_sessions_carry_the_servers_answers(tiny_llama_plan, sessions_dataset, tmp_path):
    in_process, endpoint = replay_both(tiny_llama_plan, sessions_dataset, ReplayOptions(concurrency=2), tmp_path)
    by_id = {r.request_id: r for r in endpoint.requests}
    expected = {r.request_id: r for r in in_process.requests}
    assert set(by_id) == set(expected)
    for request_id, row in by_id.items():
        assert (row.input_tokens, row.output_token_ids, row.reused_tokens) == (
            expected[request_id].input_tokens, expected[request_id].output_token_ids, expected[request_id].reused_tokens)
    # Turn 2 of session a: turns 0 and 1 with their answers, 40+6+12+4 = 62 tokens, come before its 9 new ones;
    # the history's full blocks are reused.
    assert by_id["4"].input_tokens == 71 and by_id["4"].reused_tokens == 48


def test_the_cli_writes_rows_naming_the_endpoint_and_compare_reads_both(tiny_llama_plan, shared_prefix_dataset,
                                                                         tmp_path):
    in_process = invoke("bench", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, "--mode", "sequential",
                        "--max_tokens_in_paged_kv_cache", 1024, "--output", tmp_path / "in", "--label", "in-process")
    assert in_process.exit_code == 0, in_process.output
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL)) as server:
        result = invoke("bench", "--endpoint", server.url, "--dataset", shared_prefix_dataset, "--mode", "sequential",
                        "--output", tmp_path / "ep")
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "ep" / "requests.csv")
    assert {(r["engine"], r["endpoint"], r["label"]) for r in rows} == {("kvtool@endpoint", server.url + "/v1",
                                                                         "tiny@endpoint")}
    assert [r["reused_tokens"] for r in rows] == [r["reused_tokens"] for r in read_rows(tmp_path / "in" / "requests.csv")]
    summary, = read_rows(tmp_path / "ep" / "summary.csv")
    in_process_summary, = read_rows(tmp_path / "in" / "summary.csv")
    assert (summary["engine"], summary["endpoint"], summary["api"]) == ("kvtool@endpoint", server.url + "/v1",
                                                                        "completions")
    assert summary["reused_blocks"] == in_process_summary["reused_blocks"] == "13"
    for reason in MISS_REASONS:  # read from the server's /metrics
        column = f"missed_{reason}_blocks"
        assert summary[column] == in_process_summary[column] != "", column
    assert summary["num_errors"] == "0" and summary["ttft_ms_p50"]
    assert "enable_kv_cache_reuse" not in summary  # the server's configuration is not the bench's to report

    hit_rate = f"{float(summary['token_hit_rate']):.1%}"
    assert summary["token_hit_rate"] == in_process_summary["token_hit_rate"] and hit_rate != "0.0%"
    assert re.search(rf"token hit rate \(reused / prompt\) +│ +{re.escape(hit_rate)} │", result.output)

    compared = invoke("compare", tmp_path / "in" / "summary.csv", tmp_path / "ep" / "summary.csv")
    assert compared.exit_code == 0, compared.output
    assert "tiny@endpoint" in compared.output and "in-process" in compared.output
    hit_rate_row, = [line for line in compared.output.splitlines() if "token hit rate" in line]
    assert hit_rate_row.count(hit_rate) == 2


@pytest.mark.parametrize("cached_tokens", [True, False], ids=["reported", "not-reported"])
def test_another_servers_cached_tokens_are_the_summarys_token_hit_rate(tiny_llama_plan, shared_prefix_dataset,
                                                                       tmp_path, cached_tokens):
    """A server that is not kvtool has no cache counters to read: its cached_tokens are the only reuse
    figure, shown as the token hit rate; without them the hit rate is unknown, not 0."""
    app = AsAnotherServer(create_app(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), served_model_name="tiny"),
                          cached_tokens=cached_tokens)
    with serving(app) as url:
        result = invoke("bench", "--endpoint", url, "--dataset", shared_prefix_dataset, "--mode", "sequential",
                        "--output", tmp_path / "ep")
    assert result.exit_code == 0, result.output
    summary, = read_rows(tmp_path / "ep" / "summary.csv")
    assert summary["engine"] == "hosted@endpoint" and "cache_hit_rate" not in summary
    rows = read_rows(tmp_path / "ep" / "requests.csv")
    table_row, = [line for line in result.output.splitlines() if "token hit rate (reused / prompt) │" in line]
    if cached_tokens:
        reused, prompt = sum(int(r["reused_tokens"]) for r in rows), sum(int(r["input_tokens"]) for r in rows)
        # Full blocks of 16 reused: 3 of the system prompt by 3 requests, 2 of the second group's prefix by 2.
        assert reused == 16 * (3 * 3 + 2 * 2)
        assert float(summary["token_hit_rate"]) == pytest.approx(reused / prompt, abs=1e-6)
        assert f"{reused / prompt:.1%}" in table_row
    else:
        assert summary["token_hit_rate"] == summary["total_reused_tokens"] == ""
        assert table_row.split()[-2] == "-"
        assert "reported no cached tokens (usage.prompt_tokens_details): the token hit rate is unknown" in " ".join(
            result.output.split())


def test_requests_the_server_refuses_become_error_rows_and_the_bench_exits_3_saying_why(tiny_llama_plan, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7], "output_tokens": 2},
                                              {"input_ids": [1] * 300, "output_tokens": 2},
                                              {"input_ids": [5, 6, 8], "output_tokens": 2},
                                              {"input_ids": [1] * 310, "output_tokens": 2},
                                              {"input_ids": [5, 10**6], "output_tokens": 2},
                                              {"input_ids": [1] * 290, "output_tokens": 2}])
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL, max_seq_len=256)) as server:
        result = invoke("bench", "--endpoint", server.url, "--dataset", data, "--output", tmp_path / "ep")
        allowed = invoke("bench", "--endpoint", server.url, "--dataset", data, "--output", tmp_path / "allowed",
                         "--allow_errors")
    assert result.exit_code == 3, result.output
    rows = {r["request_id"]: r for r in read_rows(tmp_path / "ep" / "requests.csv")}
    assert [bool(rows[i]["error"]) for i in "012345"] == [False, True, False, True, True, True]
    assert rows["1"]["error"].startswith("HTTP 400: the prompt has 300 tokens and max_seq_len is 256")
    summary, = read_rows(tmp_path / "ep" / "summary.csv")  # written before the exit: nothing measured is lost
    assert (summary["num_requests"], summary["num_errors"], summary["interrupted"]) == ("2", "4", "False")
    # After the summary table: the count and the distinct errors, those differing only in numbers counted as one.
    text = " ".join(result.output.split())
    assert text.index("kvtool bench summary") < text.index("Error: 4 of 6 requests failed; the most frequent errors:")
    assert ("3 × HTTP 400: the prompt has 300 tokens and max_seq_len is 256" in text
            and "(and alike, with other numbers)" in text)
    assert f"1 × {rows['4']['error']}" in text
    assert "--allow_errors exits 0 when requests fail" in text

    assert allowed.exit_code == 0, allowed.output
    assert "Note: 4 of 6 requests failed" in " ".join(allowed.output.split())


def test_text_prompts_are_sent_as_text_to_completions_and_chat(tiny_llama_plan, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [
        {"session_id": "s", "turn": 0, "prompt": "Tell me about KV caches.", "max_tokens": 5},
        {"session_id": "s", "turn": 1, "prompt": "And block reuse?", "max_tokens": 3}])
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL)) as server:
        completions = invoke("bench", "--endpoint", server.url, "--dataset", data, "--output", tmp_path / "c")
        chat = invoke("bench", "--endpoint", server.url + "/v1", "--api", "chat", "--served_model", "tiny",
                      "--dataset", data, "--output", tmp_path / "chat")
    assert completions.exit_code == 0, completions.output
    assert chat.exit_code == 0, chat.output
    first, second = read_rows(tmp_path / "c" / "requests.csv")
    # The server's count (byte-level tokenizer: BOS + 24 bytes), then the history sent back as text.
    assert int(first["input_tokens"]) == 25
    assert int(second["input_tokens"]) > 25 + 16 and int(second["reused_tokens"]) >= 16
    first, second = read_rows(tmp_path / "chat" / "requests.csv")
    assert int(second["reused_tokens"]) >= 16 and not first["error"] and not second["error"]


@pytest.mark.parametrize("args, message", [
    (["--endpoint", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
    (["--endpoint", "ftp://x"], "is not an http(s) URL"),
    (["--endpoint", "http://127.0.0.1:9", "--plan", "p"], "leave out --plan, --model and --config"),
    (["--endpoint", "http://127.0.0.1:9", "--max_batch_size", "4"], "--max_batch_size configures kvtool's engine"),
    (["--endpoint", "http://127.0.0.1:9", "--api", "grpc"], "'grpc' is unknown"),
])
def test_endpoint_mistakes_are_one_line_errors(tmp_path, shared_prefix_dataset, args, message):
    result = invoke("bench", *args, "--dataset", shared_prefix_dataset, "--output", tmp_path / "o")
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_token_ids_cannot_go_to_chat(tiny_llama_plan, shared_prefix_dataset, tmp_path):
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL)) as server:
        result = invoke("bench", "--endpoint", server.url, "--api", "chat", "--dataset", shared_prefix_dataset,
                        "--output", tmp_path / "o")
    assert result.exit_code == 2
    assert "which /v1/chat/completions cannot take: use --api completions" in " ".join(result.output.split())


def test_poisson_arrivals_are_sent_when_due(tiny_llama_plan, tmp_path):
    lines = [{"input_ids": [5 + i] * 20, "output_tokens": 2} for i in range(6)]
    data = write_jsonl(tmp_path / "rate.jsonl", lines)
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL)) as server:
        result = invoke("bench", "--endpoint", server.url, "--dataset", data, "--request_rate", 20, "--seed", 3,
                        "--output", tmp_path / "rate")
    assert result.exit_code == 0, result.output
    rows = sorted(read_rows(tmp_path / "rate" / "requests.csv"), key=lambda r: int(r["request_id"]))
    due = rate_due_times(6, 20.0, 3)
    # Arrival is the due time of a seeded Poisson process (TTFT counts from it), as in-process.
    assert [float(r["arrival_s"]) for r in rows] == pytest.approx(due, abs=1e-3)
    assert all(not r["error"] and float(r["ttft_ms"]) > 0 for r in rows)


def test_an_interrupted_replay_closes_its_streams_and_the_server_frees_their_blocks(tiny_llama_plan):
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=POOL)) as server:
        llm = EndpointLLM(EndpointOptions(url=server.url), timed=False)
        request = Request(list(range(1, 60)), SamplingParams(max_tokens=900, ignore_eos=True))
        llm.engine.add_request(request)
        deadline = time.monotonic() + 10
        while not server.call(lambda engine: engine.scheduler.num_running_requests()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        llm.shutdown()  # what run_bench's caller does after Ctrl-C
        server.wait_idle()
        assert server.call(lambda engine: engine.get_stats()["primary_used_blocks"]) == 0
        assert server.call(lambda engine: engine.scheduler.cache_manager.check_invariants()) == []
