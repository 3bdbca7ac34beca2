"""Gaussian AR(1) machinery behind the Adam-moment formulas (internal).

A window of n steps (oldest first) carries g_i = mu_i + sigma_i z_i, with z a stationary
Gaussian AR(1) of coefficient phi and unit variance:  Cov(z_i, z_j) = R_ij = phi^|i-j|.
Two linear/quadratic statistics of the window are used everywhere:

    N = sum_i a_i g_i          (a numerator: m_hat for a = bias-corrected EMA weights)
    V = sum_i c_i g_i^2        (v_hat for c = bias-corrected EMA weights of b2)

Two ways to get E[F(N) / (sqrt(V) + eps)^p]:

* ``laplace``: exact (up to 1-D quadrature).  1/(sqrt V + eps) = int_0^inf K1(s) e^{-sV} ds
  with K1(s) = 1/sqrt(pi s) - eps erfcx(eps sqrt s), and (sqrt V + eps)^-2 = int K2 e^{-sV},
  K2 = -dK1/deps = erfcx(x)(1 + 2x^2) - 2x/sqrt(pi), x = eps sqrt s.  Under the tilt e^{-sV}
  the z stay Gaussian (precision R^-1 + 2s diag(c sigma^2), tridiagonal), so N is Gaussian
  and E[N e^{-sV}], E[N^2 e^{-sV}], E[|N| e^{-sV}] are closed forms.  p in {1, 2} only.
* ``second_order``: condition on L = N - E N (Gaussian), use the exact conditional mean and
  variance of D = V - E V given L (Isserlis), and expand G(V) = (sqrt V + eps)^-p to second
  order in D around E V:  E[F G] ~ E_L[F (G0 + G1 E[D|L] + G2/2 E[D^2|L])].  The L-integral
  is done exactly (Gaussian / truncated-Gaussian moments of a polynomial).  Error: third
  order in D / E V, i.e. O(((1-b2)/(1+b2))^{3/2}) relative for i.i.d. streams.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import polynomial as P
from scipy import linalg, special
from scipy.signal import lfilter

_SQRT_PI = math.sqrt(math.pi)


# --------------------------------------------------------------------------- windows
def window_len(betas, t: float, tol: float = 1e-17) -> int:
    """Steps whose EMA weight exceeds tol relative to the newest one (capped at t)."""
    b = max(betas)
    n = 1 if b == 0.0 else int(math.ceil(math.log(tol) / math.log(b))) + 1
    return int(min(n, t)) if math.isfinite(t) else n


def ema_weights(b: float, n: int, t: float, bias_correct: bool = True) -> np.ndarray:
    """(1-b) b^(n-i), i=1..n (oldest first), divided by (1-b^t) when bias_correct."""
    k = np.arange(n - 1, -1, -1, dtype=float)
    w = (1.0 - b) * np.power(b, k)
    if bias_correct and math.isfinite(t):
        w = w / (1.0 - b ** t)
    return w


def ar1_matvec(x: np.ndarray, phi: float) -> np.ndarray:
    """R x with R_ij = phi^|i-j| (O(n) by two exponential filters)."""
    x = np.asarray(x, dtype=float)
    if phi == 0.0:
        return x.copy()
    f = lfilter([1.0], [1.0, -phi], x)
    b = lfilter([1.0], [1.0, -phi], x[::-1])[::-1]
    return f + b - x


def quad(x, y, phi):
    """x' R y."""
    return float(np.dot(x, ar1_matvec(y, phi)))


# --------------------------------------------------------------------------- moments
def linear_moments(mu, sigma, phi, a):
    """Mean and variance of N = sum a_i g_i (exact)."""
    ell = a * sigma
    return float(np.dot(a, mu)), quad(ell, ell, phi)


def quadratic_moments(mu, sigma, phi, c):
    """Mean and variance of V = sum c_i g_i^2 (exact; Gaussian 4th moments
    E[z_i^2 z_j^2] = 1 + 2 phi^(2|i-j|))."""
    y = 2.0 * c * mu * sigma
    w = c * sigma ** 2
    mean = float(np.dot(c, mu ** 2 + sigma ** 2))
    var = quad(y, y, phi) + 2.0 * quad(w, w, phi * phi)
    return mean, var


