"""How well the predicted alarm rules warn of the spikes a run actually had.

Rules come from predictions.json (adamspike.predictions). `fire_steps` evaluates them over
a layers table with the exact semantics of adamspike.predictions.OnlineAlarms (reduce the
metric over the selected tensors, compare, fire once the condition has held on
`consecutive` logged steps, re-arm after it fails), vectorised per rule instead of looping
over steps (tested equal to OnlineAlarms). Alarms the trainer fired online are read from
events.jsonl (type "alarm").

Scoring, per rule, with horizon H = the rule's largest expected lead (or a given horizon):
    an alarm fired at step f is a true positive when a spike starts in [f + min_lead, f + H]
    precision = true-positive alarms / alarms fired
    a spike is detected when some alarm fired in [start - H, start - min_lead]
    recall    = detected spikes / spikes;   lead = start - earliest such alarm
min_lead = 0 counts an alarm on the spike's first step (metrics of step t come from the
same forward pass as loss t, so that alarm is simultaneous, not early); min_lead = 1 asks
for a real warning.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd

from adamspike.metrics import shape_stats
from adamspike.predictions import DERIVED_METRICS, WEIGHTED_REDUCERS, AlarmRule

DEFAULT_HORIZON = 50


def rule_values(rule: AlarmRule, layers: pd.DataFrame) -> pd.Series:
    """The rule's reduced metric per logged step (NaN where no tensor is selected)."""
    all_steps = np.unique(layers["step"].to_numpy())
    mask = rule.mask(layers["depth"].to_numpy(), layers["kind"].astype(str).to_numpy())
    sel = layers.loc[mask]
    if rule.metric in DERIVED_METRICS:
        vals = shape_stats(sel["r_mean"], sel["r_m2"], sel["r_m3"], sel["r_m4"])[rule.metric]
    else:
        vals = sel[rule.metric].to_numpy(dtype=np.float64)
    s = pd.Series(np.asarray(vals, dtype=np.float64), index=sel["step"].to_numpy())
    s = s.where(np.isfinite(s))
    if not len(s):
        red = pd.Series(dtype=float)
    elif rule.reduce in WEIGHTED_REDUCERS:   # group_rho: sqrt(sum n v^2 / sum n), NaN left out
        n = pd.Series(sel["numel"].to_numpy(dtype=np.float64), index=s.index).where(s.notna())
        num = (n * s * s).groupby(level=0).sum()
        den = n.groupby(level=0).sum()
        red = np.sqrt(num / den.where(den > 0))
    else:
        red = s.groupby(level=0).agg(rule.reduce)
    return red.reindex(all_steps)


def fire_steps(rules: Iterable[AlarmRule], layers: pd.DataFrame) -> pd.DataFrame:
    """Alarms (rule, step, value, threshold) the rules fire over a layers table."""
    rows = []
    for rule in rules:
        val = rule_values(rule, layers)
        v = val.to_numpy()
        with np.errstate(invalid="ignore"):
            holds = (v > rule.threshold) if rule.op == ">" else (v < rule.threshold)
        holds &= ~np.isnan(v)
        # length of the current run of held conditions at each step
        idx = np.arange(len(holds))
        last_fail = np.maximum.accumulate(np.where(~holds, idx, -1))
        run = np.where(holds, idx - last_fail, 0)
        for i in np.flatnonzero(run == rule.consecutive):
            rows.append({"rule": rule.id, "step": int(val.index[i]), "metric": rule.metric,
                         "value": float(v[i]), "threshold": rule.threshold})
    return pd.DataFrame(rows, columns=["rule", "step", "metric", "value", "threshold"])


def online_alarms(events: pd.DataFrame) -> pd.DataFrame:
    """Alarms the trainer logged (events of type "alarm" with rule and step)."""
    if events is None or events.empty or "type" not in events:
        return pd.DataFrame(columns=["rule", "step"])
    ev = events[events["type"] == "alarm"]
    if ev.empty or "rule" not in ev or "step" not in ev:
        return pd.DataFrame(columns=["rule", "step"])
    return ev[["rule", "step"]].astype({"step": "int64"}).reset_index(drop=True)


def score_alarms(alarms: pd.DataFrame, spikes: pd.DataFrame, rules: Iterable[AlarmRule], *,
                 horizon: int | None = None, min_lead: int = 0) -> pd.DataFrame:
    """Precision, recall and lead times per rule, plus an "any" row over all rules."""
    rules = list(rules)
    starts = np.sort(spikes["start"].to_numpy(dtype=np.int64)) if len(spikes) else \
        np.zeros(0, np.int64)
    rows = []
    horizons = {}
    for r in rules:
        h = horizon if horizon is not None else (
            r.expected_lead_steps[1] if r.expected_lead_steps else DEFAULT_HORIZON)
        horizons[r.id] = int(h)
        f = alarms.loc[alarms["rule"] == r.id, "step"].to_numpy(dtype=np.int64)
        rows.append(_score(r.id, np.sort(f), starts, int(h), min_lead))
    if len(rules) > 1:
        # any rule: each alarm judged with its own rule's horizon
        pairs = [(int(s), horizons[rid]) for rid, s in zip(alarms["rule"], alarms["step"])
                 if rid in horizons]
        rows.append(_score_pairs("any", pairs, starts, min_lead))
    return pd.DataFrame(rows, columns=["rule", "horizon", "num_alarms", "num_true_alarms",
                                       "precision", "num_spikes", "num_detected", "recall",
                                       "lead_median", "lead_min", "lead_max"])


def _score(rule_id: str, fired: np.ndarray, starts: np.ndarray, h: int,
           min_lead: int) -> dict:
    return _score_pairs(rule_id, [(int(f), h) for f in fired], starts, min_lead, h)


def _score_pairs(rule_id, pairs, starts, min_lead, h=None) -> dict:
    true = 0
    for f, hh in pairs:
        i = np.searchsorted(starts, f + min_lead, side="left")
        true += bool(i < len(starts) and starts[i] <= f + hh)
    leads = []
    fired = np.array([f for f, _ in pairs], dtype=np.int64)
    hs = np.array([hh for _, hh in pairs], dtype=np.int64)
    for s in starts:
        ok = (fired >= s - hs) & (fired <= s - min_lead)
        if ok.any():
            leads.append(int(s - fired[ok].min()))
    n_al, n_sp = len(pairs), len(starts)
    return {"rule": rule_id, "horizon": h if h is not None else math.nan, "num_alarms": n_al,
            "num_true_alarms": true, "precision": true / n_al if n_al else math.nan,
            "num_spikes": n_sp, "num_detected": len(leads),
            "recall": len(leads) / n_sp if n_sp else math.nan,
            "lead_median": float(np.median(leads)) if leads else math.nan,
            "lead_min": float(min(leads)) if leads else math.nan,
            "lead_max": float(max(leads)) if leads else math.nan}
