"""The search for the cheapest fleet that meets an SLO (Vidur-Search's question): over every combination of
the settings searched (``--search max_batch_size=8,16,32``, routers, ...) and replica counts
(``--search replicas=1..16``), the configuration with the fewest replicas (GPUs) whose run meets every
percentile objective of ``--slo``.

Ties among the configurations meeting the SLO with the fewest replicas go to the one with the most
headroom (the smallest worst ratio of a percentile to its bound), then to the first in the order searched
(the --search values in the order given).

Pruning, and why each is safe:
- More replicas never hurt latency for a fixed router and setting (each replica gets a subset of the
  same arrivals), so whether a setting meets the SLO is monotone in the replica count: its smallest
  count is found by binary search (``log2(counts)`` runs instead of ``counts``), and a count above a met
  one, or below a missed one, is known without running it.
- A setting needs more replicas than the cheapest found so far cannot be the cheapest: each later
  setting is first run at that count; a miss there ends it (it would need more), a pass binary-searches
  below it. Counts above the best are never run.
- A run stops as soon as one objective is provably missed (kvtool.fleet.slo_early_stop): enough of its
  requests already exceed the bound that the percentile cannot come back under it, whatever the rest do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Evaluation:
    """One configuration's run: whether it met every percentile objective; ``headroom``: the worst
    ratio of a percentile to its bound (below 1 when met; None when a run stopped early); its summary row."""

    met: bool
    headroom: float | None
    row: Mapping
    stopped_early: bool = False


@dataclass(frozen=True)
class Tried:
    setting_index: int
    setting: Mapping
    replicas: int
    evaluation: Evaluation


@dataclass
class SearchResult:
    """Every configuration run, in order, the cheapest meeting the SLO (None: none did), and how many
    configurations the search covered without running them (known from monotonicity or pruned)."""

    tried: list[Tried] = field(default_factory=list)
    best: Tried | None = None
    num_configurations: int = 0

    @property
    def num_not_run(self) -> int:
        return self.num_configurations - len(self.tried)


def _better(candidate: Tried, best: Tried | None) -> bool:
    """Fewer replicas, then more headroom (a smaller worst ratio), then earlier in the search."""
    if best is None:
        return True
    key = (candidate.replicas, candidate.evaluation.headroom, candidate.setting_index)
    return key < (best.replicas, best.evaluation.headroom, best.setting_index)


def search(settings: Sequence[Mapping], replica_counts: Sequence[int],
           evaluate: Callable[[Mapping, int], Evaluation],
           on_tried: Callable[[Tried], None] | None = None) -> SearchResult:
    """The cheapest (setting, replica count) meeting the SLO, ``evaluate(setting, replicas)`` running one;
    the pruning of the module docstring."""
    counts = sorted(set(replica_counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"--search replicas: the replica counts must be positive, got {list(replica_counts)}")
    result = SearchResult(num_configurations=len(settings) * len(counts))

    def run(index: int, setting: Mapping, replicas: int) -> Tried:
        tried = Tried(index, setting, replicas, evaluate(setting, replicas))
        result.tried.append(tried)
        if on_tried is not None:
            on_tried(tried)
        return tried

    for index, setting in enumerate(settings):
        allowed = [c for c in counts if result.best is None or c <= result.best.replicas]
        if not allowed:
            continue
        smallest = run(index, setting, allowed[-1])
        if not smallest.evaluation.met:
            continue  # it needs more replicas than the cheapest so far (or than searched)
        low, high = 0, len(allowed) - 1  # allowed[high] meets: ``smallest`` is its run
        while low < high:
            middle = (low + high) // 2
            tried = run(index, setting, allowed[middle])
            if tried.evaluation.met:
                high, smallest = middle, tried
            else:
                low = middle + 1
        if _better(smallest, result.best):
            result.best = smallest
    return result
