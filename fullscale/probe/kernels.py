"""The Adam-term kernels: per-shard SUM_FIELDS sums and r-histogram counts of (g, m, v, p).
Shared with fullscale.telemetry (adamspike's own trainer): one implementation of the terms."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from adamspike.metrics import NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS


NUM_SUMS = len(SUM_FIELDS)
_COL = {f: i for i, f in enumerate(SUM_FIELDS)}
_FLOAT_COLS = [i for i, f in enumerate(SUM_FIELDS) if f not in ("n", "sat", "eps_small")]
_INT_COLS = [SUM_FIELDS.index(f) for f in ("n", "sat", "eps_small")]
# the float table's last row: column 0 the error flag, _SECANT_COLS the secant's block
# sums (num, den, uu) and its usable-step count, all-reduced with the table
_SECANT_COLS = slice(1, 5)
assert len(_FLOAT_COLS) >= 5


def update_direction(m, v, bc1, bc2, eps, zero_eps: bool):
    """m_hat, v_hat, sqrt(v_hat) and r = m_hat / (sqrt(v_hat) + eps) of exp_avg m and
    exp_avg_sq v (bc1, bc2 = 1 - b1^t, 1 - b2^t and eps: numbers, or tensors broadcasting
    against m); zero_eps: some eps is 0 (r = 0 where v_hat = 0 instead of 0/0)."""
    m_hat, v_hat = m / bc1, v / bc2
    s = torch.sqrt(v_hat)
    r = m_hat / (s + eps)
    if zero_eps:
        r = torch.where(v_hat > 0, r, 0.0)
    return m_hat, v_hat, s, r


def adam_terms(g, m, v, p, bc1, bc2, eps, zero_eps: bool, b1: float, m_prev=None):
    """The elementwise terms of SUM_FIELDS[1:] (g2 .. p2; sat and eps_small as bool) and r,
    shared by the probe and fullscale.telemetry's block kernel. m, v: exp_avg, exp_avg_sq
    after the step; g the gradient it consumed; p the parameter after the step; m_prev None:
    reconstructed as (m - (1 - b1) g) / b1."""
    m_hat, v_hat, s, r = update_direction(m, v, bc1, bc2, eps, zero_eps)
    g2, r2 = g * g, r * r
    denom = torch.maximum(v_hat, eps * eps) if torch.is_tensor(eps) else torch.clamp(v_hat, min=eps * eps)
    if zero_eps:  # v_hat = 0 implies g = 0 (v >= (1 - b2) g^2): count 0
        q = torch.where(denom > 0, g2 / torch.where(denom > 0, denom, 1.0), 0.0)
    else:
        q = g2 / denom
    if m_prev is None:
        m_prev = (m - (1 - b1) * g) / b1
    return (g2, r, r2, r2 * r, r2 * r2, q, r.abs() > SAT_THRESHOLD, s < eps, m_hat * m_hat, v_hat,
            g * m_prev, m_prev * m_prev, p * p), r


def shard_sums(g, m, v, p, bc1: float, bc2: float, b1: float, eps: float, fresh: bool,
               dtype: torch.dtype, hist_edges: Optional[torch.Tensor] = None):
    """One owned slice's SUM_FIELDS sums, on its device and without a host sync: (the 11
    real-valued sums in _FLOAT_COLS order, float64 or float32 on npu; the int64 counts n,
    sat, eps_small [+ the NUM_HIST_BINS r-histogram counts when `hist_edges`, the 63
    inner edges, is given]). bc1, bc2 = 1 - b1^t, 1 - b2^t; fresh: t = 1 (m_prev = 0)."""
    g, m, v, p = (x.reshape(-1).to(dtype) for x in (g, m, v, p))
    acc = torch.float64 if dtype == torch.float64 or g.device.type != "npu" else dtype
    terms, r = adam_terms(g, m, v, p, bc1, bc2, eps, eps == 0, b1)
    sums = [t.sum(dtype=acc) for i, t in enumerate(terms) if i not in (6, 7)]
    if fresh:   # m_prev = 0 exactly (m_t - (1 - b1) g is rounding noise)
        sums[8:10] = [torch.zeros((), dtype=acc, device=g.device)] * 2
    ints = [torch.full((1,), g.numel(), dtype=torch.int64, device=g.device),
            terms[6].sum().reshape(1), terms[7].sum().reshape(1)]
    if hist_edges is not None:
        ints.append(bin_counts(r, hist_edges, NUM_HIST_BINS))
    return torch.stack(sums), torch.cat([x.to(torch.int64) for x in ints])


def rounded_edges(edges, dtype: torch.dtype) -> torch.Tensor:
    """Histogram edges (float64) rounded up to `dtype`, so `e <= x` in dtype is numpy's
    float64 decision on the same x (the probe's and fullscale.telemetry's r histograms)."""
    npdt = np.float64 if dtype == torch.float64 else np.float32
    e = np.asarray(edges, dtype=np.float64)
    out = e.astype(npdt)
    up = out.astype(np.float64) < e
    out[up] = np.nextafter(out[up], np.array(np.inf, dtype=npdt))
    return torch.from_numpy(out)


def bin_counts(x: torch.Tensor, inner_edges: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 counts (num_bins,) of x, bin i holding e_i <= x < e_{i+1} (`inner_edges`: the
    edges without the first and last): values outside in the end bins, NaN in the last."""
    idx = torch.bucketize(x, inner_edges, right=True)
    idx = torch.where(torch.isnan(x), torch.full_like(idx, num_bins - 1), idx)
    return torch.bincount(idx, minlength=num_bins)
