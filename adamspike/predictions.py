"""predictions.json: what the toy study predicts, in a form fullscale and analysis act on.

Schema (version 3), written by `adamspike predict`, read by `adamspike plan` (one run per
recommended setting), by the trainer (alarm rules evaluated online, fired alarms logged as
events) and by `adamspike analyze --predictions` (observed spike rate against the
predicted interval, alarm precision / lift / lead time):

    {
      "schema": "adamspike.predictions", "schema_version": 3,
      "created": "2026-12-02T12:00:00Z",      # UTC, written once at creation
      "content_sha256": "...",         # pre-registration: sha256 of the canonical JSON
                                       # (content_hash) of everything but this field
      "source": {...},                 # free-form provenance (sweep tables, theory version)
      "rate_model": {...},             # the spike-rate GLM used (adamspike.spike_rate):
                                       # features, coefficients with intervals, training
                                       # range, held-out scores, horizon_steps
      "profile": {                     # the model the predictions are for
        "name": "llama2-70b", "num_layers": 80,
        "rho_by_depth": {"-1": 0.05, "0": 0.3, ...},   # rms(g)/eps per depth (measured/assumed)
        "numel_by_depth": {"-1": 262144000, ...},      # parameters per depth (group_rho weights)
        "phi": 0.0                     # assumed lag-1 gradient correlation
      },
      "settings": [                    # candidate settings, ranked by predicted rate
        {"id": "eps1e-08-b2_0.95", "overrides": {"optim.b1": 0.9, "optim.b2": 0.95,
         "optim.eps": 1e-8, "optim.lr": 1.5e-4, "train.global_batch_size": 1024},
         "rate_per_1k": 0.3, "rate_ci": [0.1, 0.9],   # spikes per 1000 steps, GLM interval
         "p_spike": 0.45, "p_spike_ci": [...],        # P(>= 1 spike in horizon_steps)
         "features": {...}, "features_lo": {...}, "features_hi": {...},
         "extrapolation": {"log10_rho_shallow": "above", ...}, "extrapolated": true,
         "risk": 0.45, "risk_label": "medium", "rank": 1,   # risk = p_spike
         "rationale": "...", "per_depth": [{"depth": -1, "rho": ..., "regime": ...}, ...]}
      ],
      "alarm_rules": [
        {"id": "rms_t_shallow", "metric": "rms_t", "depths": [-1, 1], "kinds": null,
         "reduce": "max", "op": ">", "threshold": 2.0, "consecutive": 1,
         "expected_lead_steps": [1, 8], "source": "StableAdamW (Wortsman 2023a)"}
      ],
      "validate": ["eps1e-08-b2_0.95", ...]   # setting ids worth a full-scale run, best first
    }

A setting's `overrides` are dotted RunConfig keys (adamspike.train_config.RunConfig.from_dict,
which validates them; `adamspike plan` applies them over a base config). Version 1 files
(b1 / b2 / eps / lr / global_batch_size fields per setting) and version 2 files (the
heuristic risk, no pre-registration hash) are refused with a message saying to regenerate
them.

Pre-registration. `save_predictions` stamps `created` (UTC) and `content_sha256` =
sha256 of the canonical JSON (keys sorted, no whitespace, no NaN) of the file's object
without the `content_sha256` key, and never replaces an existing file. `from_json` checks
the hash and records the outcome in `Predictions.integrity` ("ok", "missing": not
pre-registered, "mismatch": edited after creation); `adamspike analyze --predictions`
refuses a mismatching file.

A rule selects tensors by depth range (inclusive; null = all) and kind list (null = all),
reduces the metric over them (max / min / mean / median, or group_rho: the numel-weighted
rms sqrt(sum numel v^2 / sum numel) of adamspike.depth_groups.group_rho, the group statistic
of the spike-rate GLM's rho features; it needs the tensors' numel), compares with the
threshold, and fires once the comparison has held on `consecutive` logged steps in a row.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from adamspike.config import ConfigError, check_value, flatten, nest, to_dict
from adamspike.depth_groups import group_rho
from adamspike.metrics import METRIC_NAMES, shape_stats
from adamspike.rundir import atomic_write_bytes, read_json
from adamspike.train_config import RunConfig

SCHEMA = "adamspike.predictions"
SCHEMA_VERSION = 3
HASH_KEY = "content_sha256"
REDUCERS = {"max": np.nanmax, "min": np.nanmin, "mean": np.nanmean, "median": np.nanmedian,
            "group_rho": group_rho}
WEIGHTED_REDUCERS = ("group_rho",)   # reducers that take (values, numel)
DERIVED_METRICS = ("bimodality", "skewness", "kurtosis")
RULE_METRICS = METRIC_NAMES + DERIVED_METRICS


class PredictionsError(ValueError):
    """predictions.json is malformed; the message names the field."""


@dataclass
class AlarmRule:
    id: str
    metric: str
    op: str = ">"
    threshold: float = 1.0
    depths: tuple[int, int] | None = None
    kinds: tuple[str, ...] | None = None
    reduce: str = "max"
    consecutive: int = 1
    expected_lead_steps: tuple[int, int] | None = None
    source: str = ""
    # set by scoring against spikes (analysis.controls.mark_uninformative): False when the
    # rule's precision does not beat the chance rate (lift <= 1); such rules are not armed
    informative: bool | None = None
    informative_reason: str = ""

    def __post_init__(self):
        where = f"alarm_rules[{self.id!r}]"
        if self.metric not in RULE_METRICS:
            raise PredictionsError(f"{where}.metric: unknown metric {self.metric!r}; "
                                   f"known: {', '.join(RULE_METRICS)}")
        if self.op not in (">", "<"):
            raise PredictionsError(f"{where}.op: must be '>' or '<', got {self.op!r}")
        if self.reduce not in REDUCERS:
            raise PredictionsError(f"{where}.reduce: must be one of {list(REDUCERS)}")
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise PredictionsError(f"{where}.threshold: must be a finite number")
        try:
            self.consecutive = check_value(f"{where}.consecutive", self.consecutive, int,
                                           strict=True, lo=1)
        except ConfigError as e:
            raise PredictionsError(str(e)) from None
        if self.depths is not None:
            if len(self.depths) != 2 or self.depths[0] > self.depths[1]:
                raise PredictionsError(f"{where}.depths: must be [lo, hi] with lo <= hi")
            self.depths = (int(self.depths[0]), int(self.depths[1]))
        if self.kinds is not None:
            self.kinds = tuple(self.kinds)
        if self.expected_lead_steps is not None:
            self.expected_lead_steps = tuple(int(x) for x in self.expected_lead_steps)

    def mask(self, depth: np.ndarray, kind: np.ndarray) -> np.ndarray:
        """Which tensors (rows) the rule looks at."""
        m = np.ones(len(depth), dtype=bool)
        if self.depths is not None:
            m &= (depth >= self.depths[0]) & (depth <= self.depths[1])
        if self.kinds is not None:
            m &= np.isin(kind, self.kinds)
        return m

    def value(self, depth, kind, values, numel=None) -> float:
        """The reduced metric over selected tensors (NaN if none selected or all NaN);
        `numel` (per tensor) is needed by the group_rho reduce."""
        m = self.mask(np.asarray(depth), np.asarray(kind))
        v = np.asarray(values, dtype=np.float64)[m]
        if v.size == 0 or np.all(np.isnan(v)):
            return math.nan
        if self.reduce in WEIGHTED_REDUCERS:
            if numel is None:
                raise PredictionsError(f"alarm_rules[{self.id!r}]: reduce {self.reduce!r} needs "
                                       "the tensors' numel")
            return float(REDUCERS[self.reduce](v, np.asarray(numel, dtype=np.float64)[m]))
        return float(REDUCERS[self.reduce](v))

    def holds(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return value > self.threshold if self.op == ">" else value < self.threshold


def metric_values(rule: AlarmRule, columns: Mapping[str, Any]) -> np.ndarray:
    """Per-tensor values of rule.metric from layer columns (derives bimodality etc.)."""
    if rule.metric in DERIVED_METRICS:
        return shape_stats(columns["r_mean"], columns["r_m2"], columns["r_m3"],
                           columns["r_m4"])[rule.metric]
    return np.asarray(columns[rule.metric], dtype=np.float64)


class OnlineAlarms:
    """Evaluates rules step by step, as the trainer logs per-tensor metrics.

    `update(step, columns)` takes one step's layer columns (depth, kind, numel and metric
    arrays; numel is read only by group_rho rules)
    and returns the alarms that fire at this step: dicts with rule, step, value, threshold.
    A rule fires when its condition has held for `consecutive` logged steps and re-arms
    after the condition has failed once.

    Rules marked `informative: false` (their lift over the chance rate was <= 1 when
    scored) are not armed; `disarmed` lists them with the reason.
    """

    def __init__(self, rules: Iterable[AlarmRule]):
        rules = list(rules)
        self.rules = [r for r in rules if r.informative is not False]
        self.disarmed = {r.id: r.informative_reason or "marked uninformative"
                         for r in rules if r.informative is False}
        self._run = {r.id: 0 for r in self.rules}

    def update(self, step: int, columns: Mapping[str, Any]) -> list[dict]:
        fired = []
        for r in self.rules:
            v = r.value(columns["depth"], columns["kind"], metric_values(r, columns),
                        columns.get("numel"))
            if r.holds(v):
                self._run[r.id] += 1
                if self._run[r.id] == r.consecutive:
                    fired.append({"rule": r.id, "step": int(step), "metric": r.metric,
                                  "value": v, "threshold": r.threshold})
            else:
                self._run[r.id] = 0
        return fired


@dataclass
class Predictions:
    settings: list[dict] = field(default_factory=list)
    alarm_rules: list[AlarmRule] = field(default_factory=list)
    validate: list[str] = field(default_factory=list)
    profile: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    created: str = ""
    rate_model: dict = field(default_factory=dict)
    content_sha256: str = ""
    # set by from_json: {"status": "ok" | "missing" | "mismatch", "stored", "computed"}
    integrity: dict = field(default_factory=dict)

    def setting(self, setting_id: str) -> dict:
        for s in self.settings:
            if s["id"] == setting_id:
                return s
        raise PredictionsError(f"validate: no setting with id {setting_id!r}")

    def to_json(self) -> dict:
        """The file's object, without the content hash (save_predictions adds it)."""
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": self.source, "rate_model": self.rate_model, "profile": self.profile,
                "settings": self.settings,
                "alarm_rules": [_rule_json(r) for r in self.alarm_rules],
                "validate": self.validate}


