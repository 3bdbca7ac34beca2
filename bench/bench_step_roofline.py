"""Benchmark: the tiny-LLaMA step against the machine's matmul roofline, side by side.

    python bench/bench_step_roofline.py [--config configs/matched_replication.toml]
                                        [--lanes 4] [--steps 100] [--batches 8 32] [--repeats 3]

In one run, interleaved `repeats` times (medians printed):
- the step: simulate.seeds.run_arm (simulate.program's run form: jit(vmap(lax.scan of the
  one step))) over `lanes` seeds x `steps` steps, at each global batch in `batches` (8 is the
  phase map's); lane-steps per second and achieved FLOP/s, counting
  6 N_matmul + 12 L d T flops per token (forward + backward; N_matmul: every weight matrix
  including the output head, not the embedding lookup; the attention score and value
  products at sequence length T) — the convention of docs and torchtitan;
- a matmul of the same dtype (fp32) on the same cores: jnp.dot of two (n, n) matrices,
  its FLOP/s the roofline;
- per batch, the ratio achieved / matmul and the share of the flops in the output head
  (the 4096-token vocabulary; measured as most of the step's time in Science 3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from adamspike.config import flatten, read_toml, to_dict
from adamspike.llama import param_specs
from adamspike.train_config import RunConfig
from simulate import seeds as S

REPO = Path(__file__).resolve().parent.parent


def flops_per_token(cfg: RunConfig) -> tuple[float, float]:
    """(training flops per token, the output head's share of them)."""
    llama = cfg.model.llama()
    mat = sum(p.numel for p in param_specs(llama) if len(p.shape) == 2 and p.kind != "embed")
    head = llama.vocab_size * llama.dim
    T = cfg.train.seq_len
    total = 6.0 * mat + 12.0 * llama.num_layers * llama.dim * T
    return total, 6.0 * head / total


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "matched_replication.toml"))
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    base = flatten(to_dict(RunConfig.from_dict(read_toml(a.config))))
    seeds = list(range(a.lanes))
    cfgs = {}
    for b in a.batches:
        flat = {**base, "train.num_steps": a.steps, "optim.warmup_steps": max(1, a.steps // 10),
                "train.global_batch_size": b, "telemetry.enabled": False,
                "telemetry.curvature_every": 0}
        cfgs[b] = RunConfig.from_dict(flat)
        t0 = time.perf_counter()
        S.run_arm(cfgs[b], seeds)               # compile at this batch
        print(f"batch {b}: compile + first run {time.perf_counter() - t0:.1f} s")
    times = {b: [] for b in a.batches}
    mm = []
    for _ in range(a.repeats):                 # interleaved: drift hits every side alike
        mm.append(matmul_flops())
        for b, cfg in cfgs.items():
            t0 = time.perf_counter()
            S.run_arm(cfg, seeds)
            times[b].append(time.perf_counter() - t0)
    peak = statistics.median(mm)
    print(f"matmul fp32 1024^3: {peak / 1e9:.1f} GFLOP/s (median of {a.repeats})")
    for b, cfg in cfgs.items():
        t = statistics.median(times[b])
        fpt, head = flops_per_token(cfg)
        tokens = b * cfg.train.seq_len * a.steps * a.lanes
        achieved = fpt * tokens / t
        print(f"batch {b:>4}: {a.lanes * a.steps / t:8.1f} lane-steps/s, "
              f"{achieved / 1e9:6.2f} GFLOP/s, roofline ratio {achieved / peak:.3f} "
              f"(head {head:.0%} of the flops)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
