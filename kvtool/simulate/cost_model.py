"""What one engine step costs: the step's shape (from a scheduled batch) and a linear cost model fitted
to measured steps (`kvtool calibrate`) or derived from a device's published figures (estimated).

    seconds = step + context_row * rows + context_token * tokens + context_cached_token * cached tokens
              + context_pair * pairs + decode_row * rows + decode_kv_token * kv tokens + copied_byte * bytes

Every term is one kind of work, so a fitted coefficient reads as a cost (ms per 1k tokens, GB/s of
copies) and a scenario the model misses points at the term that is wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvtool import _core
from kvtool.errors import KvtoolError

PROFILE_DIR = "cost_models"  # beside plan.json: one <device key>.json per device calibrated


class StepShape(NamedTuple):
    """The work of one step as the runner flattens it: multi-token context chunks, and one-token rows
    (decode tokens, and a fully cached prompt's last token), plus the block copies before the forward."""

    num_context_rows: int = 0
    num_context_tokens: int = 0
    num_context_cached_tokens: int = 0  # cached KV the context chunks read: sum cached
    num_context_pairs: float = 0.0  # query-key pairs the context tokens attend: sum n * (cached + (n + 1) / 2)
    num_decode_rows: int = 0
    num_decode_kv_tokens: int = 0  # KV tokens the one-token rows read: sum (cached + 1)
    num_copied_bytes: int = 0      # offloaded + onboarded + partially copied, both ways

    def as_terms(self) -> tuple[float, ...]:
        """The regressors, in TERMS order (1 for the per-step constant)."""
        return (1.0, *map(float, self))


# Coefficient names (seconds per unit) in StepShape order, after the per-step constant.
TERMS = ("step", "context_row", "context_token", "context_cached_token", "context_pair", "decode_row",
         "decode_kv_token", "copied_byte")
# How each coefficient is printed: (unit label, multiplier from seconds per unit).
TERM_UNITS = {"step": ("ms per step", 1e3), "context_row": ("ms per context chunk", 1e3),
              "context_token": ("ms per 1k context tokens", 1e6),
              "context_cached_token": ("ms per 1k cached tokens read by context chunks", 1e6),
              "context_pair": ("ms per 1M attended pairs", 1e9),
              "decode_row": ("ms per one-token row", 1e3), "decode_kv_token": ("ms per 1k KV tokens read", 1e6),
              "copied_byte": ("ms per MiB copied", 1e3 * 2**20)}


def step_shape(requests: Iterable, copy_num_tokens: Sequence[int] | np.ndarray, bytes_per_token: int) -> StepShape:
    """The shape of a step from its scheduled requests (``num_tokens``, ``num_cached_tokens`` each:
    a kvtool._core.ScheduledRequest or a StepRequest) and its copies' token counts."""
    context_rows = context_tokens = context_cached = decode_rows = decode_kv = 0
    pairs = 0.0
    for r in requests:
        n, cached = r.num_tokens, r.num_cached_tokens
        if n == 1:
            decode_rows += 1
            decode_kv += cached + 1
        else:
            context_rows += 1
            context_tokens += n
            context_cached += cached
            pairs += n * (cached + (n + 1) / 2)
    copied = int(np.sum(copy_num_tokens)) * bytes_per_token if len(copy_num_tokens) else 0
    return StepShape(context_rows, context_tokens, context_cached, pairs, decode_rows, decode_kv, copied)


@dataclass(frozen=True)
class FitReport:
    """How well a calibration fit predicts grid points it was not fitted on."""

    num_fit_points: int
    num_held_out_points: int
    median_abs_error: float  # relative: |predicted - measured| / measured
    p90_abs_error: float
    max_abs_error: float
    dropped_terms: tuple[str, ...] = ()  # fitted negative: left at 0 and the rest refitted

    def describe(self) -> str:
        dropped = f"; terms fitted negative and left out: {', '.join(self.dropped_terms)}" if self.dropped_terms else ""
        return (f"held-out error on {self.num_held_out_points} grid points (fitted on {self.num_fit_points}): "
                f"median {self.median_abs_error:.1%}, p90 {self.p90_abs_error:.1%}, max {self.max_abs_error:.1%}"
                f"{dropped}")


@dataclass(frozen=True)
class ServedCosts:
    """What `kvtool serve` adds around the engine's steps on one machine, as `kvtool calibrate --served`
    measured it with a probe against a real server and its own client (kvtool.bench.served_probe). The
    server's event loop runs the engine's steps, admits new requests and writes each token between them,
    so both costs lengthen the step they belong to: ``request_s`` the step that starts a request's prompt
    (HTTP, parsing, validation, admission), ``token_s`` the step that made a token (an event written,
    read by the client). Applied by ``CostModel.as_served`` (`kvtool simulate --served`)."""

    request_s: float
    token_s: float
    ttft_p50_error: float  # the fitted simulation against the probe's measurements: median over burst sizes
    tpot_p50_error: float  # (relative, signed: simulated / measured - 1)
    probe: str = ""        # what was measured

    def __post_init__(self) -> None:
        for name in ("request_s", "token_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ServedCosts.{name} must be seconds >= 0, got {value!r}")

    def describe(self) -> str:
        return (f"served by kvtool serve: +{self.request_s * 1e3:.3g} ms per request, +{self.token_s * 1e3:.3g} ms "
                f"per streamed token; the probe simulated with them: TTFT p50 {self.ttft_p50_error:+.1%}, TPOT p50 "
                f"{self.tpot_p50_error:+.1%} ({self.probe})")


@dataclass(frozen=True)
class CostModel:
    """Seconds per step for one plan on one device. ``estimated``: derived from published figures,
    not measured; every output that uses it says so."""

    device: str                        # as reports name devices, e.g. 'cpu: AMD EPYC (2 cores)'
    coefficients: dict[str, float]     # TERMS -> seconds per unit
    estimated: bool = False
    source: str = ""                   # how it was made: the calibration grid, or the published figures
    plan_digest: str | None = None     # the plan it was calibrated on
    fit: FitReport | None = None
    created_at: str = ""
    details: dict = field(default_factory=dict)  # published figures / grid used
    served: ServedCosts | None = None  # `kvtool calibrate --served`: what serving over HTTP adds here

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(TERMS))
        if unknown:
            raise ValueError(f"cost model: unknown terms {unknown}: the terms are {list(TERMS)}")
        bad = [k for k, v in self.coefficients.items() if not (isinstance(v, (int, float)) and math.isfinite(v))]
        if bad:
            raise ValueError(f"cost model: coefficients {bad} are not finite numbers")

    @property
    def name(self) -> str:
        """How reports name the profile: the device key, and '(estimated)' when it is."""
        how = "estimated" if self.estimated else "calibrated"
        return f"{device_key(self.device)} ({how}{', served' if self.details.get('served') else ''})"

    def as_served(self) -> CostModel:
        """The model of a step of `kvtool serve` on this machine: a context row (a request's prompt; each chunk
        with chunked context) costs ``served.request_s + served.token_s`` more, a decode row ``token_s`` more.
        KvtoolError when the model has no served costs."""
        if self.served is None:
            raise KvtoolError(f"the cost model {self.name} has no costs of serving over HTTP: measure them with "
                              "`kvtool calibrate --plan DIR --served` (it starts a kvtool serve and probes it)")
        c, served = dict(self.coefficients), self.served
        c["context_row"] = c.get("context_row", 0.0) + served.request_s + served.token_s
        c["decode_row"] = c.get("decode_row", 0.0) + served.token_s
        return replace(self, coefficients=c, served=None, source=f"{self.source}; {served.describe()}",
                       details={**self.details, "served": True})

    def predict(self, shape: StepShape) -> float:
        """Seconds of one step."""
        c = self.coefficients
        return (c.get("step", 0.0) + c.get("context_row", 0.0) * shape.num_context_rows
                + c.get("context_token", 0.0) * shape.num_context_tokens
                + c.get("context_cached_token", 0.0) * shape.num_context_cached_tokens
                + c.get("context_pair", 0.0) * shape.num_context_pairs
                + c.get("decode_row", 0.0) * shape.num_decode_rows
                + c.get("decode_kv_token", 0.0) * shape.num_decode_kv_tokens
                + c.get("copied_byte", 0.0) * shape.num_copied_bytes)

    def step_costs(self, bytes_per_token: int) -> _core.StepCosts:
        """The coefficients as kvtool._core.StepSimulator takes them (it adds the terms as ``predict`` does)."""
        return _core.StepCosts(**{term: float(self.coefficients.get(term, 0.0)) for term in TERMS},
                               bytes_per_token=bytes_per_token)

    def describe_terms(self) -> list[tuple[str, str]]:
        """(term, 'value unit') for each coefficient, in TERMS order."""
        out = []
        for term in TERMS:
            unit, scale = TERM_UNITS[term]
            out.append((term, f"{self.coefficients.get(term, 0.0) * scale:.4g} {unit}"))
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str) -> CostModel:
        try:
            data = json.loads(text)
            fit, served = data.pop("fit", None), data.pop("served", None)
            return cls(fit=None if fit is None else FitReport(**{**fit, "dropped_terms": tuple(fit.get(
                "dropped_terms", ()))}), served=None if served is None else ServedCosts(**served), **data)
        except (ValueError, TypeError) as error:
            raise KvtoolError(f"{source} is not a kvtool cost model ({error}): recreate it with `kvtool calibrate`")


