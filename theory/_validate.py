"""Parameter validation shared by every theory function.

Each helper raises ``ValueError`` whose message starts with the parameter name, so that a
CLI or a config loader can report ``b2: must be in [0, 1), got 1.0``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _fail(name: str, why: str, value: Any) -> None:
    raise ValueError(f"{name}: {why}, got {value!r}")


def finite(name: str, x: Any) -> float:
    """A finite real scalar."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        _fail(name, "must be a real number", x)
    if not math.isfinite(f):
        _fail(name, "must be finite", x)
    return f


def finite_array(name: str, x: Any) -> np.ndarray:
    """A finite real array (any shape, at least one element)."""
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        _fail(name, "must be an array of real numbers", x)
    if a.size == 0:
        _fail(name, "must not be empty", x)
    if not np.all(np.isfinite(a)):
        _fail(name, "must be finite", x)
    return a


def beta(name: str, x: Any) -> float:
    """An EMA decay in [0, 1)."""
    f = finite(name, x)
    if not 0.0 <= f < 1.0:
        _fail(name, "must be in [0, 1)", x)
    return f


def phi(name: str, x: Any) -> float:
    """An AR(1) coefficient in (-1, 1)."""
    f = finite(name, x)
    if not -1.0 < f < 1.0:
        _fail(name, "must be in (-1, 1)", x)
    return f


def positive(name: str, x: Any) -> float:
    """A finite real > 0."""
    f = finite(name, x)
    if f <= 0.0:
        _fail(name, "must be > 0", x)
    return f


def nonneg(name: str, x: Any) -> float:
    """A finite real >= 0."""
    f = finite(name, x)
    if f < 0.0:
        _fail(name, "must be >= 0", x)
    return f


eps = nonneg   # a non-negative finite epsilon


def prob(name: str, x: Any, *, open_low: bool = False, open_high: bool = False) -> float:
    """A probability in [0, 1] (ends optionally open)."""
    f = finite(name, x)
    lo_bad = f <= 0.0 if open_low else f < 0.0
    hi_bad = f >= 1.0 if open_high else f > 1.0
    if lo_bad or hi_bad:
        lo = "(" if open_low else "["
        hi = ")" if open_high else "]"
        _fail(name, f"must be in {lo}0, 1{hi}", x)
    return f


def count(name: str, x: Any, minimum: int = 1) -> int:
    """An integer count >= minimum (bools and non-integral floats rejected)."""
    if isinstance(x, bool):
        _fail(name, "must be an integer", x)
    try:
        f = float(x)
    except (TypeError, ValueError):
        _fail(name, "must be an integer", x)
    if not math.isfinite(f) or f != int(f):
        _fail(name, "must be an integer", x)
    i = int(f)
    if i < minimum:
        _fail(name, f"must be >= {minimum}", x)
    return i


def step(name: str, x: Any) -> float:
    """A step count t >= 1, or math.inf for the stationary limit."""
    if x is None:
        return math.inf
    try:
        f = float(x)
    except (TypeError, ValueError):
        _fail(name, "must be an integer >= 1 or inf", x)
    if math.isinf(f) and f > 0:
        return math.inf
    return float(count(name, x, 1))
