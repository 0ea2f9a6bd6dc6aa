"""What configured a bench run, as its summary row records it; which of that differs between reports;
and the short names that tell variants apart ('reuse off', 'host 42.0 GiB', 'block 16').

A report's label is kept when it was chosen (--label, a scenario's variant names). A default label
(the plan's name, the same for every run of one plan) that several runs share gives way to what
differs: the configuration fields, taken in the order below, that first tell those runs apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvtool.units import format_bytes

UNKNOWN = "?"  # a value the report does not record (written by an older kvtool, or per-request data only)


def _text(value) -> str | None:
    """A cell as text: '' and None are None, 16.0 (a median) is '16'."""
    if value is None or value == "":
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _on_off(text: str) -> str:
    return {"true": "on", "false": "off"}.get(text.lower(), text)


def _count(text: str) -> str:
    try:
        return f"{int(float(text)):,}"
    except ValueError:
        return text


def _size(text: str) -> str:
    try:
        number = float(text)
    except ValueError:
        return text
    return "off" if not number else format_bytes(number)


@dataclass(frozen=True)
class ConfigField:
    """A configuration column: its name in the ``differs:`` line, its value there, and in a variant's name."""

    column: str
    name: str
    shown: Callable[[str], str] = str
    short: Callable[[str], str] | None = None  # the value in a variant's name (default: name + shown value)
    default: str | None = None  # what an empty cell means (a flag left out: 'default'); None: unknown
    of_row: Callable[[Mapping], str | None] | None = None  # the value when other columns make it up

    def value(self, row: Mapping) -> str | None:
        if self.of_row is not None:
            return self.of_row(row)
        text = _text(row.get(self.column))
        if text is None:
            return self.default if self.column in row else None
        return self.shown(text)

    def describe(self, row: Mapping) -> str | None:
        """The value in a variant's name ('reuse off'); None when the row does not record it."""
        text = _text(row.get(self.column))
        if text is None and self.of_row is not None:  # made up of other columns ('measured': no column)
            text = self.of_row(row)
        elif text is None and self.default is not None and self.column in row:
            text = self.default
        if text is None:
            return None
        return self.short(text) if self.short is not None else f"{self.name} {self.shown(text)}"


def _flag(column: str, shown: Callable[[str], str] = str, short: Callable[[str], str] | None = None) -> ConfigField:
    return ConfigField(column, f"--{column}", shown, short, default="default")


# A fleet's columns (kvtool.fleet): a run without them ran one engine. Names before the flags' (a fleet's
# size and router tell its runs apart first).
FLEET_FIELDS: tuple[ConfigField, ...] = (
    ConfigField("router", "--router", short=lambda v: f"router {v}"),
    ConfigField("num_replicas", "--replicas", _count, lambda v: f"{_count(v)} replica{'s' * (v not in ('1', '1.0'))}",
                of_row=lambda row: _text(row.get("num_replicas")) or ("1" if row.get("label") is not None else None)),
    ConfigField("replica", "replica", short=lambda v: v if v == "fleet" else f"replica {v}", default="fleet"),
)
# Every configuration flag's summary column (kvtool.flags.CONFIG_FLAGS, which needs the C++ extension: report
# code must not), in the order variant names use them (the ones users sweep most first).
FLAG_FIELDS: tuple[ConfigField, ...] = (
    _flag("enable_kv_cache_reuse", _on_off, lambda v: f"reuse {_on_off(v)}"),
    _flag("kv_host_cache_bytes", _size, lambda v: f"host {_size(v)}"),
    _flag("kv_disk_cache_bytes", _size, lambda v: f"disk {_size(v)}"),
    _flag("kv_disk_cache_dir", short=lambda v: f"disk in {v}"),
    _flag("kv_remote_cache", short=lambda v: f"remote {v}"),
    _flag("kv_remote_cache_bytes", _size, lambda v: f"remote {_size(v)}"),
    _flag("tokens_per_block", short=lambda v: f"block {v}"),
    _flag("max_tokens_in_paged_kv_cache", _count, lambda v: f"pool {_count(v)}{' tokens' * (v != 'default')}"),
    _flag("kv_cache_free_gpu_mem_fraction", short=lambda v: f"mem fraction {v}"),
    _flag("max_attention_window_size", _count, lambda v: f"window {_count(v)}"),
    _flag("scheduler_policy", short=str),
    _flag("enable_chunked_context", _on_off, lambda v: f"chunked {_on_off(v)}"),
    _flag("context_chunking_policy", short=str),
    _flag("max_batch_size", _count, lambda v: f"batch {_count(v)}"),
    _flag("max_num_tokens", _count, lambda v: f"max_num_tokens {_count(v)}"),
    _flag("max_seq_len", _count, lambda v: f"max_seq_len {_count(v)}"),
    _flag("enforce_eager", _on_off, lambda v: "eager" if _on_off(v) == "on" else "graphs"),
    _flag("cpu_kernels_isa", short=lambda v: f"cpu kernels {v}"),
    _flag("mode", short=str),
    _flag("concurrency", short=lambda v: f"concurrency {v}"),
    _flag("request_rate", short=lambda v: f"{v} req/s"),
    _flag("burstiness", short=lambda v: f"burstiness {v}"),
    _flag("time_scale", short=lambda v: f"time x{v}"),
    _flag("seed", short=lambda v: f"seed {v}"),
    _flag("warmup", short=lambda v: f"warmup {v}"),
    _flag("warmup_counts_in_stats", _on_off, lambda v: f"warm-up counted {_on_off(v)}"),
    _flag("temperature", short=lambda v: "greedy" if v in ("0", "0.0") else f"temperature {v}"),
    _flag("top_p", short=lambda v: f"top_p {v}"),
    _flag("top_k", short=lambda v: f"top_k {v}"),
    ConfigField("num_requests_limit", "--num_requests", _count, lambda v: f"{_count(v)} requests", "default"),
)


