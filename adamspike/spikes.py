"""The project's one spike rule, its parameters and its incident grouping (numpy / pandas).

Every spike in the project is judged here: both trainers' spike guards (adamspike.guard,
online), the report, the sweeps, the matched toys and the replay study (offline).

The rule (`RollingSpikeDetector`; robust, one-sided): a point x_t is anomalous when, with
med and MAD the median and median absolute deviation of the past `window` *normal* values
(strictly before t),

    x_t > med + k * 1.4826 * MAD      and      x_t > med + min_rel_jump * |med|

and at least `min_history` (default min(window, max(5, window // 2))) past values exist.
NaN / inf are always anomalous. Anomalous values do not enter the history (unless
`absorb=True`), so the band stays that of the regime before the spike and "recovered"
means back inside the pre-spike band. 1.4826 * MAD estimates sigma for Gaussian noise.
With `log=True` the rule runs on log(x) (losses that decay over orders of magnitude); the
relative-jump condition then reads x_t > (1 + min_rel_jump) * exp(med), the same ratio
test; values <= 0 are not anomalous (they are low) and do not enter the history.
`SpikeParams.resolved` sets min_history to LOG_MIN_HISTORY for an imported training log.

`detect_spikes` runs the online detector over a series (so offline and online decisions are
identical); consecutive anomalous points form one spike.

Parameters: `SpikeParams.from_table` is the one place they are made from settings, each
value checked (type, finite, range; ConfigError naming it): a table of the fields by name (a
study's `[spikes]` table, a spec's or sweep problem's fields, the CLIs' flags through
`from_flags`, whose flags `add_spike_flags` declares with the dataclass's defaults: window
50, k 6, min_rel_jump 0.2), or a run config's `guard` section through `from_config`
(window, mad_k, min_rel_jump).

Incidents (`incidents`): a spike start within 2 W steps of the previous start is part of the
same burst.

False positives (measured, tests/analysis/test_spikes.py, defaults window 50, k 6): none in
10 x 20,000 points of Gaussian noise; about 9e-4 per point for Student-t(5) noise, whose
tails are heavier than the MAD-sigma assumes. The median of the past window lags a falling
loss by ~window/2 steps, so heights on a steep descent are slightly underestimated.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from adamspike.config import check_value

MAD_TO_SIGMA = 1.4826

__all__ = ["MAD_TO_SIGMA", "RollingSpikeDetector", "SPIKE_COLUMNS", "SpikeParams",
           "add_spike_flags", "anomaly_flags", "anomaly_flags_many", "detect_spikes",
           "incidents", "loss_spikes", "spike_durations_many", "valued_rows"]

SPIKE_COLUMNS = ["start", "end", "peak_step", "peak", "baseline", "height", "duration",
                 "recovered", "num_points", "nonfinite"]


def _default_min_history(window: int) -> int:
    return min(window, max(5, window // 2))


# An imported training log (run config `source.megatron_log`) is an excerpt of a run, or
# starts at a resume: its first lines are mid-training, and with one line per log interval
# a spike may come 1-3 lines in. There the rule judges from the second valued line (the
# relative jump, > 20 % over the median, carries the decision while the MAD has few
# values). Measured on ../shared/reallogs: 7 of 7 onsets found (0 with the default
# history of 25), none in the no-spike control.
LOG_MIN_HISTORY = 1


def _median_sorted(s: list[float]) -> float:
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else 0.5 * (s[h - 1] + s[h])


class RollingSpikeDetector:
    """Online spike rule. `update(x)` returns True when x is anomalous (see module doc).

    After each update, `baseline` (median of the history, in the units of x) and
    `threshold` (the smallest anomalous value, in the units of x; NaN until min_history
    values exist) describe the band the point was judged against.
    """

    def __init__(self, window: int = 50, k: float = 6.0, min_rel_jump: float = 0.2,
                 min_history: int | None = None, *, log: bool = False, absorb: bool = False):
        if int(window) < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not (k >= 0 and math.isfinite(k)):
            raise ValueError(f"k must be a finite number >= 0, got {k}")
        if not (min_rel_jump >= 0 and math.isfinite(min_rel_jump)):
            raise ValueError(f"min_rel_jump must be a finite number >= 0, got {min_rel_jump}")
        self.window = int(window)
        self.k = float(k)
        self.min_rel_jump = float(min_rel_jump)
        self.min_history = _default_min_history(self.window) if min_history is None \
            else int(min_history)
        if not 1 <= self.min_history <= self.window:
            raise ValueError(f"min_history must be in [1, window={self.window}], "
                             f"got {self.min_history}")
        self.log = bool(log)
        self.absorb = bool(absorb)
        self._hist: deque[float] = deque(maxlen=self.window)
        self.num_updates = 0
        self.baseline = math.nan
        self.threshold = math.nan

    def _band(self) -> tuple[float, float]:
        """(median, anomaly threshold) of the history, in transformed units."""
        s = sorted(self._hist)
        med = _median_sorted(s)
        mad = _median_sorted(sorted(abs(x - med) for x in s))
        jump = math.log1p(self.min_rel_jump) if self.log else self.min_rel_jump * abs(med)
        return med, med + max(self.k * MAD_TO_SIGMA * mad, jump)

    def update(self, value: float) -> bool:
        x = float(value)
        self.num_updates += 1
        if not math.isfinite(x):
            return True
        if self.log:
            if x <= 0:
                return False
            x = math.log(x)
        anomalous = False
        if len(self._hist) >= self.min_history:
            med, thr = self._band()
            anomalous = x > thr
            self.baseline = math.exp(med) if self.log else med
            self.threshold = math.exp(thr) if self.log else thr
        else:
            self.baseline = self.threshold = math.nan
        if self.absorb or not anomalous:
            self._hist.append(x)
        return anomalous

    def fresh(self) -> "RollingSpikeDetector":
        """A detector with the same parameters and an empty history."""
        return RollingSpikeDetector(self.window, self.k, self.min_rel_jump, self.min_history,
                                    log=self.log, absorb=self.absorb)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "k": self.k, "min_rel_jump": self.min_rel_jump,
                "min_history": self.min_history, "log": self.log, "absorb": self.absorb,
                "history": list(self._hist), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("window", "k", "min_rel_jump", "min_history", "log", "absorb"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"spike detector state has {key}={state[key]!r}, this "
                                 f"detector has {getattr(self, key)!r}")
        hist = [float(x) for x in state["history"]]
        if len(hist) > self.window:
            raise ValueError(f"spike detector state has {len(hist)} history values > window")
        self._hist = deque(hist, maxlen=self.window)
        self.num_updates = int(state.get("num_updates", len(hist)))


@dataclass(frozen=True)
class SpikeParams:
    """The rule's parameters, constructed here only (module doc). `log`, `absorb` and
    `envelope` may be None ("auto", resolved against a trace by `resolved`; `detect_spikes`
    reads None as off)."""
    window: int = 50
    k: float = 6.0
    min_rel_jump: float = 0.2
    log: bool | None = None          # None: log scale when the loss spans > 2 decades
    absorb: bool | None = None       # None: on with log scale (a trend over decades)
    envelope: int | None = None      # running max over N steps first; None: 50 for
                                     # quadratic problems (dips where theta crosses 0)
    min_history: int | None = None   # None: min(window, max(5, window // 2))
    min_duration: int = 1            # spikes lasting fewer steps (onset until back in the
                                     # band; a spike cut off by the trace's end counts its
                                     # steps so far) are dropped: an engineer's visible spike
                                     # lasts, a heavy-tailed noise excursion does not

    @classmethod
    def from_config(cls, config: Any = None, **overrides) -> "SpikeParams":
        """The guard's parameters: from a run config (a dict with a `guard` table, or an
        object with a `.guard` section) or a guard section itself (window, mad_k,
        min_rel_jump); missing fields keep the defaults. `overrides` are field values."""
        guard = config
        if isinstance(config, Mapping):
            guard = config.get("guard", config)
        elif config is not None and hasattr(config, "guard"):
            guard = config.guard
        get = (guard.get if isinstance(guard, Mapping)
               else (lambda key, default=None: getattr(guard, key, default)))
        table = {f: get(key) for f, key in (("window", "window"), ("k", "mad_k"),
                                             ("min_rel_jump", "min_rel_jump"))}
        return cls.from_table({f: v for f, v in table.items() if v is not None}, **overrides)

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None = None, *,
                   name: Callable[[str], str] = str, **overrides) -> "SpikeParams":
        """The rule from a table of its fields by name (other keys are the caller's, e.g. a
        [spikes] table's `heights`), then `overrides` (fields only: TypeError otherwise);
        fields left out keep the defaults. Each value is checked like a config field
        (ConfigError naming the setting: `name(field)`)."""
        if set(overrides) - set(_LIMITS):
            raise TypeError(f"not spike rule fields: {sorted(set(overrides) - set(_LIMITS))}")
        values = {k: v for k, v in (table or {}).items() if k in _LIMITS}
        values.update(overrides)
        for key, value in values.items():
            tp, limits = _LIMITS[key]
            value = value.item() if isinstance(value, np.generic) else value
            values[key] = check_value(name(key), value, tp, **limits)
        return cls(**values)

    @classmethod
    def from_flags(cls, args: Any) -> "SpikeParams":
        """The rule from the flags `add_spike_flags` declared (errors name the flag)."""
        table = {k: getattr(args, k) for k in ("window", "k", "min_rel_jump")}
        if hasattr(args, "log_loss"):
            table["log"] = {"auto": None, "yes": True, "no": False}[args.log_loss]
        return cls.from_table(table, name=lambda key: "--" + key.replace("_", "-"))

    def replace(self, **kw) -> "SpikeParams":
        return dataclasses.replace(self, **kw)

    def detector(self) -> RollingSpikeDetector:
        """The online detector with these parameters (None = off for log / absorb)."""
        return RollingSpikeDetector(self.window, self.k, self.min_rel_jump, self.min_history,
                                    log=bool(self.log), absorb=bool(self.absorb))

    def resolved(self, x: np.ndarray, config: dict | None = None) -> "SpikeParams":
        log = self.log
        if log is None:
            pos = x[np.isfinite(x) & (x > 0)]
            log = bool(len(pos) and np.log10(pos.max()) - np.log10(pos.min()) > 2)
        env = self.envelope
        if env is None:
            kind = ((config or {}).get("problem") or {}).get("kind")
            env = 50 if kind == "quadratic" else 0
        history = self.min_history
        if history is None and ((config or {}).get("source") or {}).get("megatron_log"):
            history = LOG_MIN_HISTORY
        return self.replace(log=log, absorb=log if self.absorb is None else self.absorb,
                            envelope=int(env), min_history=history)

    @property
    def history(self) -> int:
        """Past normal values needed before a point is judged (min_history resolved)."""
        return (_default_min_history(self.window) if self.min_history is None
                else self.min_history)

    def describe(self) -> str:
        s = (f"loss > median + {self.k:g} x 1.4826 MAD of the previous {self.window} normal "
             f"steps and > (1 + {self.min_rel_jump:g}) x median, judged once "
             f"{self.history} earlier normal step(s) exist")
        if self.log:
            s += " (on log loss)"
        if self.envelope:
            s += f", applied to the {self.envelope}-step running max of the loss"
        if self.min_duration > 1:
            s += f", lasting >= {self.min_duration} steps"
        if self.absorb:
            s += ("; every finite value enters the history (the band follows the level: "
                  "'recovered' means the rise stopped, not a return to the old level)")
        return s


# field -> (type, limits) of the values `from_table` accepts (adamspike.config.check_value)
_LIMITS = {"window": (int, dict(lo=2)), "k": (float, dict(lo=0.0)),
           "min_rel_jump": (float, dict(lo=0.0)), "log": (Optional[bool], {}),
           "absorb": (Optional[bool], {}), "envelope": (Optional[int], dict(lo=0)),
           "min_history": (Optional[int], dict(lo=1)), "min_duration": (int, dict(lo=1))}


def add_spike_flags(ap: Any, log_loss: bool = True) -> None:
    """The spike rule's flags of the commands that judge a trace (analyze, watch, assess),
    with the rule's defaults; `SpikeParams.from_flags` reads them."""
    d = SpikeParams()
    ap.add_argument("--window", type=int, default=d.window, help="spike rule: past steps")
    ap.add_argument("--k", type=float, default=d.k, help="spike rule: MAD multiplier")
    ap.add_argument("--min-rel-jump", type=float, default=d.min_rel_jump,
                    help="spike rule: relative jump over the median")
    if log_loss:
        ap.add_argument("--log-loss", choices=("auto", "yes", "no"), default="auto",
                        help="run the spike rule on log(loss) (auto: when it spans > 2 decades)")


def anomaly_flags(values: Sequence[float], params: SpikeParams | None = None,
                  **kw) -> tuple[np.ndarray, np.ndarray]:
    """Per-point anomalous flags and the baseline (median) each point was judged against.
    `params` or SpikeParams field keywords (not both)."""
    det = _params(params, kw).detector()
    x = np.asarray(values, dtype=np.float64)
    flags = np.zeros(len(x), dtype=bool)
    base = np.full(len(x), np.nan)
    for i, v in enumerate(x.tolist()):
        flags[i] = det.update(v)
        base[i] = det.baseline
    return flags, base


def _row_median(s: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Median of each sorted row's first c values (NaN sort last): `_median_sorted`'s."""
    i = np.arange(len(c))
    return (s[i, (c - 1) // 2] + s[i, c // 2]) / 2


def anomaly_flags_many(values: np.ndarray, params: SpikeParams) -> np.ndarray:
    """`anomaly_flags` of many series at once: values (R, n) -> flags (R, n), the same
    decisions as R online detectors (one history ring per row; NaN marks an empty slot),
    for the noise nulls that judge thousands of replicate lanes (analysis.spike_null)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"values must be (series, steps), got shape {x.shape}")
    p = params
    R, n = x.shape
    W = int(p.window)
    min_hist = p.history
    hist = np.full((R, W), np.nan)
    count = np.zeros(R, dtype=np.int64)
    pos = np.zeros(R, dtype=np.int64)
    flags = np.zeros((R, n), dtype=bool)
    rows = np.arange(R)
    jump_log = math.log1p(p.min_rel_jump)
    kk = p.k * MAD_TO_SIGMA
    for t in range(n):
        v = x[:, t]
        finite = np.isfinite(v)
        if p.log:
            use = finite & (v > 0)
            v = np.log(np.where(use, v, 1.0))
        else:
            use = finite
        anom = ~finite
        judge = use & (count >= min_hist)
        if judge.all():       # the common case: every row judged, no row copies
            med = _row_median(np.sort(hist, axis=1), count)
            mad = _row_median(np.sort(np.abs(hist - med[:, None]), axis=1), count)
            jump = jump_log if p.log else p.min_rel_jump * np.abs(med)
            anom = v > med + np.maximum(kk * mad, jump)
        elif judge.any():
            h, c = hist[judge], count[judge]
            med = _row_median(np.sort(h, axis=1), c)
            mad = _row_median(np.sort(np.abs(h - med[:, None]), axis=1), c)
            jump = jump_log if p.log else p.min_rel_jump * np.abs(med)
            thr = med + np.maximum(kk * mad, jump)
            anom[judge] = v[judge] > thr
        flags[:, t] = anom
        add = use & (~anom | bool(p.absorb))
        if add.any():
            r = rows[add]
            hist[r, pos[r]] = v[r]
            pos[r] = (pos[r] + 1) % W
            count[r] = np.minimum(count[r] + 1, W)
    return flags


def spike_durations_many(values: np.ndarray, params: SpikeParams) -> list[np.ndarray]:
    """Per series, the durations of its spikes under the rule (runs of consecutive
    anomalous points; a duration counts from the onset to the first point back in the
    band, or to the end), with `min_duration` applied: what `detect_spikes` would count,
    without building its rows."""
    flags = anomaly_flags_many(values, params)
    n = flags.shape[1]
    out = []
    for f in flags:
        d = np.diff(np.concatenate([[0], f.astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)   # end: first normal
        dur = np.where(ends < n, ends - starts, n - starts)
        out.append(dur[dur >= params.min_duration])
    return out


def _params(params: SpikeParams | None, kw: dict) -> SpikeParams:
    if params is not None and kw:
        raise TypeError(f"give SpikeParams or keywords, not both (got {sorted(kw)})")
    return params if params is not None else SpikeParams.from_table(**kw)


def detect_spikes(values: Sequence[float], steps: Sequence[int] | None = None,
                  params: SpikeParams | None = None, **kw) -> pd.DataFrame:
    """Spikes in a series: one row per run of consecutive anomalous points. `params` or
    SpikeParams field keywords (window, k, min_rel_jump, min_history, log, absorb,
    envelope: the running max over that many steps is judged instead of the values;
    min_duration: shorter spikes are left out).

    Columns: start / end (first / last anomalous step), peak_step, peak (max value; inf or
    NaN for a non-finite spike), baseline (history median at the start), height
    (peak / baseline - 1; (peak - baseline) / |baseline| for a non-positive baseline),
    duration (steps from start until the first point back within the band; for an
    unrecovered spike, up to and including the last step), recovered, num_points,
    nonfinite (any NaN / inf in the spike).
    """
    p = _params(params, kw)
    x = np.asarray(values, dtype=np.float64)
    s = np.arange(len(x), dtype=np.int64) if steps is None else np.asarray(steps, dtype=np.int64)
    if s.shape != x.shape:
        raise ValueError(f"steps has shape {s.shape}, values {x.shape}")
    if p.envelope and p.envelope > 1:
        x = pd.Series(x).rolling(p.envelope, min_periods=1).max().to_numpy()
    flags, base = anomaly_flags(x, p)
    rows = []
    i, n = 0, len(x)
    while i < n:
        if not flags[i]:
            i += 1
            continue
        j = i
        while j + 1 < n and flags[j + 1]:
            j += 1
        seg = x[i:j + 1]
        bad = ~np.isfinite(seg)
        if bad.any():
            q = i + int(np.argmax(bad))
            peak = math.inf if np.isposinf(seg).any() else float(x[q])
        else:
            q = i + int(np.argmax(seg))
            peak = float(x[q])
        b = float(base[i])
        if not math.isfinite(b):  # non-finite before the band existed
            height = math.nan
        elif b > 0:
            height = peak / b - 1.0
        else:
            height = (peak - b) / abs(b) if b != 0 else math.inf
        recovered = j + 1 < n
        duration = int(s[j + 1] - s[i]) if recovered else int(s[j] - s[i] + 1)
        rows.append({"start": int(s[i]), "end": int(s[j]), "peak_step": int(s[q]),
                     "peak": peak, "baseline": b, "height": float(height),
                     "duration": duration, "recovered": bool(recovered),
                     "num_points": int(j - i + 1), "nonfinite": bool(bad.any())})
        i = j + 1
    df = pd.DataFrame(rows, columns=SPIKE_COLUMNS)
    if p.min_duration > 1 and len(df):
        df = df[df["duration"] >= p.min_duration].reset_index(drop=True)
    return df.astype({"start": "int64", "end": "int64", "peak_step": "int64",
                      "duration": "int64", "num_points": "int64", "recovered": bool,
                      "nonfinite": bool, "peak": "float64", "baseline": "float64",
                      "height": "float64"})


def valued_rows(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    """The rows that carry a value of `column`: a skipped step (fp16 loss-scale overflow,
    where Megatron prints neither loss nor grad norm) with a NaN there has no value, and is
    not a non-finite spike; nor is a row whose `<column>_missing` flag is set (an imported
    log's line without the field, or with a placeholder the framework prints when it did
    not measure: adamspike.megatron_log). A NaN on a step that was not skipped stays (a
    divergence)."""
    if steps.empty or ("skipped" not in steps and f"{column}_missing" not in steps):
        return steps
    missing = np.zeros(len(steps), dtype=bool)
    if "skipped" in steps:
        missing |= (steps["skipped"].to_numpy(bool)
                    & ~np.isfinite(steps[column].to_numpy(float)))
    if f"{column}_missing" in steps:
        missing |= steps[f"{column}_missing"].eq(True).to_numpy()
    return steps.loc[~missing] if missing.any() else steps


def loss_spikes(steps: pd.DataFrame, params: SpikeParams = SpikeParams(),
                column: str = "loss", config: dict | None = None
                ) -> tuple[pd.DataFrame, SpikeParams]:
    """Spikes of a steps column with the report's rule (auto fields resolved against the
    trace and the run config); returns (spikes, resolved rule). Skipped steps without a
    value (`valued_rows`) are left out."""
    steps = valued_rows(steps, column)
    x = steps[column].to_numpy(float)
    p = params.resolved(x, config)
    return detect_spikes(x, steps["step"].to_numpy(), p), p


def incidents(spikes: pd.DataFrame, window: int) -> pd.DataFrame:
    """The spikes (detector rows of one trace, by start) that open an incident: a start
    within 2 * `window` steps of the previous start is part of the same burst."""
    if spikes.empty:
        return spikes
    gaps = np.diff(spikes["start"].to_numpy(np.float64), prepend=-math.inf)
    return spikes[gaps > 2 * window]
