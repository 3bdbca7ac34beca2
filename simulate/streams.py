"""Monte-Carlo of AR(1) gradient streams through optax's Adam (JAX; never torch).

Each configuration c has n_coords independent coordinates; coordinate i sees

    g_t = mu_i + sigma_t z_t,   z_t = phi z_{t-1} + sqrt(1-phi^2) e_t,   z_1 ~ N(0, 1)

(stationary, unit variance), mu_i = +mu ("fixed") or +-mu with random sign ("random").
The gradients go through ``optax.scale_by_adam(b1, b2, eps)`` (eps_root = 0), whose output
is exactly r = m_hat / (sqrt(v_hat) + eps) (eps outside the root), with m_hat, v_hat read
from its state. Configurations are ``jax.vmap``-ed, steps run in ``jax.lax.scan``.

Statistics (``STATS``), per recorded step, each with a standard error:
    r_mean, r_rms, r_abs (E|r|), r_m2..r_m4 (raw moments), bc (Sarle, population form from
    the pooled moments), sat_frac (P(|r| > 0.9)), m_mean, m_var, v_mean, v_var (of m_hat,
    v_hat), mv_cov, rms_t = sqrt(mean g^2 / max(v_hat, eps^2)), grad_mom_cos = cos(g_t, m_{t-1})
    over the coordinates of a configuration.
Standard errors are batch means: the coordinates are split into ``n_groups`` (default 64)
independent groups, each statistic is computed per group, and se = std(groups)/sqrt(G).
(Coordinates are independent, so groups are independent replicas; for a nonlinear
statistic the group estimates carry an O(G/N) bias, negligible at N >= 1e4.)

Precision: float64 by default (``jax.enable_x64`` inside the call; the process-wide setting
is left alone), because r moments are compared with closed forms to ~1e-4 relative.
Deterministic: the same seed, configurations and sizes give bit-identical results on the
same machine.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.scipy.special import erfinv

STATS = ("r_mean", "r_rms", "r_abs", "r_m2", "r_m3", "r_m4", "bc", "sat_frac", "m_mean", "m_var",
         "v_mean", "v_var", "mv_cov", "rms_t", "grad_mom_cos")

# per-group sums, in this order
_SUMS = ("r", "r2", "r3", "r4", "ra", "sat", "q", "gm", "g2", "mp2", "mh", "mh2", "vh", "vh2", "mv")

_DEFAULT = {"b1": 0.9, "b2": 0.95, "eps": 0.0, "sigma": 1.0, "mu": 0.0, "phi": 0.0}


def _as_configs(configs) -> list[dict]:
    out = []
    for c in configs:
        unknown = set(c) - set(_DEFAULT)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown stream parameter")
        d = {**_DEFAULT, **c}
        for k in ("b1", "b2"):
            if not 0.0 <= float(d[k]) < 1.0:
                raise ValueError(f"{k}: must be in [0, 1), got {d[k]!r}")
        if not -1.0 < float(d["phi"]) < 1.0:
            raise ValueError(f"phi: must be in (-1, 1), got {d['phi']!r}")
        if float(d["eps"]) < 0.0:
            raise ValueError(f"eps: must be >= 0, got {d['eps']!r}")
        if float(d["sigma"]) <= 0.0:
            raise ValueError(f"sigma: must be > 0, got {d['sigma']!r}")
        out.append(d)
    if not out:
        raise ValueError("configs: must not be empty")
    return out


def _lowbias32(x):
    """A 32-bit integer hash (C. Wellons' lowbias32), a bijection on uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_normals(key_a, key_b, t, n: int, dtype):
    """n standard normals for step t: counter-based, z = sqrt(2) erfinv(2u - 1),
    u = (hash(hash(j ^ key_a) ^ hash(t + key_b)) >> 8 + 1/2) / 2^24, j = 0..n-1.

    24-bit uniforms: tails truncated at |z| ~ 5.4 (mass 7e-8, relative bias of E z^4 < 1e-4).
    """
    j = jnp.arange(n, dtype=jnp.uint32)
    h = _lowbias32(_lowbias32(j ^ key_a) ^ _lowbias32(t.astype(jnp.uint32) + key_b))
    # odd integers in (-2^24, 2^24), exact in float32: |u| <= 1 - 2^-24, never +-1
    k = (2 * (h >> 8) + 1).astype(jnp.int32) - jnp.int32(1 << 24)
    u = k.astype(jnp.float32) * jnp.float32(2.0 ** -24)
    return (jnp.float32(math.sqrt(2.0)) * erfinv(u)).astype(dtype)


@functools.lru_cache(maxsize=32)
def _build(n_coords: int, steps: int, n_groups: int, record_all: bool, mu_random: bool,
           dtype, rng: str = "hash"):
    gsize = n_coords // n_groups

    def noise(key, t):
        if rng == "threefry":
            return jax.random.normal(jax.random.fold_in(key, t), (n_coords,), dtype)
        kd = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        return hash_normals(kd[0].astype(jnp.uint32), kd[1].astype(jnp.uint32), t, n_coords, dtype)

    def sums(g, mprev, upd, state, eps, b1, b2):
        cnt = state.count.astype(dtype)
        mh = state.mu / (1.0 - b1 ** cnt)
        vh = state.nu / (1.0 - b2 ** cnt)
        r = upd
        q = g * g / jnp.maximum(vh, eps * eps)
        cols = (r, r * r, r ** 3, r ** 4, jnp.abs(r), (jnp.abs(r) > 0.9).astype(dtype), q,
                g * mprev, g * g, mprev * mprev, mh, mh * mh, vh, vh * vh, mh * vh)
        return jnp.stack([c.reshape(n_groups, gsize).sum(1) for c in cols], axis=0)

    def one_clean(b1, b2, eps, mu, phi, sig_t, key):
        tx = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
        ksign, kz, kloop = jax.random.split(key, 3)
        if mu_random:
            sign = jnp.where(jax.random.bernoulli(ksign, 0.5, (n_coords,)), 1.0, -1.0)
        else:
            sign = jnp.ones((n_coords,))
        mus = (mu * sign).astype(dtype)
        z0 = noise(kz, jnp.int32(0))
        state0 = tx.init(jnp.zeros((n_coords,), dtype))
        a = jnp.sqrt(1.0 - phi * phi)

        def step(z, state, t, sig):
            e = noise(kloop, t)
            z = jnp.where(t == 0, z, phi * z + a * e)
            g = mus + sig * z
            mprev = state.mu
            upd, state = tx.update(g, state)
            return z, state, g, mprev, upd

        ts = jnp.arange(steps)
        if record_all:
            def body(carry, xs):
                z, state, g, mprev, upd = step(*carry, *xs)
                return (z, state), sums(g, mprev, upd, state, eps, b1, b2)

            _, outs = jax.lax.scan(body, (z0, state0), (ts, sig_t))
            return outs                                          # (steps, 15, G)

        def body(carry, xs):
            z, state, _, _, _ = step(*carry, *xs)
            return (z, state), None

        (z, state), _ = jax.lax.scan(body, (z0, state0), (ts[:-1], sig_t[:-1]))
        _, state, g, mprev, upd = step(z, state, ts[-1], sig_t[-1])
        return sums(g, mprev, upd, state, eps, b1, b2)[None]     # (1, 15, G)

    def run(b1, b2, eps, mu, phi, sig_t, key):
        # the configs' keys split inside the program: split eagerly, it compiles one more
        # program per number of configs (issue 37: distinct programs); the same bits
        return jax.vmap(one_clean)(b1, b2, eps, mu, phi, sig_t, jax.random.split(key, len(b1)))

    return jax.jit(run)


def _finish(s: np.ndarray, gsize: int) -> dict:
    """s: (..., 15, G) group sums -> statistics (pooled) and batch-means SEs."""
    def stats(x, n):
        d = dict(zip(_SUMS, np.moveaxis(x, -2, 0)))
        e = {k: v / n for k, v in d.items()}
        r2, r1, r3, r4 = e["r2"], e["r"], e["r3"], e["r4"]
        var = r2 - r1 ** 2
        with np.errstate(divide="ignore", invalid="ignore"):
            skew = (r3 - 3 * r1 * r2 + 2 * r1 ** 3) / var ** 1.5
            kurt = (r4 - 4 * r1 * r3 + 6 * r1 ** 2 * r2 - 3 * r1 ** 4) / var ** 2
            bc = (skew ** 2 + 1.0) / kurt
            cos = e["gm"] / np.sqrt(e["g2"] * e["mp2"])
        return {
            "r_mean": r1, "r_rms": np.sqrt(r2), "r_abs": e["ra"], "r_m2": r2, "r_m3": r3,
            "r_m4": r4, "bc": bc, "sat_frac": e["sat"], "m_mean": e["mh"],
            "m_var": e["mh2"] - e["mh"] ** 2, "v_mean": e["vh"], "v_var": e["vh2"] - e["vh"] ** 2,
            "mv_cov": e["mv"] - e["mh"] * e["vh"], "rms_t": np.sqrt(e["q"]), "grad_mom_cos": cos,
        }

    g = s.shape[-1]
    pooled = stats(s.sum(-1, keepdims=True), gsize * g)
    per = stats(s, gsize)
    out = {}
    for k in STATS:
        out[k] = pooled[k][..., 0]
        out[k + "_se"] = per[k].std(-1, ddof=1) / math.sqrt(g)
    return out


def simulate_streams(configs: Sequence[dict], steps: int, n_coords: int = 65536, *,
                     seed: int = 0, mu_sign: str = "fixed", record: str = "last",
                     sigma_t: np.ndarray | None = None, n_groups: int = 64,
                     dtype: str = "float64", rng: str = "hash") -> dict:
    """Run the streams; return {stat: array, stat_se: array} of shape (C,) or (C, steps).

    configs: dicts with keys b1, b2, eps, sigma, mu, phi (defaults 0.9, 0.95, 0, 1, 0, 0).
    sigma_t: optional (C, steps) per-step gradient scale (overrides sigma; transients).
    record: "last" (statistics after the final step) or "all" (after every step).
    rng: "hash" (default; counter-based hash + inverse-erf normals, ~10x cheaper on CPU) or
    "threefry" (jax.random.normal).  Both are seeded from jax.random.PRNGKey(seed).
    """
    cfg = _as_configs(configs)
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps!r}")
    if n_coords < n_groups or n_coords % n_groups:
        raise ValueError(f"n_coords: must be a positive multiple of n_groups={n_groups}, got {n_coords!r}")
    if mu_sign not in ("fixed", "random"):
        raise ValueError(f"mu_sign: must be 'fixed' or 'random', got {mu_sign!r}")
    if record not in ("last", "all"):
        raise ValueError(f"record: must be 'last' or 'all', got {record!r}")
    if rng not in ("hash", "threefry"):
        raise ValueError(f"rng: must be 'hash' or 'threefry', got {rng!r}")
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype: must be 'float64' or 'float32', got {dtype!r}")
    with jax.enable_x64(dtype == "float64"):
        dt = jnp.float64 if dtype == "float64" else jnp.float32
        # host arrays in: each eager jnp op would compile a program of its own
        col = lambda k: np.asarray([float(c[k]) for c in cfg], dtype)  # noqa: E731
        if sigma_t is None:
            sig = np.broadcast_to(col("sigma")[:, None], (len(cfg), steps))
        else:
            sig = np.asarray(np.asarray(sigma_t, float), dtype)
            if sig.shape != (len(cfg), steps) or not bool(np.all(sig > 0)):
                raise ValueError(f"sigma_t: must be positive with shape ({len(cfg)}, {steps})")
        fn = _build(int(n_coords), steps, n_groups, record == "all", mu_sign == "random", dt, rng)
        s = fn(col("b1"), col("b2"), col("eps"), col("mu"), col("phi"), sig,
               jax.random.PRNGKey(int(seed)))
        s = np.asarray(jax.device_get(s), dtype=float)           # (C, T|1, 15, G)
    out = _finish(s, n_coords // n_groups)
    if record == "last":
        out = {k: v[:, 0] for k, v in out.items()}
    return out


def sample_updates(config: dict, steps: int, n_coords: int = 65536, *, seed: int = 0,
                   mu_sign: str = "random", rng: str = "hash") -> np.ndarray:
    """The raw r = optax update of every coordinate after `steps` steps (for histograms)."""
    (c,) = _as_configs([config])
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps!r}")
    with jax.enable_x64(True):
        dt = jnp.float64
        tx = optax.scale_by_adam(b1=c["b1"], b2=c["b2"], eps=c["eps"])
        key = jax.random.PRNGKey(int(seed))

        def noise(k, t):
            if rng == "threefry":
                return jax.random.normal(jax.random.fold_in(k, t), (n_coords,), dt)
            return hash_normals(k[0].astype(jnp.uint32), k[1].astype(jnp.uint32), t, n_coords, dt)

        @jax.jit
        def run():
            ksign, kz, kloop = jax.random.split(key, 3)   # in the program: one fewer to compile
            sign = (jnp.where(jax.random.bernoulli(ksign, 0.5, (n_coords,)), 1.0, -1.0)
                    if mu_sign == "random" else jnp.ones((n_coords,)))
            mus = (c["mu"] * sign).astype(dt)
            a = math.sqrt(1 - c["phi"] ** 2)

            def body(carry, t):
                z, st, _ = carry
                z = jnp.where(t == 0, z, c["phi"] * z + a * noise(kloop, t))
                upd, st = tx.update(mus + c["sigma"] * z, st)
                return (z, st, upd), None

            init = (noise(kz, jnp.int32(0)), tx.init(jnp.zeros((n_coords,), dt)), jnp.zeros((n_coords,), dt))
            (_, _, upd), _ = jax.lax.scan(body, init, jnp.arange(steps))
            return upd

        return np.asarray(run(), dtype=float)