def _model(text: str) -> str:
    return Path(text.removeprefix("preset:")).name or text


def _dataset(row: Mapping) -> str | None:
    """'abab.jsonl (sha256 0123456789ab)': the file's name and what it held."""
    name, digest = _text(row.get("dataset")), _text(row.get("dataset_sha256"))
    if name is None:
        return None
    return f"{Path(name).name} (sha256 {digest[:12]})" if digest else Path(name).name


def _simulated(row: Mapping) -> str | None:
    """'simulated' or 'measured' (a summary without the column is a measured run's; kvtool simulate
    names itself in the engine column too)."""
    if str(row.get("simulated")) == "True" or str(row.get("engine", "")).startswith("kvtool simulate"):
        return "simulated"
    return "measured" if "simulated" in row or "engine" in row else None


# After the flags: what was served, on what, with which data; then the pools the run created.
OTHER_FIELDS: tuple[ConfigField, ...] = (
    ConfigField("model", "model", short=_model),
    ConfigField("dataset", "dataset", short=lambda v: Path(v).stem, of_row=_dataset),
    ConfigField("scenario", "scenario", short=str),
    ConfigField("simulated", "simulated", short=lambda v: "simulated" if v in ("True", "simulated") else "measured",
                of_row=_simulated),
    ConfigField("cost_profile", "cost profile", short=str),
    ConfigField("tier_costs", "third tier costs", short=str),
    ConfigField("engine", "engine", short=str),
    ConfigField("endpoint", "endpoint", short=str),
    ConfigField("api", "--api", short=lambda v: f"{v} api"),
    ConfigField("device", "device", short=str),
    ConfigField("kv_primary_tokens", "primary pool", lambda v: f"{_count(v)} tokens",
                lambda v: f"primary {_count(v)} tokens"),
    ConfigField("kv_host_bytes", "host pool", _size, lambda v: f"host pool {_size(v)}"),
)
_KNOWN = {field.column for field in FLEET_FIELDS + FLAG_FIELDS + OTHER_FIELDS} | {"plan_path", "dataset_sha256"}


