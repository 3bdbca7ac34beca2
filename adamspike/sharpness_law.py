"""The 70B's sharpness law as data: evaluate a fitted law (analysis/sharpness.py fits it
under the plan's QC; `adamspike science4` writes it as law.json and ships it) and the
plan's mechanism labels. On the floor so that the reader (analysis) and the predictor
(simulate/predict.py) evaluate one law with one function.

    log10 lambda_inf = c0 + c_d log10 dim + c_L log10 layers + c_lr log10 lr

At x = (1, log10 dim, log10 layers, log10 lr) the prediction interval at the law's level is
x'c -+ t sqrt(s^2 + x' cov x), cov = s^2 (X'X)^-1 (a regression prediction interval).

Labels (docs/plan/science4_v*.toml [labels]) from S with its interval [S_lo, S_hi]: "A"
when S_lo >= edge, "below the edge" when S_hi < edge, "undetermined (A)" otherwise;
" + B" when rho_min < dormant_rho.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

EDGE = 1.0
DORMANT_RHO = 0.1


def law_at(law: Mapping[str, Any], dim: float, layers: float, lr: float) -> tuple[float, float, float]:
    """(point, lo, hi) of lambda_inf at (dim, layers, lr): the regression prediction interval."""
    x = np.array([1.0, math.log10(dim), math.log10(layers), math.log10(lr)])
    mu = float(x @ np.asarray(law["coef"], float))
    se = math.sqrt(law["s2"] + float(x @ np.asarray(law["cov"], float) @ x))
    return 10 ** mu, 10 ** (mu - law["t"] * se), 10 ** (mu + law["t"] * se)


def label(S: float, lo: float, hi: float, rho_min: float, edge: float = EDGE,
          dormant_rho: float = DORMANT_RHO) -> str:
    """The plan's mechanism label (module doc)."""
    a = "A" if lo >= edge else "below the edge" if hi < edge else "undetermined (A)"
    return a + (" + B" if rho_min < dormant_rho else "")
