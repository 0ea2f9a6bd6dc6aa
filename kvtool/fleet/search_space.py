"""What `kvtool simulate --search` searches: ``--search replicas=1..16`` (the fleet sizes, a range or a
list), ``--search router=round_robin,prefix_aware`` and ``--search NAME=V1,V2,...`` for any configuration
flag of bench and simulate (``max_batch_size``, ``kv_host_cache_bytes``, ...; each value read as YAML, as
--sweep reads it). The settings are every combination of the values of the names other than replicas, in
the order given."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml

from kvtool.flags import FLAG_NAMES
from kvtool.fleet.routers import ROUTERS

MAX_VALUES = 1024  # a range longer than this is a typo (replicas=1..10000), not a search


@dataclass(frozen=True)
class SearchSpace:
    """The settings to search (each {flag or 'router': value}) and the replica counts, ascending."""

    settings: list[dict]
    replica_counts: list[int]

    @property
    def num_configurations(self) -> int:
        return len(self.settings) * len(self.replica_counts)


def _values(spec: str, name: str, text: str) -> list:
    if ".." in text and "," not in text:
        low, _, high = text.partition("..")
        try:
            first, last = int(low), int(high)
        except ValueError:
            raise ValueError(f"--search {spec!r}: {text!r} is not a range of whole numbers: give LOW..HIGH, e.g. "
                             f"{name}=1..16") from None
        if last < first or last - first >= MAX_VALUES:
            raise ValueError(f"--search {spec!r}: {text!r} is empty or longer than {MAX_VALUES:,} values: give LOW..HIGH "
                             "with LOW <= HIGH")
        return list(range(first, last + 1))
    values = [yaml.safe_load(part) for part in (p.strip() for p in text.split(",")) if part]
    if not values:
        raise ValueError(f"--search {spec!r} names no value: give NAME=V1,V2,... or NAME=LOW..HIGH")
    return values


def parse_search(specs: Sequence[str], *, replicas: int | None = None,
                 given: Mapping[str, object] | None = None) -> SearchSpace:
    """The search space of the --search flags; ``replicas``: --replicas (the count when replicas are not
    searched, default 1); ``given``: the configuration flags given, which a search must not also vary."""
    dimensions: dict[str, list] = {}
    for spec in specs:
        name, separator, text = spec.partition("=")
        name = name.strip()
        if not separator or not name or not text.strip():
            raise ValueError(f"--search {spec!r} is not NAME=V1,V2,... or NAME=LOW..HIGH (e.g. --search replicas=1..16 "
                             "--search max_batch_size=8,16,32)")
        if name not in ("replicas", "router", *FLAG_NAMES):
            raise ValueError(f"--search {spec!r}: {name!r} cannot be searched: give replicas, router or one of "
                             + ", ".join(FLAG_NAMES))
        if name in dimensions:
            raise ValueError(f"--search {name} is given twice: give its values in one --search {name}=...")
        if name == "replicas" and replicas is not None:
            raise ValueError("--replicas is given and searched: drop --replicas or its --search")
        if given is not None and name in given:
            raise ValueError(f"--{name} is given and searched: drop --{name} or its --search")
        values = _values(spec, name, text.strip())
        if name == "replicas" and any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"--search {spec!r}: replica counts are whole numbers from 1 up")
        if name == "router":
            unknown = [v for v in values if v not in ROUTERS]
            if unknown:
                raise ValueError(f"--search {spec!r}: {unknown[0]!r} is not a router: use {', '.join(ROUTERS)}")
        dimensions[name] = values
    counts = sorted(set(dimensions.pop("replicas", [replicas or 1])))
    names = list(dimensions)
    settings = [dict(zip(names, combination)) for combination in itertools.product(*dimensions.values())]
    return SearchSpace(settings, counts)


def describe_setting(setting: Mapping) -> str:
    """'max_batch_size=8,router=prefix_aware' ('' for the only setting of a search over replicas alone)."""
    return ",".join(f"{name}={value}" for name, value in setting.items())