def config_fields(rows: Sequence[Mapping]) -> list[ConfigField]:
    """Every configuration field the rows record, in name order: the flags, the build options
    (``plan_*`` of a built plan, ``build_*`` of a scenario's variant), the rest (model, dataset, engine,
    simulation, device, pools); the model's architecture (``model_*``) when the model is not recorded."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    fields = [field for field in FLEET_FIELDS + FLAG_FIELDS if field.column in columns]
    for prefix, what in (("plan_", "plan"), ("build_", "build")):
        fields += [ConfigField(column, f"{what} {column.removeprefix(prefix)}",
                               short=lambda v, name=column.removeprefix(prefix): f"{name} {v}")
                   for column in columns if column.startswith(prefix) and column not in _KNOWN]
    fields += [field for field in OTHER_FIELDS
               if field.column in columns or any(field.value(row) is not None for row in rows)]
    if "model" not in columns and "plan_path" in columns:
        fields.append(ConfigField("plan_path", "plan", short=_model))
    if "model" not in columns and "plan_path" not in columns:
        fields += [ConfigField(column, column.replace("_", " "), short=lambda v, c=column: f"{c} {v}")
                   for column in columns if column.startswith("model_")]
    return fields


def differing_fields(rows: Sequence[Mapping]) -> list[ConfigField]:
    """The configuration fields whose recorded values differ between the rows (a row that does not record
    a field does not make it differ)."""
    found = []
    for field in config_fields(rows):
        values = {field.value(row) for row in rows} - {None}
        if len(values) > 1:
            found.append(field)
    return found


def telling_apart(rows: Sequence[Mapping], fields: Sequence[ConfigField]) -> list[ConfigField]:
    """The fewest of ``fields``, taken in order, whose values tell the rows apart as far as they can: a
    field joins only when it splits rows the earlier ones left together (so 'block 16' comes without
    the pool sizes that follow from it)."""
    chosen: list[ConfigField] = []

    def groups(with_fields: Sequence[ConfigField]) -> int:
        return len({tuple(field.value(row) for field in with_fields) for row in rows})

    best = groups(fields)
    for field in fields:
        if groups(chosen + [field]) > groups(chosen):
            chosen.append(field)
        if groups(chosen) == best:
            break
    return chosen


def describe(row: Mapping, fields: Sequence[ConfigField]) -> str:
    """'reuse off, host 42.0 GiB': the row's values of ``fields`` ('' when it records none)."""
    return ", ".join(text for text in (field.describe(row) for field in fields) if text)


def default_label(row: Mapping) -> bool:
    """Whether the row's label is the one kvtool gives a run without --label (the plan's or model's
    name, or SERVED_MODEL@endpoint), which says nothing of how variants differ."""
    source = row.get("label_source")
    if source:
        return source == "default"
    label = str(row.get("label") or "")
    model = _text(row.get("model")) or _text(row.get("plan_path"))
    if not label or model is None:
        return not label
    return label in (_model(model), f"{model}@endpoint")


class VariantNames(NamedTuple):
    names: list[str]
    derived: list[bool]  # whether a name is only what sets its row apart (its default label replaced)


def variant_names(rows: Sequence[Mapping], sources: Sequence[Path]) -> VariantNames:
    """A distinct, short name per row. A label that several rows share gives way to what tells them
    apart ('reuse on', 'reuse off') when it is kvtool's default, and gets it added when it was chosen
    ('on (host off)'); names still alike get that added, then their files' places, then a number."""
    names = [str(row.get("label") or "run") for row in rows]
    derived = [False] * len(rows)
    for group in _repeated(names):
        among = [rows[i] for i in group]
        fields = telling_apart(among, differing_fields(among))
        for i in group:
            detail = describe(rows[i], fields)
            if detail and default_label(rows[i]):
                names[i], derived[i] = detail, True
            elif detail:
                names[i] = f"{names[i]} ({detail})"
    for group in _repeated(names):  # alike across groups: 'reuse on' of two plans
        among = [rows[i] for i in group]
        fields = telling_apart(among, differing_fields(among))
        for i in group:
            detail = describe(rows[i], fields)
            if detail:
                names[i] = f"{names[i]} ({detail})"
    for group in _repeated(names):
        places = _places([sources[i] for i in group])
        for i, place in zip(group, places):
            names[i] = f"{names[i]} ({place})"
    for group in _repeated(names):
        for number, i in enumerate(group[1:], start=2):
            names[i] = f"{names[i]} #{number}"
    return VariantNames(names, derived)


def _repeated(names: Sequence[str]) -> list[list[int]]:
    positions: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        positions.setdefault(name, []).append(i)
    return [group for group in positions.values() if len(group) > 1]


def _places(paths: Sequence[Path]) -> list[str]:
    """The shortest tail of each path's directory that tells them apart ('out/on/summary.csv' -> 'on'),
    else the file names' stems ('a.csv' -> 'a'), else the whole paths."""
    paths = [Path(p) for p in paths]
    for depth in range(1, max(len(p.parent.parts) for p in paths) + 1):
        tails = ["/".join(p.parent.parts[-depth:]) for p in paths]
        if len(set(tails)) == len(tails):
            return tails
    stems = [p.stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
