"""Per-tensor Adam telemetry: the one definition both backends implement.

All metrics are computed after the optimizer step, from the gradient g Adam consumed, its
bias-corrected state m_hat = m_t / (1 - b1^t), v_hat = v_t / (1 - b2^t), the momentum before
the step m_prev = m_{t-1} (raw), and the parameter p after the step:

    r            = m_hat / (sqrt(v_hat) + eps)          unit-lr update, no weight decay
    grad_rms     = sqrt(mean(g^2));   rho = grad_rms / eps
    update_rms   = sqrt(mean(r^2))
    rms_t        = sqrt(mean(g^2 / max(v_hat, eps^2)))  StableAdamW's staleness signal
    sat_frac     = mean(|r| > 0.9);   eps_frac = mean(sqrt(v_hat) < eps)
    r_mean, r_m2, r_m3, r_m4 = mean(r^k)                  raw moments (sum-reducible)
    m_v_ratio    = ||m_hat|| / ||sqrt(v_hat)||
    grad_mom_cos = <g, m_prev> / (||g|| ||m_prev||)      NaN when either norm is 0
    param_rms    = sqrt(mean(p^2))

Sharded tensors (FSDP) reduce exactly: each shard computes the SUM_FIELDS sums of its local
elements, the sums are all-reduced, and `finalize` turns them into metrics. The backends
implement `shard_sums` in their own framework; this numpy version is the reference tests
compare against. Histograms of r use the fixed HIST_EDGES; values outside are counted in
the first / last bin, so counts always add up to numel.

Histograms of sqrt(v_hat)/eps (`vhistogram`, the run directory's `vhists` table, on
histogram steps): the per-coordinate second-moment scale in units of eps, on the fixed
log-spaced VHIST_EDGES (10^-4 .. 10^6, 8 bins per decade). sqrt(v_hat)/eps is each
coordinate's own rho (up to the v_hat estimate of E g^2): the spread within a tensor that
a per-tensor rms hides. Bin of x: the i with VHIST_EDGES[i] <= x < VHIST_EDGES[i+1] (x below
the first edge: bin 0; at or above the last edge, inf and NaN: the last bin), i.e.
searchsorted(edges, x, side="right") - 1 clipped to the bins, as the backends compute it.
"""

from __future__ import annotations

import numpy as np

SAT_THRESHOLD = 0.9

METRIC_NAMES = ("grad_rms", "rho", "update_rms", "rms_t", "sat_frac", "eps_frac",
                "r_mean", "r_m2", "r_m3", "r_m4", "m_v_ratio", "grad_mom_cos", "param_rms")

SUM_FIELDS = ("n", "g2", "r1", "r2", "r3", "r4", "g2_over_v", "sat", "eps_small",
              "m_hat2", "v_hat", "g_mprev", "mprev2", "p2")

_COLUMN = {k: i for i, k in enumerate(SUM_FIELDS)}

HIST_EDGES = np.linspace(-1.6, 1.6, 65)
NUM_HIST_BINS = len(HIST_EDGES) - 1

VHIST_EDGES = 10.0 ** np.linspace(-4.0, 6.0, 81)   # sqrt(v_hat) / eps, 8 bins per decade
NUM_VHIST_BINS = len(VHIST_EDGES) - 1


def update_direction(m_hat, v_hat, eps):
    """r = m_hat / (sqrt(v_hat) + eps)."""
    return m_hat / (np.sqrt(v_hat) + eps)


def shard_sums(g, m_hat, v_hat, m_prev, p, eps) -> np.ndarray:
    """The SUM_FIELDS sums over the elements of one shard (float64)."""
    g, m_hat, v_hat, m_prev, p = (np.asarray(x, dtype=np.float64).ravel()
                                  for x in (g, m_hat, v_hat, m_prev, p))
    r = update_direction(m_hat, v_hat, eps)
    r2 = r * r
    g2 = g * g
    return np.array([
        g.size, g2.sum(), r.sum(), r2.sum(), (r2 * r).sum(), (r2 * r2).sum(),
        (g2 / np.maximum(v_hat, eps * eps)).sum() if eps > 0 else _safe_ratio_sum(g2, v_hat),
        (np.abs(r) > SAT_THRESHOLD).sum(), (np.sqrt(v_hat) < eps).sum(),
        (m_hat * m_hat).sum(), v_hat.sum(), (g * m_prev).sum(), (m_prev * m_prev).sum(),
        (p * p).sum(),
    ], dtype=np.float64)


def _safe_ratio_sum(g2, v_hat):
    # eps = 0: max(v, 0) = v; coordinates with v = 0 have g = 0 (v >= (1-b2) g^2), count as 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(v_hat > 0, g2 / np.where(v_hat > 0, v_hat, 1.0), 0.0)
    return q.sum()


def _rho(grad_rms, eps):
    """grad_rms / eps, inf where eps = 0; eps a scalar or one per tensor (row)."""
    eps = np.asarray(eps, dtype=np.float64)
    if eps.ndim == 0:
        return grad_rms / eps if eps > 0 else np.full_like(grad_rms, np.inf)
    return np.where(eps > 0, grad_rms / np.where(eps > 0, eps, 1.0), np.inf)


