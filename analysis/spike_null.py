"""Every spike rate beside its null: the same rule on noise fitted to the same lanes.

The plan (docs/plan/science4_v1.toml [spikes]) fixes two classes of the one spike rule
(adamspike.spikes): "visible" (>= 20 local-noise sigmas and >= 1.3x the running median,
lasting >= 3 steps: what an engineer sees on a loss curve) and "secondary" (k = 4, >= 10 %:
Science 3's map rule). For a lane's loss x_t:

    trend_t = median(x_{t-h} .. x_{t+h})   (centred, h = trend_window // 2)
    r_t     = x_t - trend_t

and two nulls, each `replicates` lanes per observed lane, judged by the same rule:
- "student_t": trend + iid draws from a Student-t fitted to the lane's residuals by
  maximum likelihood (all residuals, spikes included: a real spike fattens its own null's
  tails, so this null is conservative);
- "shuffle": trend + the lane's residuals in a random order (the same marginal without
  the temporal clustering: a duration condition that noise cannot meet shows here).

A cell's count under a class beats a null when the Monte-Carlo p = (1 + #{replicate cells
with a count >= the observed}) / (1 + replicates) is below alpha; it counts as spiking
under that class only when it beats both nulls.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.spikes import SpikeParams, detect_spikes, spike_durations_many
from analysis.phase_map import poisson_interval

NULLS = ("student_t", "shuffle")
CLASSES = ("visible", "secondary")


def class_params(plan: Mapping[str, Any], name: str) -> SpikeParams:
    """The plan's spike class as the rule's parameters."""
    return SpikeParams.from_table(plan["spikes"][name], name=lambda k: f"[spikes.{name}] {k}")


def trend_residuals(x: np.ndarray, trend_window: int) -> tuple[np.ndarray, np.ndarray]:
    """(centred running median, residuals) of a lane (module doc)."""
    trend = pd.Series(x).rolling(int(trend_window), center=True, min_periods=1).median()
    trend = trend.to_numpy()
    return trend, x - trend


def null_lanes(x: np.ndarray, kind: str, replicates: int, rng: np.random.Generator,
               trend_window: int) -> np.ndarray:
    """(replicates, len(x)) null lanes of one observed lane (module doc)."""
    trend, r = trend_residuals(np.asarray(x, float), trend_window)
    r = r[np.isfinite(r)]
    n = len(x)
    if kind == "student_t":
        df, loc, scale = stats.t.fit(r)
        draws = stats.t.rvs(df, loc=loc, scale=scale, size=(replicates, n), random_state=rng)
    elif kind == "shuffle":
        draws = np.stack([rng.permutation(np.resize(r, n)) for _ in range(replicates)])
    else:
        raise ValueError(f"null {kind!r}: one of {NULLS}")
    return trend[None, :] + draws


def cell_nulls(lanes: Sequence[np.ndarray], null: Mapping[str, Any],
               seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Per null, each lane's (replicates, len(lane)) null lanes, drawn in lane order from
    the null's own stream: the same draws for every class judged on this cell."""
    reps, tw = int(null["replicates"]), int(null["trend_window"])
    out = {}
    for j, kind in enumerate(NULLS):
        rng = np.random.default_rng([seed, j])
        out[kind] = [null_lanes(np.asarray(x, float), kind, reps, rng, tw) for x in lanes]
    return out


def _durations_by_lane(nulls: list[np.ndarray], params: SpikeParams) -> list[list[np.ndarray]]:
    """spike_durations_many of each lane's null lanes, the lanes of one length judged in one
    call (rows are independent: the same durations as one call per lane, fewer passes)."""
    out: list[list[np.ndarray]] = [[] for _ in nulls]
    for n in sorted({a.shape[1] for a in nulls}):
        idx = [i for i, a in enumerate(nulls) if a.shape[1] == n]
        got = spike_durations_many(np.concatenate([nulls[i] for i in idx]), params)
        at = 0
        for i in idx:
            out[i], at = got[at:at + len(nulls[i])], at + len(nulls[i])
    return out