def cov_linear_quadratic(mu, sigma, phi, a, c):
    """Cov(N, V) = sum a_i c_j 2 mu_j sigma_i sigma_j phi^|i-j| (odd moments vanish)."""
    return quad(a * sigma, 2.0 * c * mu * sigma, phi)


# --------------------------------------------------------------------------- Laplace
def _kernel(s: np.ndarray, eps: float, p: int) -> np.ndarray:
    """K_p(s) with (sqrt V + eps)^-p = int_0^inf K_p(s) e^{-sV} ds, p in {1, 2}."""
    x = eps * np.sqrt(s)
    big = x > 30.0
    xs = np.where(big, 1.0, x)
    xb = np.where(big, x, 30.0)
    if p == 1:
        u = np.where(big,
                     0.5 / xb ** 2 - 0.75 / xb ** 4 + 1.875 / xb ** 6 - 6.5625 / xb ** 8,
                     1.0 - _SQRT_PI * xs * special.erfcx(xs))
        return u / np.sqrt(math.pi * s)
    if p == 2:
        small = special.erfcx(xs) * (1.0 + 2.0 * xs ** 2) - 2.0 * xs / _SQRT_PI
        large = (xb ** -3 - 3.0 * xb ** -5 + 11.25 * xb ** -7 - 52.5 * xb ** -9) / _SQRT_PI
        return np.where(big, large, small)
    raise ValueError("p: must be 1 or 2")


def _tilt(mu, sigma, phi, a, c, s_grid):
    """For each s: log Z(s) = log E e^{-sV}, and the tilted mean / variance of N.

    a may be (n,) or (k, n) (k numerators share one tilt); mN, vN are then (S, k).
    """
    n = mu.size
    lam = c * sigma ** 2
    bvec0 = -2.0 * c * mu * sigma          # linear coefficient per unit s
    a = np.atleast_2d(a)
    ell = a * sigma[None, :]                                   # (k, n)
    n0 = a @ mu                                                # (k,)
    if phi == 0.0:
        logz = np.zeros_like(s_grid)
        mN = np.tile(n0, (s_grid.size, 1))
        vN = np.zeros((s_grid.size, a.shape[0]))
        for i0 in range(0, n, 2048):                            # chunks bound the memory
            sl = slice(i0, min(n, i0 + 2048))
            di = 1.0 / (1.0 + 2.0 * np.outer(s_grid, lam[sl]))  # (S, chunk)
            logz += 0.5 * np.log(di).sum(1) - s_grid * (di @ (c[sl] * mu[sl] ** 2))
            mN += s_grid[:, None] * (di @ (bvec0[sl][:, None] * ell[:, sl].T))
            vN += di @ (ell[:, sl].T ** 2)
        return logz, mN, vN
    q = 1.0 / (1.0 - phi * phi)
    diag0 = np.full(n, q * (1.0 + phi * phi))
    diag0[0] = diag0[-1] = q
    if n == 1:
        diag0[0] = 1.0
    off = np.full(n, -q * phi)
    logdetq = -(n - 1) * math.log(1.0 - phi * phi)
    logz = np.empty_like(s_grid)
    mN = np.empty((s_grid.size, a.shape[0]))
    vN = np.empty((s_grid.size, a.shape[0]))
    k_num = a.shape[0]
    ab = np.empty((2, n))
    u = mu / sigma
    qu = diag0 * u
    qu[:-1] += off[:-1] * u[1:]
    qu[1:] += off[:-1] * u[:-1]
    for k, s in enumerate(s_grid):
        ab[0] = diag0 + 2.0 * s * lam
        ab[1] = off
        ab[1, -1] = 0.0
        chol = linalg.cholesky_banded(ab, lower=True, check_finite=False)
        b = s * bvec0
        rhs = np.column_stack([b, qu, ell.T])
        sol = linalg.cho_solve_banded((chol, True), rhs, check_finite=False)
        logdetp = 2.0 * np.log(chol[0]).sum()
        # 1/2 b'P^-1 b - s sum c mu^2 = -1/2 (D u)' P^-1 (Q u)   (Woodbury; no cancellation)
        logz[k] = 0.5 * (logdetq - logdetp) - 0.5 * s * float((2.0 * lam * u) @ sol[:, 1])
        mN[k] = n0 + ell @ sol[:, 0]
        vN[k] = np.einsum("kn,nk->k", ell, sol[:, 2:2 + k_num])
    return logz, mN, vN


