"""The engine with the forward replaced by a cost model: the same C++ scheduler and KV cache manager
as a real run, stepping a simulated clock by each step's predicted cost."""

from __future__ import annotations

from kvtool import _core
from kvtool.runtime.engine import Engine
from kvtool.runtime.request import Request
from kvtool.simulate.cost_model import CostModel, step_shape


class SimulatedClock:
    """Seconds since the simulation started; only steps and waits for arrivals move it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds

    def sleep(self, seconds: float) -> None:
        """Waiting for the next arrival jumps to it."""
        self.seconds += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


class SimulatedEngine(Engine):
    """kvtool's Engine, scheduling and caching exactly as in a real run; each step advances the clock
    by ``cost_model.predict`` of its shape instead of running the model.

    Generated tokens are a deterministic function of the request's last token and length, so two
    requests with the same prompt get the same answer (as greedy decoding gives), and a later session
    turn, which resends the answer, finds its blocks as it would in a real run.
    """

    def __init__(self, cost_model: CostModel, cache_config: _core.CacheConfig, scheduler_config: _core.SchedulerConfig,
                 *, vocab_size: int, bytes_per_token: int, clock: SimulatedClock, tokenizer=None) -> None:
        super().__init__(None, cache_config, scheduler_config, vocab_size=vocab_size, eos_token_ids=[],
                         bytes_per_token=bytes_per_token, tokenizer=tokenizer, clock=clock.now)
        self.cost_model = cost_model
        self.simulated_clock = clock
        self.num_steps = 0

    def _make_generator(self, params, request_id: int) -> None:
        return None

    def _execute(self, batch, sampling: list[Request]) -> list[int] | None:
        copies = batch.copy_ops
        requests = batch.requests
        if not requests:
            if len(copies):  # copies with nothing to compute still take their time
                self.simulated_clock.advance(self.cost_model.predict(step_shape((), copies.num_tokens,
                                                                               self.bytes_per_token)))
            return None
        self.num_steps += 1
        self.simulated_clock.advance(self.cost_model.predict(step_shape(requests, copies.num_tokens,
                                                                        self.bytes_per_token)))
        vocab_size = self.vocab_size
        tokens = []
        for request in sampling:
            output = request.output_token_ids
            last = output[-1] if output else request.prompt_token_ids[-1]
            length = len(request.prompt_token_ids) + len(output)
            tokens.append((last * 2654435761 + length * 40503 + 1) % vocab_size)
        return tokens
