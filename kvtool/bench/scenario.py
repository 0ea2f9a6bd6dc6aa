"""Named benchmark scenarios (bench_configs/*.yaml are commented examples): a dataset (a file, or a
generator and its parameters), a model to build (``build:`` holds BuildOptions) or a built plan, bench
flags (``bench:``, the flags' underscore names), a sweep of variants (a label and overrides), and
``repeat`` / ``warmup_rounds``. ``tokens_per_block`` is a build option for a model (one plan per
value) and a flag checked against a built plan. Unknown keys are errors naming the key, the file and
the allowed keys; ``--set bench.max_batch_size=4`` overrides apply before validation.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from kvtool.workloads import generators
from kvtool.workloads.datasets import write_jsonl
from kvtool.config import ConfigError, EngineConfig, ReplayOptions
from kvtool.errors import KvtoolError
from kvtool.flags import FLAG_NAMES, configs

DEFAULT_MODEL = "preset:tiny-llama"
TOP_LEVEL_KEYS = ("name", "description", "model", "plan", "build", "dataset", "bench", "sweep", "repeat",
                  "warmup_rounds")
VARIANT_KEYS = ("label", "model", "plan", "build", "dataset")


class ScenarioError(KvtoolError):
    """A scenario file that cannot be run (unknown key, bad value); the message names the file."""


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset file, or a generator with its parameters (generated into the output directory)."""

    path: Path | None = None
    generator: str | None = None
    parameters: Mapping[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        if self.path is not None:
            return str(self.path)
        params = ",".join(f"{k}={v}" for k, v in sorted(self.parameters.items()))
        return f"{self.generator}({params})"

    def materialize(self, output_dir: Path, stem: str) -> Path:
        """The dataset file: the given path, or the generator's output written to output_dir/<stem>.jsonl."""
        if self.path is not None:
            return self.path
        return write_jsonl(output_dir / f"{stem}.jsonl", generators.generate(self.generator, self.parameters))


@dataclass(frozen=True)
class Variant:
    """One run of a scenario: where the plan comes from, the dataset and the configuration its bench flags
    ask for (the engine's, and the replay's)."""

    label: str
    model: str | None                # a preset/checkpoint to build (None: `plan` is used as is)
    plan: Path | None
    build: Mapping[str, object]      # BuildOptions fields for `model`
    dataset: DatasetSpec
    engine: EngineConfig
    replay: ReplayOptions

    @property
    def plan_source(self) -> str:
        return str(self.plan) if self.plan is not None else str(self.model)

    def build_options(self, *, dtype: str | None = None):
        """The BuildOptions its `model:` is built with: its `build:` section, with ``dtype`` (default: this
        device's) when the section names none."""
        from kvtool.plan import BuildOptions

        if dtype is None and "dtype" not in self.build:
            from kvtool.runtime.device import default_dtype  # torch: only when a model is built here

            dtype = default_dtype()
        return BuildOptions(**{"dtype": dtype, **self.build})


@dataclass(frozen=True)
class Scenario:
    path: Path
    name: str
    description: str
    variants: tuple[Variant, ...]
    repeat: int = 1              # runs of every variant, alternating: a median and a spread per figure
    warmup_rounds: int = 0       # rounds of every variant run first and not recorded (a process warming up)


def parse_set(assignment: str) -> tuple[list[str], object]:
    """'bench.max_batch_size=4' -> (['bench', 'max_batch_size'], 4); the value is read as YAML."""
    if "=" not in assignment:
        raise ScenarioError(f"--set {assignment!r} is not KEY=VALUE (e.g. --set bench.max_batch_size=4)")
    key, _, text = assignment.partition("=")
    parts = [part for part in key.strip().split(".") if part]
    if not parts:
        raise ScenarioError(f"--set {assignment!r} has no key")
    return parts, yaml.safe_load(text) if text.strip() else None


def apply_set(document: dict, assignment: str) -> None:
    """Applies one --set override to the raw scenario document (list items by index: sweep.0.label=x)."""
    parts, value = parse_set(assignment)
    node = document
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(f"--set {assignment}: {'.'.join(parts[:depth + 1])} is not an item of the list")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ScenarioError(f"--set {assignment}: {'.'.join(parts[:depth + 1])} is not a mapping")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ScenarioError(f"--set {assignment}: {'.'.join(parts)} is not an item of the list")
        node[int(last)] = value
    else:
        node[last] = value


class _Checker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> ScenarioError:
        return ScenarioError(f"{self.path}: {where}: {what}")

    def keys(self, mapping, where: str, allowed: Sequence[str]) -> dict:
        if mapping is None:
            return {}
        if not isinstance(mapping, dict):
            raise self.fail(where, f"expected a mapping, got {type(mapping).__name__}")
        for key in mapping:
            if key not in allowed:
                raise self.fail(where, f"unknown key {key!r}; allowed keys: {', '.join(allowed)}")
        return dict(mapping)


def _dataset_spec(check: _Checker, raw, where: str, base_dir: Path) -> DatasetSpec:
    if not isinstance(raw, dict) or ("path" in raw) == ("generator" in raw):
        raise check.fail(where, "give either `path: FILE.jsonl` or `generator: NAME` with its parameters; generators: "
                         + ", ".join(generators.GENERATORS))
    if "path" in raw:
        check.keys(raw, where, ("path",))
        path = Path(str(raw["path"]))
        if not path.is_absolute() and not path.exists() and (base_dir / path).exists():
            path = base_dir / path
        return DatasetSpec(path=path)
    name = str(raw["generator"])
    parameters = {k: v for k, v in raw.items() if k != "generator"}
    try:
        allowed = ["generator"] + generators.generator_parameters(name) + list(generators.OPTION_NAMES)
    except ValueError as error:
        raise check.fail(where, str(error)) from None
    check.keys(raw, where, allowed)
    return DatasetSpec(generator=name, parameters=parameters)


def _default_build_limits() -> dict[str, int]:
    """The runtime limits a plan built with default BuildOptions admits."""
    from kvtool.plan.build_options import DEFAULT_MAX_SEQ_LEN_CAP, BuildOptions

    defaults = BuildOptions()
    return {"max_batch_size": defaults.max_batch_size, "max_num_tokens": defaults.max_num_tokens,
            "max_seq_len": defaults.max_seq_len or DEFAULT_MAX_SEQ_LEN_CAP}


def _merged(base: Mapping | None, override: Mapping | None) -> dict:
    return {**(base or {}), **(override or {})}


def _plan_source(check: _Checker, where: str, document: Mapping, raw_variant: Mapping, model: str | None,
                 plan: str | Path | None) -> tuple[str | None, str | None]:
    """(model to build, plan directory) of a variant: the command line, else the variant, else the file."""
    if raw_variant.get("model") and raw_variant.get("plan"):
        raise check.fail(where, "give either `model:` (built into a plan) or `plan:` (a built plan), not both")
    if plan is not None:
        return None, str(plan)
    if model is not None:
        return model, None
    if raw_variant.get("plan"):
        return None, str(raw_variant["plan"])
    if raw_variant.get("model"):
        return str(raw_variant["model"]), None
    if document.get("plan"):
        return None, str(document["plan"])
    return str(document.get("model") or DEFAULT_MODEL), None


def _bake_into_build(flags: dict, build: dict) -> None:
    """For a plan built from a recipe: the block size is a build option (one plan per value), and
    runtime limits above what a default build admits are built in."""
    if flags.get("tokens_per_block") is not None:
        build["tokens_per_block"] = flags.pop("tokens_per_block")
    for limit, built_for in _default_build_limits().items():
        if flags.get(limit) is not None and limit not in build and flags[limit] > built_for:
            build[limit] = flags[limit]


def load_scenario(path: str | Path, *, sets: Sequence[str] = (), model: str | None = None, plan: str | Path | None = None,
                  dataset: str | Path | None = None, bench_overrides: Mapping[str, object] | None = None,
                  sweep: Sequence[Mapping] | None = None) -> Scenario:
    """Reads, overrides and validates a scenario; every variant's flags are checked before anything runs.
    ``sweep`` replaces the file's variants (`kvtool simulate --sweep`).

    ``model``/``plan``/``dataset``/``bench_overrides`` come from `kvtool bench` flags given beside
    --config: they replace the scenario's values in every variant (the command line wins over a
    variant's own overrides, since the user asked for it explicitly).
    """
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"scenario {path} does not exist; see bench_configs/ for examples")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ScenarioError(f"{path}: not valid YAML ({error})") from None
    except UnicodeDecodeError as error:
        raise ScenarioError(f"scenario {path} is not a UTF-8 text file ({error.reason} at byte {error.start}): "
                            "give a YAML file such as bench_configs/system_prompt.yaml") from None
    if sweep is not None and isinstance(document, dict):
        document["sweep"] = [dict(variant) for variant in sweep]
    return scenario_from_document(document, path, sets=sets, model=model, plan=plan, dataset=dataset,
                                  bench_overrides=bench_overrides)


