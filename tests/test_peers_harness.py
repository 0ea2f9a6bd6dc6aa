"""bench/peers' own logic: which CPU kind a run is filed under (from /proc/cpuinfo's flags), the
floors' byte and FLOP counts and each core's own probe, each request against the memory floor at the
rate read around it (each memory rate apart), the load flag and the CPU it counts as the benchmark's,
the same Poisson schedule for every engine, and the cross-engine token-id verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "bench" / "peers"
sys.path.insert(0, str(PEERS))

from common import load_requests  # noqa: E402
from load import OTHER_CPU_LIMIT_PCT, _tree_ticks, is_loaded  # noqa: E402
from machine import read_cpu_info  # noqa: E402
from report import (  # noqa: E402
    AroundRequest, _memory_floor_ms, _own_bandwidth, _rate_split, _ratios_to_floor, _reads_around_requests, _targets,
    identity, tpot_vs_floor_by_rate)

AVX2 = "fpu sse2 avx avx2 fma"
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512dq"


@pytest.mark.parametrize("model, flags, kind", [
    ("AMD EPYC", AVX2, "amd-epyc-avx2"),
    ("AMD EPYC 9654 96-Core Processor", AVX512, "amd-epyc-9654-avx512"),
    ("AMD EPYC", AVX512 + " avx512_bf16", "amd-epyc-avx512-bf16"),
    ("Intel(R) Xeon(R) Platinum 8480+", AVX512 + " avx512_bf16 amx_tile amx_bf16 amx_int8",
     "intel-xeon-platinum-8480-amx"),
    ("Some CPU", "fpu sse2", "some-cpu-baseline"),
])
def test_the_cpu_kind_names_the_model_and_the_best_vector_isa(tmp_path, model, flags, kind):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                       f"model name\t: {model}\nflags\t\t: {flags}\n")
    assert read_cpu_info(cpuinfo).kind == kind


def test_two_generations_behind_one_model_name_are_two_kinds(tmp_path):
    # A VM names a Zen 4 and a Zen 5 both "AMD EPYC"; their family and model numbers tell them apart.
    kinds = []
    for family, model in ((25, 17), (26, 2)):
        cpuinfo = tmp_path / f"cpuinfo-{family}"
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                           f"model name\t: AMD EPYC\nflags\t\t: {AVX512} avx512_bf16\n\n"
                           f"processor\t: 1\ncpu family\t: 99\nmodel\t\t: 99\nmodel name\t: AMD EPYC\n")
        cpu = read_cpu_info(cpuinfo)
        kinds.append(cpu.kind)
        assert f"family {family}, model {model};" in cpu.describe()
        assert (cpu.as_row()["cpu_family"], cpu.as_row()["cpu_model_number"]) == (family, model)
    assert kinds == ["amd-epyc-f25m17-avx512-bf16", "amd-epyc-f26m2-avx512-bf16"]


def test_cpuinfo_without_flags_is_an_error(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\n")
    with pytest.raises(ValueError, match="no CPU model or flags"):
        read_cpu_info(cpuinfo)


def test_floors_count_every_weight_once_and_causal_attention():
    from floors import decode_bytes, prompt_flops

    from kvtool.models.presets import preset_config

    c = preset_config("tiny-qwen3")  # q/k norms, tied embeddings
    layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size + 3 * c.intermediate_size * \
        c.hidden_size + 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    head = c.vocab_size * c.hidden_size
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    expected = (c.num_layers * layer + c.hidden_size + head + c.hidden_size) * 4 + 100 * kv_per_token
    assert decode_bytes(c, 4, 4, context_len=100) == expected
    projections = 2 * c.num_layers * (layer - 2 * c.hidden_size - (2 * c.head_dim if c.qk_norm else 0))
    # 3 tokens see 1 + 2 + 3 = 6 keys: 4 FLOPs per key and head dim (QK and PV).
    attention = c.num_layers * c.num_heads * c.head_dim * 4 * 6
    assert prompt_flops(c, 3) == 3 * projections + attention + 2 * head


def test_each_core_is_probed_alone_and_the_process_keeps_its_cores_and_threads():
    import torch
    from floors import core_gemm_rates

    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    rates = core_gemm_rates()
    assert sorted(rates) == sorted(f"cpu{cpu}" for cpu in cpus)
    assert all(rate > 0 for rate in rates.values())
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == threads


def test_a_probe_of_two_buffers_reads_each_once_in_turn():
    # A buffer read twice in a row is partly still in the last-level cache: its second read is not memory's.
    from floors import BandwidthProbe

    probe = BandwidthProbe(1, 1 << 20, num_buffers=2)
    read = []
    probe.kernels = type("Kernels", (), {"sum": lambda self, address, count: read.append(address)})()
    assert probe.read(2) > 0 and probe.read(2) > 0
    first, second = (buffer.data_ptr() for buffer in probe.buffers)
    assert read == [first, second, first, second]


def test_the_compute_floor_takes_kvtools_tile_product_where_the_decoder_runs_one():
    import torch
    from floors import tile_gemm_rate

    from kvtool.cpu_kernels import CpuKernels

    rate = tile_gemm_rate(torch.bfloat16)
    if CpuKernels("auto", 1).has_tile_products:
        assert rate is not None and rate > 0
    else:
        assert rate is None
    assert tile_gemm_rate(torch.float32) is None  # float32 prompts keep oneDNN's product


def test_a_replay_is_held_to_the_memory_floor_at_its_own_process_bandwidth(tmp_path):
    floors = {"start": {"models": {"bfloat16": {"decode_bytes": 300_000_000}}}}
    (tmp_path / "bandwidth.json").write_text(json.dumps({"threads": 2, "before_gb_s": 50.0, "after_gb_s": 60.0}))
    bandwidth = _own_bandwidth(tmp_path)
    assert bandwidth == 60.0  # the better of before and after
    assert _memory_floor_ms(floors, "bfloat16", bandwidth) == pytest.approx(5.0)  # 300 MB at 60 GB/s
    assert _memory_floor_ms(floors, "float32", bandwidth) is None  # no probe counted that dtype's bytes
    assert _own_bandwidth(tmp_path / "vllm-run") is None  # peers do not measure it


def test_each_request_is_held_to_the_floor_at_the_better_rate_read_around_it(tmp_path):
    floors = {"start": {"models": {"bfloat16": {"decode_bytes": 300_000_000}}}}
    # Reads: 50 before the replay, then 60, 30 and 100 GB/s after each of its three requests.
    (tmp_path / "bandwidth.json").write_text(json.dumps({"threads": 2, "before_gb_s": 50.0, "after_gb_s": 40.0,
                                                         "after_each_request_gb_s": [60.0, 30.0, 100.0]}))
    (tmp_path / "requests.csv").write_text("request_id,tpot_ms\na,6.0\nb,12.0\nc,4.5\n")
    reads = _reads_around_requests(tmp_path)
    assert reads == [AroundRequest(50.0, 60.0, 6.0), AroundRequest(60.0, 30.0, 12.0), AroundRequest(30.0, 100.0, 4.5)]
    # Floors at 60 (50 | 60), 60 (60 | 30) and 100 (30 | 100) GB/s: 5, 5 and 3 ms.
    assert _ratios_to_floor(reads, floors, "bfloat16") == pytest.approx([1.2, 2.4, 1.5])
    (tmp_path / "requests.csv").write_text("request_id,tpot_ms\na,6.0\n")
    with pytest.raises(ValueError, match="1 requests but 3 reads"):
        _reads_around_requests(tmp_path)
    (tmp_path / "bandwidth.json").write_text(json.dumps({"threads": 2, "before_gb_s": 50.0, "after_gb_s": 40.0}))
    assert _reads_around_requests(tmp_path) == []  # a replay at concurrency 8


def test_the_requests_of_each_memory_rate_are_held_to_their_floor_apart():
    floors = {"start": {"models": {"bfloat16": {"decode_bytes": 300_000_000}}}}
    slow = [AroundRequest(30.0, 30.0, 11.0), AroundRequest(30.0, 32.0, 11.0), AroundRequest(31.0, 30.0, 10.0)]
    fast = [AroundRequest(60.0, 60.0, 7.5), AroundRequest(60.0, 62.0, 7.0)]
    flipped = [AroundRequest(30.0, 60.0, 8.0)]  # the rate changed while it ran
    split = _rate_split(slow + fast + flipped)
    assert 32.0 < split < 60.0
    by_rate = tpot_vs_floor_by_rate(slow + fast + flipped, floors, "bfloat16", split)
    assert by_rate["slower"].num_requests == 3 and by_rate["faster"].num_requests == 2  # the flipped one in neither
    assert by_rate["faster"].tpot_ms_p50 == pytest.approx(7.25)
    # Floors 5 ms at 60 GB/s, 300 / 62 ms at 62: ratios 1.5 and 1.447, where the slow requests are 1.1 or less.
    assert by_rate["faster"].tpot_vs_floor == pytest.approx((1.5 + 7.0 / (300 / 62)) / 2)
    assert by_rate["slower"].tpot_vs_floor == pytest.approx(1.1)
    # One rate throughout: every request together.
    assert _rate_split(slow) is None and _rate_split([]) is None
    assert tpot_vs_floor_by_rate(slow, floors, "bfloat16", None)["all"].num_requests == 3


def test_a_memory_rate_too_few_requests_ran_at_is_named_not_checked():
    row = {"rate_split_gb_s": 45.0, "num_requests_faster_rate": 2, "tpot_ms_p50_faster_rate": 7.0,
           "tpot_vs_floor_faster_rate": 1.5, "num_requests_slower_rate": 30, "tpot_ms_p50_slower_rate": 10.0,
           "tpot_vs_floor_slower_rate": 1.25}
    table = "\n".join(_targets({"kvtool bf16 reuse-on": row}, {}, {}))
    assert "(bfloat16, ms; the 30 requests read below 45 GB/s) | 10.0 | 8.0 | 1.25x | yes |" in table
    assert "read at or above 45 GB/s) |" not in table  # two requests: no target row...
    assert "- bfloat16: 2 request(s) read at or above 45 GB/s throughout" in table  # ...but said so
    assert "float32" not in table.split("## Targets")[1].split("Floors")[0]  # no float32 replay: nothing


def test_the_benchmark_keeps_the_cpu_of_its_processes_that_ended():
    before = _tree_ticks(os.getpid())
    # A child that spins for ~0.3 s of CPU and ends (subprocess.run waits for it), as a variant's process does.
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.3: pass"], check=True)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    assert _tree_ticks(os.getpid()) - before >= 0.25 * ticks_per_s  # not someone else's CPU


def test_a_variant_is_flagged_when_others_took_over_a_quarter_of_the_cpu():
    quiet = [{"cpu_other_pct": 10.0}, {"cpu_other_pct": 30.0}]
    busy = [{"cpu_other_pct": OTHER_CPU_LIMIT_PCT + 10}, {"cpu_other_pct": OTHER_CPU_LIMIT_PCT}]
    assert not is_loaded(quiet) and is_loaded(busy) and not is_loaded([])


def test_the_poisson_dataset_gives_every_engine_the_same_due_times(tmp_path):
    lines = [{"input_ids": [1, 2, 3], "output_tokens": 4, "request_id": "warmup"},
             {"input_ids": [4, 5], "output_tokens": 4, "request_id": "a", "arrival_time_s": 0.0},
             {"input_ids": [6], "output_tokens": 4, "request_id": "b", "arrival_time_s": 0.75}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [(r.request_id, r.arrival_time_s) for r in load_requests(path)] == [("warmup", None), ("a", 0.0),
                                                                              ("b", 0.75)]


def test_identity_reports_where_each_request_first_differs():
    reference = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    outputs = {"transformers no-cache": [reference],
               "kvtool reuse-on": [dict(reference)],
               "vllm reuse-on": [{"a": [1, 2, 9, 4], "b": [5, 6, 7, 8]}],
               "kvtool bf16 reuse-on": [{"a": [1, 0, 0, 0], "b": [5, 6, 7, 8]}],
               "vllm bf16 reuse-on": [{"a": [1, 0, 0, 0], "b": [5, 6, 7, 0]}]}
    lines = identity(outputs, num_requests=2, output_len=4)
    assert "- kvtool reuse-on cycle 0 vs transformers no-cache: identical" in lines
    assert "- vllm reuse-on cycle 0 vs transformers no-cache: 1 of 2 differ (first differing token at [2])" in lines
    # bfloat16 runs are held to kvtool's bfloat16 run: rounding differs from float32's.
    assert "- vllm bf16 reuse-on cycle 0 vs kvtool bf16 reuse-on: 1 of 2 differ (first differing token at [3])" in lines
    # And each bfloat16 run against float32: how long its greedy ids follow float32's.
    assert "- kvtool bf16 reuse-on cycle 0: 1 of 2 identical; the same ids for the first 2.5 tokens " \
           "(median; mean 2.5)" in lines
    assert "- vllm bf16 reuse-on cycle 0: 0 of 2 identical; the same ids for the first 2 tokens " \
           "(median; mean 2.0)" in lines
    only_bf16 = {name: runs for name, runs in outputs.items() if " bf16" in name}
    assert not any("follows float32" in line for line in identity(only_bf16, num_requests=2, output_len=4))


@pytest.mark.parametrize("onednn_isa, hidden", [
    ("AVX2", {"avx512", "avx512_bf16", "amx_tile"}),
    ("SSE41", {"avx512", "avx512_bf16", "amx_tile"}),
    ("AVX512_CORE", {"avx512_bf16", "amx_tile"}),
    ("AVX512_CORE_BF16", {"amx_tile"}),
    (None, set()),
])
def test_a_run_limited_to_an_isa_has_vllm_load_the_kernels_of_a_cpu_with_only_it(onednn_isa, hidden):
    # vLLM picks its kernel build and attention ISA from these queries; the others keep the CPU's answer.
    code = ("import json, torch; from peer_isa import limit_torch_cpu_queries\n"
            "ask = lambda: {f: getattr(torch.cpu, f'_is_{f}_supported')() for f in ('avx512', 'avx512_bf16', "
            "'amx_tile')}\nbefore = ask(); limit_torch_cpu_queries(); print(json.dumps([before, ask()]))")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if onednn_isa:
        env["ONEDNN_MAX_CPU_ISA"] = onednn_isa
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(PEERS)), capture_output=True,
                         text=True, check=True).stdout
    before, after = json.loads(out)
    assert after == {feature: False if feature in hidden else answer for feature, answer in before.items()}
