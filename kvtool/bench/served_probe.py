"""`kvtool calibrate --served`: what `kvtool serve` adds around the engine's steps on this machine.

A probe dataset (bursts of 1, 2, 4 and 8 requests of fresh prompts, the bursts apart so the server
idles between them, as it does between a trace's arrivals) is replayed with `kvtool bench --endpoint`
against a `kvtool serve` of the plan, both started here as they are when a user compares a real fleet
with `kvtool simulate --replicas N --served`. The same probe is simulated with the step cost model plus
two served costs (kvtool.simulate.cost_model.ServedCosts: per request admitted, per token streamed),
and those two are fitted so that the simulation's TTFT p50 and TPOT p50 of each burst size match the
measured ones (least squares of the log ratios, one coordinate at a time by golden-section search: each
cost moves one of the two latencies most, and both only upward).

Why fitted end to end and not timed inside the server: what a client measures also includes its own
work and the OS handing the CPU between client and server processes, which on a small machine is a
large share (results/serve/README.md), and no timer inside the server sees it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.simulate.cost_model import CostModel, ServedCosts

MAX_REQUEST_S = 0.05  # the search's bounds: far above what a server on any machine adds
MAX_TOKEN_S = 0.005


@dataclass(frozen=True)
class ServedProbe:
    """The probe: ``num_bursts`` bursts of each size, ``gap_s`` apart, of prompts of ``prompt_tokens``
    fresh random tokens (no reuse) generating ``output_tokens`` each."""

    burst_sizes: tuple[int, ...] = (1, 2, 4, 8)
    num_bursts: int = 6
    gap_s: float = 0.5
    prompt_tokens: int = 384
    output_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.burst_sizes or any(k < 1 for k in self.burst_sizes):
            raise ValueError(f"ServedProbe.burst_sizes must be positive, got {self.burst_sizes!r}")
        if self.num_bursts < 1 or self.gap_s <= 0 or self.prompt_tokens < 2 or self.output_tokens < 2:
            raise ValueError("ServedProbe: num_bursts >= 1, gap_s > 0, prompt_tokens >= 2 and output_tokens >= 2")

    def describe(self) -> str:
        return (f"{self.num_bursts} bursts each of {', '.join(map(str, self.burst_sizes))} requests, "
                f"{self.gap_s:g} s apart, {self.prompt_tokens}-token prompts, {self.output_tokens} output tokens")

    def lines(self, *, vocab_size: int, seed: int = 0) -> list[dict]:
        """The probe as dataset lines (token ids, arrival times), bursts of each size in turn."""
        rng = random.Random(seed)
        lines, burst = [], 0
        for _ in range(self.num_bursts):
            for size in self.burst_sizes:
                for _ in range(size):
                    lines.append({"input_ids": [rng.randrange(4, vocab_size) for _ in range(self.prompt_tokens)],
                                  "output_tokens": self.output_tokens, "arrival_time_s": burst * self.gap_s})
                burst += 1
        return lines

    def burst_size_of(self, arrival_s: float) -> int:
        """The size of the burst that arrives ``arrival_s`` after the first."""
        burst = round(arrival_s / self.gap_s)
        return self.burst_sizes[burst % len(self.burst_sizes)]

    def fits(self, max_batch_size: int, max_seq_len: int) -> ServedProbe:
        """This probe within an engine's limits (bursts no larger than a batch, prompts that fit)."""
        sizes = tuple(k for k in self.burst_sizes if k <= max_batch_size) or (1,)
        prompt = min(self.prompt_tokens, max(2, max_seq_len // 2 - self.output_tokens))
        return replace(self, burst_sizes=sizes, prompt_tokens=prompt)


QUICK_PROBE = ServedProbe(burst_sizes=(1, 4), num_bursts=3, gap_s=0.25, prompt_tokens=128, output_tokens=8)


@dataclass(frozen=True)
class LatencyMedians:
    """TTFT and TPOT medians (seconds) of each burst size of a probe's replay."""

    ttft: dict[int, float]
    tpot: dict[int, float]


def medians(rows: Sequence, probe: ServedProbe) -> LatencyMedians:
    """Per burst size, from request rows (RequestMetrics or the per-request CSV's dicts)."""
    ttft: dict[int, list[float]] = {}
    tpot: dict[int, list[float]] = {}

    def value(row, name):
        v = row[name] if isinstance(row, dict) else getattr(row, name)
        return None if v in (None, "") else float(v)

    for row in rows:
        size = probe.burst_size_of(value(row, "arrival_s"))
        if value(row, "ttft_ms") is None or value(row, "tpot_ms") is None:
            raise KvtoolError(f"the served probe's request {value(row, 'arrival_s')} s failed: "
                              f"{row['error'] if isinstance(row, dict) else row.error}")
        ttft.setdefault(size, []).append(value(row, "ttft_ms") / 1e3)
        tpot.setdefault(size, []).append(value(row, "tpot_ms") / 1e3)
    return LatencyMedians({k: statistics.median(v) for k, v in ttft.items()},
                          {k: statistics.median(v) for k, v in tpot.items()})


def mismatch(simulated: LatencyMedians, measured: LatencyMedians) -> float:
    """Sum of squared log ratios, simulated over measured, of every burst size's TTFT and TPOT p50."""
    return sum(math.log(simulated.ttft[k] / measured.ttft[k]) ** 2 + math.log(simulated.tpot[k] / measured.tpot[k]) ** 2
               for k in measured.ttft)


def _golden_section(f: Callable[[float], float], low: float, high: float, *, steps: int = 18) -> float:
    """The x in [low, high] minimising a unimodal f."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_served(simulate: Callable[[float, float], LatencyMedians], measured: LatencyMedians, probe: ServedProbe,
               *, rounds: int = 3) -> ServedCosts:
    """The (request_s, token_s) whose simulation (``simulate(request_s, token_s)``) matches ``measured``."""
    request_s, token_s = 0.0, 0.0
    for _ in range(rounds):
        token_s = _golden_section(lambda t, r=request_s: mismatch(simulate(r, t), measured), 0.0, MAX_TOKEN_S)
        request_s = _golden_section(lambda r, t=token_s: mismatch(simulate(r, t), measured), 0.0, MAX_REQUEST_S)
    fitted = simulate(request_s, token_s)
    return ServedCosts(
        request_s=request_s, token_s=token_s,
        ttft_p50_error=statistics.median(fitted.ttft[k] / measured.ttft[k] - 1 for k in measured.ttft),
        tpot_p50_error=statistics.median(fitted.tpot[k] / measured.tpot[k] - 1 for k in measured.tpot),
        probe=probe.describe())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kvtool(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtool", *args]


@contextlib.contextmanager
def _server(plan_dir: Path, pool_tokens: int, log: Path):
    """A `kvtool serve` of the plan on a free port; its URL once it answers."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        process = subprocess.Popen(_kvtool("serve", "--plan", str(plan_dir), "--port", str(port),
                                           "--max_tokens_in_paged_kv_cache", str(pool_tokens)),
                                   stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    raise KvtoolError(f"the probe's kvtool serve exited ({process.returncode}): "
                                      f"{log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise KvtoolError("the probe's kvtool serve did not answer within 5 minutes")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def pool_tokens(probe: ServedProbe, tokens_per_block: int) -> int:
    """A primary pool with room for every request of the probe's largest burst, twice over: nothing is evicted."""
    per_request = -(-(probe.prompt_tokens + probe.output_tokens) // tokens_per_block) * tokens_per_block
    return 2 * max(probe.burst_sizes) * per_request


class ProbeSimulation:
    """The probe (``dataset``, its lines) replayed through a SimulatedLLM of ``plan`` on ``cost_model`` plus
    the served costs it is called with: ``simulation(request_s, token_s)`` -> LatencyMedians."""

    def __init__(self, plan, cost_model: CostModel, probe: ServedProbe, dataset, directory: Path) -> None:
        from kvtool.config import EngineConfig, KvCacheConfig, ReplayOptions

        self.plan, self.cost_model, self.probe, self.dataset = plan, cost_model, probe, dataset
        self.requests_csv = Path(directory) / "simulated.csv"
        self.pool_tokens = pool_tokens(probe, plan.build_options.tokens_per_block)  # the real server's too
        self.config = EngineConfig(kv_cache_config=KvCacheConfig(max_tokens=self.pool_tokens))
        self.replay = ReplayOptions(mode="trace")

    def __call__(self, request_s: float, token_s: float) -> LatencyMedians:
        from rich.console import Console

        from kvtool.bench.runner import run_bench
        from kvtool.simulate.simulated_llm import SimulatedLLM

        served = replace(self.cost_model, served=ServedCosts(request_s, token_s, 0.0, 0.0)).as_served()
        result = run_bench(SimulatedLLM(self.plan, served, self.config), self.dataset, self.replay, label="probe",
                           requests_csv=self.requests_csv, console=Console(file=io.StringIO()))
        return medians(result.requests, self.probe)


def measure_served(plan, cost_model: CostModel, probe: ServedProbe, *, max_batch_size: int, max_seq_len: int,
                   on_status: Callable[[str], None] = lambda _: None) -> ServedCosts:
    """Replays the probe through a real `kvtool serve` of ``plan`` (a built Plan) and fits the served
    costs that make ``cost_model``'s simulation of it match (see the module docstring)."""
    from kvtool.workloads.datasets import load_dataset, write_jsonl

    probe = probe.fits(max_batch_size, max_seq_len)
    with tempfile.TemporaryDirectory(prefix="kvtool-served-probe-") as tmp:
        directory = Path(tmp)
        dataset_path = write_jsonl(directory / "probe.jsonl", probe.lines(vocab_size=plan.model_config.vocab_size))
        simulation = ProbeSimulation(plan, cost_model, probe, load_dataset(dataset_path), directory)
        on_status(f"probing kvtool serve: {probe.describe()}")
        with _server(Path(plan.path), simulation.pool_tokens, directory / "serve.log") as url:
            command = _kvtool("bench", "--endpoint", url, "--dataset", str(dataset_path), "--mode", "trace",
                              "--output", str(directory / "real"))
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
            if done.returncode != 0:
                raise KvtoolError(f"the served probe's `kvtool bench --endpoint` failed ({done.returncode}): "
                                  f"{(done.stdout + done.stderr)[-2000:]}")
        with open(directory / "real" / "requests.csv", newline="") as source:
            measured = medians(list(csv.DictReader(source)), probe)
        on_status("fitting the served costs")
        return fit_served(simulation, measured, probe)