def sweep_variants(assignments: Sequence[str]) -> list[dict]:
    """--sweep NAME=V1,V2,... (repeatable): one variant per value (each read as YAML), labelled
    NAME=VALUE; several --sweep flags give every combination."""
    variants = [{}]
    for assignment in assignments:
        variants = [{**variant, **value, "label": ",".join(filter(None, (variant.get("label"), value["label"])))}
                    for variant in variants for value in _sweep_values(assignment)]
    return variants


def _sweep_values(assignment: str) -> list[dict]:
    name, _, values = assignment.partition("=")
    name = name.strip()
    if not name or not values.strip():
        raise ScenarioError(f"--sweep {assignment!r} is not NAME=V1,V2,... (e.g. --sweep kv_host_cache_bytes=0,1GiB,4GiB)")
    if name not in FLAG_NAMES:
        raise ScenarioError(f"--sweep {assignment!r}: {name!r} is not a bench flag; sweepable flags: "
                            + ", ".join(FLAG_NAMES))
    parts = [part.strip() for part in values.split(",") if part.strip()]
    return [{"label": f"{name}={part}", name: yaml.safe_load(part)} for part in parts]


def scenario_from_document(document, path: Path, *, sets: Sequence[str] = (), model: str | None = None,
                           plan: str | Path | None = None, dataset: str | Path | None = None,
                           bench_overrides: Mapping[str, object] | None = None) -> Scenario:
    """A scenario from its raw document (a scenario file's YAML, or one made from command-line flags);
    ``path`` names it in errors. See load_scenario."""
    check = _Checker(path)
    document = copy.deepcopy(check.keys(document, "top level", TOP_LEVEL_KEYS))
    for assignment in sets:
        apply_set(document, assignment)
    document = check.keys(document, "top level (after --set)", TOP_LEVEL_KEYS)
    if dataset is not None:
        document["dataset"] = {"path": str(dataset)}

    from kvtool.plan.build_options import BuildOptions  # torch loads only when a scenario is used

    flag_names = FLAG_NAMES
    build_keys = tuple(f.name for f in fields(BuildOptions))
    base_bench = check.keys(document.get("bench"), "bench", flag_names)
    base_build = check.keys(document.get("build"), "build", build_keys)
    if "dataset" not in document:
        raise check.fail("top level", "no `dataset:` (a `path:` or a `generator:`); or pass --dataset FILE")
    sweep = document.get("sweep") or [{}]
    if not isinstance(sweep, list):
        raise check.fail("sweep", "expected a list of variants (each a mapping with a label and overrides)")
    name = str(document.get("name") or path.stem)

    if document.get("model") and document.get("plan"):
        raise check.fail("top level", "give either `model:` (built into a plan) or `plan:` (a built plan), not both")
    variants, labels = [], set()
    for position, raw_variant in enumerate(sweep):
        where = f"sweep[{position}]"
        raw_variant = check.keys(raw_variant, where, VARIANT_KEYS + tuple(flag_names))
        label = str(raw_variant.get("label") or (name if len(sweep) == 1 else f"variant{position}"))
        if label in labels:
            raise check.fail(where, f"label {label!r} is used twice; give each variant its own label")
        labels.add(label)
        where = f"sweep[{position}] ({label})"
        variant_model, variant_plan = _plan_source(check, where, document, raw_variant, model, plan)
        build = check.keys(_merged(base_build, raw_variant.get("build")), f"{where} build", build_keys)
        flags = {**base_bench, **{k: v for k, v in raw_variant.items() if k in flag_names}, **(bench_overrides or {})}
        if variant_plan is None:
            _bake_into_build(flags, build)
        elif raw_variant.get("build"):
            raise check.fail(where, "`build:` needs `model:` (a recipe to build); a `plan:` directory is already built")
        else:
            build = {}  # a built plan: the scenario's build options do not apply
        dataset_raw = document["dataset"] if dataset is None else {"path": str(dataset)}
        override = raw_variant.get("dataset")
        if override is not None and dataset is None:
            if not isinstance(override, dict):
                raise check.fail(f"{where} dataset", "expected a mapping")
            replaces = "path" in override or "generator" in override
            dataset_raw = override if replaces else _merged(dataset_raw, override)
        spec = _dataset_spec(check, dataset_raw, f"{where} dataset", path.parent)
        try:
            engine, replay = configs(flags)
            if variant_plan is None:
                try:
                    BuildOptions(**build)
                except ConfigError as error:  # named as the file spells it: build.<option>
                    raise ValueError(f"build.{error.field} {error.problem}") from None
            if spec.generator is not None:
                generators.check_parameters(spec.generator, spec.parameters)
        except (TypeError, ValueError) as error:
            raise check.fail(where, str(error)) from None
        variants.append(Variant(label=label, model=variant_model, plan=Path(variant_plan) if variant_plan else None,
                                build=build, dataset=spec, engine=engine, replay=replay))
    counts = {}
    for key, default, minimum in (("repeat", 1, 1), ("warmup_rounds", 0, 0)):
        value = document.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise check.fail(key, f"expected a number of runs >= {minimum}, got {value!r}")
        counts[key] = value
    return Scenario(path=path, name=name, description=str(document.get("description") or ""),
                    variants=tuple(variants), **counts)
