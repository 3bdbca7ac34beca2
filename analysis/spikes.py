"""Spike tables for analysis: the project's rule lives in the floor (adamspike.spikes:
RollingSpikeDetector, SpikeParams, detect_spikes, anomaly_flags, incidents; re-exported here),
and this module adds the published rules it is compared with.

For comparison with published practice:
- `spike_score_olmo2`: OLMo 2's spike score, % of points at least 7 sigma from the rolling
  mean of the last 1000 values (two-sided; we score only points with >= min_history past
  values, and the past values exclude the point itself).
- `zscore_flags`: the skip-step rules of OLMo-core (|x - mean| / std > 6 over the last 128,
  after max(20, 64) entries, sample std) and Levanter (x > mean + 6 max(std, 1e-6) over the
  last 128, after 64 entries, population std); every value enters the history.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from adamspike.spikes import (MAD_TO_SIGMA, SPIKE_COLUMNS, RollingSpikeDetector, SpikeParams,
                              anomaly_flags, detect_spikes, incidents)

__all__ = ["MAD_TO_SIGMA", "RollingSpikeDetector", "SPIKE_COLUMNS", "SpikeParams",
           "anomaly_flags", "detect_spikes", "incidents", "spike_score_olmo2", "zscore_flags"]


def _past_rolling(x: np.ndarray, window: int, ddof: int) -> tuple[np.ndarray, np.ndarray,
                                                                    np.ndarray]:
    """Mean, std and count of the finite values among the `window` points before each."""
    ser = pd.Series(x).where(np.isfinite(x)).shift(1)
    roll = ser.rolling(window, min_periods=1)
    return (roll.mean().to_numpy(), roll.std(ddof=ddof).to_numpy(),
            roll.count().to_numpy())


def spike_score_olmo2(values: Sequence[float], *, window: int = 1000, num_sigma: float = 7.0,
                      min_history: int = 20) -> float:
    """OLMo 2's spike score: percentage of scored points with |x - mean| >= num_sigma * std,
    mean / std over the previous `window` values. Points with fewer than `min_history`
    past finite values are not scored; non-finite points count as spikes. NaN if no point
    is scored."""
    x = np.asarray(values, dtype=np.float64)
    mean, std, count = _past_rolling(x, window, ddof=0)
    scored = count >= min_history
    if not scored.any():
        return math.nan
    with np.errstate(invalid="ignore"):
        spike = ~np.isfinite(x) | (np.abs(x - mean) >= num_sigma * std)
    return float(100.0 * spike[scored].mean())


ZSCORE_RULES = {
    # window, min history, threshold, two-sided, ddof, sigma floor
    "olmo-core": (128, max(20, 128 // 2), 6.0, True, 1, 0.0),
    "levanter": (128, max(2, 64), 6.0, False, 0, 1e-6),
}


def zscore_flags(values: Sequence[float], rule: str = "olmo-core") -> np.ndarray:
    """Steps the rule would skip (bool per point); every value enters the history, as in
    both implementations. Non-finite values are flagged."""
    if rule not in ZSCORE_RULES:
        raise ValueError(f"rule must be one of {sorted(ZSCORE_RULES)}, got {rule!r}")
    window, min_hist, thr, two_sided, ddof, floor = ZSCORE_RULES[rule]
    x = np.asarray(values, dtype=np.float64)
    mean, std, count = _past_rolling(x, window, ddof=ddof)
    std = np.maximum(std, floor) if floor > 0 else std
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = x - mean
        z = (np.abs(dev) if two_sided else dev) / std
        flags = (count >= min_hist) & (z > thr)
    return flags | ~np.isfinite(x)
