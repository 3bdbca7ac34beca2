"""Benchmark: a vmapped sweep against the same configurations run one after another.

    python bench/bench_sweep_vmap.py [--configs 32] [--steps 5000] [--repeats 5]

Problem: Adam on the 1-D quadratic (simulate.quadratic.simulate_quadratic, float64; both
sides return the log loss and the telemetry sums the sweep records), configurations = a grid over eps x b2 (x lr when more are
asked for). Both sides are jitted once before timing (compile time reported separately):
  sequential  jit(simulate_quadratic), called once per configuration (the hyperparameters
              are traced arguments, so one compilation serves them all)
  vmapped     jit(vmap(simulate_quadratic)), one call for all configurations
Each side is timed `repeats` times, interleaved, and the median is reported; the results of
both sides are checked to agree. Target: vmapped >= 3x faster.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import numpy as np

from simulate.quadratic import HPARAM_DEFAULTS, QuadraticSpec, simulate_quadratic


def configs(n: int) -> list[dict]:
    eps = np.geomspace(1e-8, 1e-2, 8)
    b2 = (0.9, 0.95, 0.99, 0.999)
    lr = (1e-2, 3e-3, 3e-2, 1e-3)
    grid = [{"eps": float(e), "b2": b, "lr": l, "noise": 1e-9, "seed": i}
            for i, (l, b, e) in enumerate(itertools.product(lr, b2, eps))]
    return grid[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.configs < 16:
        ap.error("--configs: need >= 16")
    spec = QuadraticSpec(num_steps=args.steps, record_sums=True)
    cfgs = configs(args.configs)
    stacked = {k: np.array([{**HPARAM_DEFAULTS, **c}[k] for c in cfgs]) for k in HPARAM_DEFAULTS}
    with jax.enable_x64(True):
        traces = lambda hp: (lambda o: (o["log10_loss"], o["sums"]))(simulate_quadratic(hp, spec))  # noqa: E731
        one = jax.jit(traces)
        many = jax.jit(jax.vmap(traces))
        singles = [{k: np.asarray(v[i]) for k, v in stacked.items()} for i in range(len(cfgs))]

        t0 = time.perf_counter()
        jax.block_until_ready(one(singles[0]))
        compile_seq = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(many(stacked))
        compile_vmap = time.perf_counter() - t0

        def run_seq():
            return np.stack([np.asarray(jax.block_until_ready(one(hp))[0]) for hp in singles])

        def run_vmap():
            return np.asarray(jax.block_until_ready(many(stacked))[0])

        t_seq, t_vmap = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            a = run_seq()
            t_seq.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = run_vmap()
            t_vmap.append(time.perf_counter() - t0)
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    med_seq, med_vmap = statistics.median(t_seq), statistics.median(t_vmap)
    print(f"quadratic sweep: {len(cfgs)} configurations x {args.steps} steps, "
          f"{args.repeats} repeats, {jax.devices()[0].platform}")
    print(f"  compile (first call, excluded): sequential {compile_seq:.2f} s, vmapped {compile_vmap:.2f} s")
    print(f"  sequential (jit, one call per config): median {med_seq:.3f} s  "
          f"({1e6 * med_seq / (len(cfgs) * args.steps):.2f} us per config-step)")
    print(f"  vmapped (one call):                    median {med_vmap:.3f} s  "
          f"({1e6 * med_vmap / (len(cfgs) * args.steps):.2f} us per config-step)")
    ratio = med_seq / med_vmap
    print(f"  speed-up vmapped / sequential: {ratio:.2f}x (target >= 3x: "
          f"{'met' if ratio >= 3 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