def cell_against_null(lanes: Sequence[np.ndarray], params: SpikeParams,
                      null: Mapping[str, Any], seed: int = 0,
                      nulls: Mapping[str, list[np.ndarray]] | None = None) -> dict:
    """Observed spikes of a cell's lanes under one class and both nulls (module doc).
    Returns count, exposure (steps), durations and heights of the observed spikes, and per
    null the replicate cells' mean count, their 95th percentile, p, and the null spikes'
    median duration; `beats` is True when p < alpha under every null. `nulls`: the cell's
    `cell_nulls(lanes, null, seed)` when several classes judge the same cell."""
    reps, alpha = int(null["replicates"]), float(null["alpha"])
    if nulls is None:
        nulls = cell_nulls(lanes, null, seed)
    obs = [detect_spikes(np.asarray(x, float), params=params) for x in lanes]
    count = int(sum(len(s) for s in obs))
    allspk = pd.concat(obs, ignore_index=True) if obs else pd.DataFrame()
    out = {"count": count, "exposure": int(sum(len(x) for x in lanes)),
           "durations": allspk["duration"].astype(int).tolist() if count else [],
           "heights": allspk["height"].astype(float).tolist() if count else [],
           "censored": int((~allspk["recovered"]).sum()) if count else 0}
    beats = True
    for kind in NULLS:
        totals = np.zeros(reps, dtype=np.int64)
        durs: list[int] = []
        for got in _durations_by_lane(nulls[kind], params):
            totals += np.array([len(g) for g in got], dtype=np.int64)
            durs.extend(int(v) for g in got for v in g)
        p = (1 + int((totals >= count).sum())) / (1 + reps)
        out[kind] = {"mean": float(totals.mean()), "q95": float(np.quantile(totals, 0.95)),
                     "p": p, "median_duration": float(np.median(durs)) if durs else math.nan}
        beats &= p < alpha
    out["beats"] = bool(beats and count > 0)
    return out


def per_1k(k: float, steps: float) -> float:
    return 1000.0 * k / steps if steps else math.nan


def cells_table(cells: Iterable[tuple[Mapping[str, Any], Sequence[np.ndarray]]],
                plan: Mapping[str, Any]) -> pd.DataFrame:
    """One row per (cell, class): the observed rate per 1k steps with its exact Poisson 95 %
    interval, each null's mean rate and p, durations, and whether it beats both nulls.
    `cells`: (labels, lanes) pairs, labels a dict of the cell's identifying columns."""
    null = plan["spikes"]["null"]
    rows = []
    for labels, lanes in cells:
        nulls = cell_nulls(lanes, null, seed=int(null["seed"]))
        for cls in CLASSES:
            r = cell_against_null(lanes, class_params(plan, cls), null, nulls=nulls)
            lo, hi = poisson_interval(r["count"], r["exposure"] / 1000.0)
            rows.append({**labels, "class": cls, "spikes": r["count"],
                         "steps": r["exposure"], "rate_per_1k": per_1k(r["count"], r["exposure"]),
                         "rate_lo": lo, "rate_hi": hi,
                         "null_t_per_1k": per_1k(r["student_t"]["mean"], r["exposure"]),
                         "p_t": r["student_t"]["p"],
                         "null_shuffle_per_1k": per_1k(r["shuffle"]["mean"], r["exposure"]),
                         "p_shuffle": r["shuffle"]["p"],
                         "median_duration": float(np.median(r["durations"])) if r["durations"] else math.nan,
                         "null_t_median_duration": r["student_t"]["median_duration"],
                         "median_height": float(np.median(r["heights"])) if r["heights"] else math.nan,
                         "censored": r["censored"], "beats_null": r["beats"]})
    return pd.DataFrame(rows)