def finalize(sums, eps) -> dict[str, float]:
    """Metrics from (all-reduced) SUM_FIELDS sums. `sums` is a sequence in SUM_FIELDS order
    or an array of shape (num_tensors, len(SUM_FIELDS)), giving arrays per metric; eps is
    Adam's eps, a scalar or one per tensor (per-group eps)."""
    s = np.asarray(sums, dtype=np.float64)
    c = _COLUMN
    with np.errstate(divide="ignore", invalid="ignore"):
        per_n = s / s[..., :1]   # every sum / n in one pass (small arrays: calls are the cost)
        grad_rms = np.sqrt(per_n[..., c["g2"]])
        g2, mprev2 = s[..., c["g2"]], s[..., c["mprev2"]]
        out = {
            "grad_rms": grad_rms,
            "rho": _rho(grad_rms, eps),
            "update_rms": np.sqrt(per_n[..., c["r2"]]),
            "rms_t": np.sqrt(per_n[..., c["g2_over_v"]]),
            "sat_frac": per_n[..., c["sat"]],
            "eps_frac": per_n[..., c["eps_small"]],
            "r_mean": per_n[..., c["r1"]],
            "r_m2": per_n[..., c["r2"]],
            "r_m3": per_n[..., c["r3"]],
            "r_m4": per_n[..., c["r4"]],
            "m_v_ratio": np.sqrt(s[..., c["m_hat2"]] / s[..., c["v_hat"]]),
            "grad_mom_cos": np.where((g2 > 0) & (mprev2 > 0),
                                     s[..., c["g_mprev"]] / np.sqrt(g2 * mprev2), np.nan),
            "param_rms": np.sqrt(per_n[..., c["p2"]]),
        }
    if s.ndim == 1:
        return {k: float(v) for k, v in out.items()}
    return out


def reference_metrics(g, m_hat, v_hat, m_prev, p, eps) -> dict[str, float]:
    """Direct numpy computation of every metric for one (unsharded) tensor."""
    return finalize(shard_sums(g, m_hat, v_hat, m_prev, p, eps), eps)


def histogram(r) -> np.ndarray:
    """Counts of r in HIST_EDGES bins, out-of-range values clipped into the end bins."""
    r = np.clip(np.asarray(r, dtype=np.float64).ravel(), HIST_EDGES[0], HIST_EDGES[-1])
    return np.histogram(r, bins=HIST_EDGES)[0].astype(np.int64)


def vhist_ratio(v_hat, eps) -> np.ndarray:
    """sqrt(v_hat) / eps (float64; inf where eps = 0 and v_hat > 0, NaN at 0 / 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.asarray(v_hat, dtype=np.float64).ravel()) / float(eps)


def vhist_bins(x) -> np.ndarray:
    """Bin index of each x = sqrt(v_hat)/eps on VHIST_EDGES (module doc)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    idx = np.searchsorted(VHIST_EDGES, x, side="right") - 1
    idx = np.where(np.isnan(x), NUM_VHIST_BINS - 1, idx)
    return np.clip(idx, 0, NUM_VHIST_BINS - 1)


def vhistogram(v_hat, eps) -> np.ndarray:
    """Counts (NUM_VHIST_BINS,) of sqrt(v_hat)/eps on VHIST_EDGES: the reference both
    backends are tested against."""
    return np.bincount(vhist_bins(vhist_ratio(v_hat, eps)),
                       minlength=NUM_VHIST_BINS).astype(np.int64)


def vhist_centers() -> np.ndarray:
    """Geometric bin centres of VHIST_EDGES (the end bins also hold what lies beyond)."""
    return np.sqrt(VHIST_EDGES[:-1] * VHIST_EDGES[1:])


def shape_stats(r_mean, r_m2, r_m3, r_m4) -> dict[str, np.ndarray]:
    """Skewness, (non-excess) kurtosis and Sarle's bimodality coefficient from raw moments.

    var = m2 - m1^2, skew = (m3 - 3 m1 m2 + 2 m1^3) / var^1.5,
    kurt = (m4 - 4 m1 m3 + 6 m1^2 m2 - 3 m1^4) / var^2, BC = (skew^2 + 1) / kurt
    (the large-sample form; BC > 5/9 suggests bimodality).
    """
    m1, m2, m3, m4 = (np.asarray(x, dtype=np.float64) for x in (r_mean, r_m2, r_m3, r_m4))
    var = m2 - m1 ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        skew = (m3 - 3 * m1 * m2 + 2 * m1 ** 3) / var ** 1.5
        kurt = (m4 - 4 * m1 * m3 + 6 * m1 ** 2 * m2 - 3 * m1 ** 4) / var ** 2
        bc = (skew ** 2 + 1) / kurt
    return {"skewness": skew, "kurtosis": kurt, "bimodality": bc}
