"""Benchmark: >= 10 seeds of a tiny-LLaMA arm as one vmapped program vs one after another.

    python bench/bench_seeds_vmap.py [--config configs/matched_replication.toml]
                                     [--seeds 10] [--steps 100] [--repeats 3]

The arm is a RunConfig (default: the matched-regime replication's base); its seeds differ in
train.seed (init, data, batch order), so seed k of every arm is paired. Three ways to run
the same seeds, all compiled before timing (compile times printed separately):

  vmapped     simulate.seeds.run_arm: simulate.program's run form (jit(vmap(lax.scan of the
              one step))), one call (timed with making the seeds' batches)
  sequential  the same program at one lane, called once per seed (run_arm(vmapped=False))
  trainer     simulate.llama_train.train per seed (what `adamspike simulate llama` runs,
              telemetry off: the per-step loop with its host-side control flow), after one
              warm-up run that compiles its step

Each side is timed `repeats` times, interleaved; medians and the ratios against the
vmapped side are printed, and the vmapped losses are checked against the sequential ones.
Target (issue 14): vmapped >= 3x faster than running the seeds one after another.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from adamspike.config import flatten, read_toml, to_dict
from adamspike.train_config import RunConfig
from simulate import seeds as S
from simulate.llama_train import train

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "matched_replication.toml"))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    flat = flatten(to_dict(RunConfig.from_dict(read_toml(a.config))))
    flat.update({"train.num_steps": a.steps, "optim.warmup_steps": max(1, a.steps // 10),
                 "telemetry.enabled": False, "telemetry.curvature_every": 0})
    cfg = RunConfig.from_dict(flat)
    seeds = list(range(a.seeds))
    t0 = time.perf_counter()
    S.run_arm(cfg, seeds)                    # compiles the program at len(seeds) lanes
    t1 = time.perf_counter()
    S.run_arm(cfg, seeds[:1], vmapped=False)  # and at one lane
    t2 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_seeds_"))
    train(cfg, tmp / "warmup", progress=False)
    t3 = time.perf_counter()
    print(f"first run (compile + run): vmapped {t1 - t0:.1f} s, one lane {t2 - t1:.1f} s, "
          f"trainer warm-up run {t3 - t2:.1f} s")

    def vec():   # includes making the seeds' batches, as the trainer does per step
        return S.run_arm(cfg, seeds)

    def seq():
        return S.run_arm(cfg, seeds, vmapped=False)

    runs = iter(range(10 ** 6))

    def trainer():
        for k in seeds:
            c = RunConfig.from_dict({**flat, "train.seed": k})
            train(c, tmp / f"r{next(runs)}", progress=False)

    times = {"vmapped": [], "sequential": [], "trainer": []}
    for _ in range(a.repeats):
        for name, fn in (("vmapped", vec), ("sequential", seq), ("trainer", trainer)):
            t = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t)
            if name == "vmapped":
                rv = out
            elif name == "sequential":
                rs = out
    # different XLA programs (lane width 10 vs 1): fp32 rounding differs, bound loosely
    np.testing.assert_allclose(rs["loss"], rv["loss"], rtol=1e-3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.seeds} seeds x {a.steps} steps of {Path(a.config).name} (dim {cfg.model.dim}, "
          f"{cfg.model.num_layers} layers, vocab {cfg.model.vocab_size}, batch "
          f"{cfg.train.global_batch_size} x {cfg.train.seq_len}), medians of {a.repeats}:")
    for k in ("vmapped", "sequential", "trainer"):
        print(f"  {k:<10} {med[k]:7.2f} s   ratio to vmapped {med[k] / med['vmapped']:.2f}x   "
              f"runs {[round(x, 2) for x in times[k]]}")
    print("target: vmapped >= 3x faster than one after another")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