def model_key(setting: Mapping[str, Any]) -> tuple | None:
    """What the spike-rate model sees of a setting: its `model_features` values (9
    significant digits); None when the setting does not name them. Two settings with the
    same key get the same predicted rate and interval: the model cannot tell them apart
    (they differ only in keys it does not use, e.g. the batch size when tokens per step is
    not a model feature)."""
    names, feats = setting.get("model_features"), setting.get("features") or {}
    if not names or any(feats.get(k) is None for k in names):
        return None
    return tuple((k, float(f"{float(feats[k]):.9g}")) for k in names)


def indistinguishable(settings: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """Groups (of two or more setting ids, in the given order) that the model cannot tell
    apart (model_key)."""
    groups: dict[tuple, list[str]] = {}
    for s in settings:
        key = model_key(s)
        if key is not None:
            groups.setdefault(key, []).append(str(s["id"]))
    return [ids for ids in groups.values() if len(ids) > 1]


# which model features a setting's key moves (simulate.predict.candidate_features /
# mechanism_inputs): a key that moves none of a model's features is not in the model
KEY_FEATURES = {
    "optim.eps": ("log10_rho_shallow", "log10_rho_deep", "log10_lr_over_eps", "log10_stability",
                  "log10_rho_min"),
    "optim.lr": ("log10_lr_over_eps", "log10_stability"),
    "optim.b2": ("log10_one_minus_b2",),
    "optim.b1": (),                     # the stability number's 38 takes b1 = 0.9
    "train.global_batch_size": ("log10_tokens_per_step",),
}
MECHANISM_FEATURES = ("log10_stability", "log10_rho_min", "warmup")


def not_in_model(features: Iterable[str]) -> list[str]:
    """The setting keys (KEY_FEATURES) none of whose features the model uses: it gives the
    same number at any value of them (which is not a measurement of no effect)."""
    f = set(features)
    return [k for k, fs in KEY_FEATURES.items() if not f & set(fs)]


def model_label(rate_model: Mapping[str, Any]) -> str:
    """One line naming a predictions file's rate model: its kind (the mechanism model or
    the regime GLM), its features, the model schema version, the file and its sha256."""
    feats = list(rate_model.get("features") or [])
    kind = ("mechanism model" if set(feats) & set(MECHANISM_FEATURES) else "regime GLM")
    src = rate_model.get("model_file") or (
        "fitted on " + ", ".join(rate_model.get("fitted_on") or []) if rate_model.get("fitted_on")
        else "?")
    sha = rate_model.get("model_sha256")
    return (f"{kind} ({', '.join(feats)}; spike-rate model schema v{rate_model.get('version', 1)})"
            f", {src}" + (f" sha256 {sha[:12]}" if sha else "")
            + (f", {rate_model['shipped'].split(' (')[0]}" if rate_model.get("shipped") else ""))


def content_hash(data: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of `data` without its HASH_KEY: keys sorted,
    separators ',' and ':', no NaN / infinity."""
    body = {k: v for k, v in data.items() if k != HASH_KEY}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def verify_hash(data: Mapping[str, Any]) -> dict:
    """{"status": "ok" | "missing" | "mismatch", "stored": ..., "computed": ...}."""
    stored = data.get(HASH_KEY)
    try:
        computed = content_hash(data)
    except ValueError:        # NaN somewhere: it cannot be the file that was hashed
        computed = ""
    status = "missing" if not stored else "ok" if stored == computed else "mismatch"
    return {"status": status, "stored": stored or "", "computed": computed}


def _rule_json(r: AlarmRule) -> dict:
    d = asdict(r)
    for k in ("depths", "kinds", "expected_lead_steps"):
        if d[k] is not None:
            d[k] = list(d[k])
    return d


def from_json(data: Mapping[str, Any], where: str = "predictions") -> Predictions:
    if not isinstance(data, Mapping):
        raise PredictionsError(f"{where}: expected a JSON object")
    if data.get("schema") != SCHEMA:
        raise PredictionsError(f"{where}: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("schema_version") == 1:
        raise PredictionsError(f"{where}: schema_version 1 (settings with b1/b2/eps/lr fields) is "
                               f"no longer read; regenerate it with `adamspike predict` "
                               f"(version {SCHEMA_VERSION}: settings carry dotted overrides)")
    if data.get("schema_version") == 2:
        raise PredictionsError(f"{where}: schema_version 2 (the heuristic risk, no "
                               f"pre-registration hash) is no longer read; regenerate it with "
                               f"`adamspike predict` (version {SCHEMA_VERSION}: GLM spike rate "
                               "per setting with an interval, content hash)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PredictionsError(f"{where}: schema_version {data.get('schema_version')!r} is not "
                               f"supported (expected {SCHEMA_VERSION})")
    settings = data.get("settings", [])
    if not isinstance(settings, list):
        raise PredictionsError(f"{where}.settings: expected a list")
    seen = set()
    for i, s in enumerate(settings):
        if not isinstance(s, Mapping) or "id" not in s:
            raise PredictionsError(f"{where}.settings[{i}]: needs an 'id'")
        if s["id"] in seen:
            raise PredictionsError(f"{where}.settings[{i}].id: duplicate id {s['id']!r}")
        seen.add(s["id"])
        if not isinstance(s.get("overrides"), Mapping):
            raise PredictionsError(f"{where}.settings[{i}].overrides: missing (a table of dotted "
                                   "RunConfig keys)")
        _refuse_quoted_numbers(s["overrides"], f"{where}.settings[{i}].overrides")
        setting_config(s, f"{where}.settings[{i}]")
    rules = []
    for i, r in enumerate(data.get("alarm_rules", [])):
        if not isinstance(r, Mapping) or "id" not in r or "metric" not in r:
            raise PredictionsError(f"{where}.alarm_rules[{i}]: needs 'id' and 'metric'")
        unknown = set(r) - set(AlarmRule.__dataclass_fields__)
        if unknown:
            raise PredictionsError(f"{where}.alarm_rules[{i}]: unknown field(s) {sorted(unknown)}")
        rules.append(AlarmRule(**r))
    p = Predictions(settings=list(settings), alarm_rules=rules,
                    validate=list(data.get("validate", [])), profile=dict(data.get("profile", {})),
                    source=dict(data.get("source", {})), created=str(data.get("created", "")),
                    rate_model=dict(data.get("rate_model") or {}),
                    content_sha256=str(data.get(HASH_KEY) or ""), integrity=verify_hash(data))
    for sid in p.validate:
        p.setting(sid)
    return p


def _refuse_quoted_numbers(overrides: Mapping[str, Any], where: str) -> None:
    """JSON has numbers: a string where the schema wants one ("optim.b1": "0.9") is an
    error here, although the CLI's --key value strings are parsed."""
    defaults = flatten(to_dict(RunConfig()))
    for key, value in flatten(nest(overrides)).items():
        want = defaults.get(key)
        if (isinstance(value, str) and isinstance(want, (int, float))
                and not isinstance(want, bool)):
            raise PredictionsError(f"{where}.{key}: expected a number, got the string {value!r}")


def setting_config(s: Mapping[str, Any], where: str = "setting", base=None):
    """RunConfig of a setting's overrides over `base` (default: the defaults); a bad key or
    value raises PredictionsError naming the setting and the key."""
    try:
        return RunConfig.from_dict(s["overrides"], base=base)
    except ConfigError as e:
        raise PredictionsError(f"{where}.overrides: {e}") from None


def load_predictions(path: str | Path) -> Predictions:
    path = Path(path)
    data = read_json(path, PredictionsError, f"{path}: predictions file not found")
    return from_json(data, where=str(path))


def save_predictions(pred: Predictions, path: str | Path) -> dict:
    """Pre-register: stamp the UTC creation time and the content hash, write atomically.
    Refuses to replace an existing file (a pre-registered file is never overwritten).
    Returns the object written."""
    path = Path(path)
    if path.exists():
        raise PredictionsError(f"{path}: exists (a pre-registered predictions file is never "
                               "overwritten); choose a new path")
    data = pred.to_json()
    data[HASH_KEY] = content_hash(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        raise PredictionsError(f"{path}: appeared while writing; nothing was overwritten")
    atomic_write_bytes(path, json.dumps(data, indent=2, allow_nan=False).encode())
    pred.created, pred.content_sha256 = data["created"], data[HASH_KEY]
    return data
