"""`kvtool bench --temperature/--top_p/--top_k`: sampled replays, seeded per request, in process and
against a server."""

from __future__ import annotations

import json

import pytest
from endpoint_servers import serving
from serve_helpers import tiny_llm
from typer.testing import CliRunner

from kvtool import KvCacheConfig
from kvtool.bench.endpoint import EndpointLLM, EndpointOptions
from kvtool.bench.runner import run_bench
from kvtool.cli import app
from kvtool.config import ReplayOptions, SamplingParams
from kvtool.flags import configs
from kvtool.serve import create_app
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.requests import request_seed

POOL = KvCacheConfig(max_tokens=1024)
SHARED = list(range(300, 340))


@pytest.fixture
def dataset_path(tmp_path):
    lines = [{"input_ids": SHARED + [20 + i, 7, 8], "output_tokens": 12} for i in range(4)]
    return write_jsonl(tmp_path / "sampled.jsonl", lines)


def replay_tokens(plan, dataset_path, tmp_path, **replay) -> list[list[int]]:
    """Each measured request's output token ids, a sequential in-process replay on a fresh engine."""
    result = run_bench(tiny_llm(plan, kv_cache_config=POOL), load_dataset(dataset_path),
                       ReplayOptions(mode="sequential", **replay), label="run", requests_csv=tmp_path / "r.csv")
    assert result.failure is None
    return [list(metrics.output_token_ids) for metrics in result.requests]


def test_a_sampled_replay_draws_each_request_from_its_own_seed(tiny_llama_plan, dataset_path, tmp_path):
    sampled = replay_tokens(tiny_llama_plan, dataset_path, tmp_path, temperature=1.0, top_p=0.95, seed=3)
    # Each request as kvtool.LLM generates it with its own seed, one after another on one engine (the
    # same cache history as the replay's).
    llm = tiny_llm(tiny_llama_plan, kv_cache_config=POOL)
    lines = load_dataset(dataset_path).records
    alone = [llm.generate(list(line.input_ids), SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.95, seed=request_seed(3, index), ignore_eos=True)).outputs[0].token_ids
        for index, line in enumerate(lines)]
    assert sampled == alone
    assert all(len(tokens) == 12 for tokens in sampled)  # exactly the line's output tokens, EOS or not


def test_a_sampled_replay_repeats_with_its_seed_and_differs_with_another(tiny_llama_plan, dataset_path, tmp_path):
    first = replay_tokens(tiny_llama_plan, dataset_path, tmp_path, temperature=1.0, seed=5)
    assert replay_tokens(tiny_llama_plan, dataset_path, tmp_path, temperature=1.0, seed=5) == first
    assert replay_tokens(tiny_llama_plan, dataset_path, tmp_path, temperature=1.0, seed=6) != first
    greedy = replay_tokens(tiny_llama_plan, dataset_path, tmp_path)
    assert greedy != first
    # top_k 1 keeps only the largest logit: greedy at any temperature.
    assert replay_tokens(tiny_llama_plan, dataset_path, tmp_path, temperature=2.0, top_k=1) == greedy


def test_request_seeds_differ_between_lines_and_runs():
    seeds = {request_seed(seed, index) for seed in range(3) for index in range(100)}
    assert len(seeds) == 300
    assert all(0 <= seed < 2 ** 63 for seed in seeds)
    assert request_seed(1, 0) != request_seed(0, 1)  # not seed + index: runs do not share shifted streams


@pytest.mark.parametrize(("flags", "message"), [
    ({"top_p": 0.9}, "--top_p 0.9 cuts the tokens a sampled request draws from, but temperature is 0"),
    ({"top_k": 40}, "--top_k 40 cuts the tokens .* give a temperature > 0 too"),
    ({"temperature": -0.5}, "--temperature must be >= 0 .0: greedy., got -0.5"),
    ({"temperature": 1.0, "top_p": 0.0}, r"--top_p must be in \(0, 1\] \(1: no cut\), got 0.0"),
    ({"temperature": 1.0, "top_p": 1.5}, r"--top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_k": -1}, "--top_k must be an integer >= 0 .0: every token., got -1"),
    ({"temperature": float("nan")}, "--temperature must be a number, got nan"),
    ({"temperature": "hot"}, "--temperature must be a number, got 'hot'"),  # a scenario's YAML
])
def test_bad_sampling_flags_name_the_flag_and_the_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        configs(flags)


def test_top_k_one_is_greedy_and_needs_no_temperature():
    assert not configs({"top_k": 1})[1].sampled
    assert not configs({"temperature": 0.5, "top_k": 1})[1].sampled
    assert configs({"temperature": 0.5})[1].sampled


def test_the_summary_records_the_sampling_and_the_replay_names_it(tiny_llama_plan, dataset_path, tmp_path):
    result = run_bench(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), load_dataset(dataset_path),
                       ReplayOptions(mode="sequential", temperature=0.7, top_k=20), label="run",
                       requests_csv=tmp_path / "r.csv")
    row = result.row
    assert (row["temperature"], row["top_p"], row["top_k"]) == (0.7, 1.0, 20)
    assert row["replay"] == "sequential,temperature=0.7,top_k=20"


class RecordedBodies:
    """ASGI middleware: keeps the JSON body of every completion request the app is sent."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            return await self.app(scope, receive, send)
        chunks = []

        async def recorded():
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                self.bodies.append(json.loads(b"".join(chunks)))
            return message

        await self.app(scope, recorded, send)


def test_an_endpoint_replay_sends_the_sampling_and_no_seed(tiny_llama_plan, dataset_path, tmp_path):
    app_ = RecordedBodies(create_app(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), served_model_name="tiny"))
    with serving(app_) as url:
        llm = EndpointLLM(EndpointOptions(url=url), timed=False)
        try:
            result = run_bench(llm, load_dataset(dataset_path), ReplayOptions(mode="sequential", temperature=0.8,
                                                                               top_p=0.9, top_k=5),
                               label="endpoint", requests_csv=tmp_path / "r.csv")
        finally:
            llm.shutdown()
    assert result.failure is None and len(result.requests) == 4
    assert all(len(r.output_token_ids) == 12 for r in result.requests)
    assert len(app_.bodies) == 4
    for body in app_.bodies:
        assert (body["temperature"], body["top_p"], body["top_k"], body["ignore_eos"]) == (0.8, 0.9, 5, True)
        assert "seed" not in body  # the server's own draws: a seeded request costs vLLM more a step


def test_simulate_refuses_sampling_it_does_not_model(tiny_llama_plan, dataset_path, tmp_path):
    result = CliRunner().invoke(app, ["simulate", "--plan", str(tiny_llama_plan), "--dataset", str(dataset_path),
                                      "--temperature", "0.8", "--output", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--temperature 0.8: kvtool simulate's cost model times greedy steps" in result.output
    assert "Traceback" not in result.output