def laplace(mu, sigma, phi, a, c, eps, *, h: float = 0.5, span: float = 50.0):
    """Exact E[N/(sqrtV+eps)], E[N^2/(sqrtV+eps)^2], E[|N|/(sqrtV+eps)], E[N^2/V].

    Trapezoid rule in log s on [-span, span] around 1/E[V] (step h); exponentially
    convergent for these analytic integrands (checked against adaptive quadrature in tests).
    a: (n,) -> floats; (k, n) -> arrays of length k (one tilt shared).
    """
    single = np.ndim(a) == 1
    v0 = float(np.dot(c, mu ** 2 + sigma ** 2))
    y = np.arange(-span, span + h / 2, h)
    s = np.exp(y) / v0
    logz, mN, vN = _tilt(mu, sigma, phi, a, c, s)
    z = (np.exp(logz) * s * h)[:, None]                        # ds = s dy
    sd = np.sqrt(np.maximum(vN, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(sd > 0, mN / sd, np.inf)
    fold = np.where(sd > 0, sd * math.sqrt(2.0 / math.pi) * np.exp(-0.5 * np.minimum(ratio ** 2, 1e4))
                    + np.abs(mN) * (1.0 - 2.0 * special.ndtr(-np.abs(ratio))), np.abs(mN))
    k1 = _kernel(s, eps, 1)[:, None]
    k2 = _kernel(s, eps, 2)[:, None]
    out = {
        "r1": np.sum(z * k1 * mN, 0),
        "r2": np.sum(z * k2 * (mN ** 2 + vN), 0),
        "rabs": np.sum(z * k1 * fold, 0),
        "inv2": np.sum(z * (mN ** 2 + vN), 0),
    }
    return {k: float(v[0]) for k, v in out.items()} if single else out


# --------------------------------------------------------------------------- 2nd order
def _gauss_poly_mean(coef, n0, sd, absval):
    """E[F(N) poly(Z)] with N = n0 + sd Z, Z ~ N(0,1), F = 1 or sign(N) (absval)."""
    if not absval:
        k = np.arange(len(coef))
        mom = np.where(k % 2 == 0, special.factorial2(np.maximum(k - 1, 0)), 0.0)
        return float(np.dot(coef, mom))
    # sign(N) = +1 for Z > c0, -1 below
    c0 = -n0 / sd
    kmax = len(coef)
    pdf = math.exp(-0.5 * c0 * c0) / math.sqrt(2.0 * math.pi)
    j = np.zeros(kmax)
    full = np.zeros(kmax)
    for k in range(kmax):
        if k == 0:
            j[k] = special.ndtr(-c0)
            full[k] = 1.0
        elif k == 1:
            j[k] = pdf
            full[k] = 0.0
        else:
            j[k] = c0 ** (k - 1) * pdf + (k - 1) * j[k - 2]
            full[k] = (k - 1) * full[k - 2]
    upper = j
    lower = full - j
    return float(np.dot(coef, upper - lower))


def _g_derivs(v0, eps, p):
    u = math.sqrt(v0)
    g0 = (u + eps) ** (-p)
    g1 = -p * (u + eps) ** (-p - 1) / (2.0 * u)
    g2 = p * (p + 1) * (u + eps) ** (-p - 2) / (4.0 * u * u) + p * (u + eps) ** (-p - 1) / (4.0 * u ** 3)
    return g0, g1, g2


def second_order(mu, sigma, phi, a, c, eps, *, q: int, p: int, absval: bool = False,
                 order: int = 2, g_override=None):
    """E[N^q (sqrt V+eps)^-p] (|N|^q if absval) to second order in D = V - E V given N.

    g_override=(g0, g1, g2) replaces the derivatives of (sqrt V + eps)^-p (used for
    1/max(V, eps^2)).  order=0 gives the 'v at its mean' approximation.
    """
    ell = a * sigma
    y = 2.0 * c * mu * sigma
    w = c * sigma ** 2
    n0 = float(np.dot(a, mu))
    v0 = float(np.dot(c, mu ** 2 + sigma ** 2))
    pv = ar1_matvec(ell, phi)
    sl = float(np.dot(ell, pv))
    wp = w * pv
    yp = float(np.dot(y, pv))
    wpp = float(np.dot(w, pv * pv))
    rwp = ar1_matvec(wp, phi)
    yry = quad(y, y, phi)
    yrwp = float(np.dot(y, rwp))
    wprwp = float(np.dot(wp, rwp))
    wrrw = quad(w, w, phi * phi)
    g0, g1, g2 = g_override if g_override is not None else _g_derivs(v0, eps, p)
    if order == 0:
        g1 = g2 = 0.0
    sd = math.sqrt(max(sl, 0.0))
    if sd == 0.0:
        # N is deterministic: D independent of it
        inner = g0 + 0.5 * g2 * (yry + 2.0 * wrrw)
        return (abs(n0) if absval else n0) ** q * inner
    # polynomials in Z (L = sd Z, lambda = L/sl = Z/sd)
    lam = np.array([0.0, 1.0 / sd])
    mu_d = P.polyadd(yp * lam, wpp * P.polysub(P.polymul(lam, lam), [1.0 / sl]))
    lin = P.polyadd([yp], 2.0 * wpp * lam)
    var_d = P.polyadd(P.polyadd([yry + 2.0 * wrrw - 4.0 * wprwp / sl + 2.0 * wpp ** 2 / sl ** 2],
                                4.0 * yrwp * lam),
                      P.polysub(4.0 * wprwp * P.polymul(lam, lam), P.polymul(lin, lin) / sl))
    inner = P.polyadd(P.polyadd([g0], g1 * mu_d), 0.5 * g2 * P.polyadd(P.polymul(mu_d, mu_d), var_d))
    nz = np.array([n0, sd])
    fq = np.array([1.0])
    for _ in range(q):
        fq = P.polymul(fq, nz)
    # |N|^q = N^q sign(N)^q
    use_sign = absval and (q % 2 == 1)
    return _gauss_poly_mean(P.polymul(fq, inner), n0, sd, use_sign)


def sat_prob(mu, sigma, phi, a, c, eps, thresh=0.9, n_grid=20001):
    """P(|N| h(E[V|N]) > thresh), h(V) = 1/(sqrtV+eps): v replaced by its conditional mean
    given N (captures the m-v correlation, drops the conditional spread of v)."""
    ell = a * sigma
    y = 2.0 * c * mu * sigma
    w = c * sigma ** 2
    n0 = float(np.dot(a, mu))
    v0 = float(np.dot(c, mu ** 2 + sigma ** 2))
    pv = ar1_matvec(ell, phi)
    sl = float(np.dot(ell, pv))
    yp = float(np.dot(y, pv))
    wpp = float(np.dot(w, pv * pv))
    sd = math.sqrt(sl)
    zg = np.linspace(-9.0, 9.0, n_grid)
    lam = zg / sd
    vcond = np.maximum(v0 + yp * lam + wpp * (lam * lam - 1.0 / sl), 0.0)
    r = (n0 + sd * zg) / (np.sqrt(vcond) + eps)
    dens = np.exp(-0.5 * zg ** 2)
    dens /= dens.sum()
    return float(np.sum(dens * (np.abs(r) > thresh)))
