"""Shared helpers for the theory tests: Monte-Carlo comparisons by z-scores.

Multiplicity: a test that compares K closed-form numbers with the Monte-Carlo asserts
  (a) every |z| < Z_MAX = 4 (Bonferroni: P(any |z| > 4) ~ K * 6e-5, < 3 % for K = 500),
  (b) at most FRAC_3SE = 2 % of the |z| exceed 3 (expected 0.3-0.5 % with t-distributed
      batch-means SEs), and
  (c) mean(z^2) in [0.5, 1.6] (the SEs are neither too small nor inflated),
so that "within 3 standard errors" is checked for the family and not just per number.
"""

from __future__ import annotations

import numpy as np
import pytest

Z_MAX = 4.0
FRAC_3SE = 0.02


def _check_z(rows, label=""):
    """rows: list of (name, theory, mc, se). Raises AssertionError with the worst rows."""
    z = []
    for name, th, mc, se in rows:
        se = max(float(se), 1e-15)
        z.append(((float(mc) - float(th)) / se, name, th, mc, se))
    zs = np.array([abs(x[0]) for x in z])
    worst = sorted(z, key=lambda x: -abs(x[0]))[:8]
    msg = label + "\n" + "\n".join(f"  z={a:+.2f} {n}: theory={t:.6g} mc={m:.6g} se={s:.2g}"
                                   for a, n, t, m, s in worst)
    assert zs.max() < Z_MAX, msg
    assert np.mean(zs > 3) <= FRAC_3SE, msg
    if len(zs) >= 30:
        assert 0.5 <= float(np.mean(zs ** 2)) <= 1.6, msg + f"\n mean z^2 = {np.mean(zs ** 2):.3f}"
    return zs


@pytest.fixture
def check_z():
    """The z-score family check (see module docstring)."""
    return _check_z
