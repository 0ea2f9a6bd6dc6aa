"""Retention by token range from every input a user has: a dataset line's and a serve request's
``kv_cache_retention_config`` (TensorRT-LLM's JSON field names, durations in milliseconds) keep a system
prompt at a high priority through the requests that would push it out of the KV cache, as the LLM API's
KvCacheRetentionConfig does (tests/test_llm_kv_cache_retention.py); a bad one names the file and line, or
the request's field."""

from __future__ import annotations

import csv

import httpx
import pytest
from serve_helpers import TIMEOUT_S, running_server
from test_cli_bench import invoke

from kvtool import LLM, KvCacheConfig
from kvtool.config import retention_from_json
from kvtool.errors import DatasetError
from kvtool.workloads.datasets import load_dataset, write_jsonl

SYSTEM = list(range(10, 42))  # two full 16-token blocks
KEEP = {"token_range_retention_configs": [{"token_start": 0, "token_end": 32, "priority": 90,
                                           "duration_ms": 600000}]}
FILLERS = [[(13 * i + 100 * k) % 1000 + 1 for i in range(100)] for k in range(1, 5)]


def conversation(retention) -> list[dict]:
    """The system prompt with a question, four unrelated prompts that fill a 192-token cache, then the
    system prompt with another question."""
    extra = {} if retention is None else {"kv_cache_retention_config": retention}
    return ([{"input_ids": SYSTEM + [500, 501, 502], "output_tokens": 4, **extra}]
            + [{"input_ids": filler, "output_tokens": 4} for filler in FILLERS]
            + [{"input_ids": SYSTEM + [600, 601, 602], "output_tokens": 4, **extra}])


@pytest.mark.parametrize("retention, reused", [(None, 0), (KEEP, 2)])
def test_a_dataset_lines_retention_keeps_its_system_prompt(tmp_path, tiny_llama_plan, retention, reused):
    dataset = write_jsonl(tmp_path / "d.jsonl", conversation(retention))
    out = tmp_path / "out"
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", dataset, "--mode", "sequential",
                    "--max_tokens_in_paged_kv_cache", 192, "--output", out)
    assert result.exit_code == 0, result.output
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["reused_tokens"]) == 16 * reused


def test_a_serve_requests_retention_keeps_its_system_prompt(tiny_llama_plan):
    llm = LLM(model=tiny_llama_plan, max_batch_size=1, max_seq_len=256,
              kv_cache_config=KvCacheConfig(max_tokens=192))
    with running_server(llm) as server:
        def cached(line) -> int:
            body = {"prompt": line["input_ids"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            if "kv_cache_retention_config" in line:
                body["kv_cache_retention_config"] = line["kv_cache_retention_config"]
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached(line) for line in conversation(KEEP)][-1] == 32
        bad = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "prompt": [5, 6, 7], "kv_cache_retention_config": {"token_range_retention_configs": [
                {"token_start": 0, "token_end": 32, "priority": 101}]}})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "kv_cache_retention_config"
        assert error["message"] == ("'kv_cache_retention_config.token_range_retention_configs[0].priority' must be in "
                                    "0..100, got 101")


def test_bench_endpoint_sends_a_dataset_lines_retention_to_a_kvtool_server(tmp_path, tiny_llama_plan):
    from kvtool.bench.endpoint import EndpointLLM, EndpointOptions
    from kvtool.bench.runner import run_bench
    from kvtool.config import ReplayOptions

    dataset = load_dataset(write_jsonl(tmp_path / "d.jsonl", conversation(KEEP)))
    llm = LLM(model=tiny_llama_plan, max_batch_size=1, max_seq_len=256,
              kv_cache_config=KvCacheConfig(max_tokens=192))
    with running_server(llm) as server:
        endpoint = EndpointLLM(EndpointOptions(url=server.url), timed=False)
        try:
            result = run_bench(endpoint, dataset, ReplayOptions(mode="sequential"), label="endpoint",
                               requests_csv=tmp_path / "r.csv")
        finally:
            endpoint.shutdown()
    assert result.requests[-1].reused_tokens == 32


def test_the_json_form_reads_back_what_it_wrote():
    config = retention_from_json({**KEEP, "decode_retention_priority": 10, "decode_duration_ms": 5})
    assert retention_from_json(config.to_json()) == config
    assert config.to_core(40)[0].priority == 90 and config.to_core(40)[1].priority == 10


@pytest.mark.parametrize("retention, message", [
    ({"token_range_retention_configs": [{"token_start": 0, "token_end": 32, "priority": 90},
                                        {"token_start": 16, "priority": 10}]},
     "'kv_cache_retention_config.token_range_retention_configs' has overlapping or unsorted ranges"),
    ({"token_range_retention_configs": [{"token_start": 0, "priority": 90, "duration_ms": 0}]},
     "'kv_cache_retention_config.token_range_retention_configs[0].duration_ms' must be a positive number of "
     "milliseconds"),
    ({"ranges": []}, "'kv_cache_retention_config' has unknown key(s) ['ranges']"),
    ([0, 32, 90], "'kv_cache_retention_config' must be a JSON object, got list"),
])
def test_a_bad_retention_in_a_dataset_names_the_line_and_field(tmp_path, retention, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2], "output_tokens": 1},
                                             {"input_ids": [1, 2], "output_tokens": 1,
                                              "kv_cache_retention_config": retention}])
    with pytest.raises(DatasetError) as error:
        load_dataset(path)
    assert str(error.value).startswith(f"{path} line 2: {message}")
