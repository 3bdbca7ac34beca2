"""Benchmark: the JAX/optax stream Monte-Carlo (simulate.streams) vs a plain numpy loop.

Same work on both sides: n coordinates (default 65,536) x T steps (default 2,000) of an
AR(1) gradient stream (phi = 0.5, mu = 0.1, sigma = 1) through Adam (b1 = 0.9, b2 = 0.95,
eps = 1e-8), then the final-step statistics (moments of r, rms_t, grad_mom_cos, ...).
numpy draws its normals with numpy.random.default_rng (the straightforward choice); JAX uses
simulate.streams' counter-hash normals (rng="hash", default) or jax.random (rng="threefry").
Reports the median of >= 3 timed repeats per side, the JAX compile time separately (first
call minus the steady-state median), and the ratio numpy / JAX.

    python bench/bench_streams.py [--coords 65536] [--steps 2000] [--repeats 3]
                                  [--dtype float64] [--rng hash|threefry|both] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulate.streams import simulate_streams  # noqa: E402

B1, B2, EPS, PHI, MU, SIGMA = 0.9, 0.95, 1e-8, 0.5, 0.1, 1.0


def numpy_streams(n: int, steps: int, seed: int = 0, dtype=np.float64) -> dict:
    rng = np.random.default_rng(seed)
    a = math.sqrt(1 - PHI * PHI)
    z = rng.standard_normal(n, dtype=dtype)
    m = np.zeros(n, dtype)
    v = np.zeros(n, dtype)
    for t in range(1, steps + 1):
        if t > 1:
            z = PHI * z + a * rng.standard_normal(n, dtype=dtype)
        g = MU + SIGMA * z
        mprev = m
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        mh = m / (1 - B1 ** t)
        vh = v / (1 - B2 ** t)
        r = mh / (np.sqrt(vh) + EPS)
    return {"r_rms": float(np.sqrt(np.mean(r * r))), "r_abs": float(np.mean(np.abs(r))),
            "rms_t": float(np.sqrt(np.mean(g * g / np.maximum(vh, EPS * EPS)))),
            "grad_mom_cos": float(np.dot(g, mprev) / np.sqrt(np.dot(g, g) * np.dot(mprev, mprev))),
            "bc_moments": [float(np.mean(r ** k)) for k in (1, 2, 3, 4)]}


def jax_streams(n: int, steps: int, seed: int, dtype: str, rng: str) -> dict:
    out = simulate_streams([dict(b1=B1, b2=B2, eps=EPS, phi=PHI, mu=MU, sigma=SIGMA)], steps=steps,
                           n_coords=n, seed=seed, dtype=dtype, rng=rng)
    return {k: float(out[k][0]) for k in ("r_rms", "r_abs", "rms_t", "grad_mom_cos")}


def timed(fn, repeats):
    ts = []
    res = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        ts.append(time.perf_counter() - t0)
    return ts, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coords", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    ap.add_argument("--rng", default="both", choices=("hash", "threefry", "both"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats: must be >= 3 (median of >= 3)")
    n, steps = args.coords, args.steps

    report = {"coords": n, "steps": steps, "repeats": args.repeats, "dtype": args.dtype,
              "cpu_count": os.cpu_count(), "jax_devices": [str(d) for d in jax.devices()],
              "loadavg": os.getloadavg()}
    np_dtype = np.float64 if args.dtype == "float64" else np.float32
    ts, np_res = timed(lambda: numpy_streams(n, steps, 0, np_dtype), args.repeats)
    report["numpy_s"] = statistics.median(ts)
    report["numpy_runs_s"] = ts
    report["numpy_stats"] = np_res
    for rng in (("hash", "threefry") if args.rng == "both" else (args.rng,)):
        t0 = time.perf_counter()
        jax_streams(n, steps, 1, args.dtype, rng)           # compile + first run
        first = time.perf_counter() - t0
        ts, res = timed(lambda: jax_streams(n, steps, 1, args.dtype, rng), args.repeats)
        med = statistics.median(ts)
        report[f"jax_{rng}_s"] = med
        report[f"jax_{rng}_runs_s"] = ts
        report[f"jax_{rng}_compile_s"] = max(first - med, 0.0)
        report[f"jax_{rng}_stats"] = res
        report[f"ratio_numpy_over_jax_{rng}"] = report["numpy_s"] / med
    if args.json:
        print(json.dumps(report))
    else:
        print(f"streams benchmark: {n} coords x {steps} steps, {args.dtype}, median of {args.repeats}"
              f" (cpus {os.cpu_count()}, load {report['loadavg'][0]:.1f})")
        print(f"  numpy loop          {report['numpy_s']:8.3f} s   runs {[round(x, 3) for x in report['numpy_runs_s']]}")
        for rng in (("hash", "threefry") if args.rng == "both" else (args.rng,)):
            print(f"  jax ({rng:8s})     {report[f'jax_{rng}_s']:8.3f} s   compile {report[f'jax_{rng}_compile_s']:.3f} s"
                  f"   ratio numpy/jax = {report[f'ratio_numpy_over_jax_{rng}']:.2f}x")
        print(f"  check r_rms: numpy {np_res['r_rms']:.4f}  jax {report[f'jax_{rng}_stats']['r_rms']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