def device_key(device: str) -> str:
    """A file-name-safe key of a device description: 'cpu: AMD EPYC 9R45 (2 cores)' -> 'cpu-amd-epyc-9r45-2-cores'."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"


def profile_path(plan_dir: Path, device: str) -> Path:
    return Path(plan_dir) / PROFILE_DIR / f"{device_key(device)}.json"


def save_profile(model: CostModel, plan_dir: Path) -> Path:
    """Writes the model beside the plan, keyed by device (replacing an older calibration)."""
    path = profile_path(plan_dir, model.device)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(model.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path


def load_profile(path: Path) -> CostModel:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise KvtoolError(f"cannot read the cost model {path} ({error.strerror or error}): give an existing file "
                          "or run `kvtool calibrate --plan DIR`") from None
    return CostModel.from_json(text, source=str(path))


def fit_coefficients(shapes: Sequence[StepShape], seconds: Sequence[float]) -> tuple[dict[str, float], tuple[str, ...]]:
    """Least squares of seconds on the step terms, relative error weighted (a 5 ms step counts as much
    as a 2 s one). A term whose coefficient comes out negative is physically wrong (work that saves
    time): it is dropped and the rest refitted, until none is negative. Terms no point exercises stay 0."""
    x = np.array([s.as_terms() for s in shapes], dtype=np.float64)  # [num_points, num_terms]
    y = np.asarray(seconds, dtype=np.float64)
    weights = 1.0 / y
    active = [j for j in range(len(TERMS)) if np.any(x[:, j] != 0)]
    dropped: list[str] = []
    while True:
        columns = x[:, active] * weights[:, None]
        # Columns scaled to unit norm: the terms' units differ by nine orders of magnitude.
        norms = np.linalg.norm(columns, axis=0)
        solution, *_ = np.linalg.lstsq(columns / norms, y * weights, rcond=None)
        solution /= norms
        negative = [j for j, value in zip(active, solution) if value < 0]
        if not negative:
            break
        worst = min(negative, key=lambda j: solution[active.index(j)] * norms[active.index(j)])
        active.remove(worst)
        dropped.append(TERMS[worst])
    coefficients = dict.fromkeys(TERMS, 0.0)
    for j, value in zip(active, solution):
        coefficients[TERMS[j]] = float(value)
    return coefficients, tuple(dropped)


def relative_errors(model: CostModel, shapes: Sequence[StepShape], seconds: Sequence[float]) -> np.ndarray:
    predicted = np.array([model.predict(s) for s in shapes])
    measured = np.asarray(seconds, dtype=np.float64)
    return np.abs(predicted - measured) / measured
