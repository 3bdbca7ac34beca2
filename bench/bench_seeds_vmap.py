"""Benchmark: >= 10 seeds of a tiny-LLaMA arm as one vmapped program vs one after another.

    python bench/bench_seeds_vmap.py [--seeds 10] [--steps 100] [--dim 64] [--layers 2]
                                     [--batch 16] [--repeats 3]

The program is simulate.ladder.seed_program: one seed's whole training run (init, AdamW
with clip and weight decay, lax.scan over the steps, per-depth gradient sums of squares),
seeds differing in their init key and batch order (adamspike.order.sample_indices, so the
same seed index reads the same batches in every arm: arms are paired). Both sides are
compiled before timing (compile times reported separately):
  sequential  jit(run_one), called once per seed
  vmapped     jit(vmap(run_one)), one call for all seeds
Each side is timed `repeats` times, interleaved; medians are reported and the results of
both sides are checked to agree. Target (issue 14): vmapped >= 3x faster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from simulate import ladder as LD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    spec = LD.LadderSpec(rungs=[(a.dim, a.layers, a.batch)], seeds=a.seeds, num_steps=a.steps,
                         warmup_steps=max(1, a.steps // 10))
    cfg = LD.llama_config(a.dim, a.layers, spec)
    seeds = list(range(a.seeds))
    toks = jnp.asarray(np.swapaxes(LD.batches(spec, a.batch, seeds), 0, 1))
    keys = jnp.stack([jax.random.PRNGKey(k) for k in seeds])
    run_one, _, _ = LD.seed_program(cfg, spec)
    t0 = time.perf_counter()
    vm = jax.jit(jax.vmap(run_one)).lower(keys, toks).compile()
    t1 = time.perf_counter()
    one = jax.jit(run_one).lower(keys[0], toks[0]).compile()
    t2 = time.perf_counter()
    print(f"compile: vmapped {t1 - t0:.2f} s, sequential {t2 - t1:.2f} s")

    def seq():
        return [jax.block_until_ready(one(keys[i], toks[i])) for i in seeds]

    def vec():
        return jax.block_until_ready(vm(keys, toks))

    ts, tv = [], []
    for _ in range(a.repeats):
        t = time.perf_counter(); rs = seq(); ts.append(time.perf_counter() - t)
        t = time.perf_counter(); rv = vec(); tv.append(time.perf_counter() - t)
    np.testing.assert_allclose(np.stack([r[0] for r in rs]), np.asarray(rv[0]), rtol=1e-4)
    s, v = statistics.median(ts), statistics.median(tv)
    print(f"{a.seeds} seeds x {a.steps} steps, dim {a.dim}, {a.layers} layers, batch "
          f"{a.batch} x {spec.seq_len}: sequential {s:.2f} s, vmapped {v:.2f} s, "
          f"ratio {s / v:.2f}x (target >= 3x); runs {ts} / {tv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
