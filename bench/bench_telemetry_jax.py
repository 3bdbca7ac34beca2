"""Overhead of the per-tensor Adam telemetry in the JAX toy LLaMA train step.

Compiled variants of simulate.llama_train's step (the same function the trainer runs),
measured side by side in one process: telemetry off, telemetry sums on, sums + r
histograms (both with the native CPU kernel, simulate.native_telemetry, the default),
"xla": the sums by XLA's reductions (native=False), and the trainer's one program with
what a step reports as a traced input (`lax.switch`), called for sums ("switch:sums") and
for sums + histograms ("switch:hist"). Every repeat runs a block of steps of
each variant back to back (the order rotating between repeats), device-synchronised;
printed per variant:
    median   ms per step over the repeats, and its ratio to "off"
    paired   median over repeats of (this variant's block / the "off" block of the same
             repeat): the steadier number when the machine's speed drifts between repeats
    hist/10  the trainer's default (metrics every step, histograms every 10th):
             telemetry + (telemetry+hist - telemetry) / 10, from the paired ratios
Target: telemetry and hist/10 <= 1.05 x off. CPU time (time.process_time) is printed beside
wall time: pinned to one core (taskset -c 0), it is what the step costs whatever else runs.

The telemetry's cost is per parameter and the step's per token, so the ratio falls as the
batch grows: `--batch 32` is configs/toy_spike.toml's batch (the study's spiking runs).

Measured (2-core shared VM, one core, 2026-12-03; the machine's speed drifts by up to 40 %
between sessions). XLA's reductions, in their successive layouts: the packed layout with
13 minor-axis reductions, paired 1.07-1.08 on a 9-14 ms step; one variadic column reduce
over the packed array, 1.032-1.055; whole-block tensors read in place and r shared with
optax's update, 1.030-1.052 (hist/10 1.036-1.056) on a 9-11 ms step. Later the same day
the machine ran the step in 5.8-5.9 ms and XLA's ~0.3 ms became 1.051-1.059 (hist/10
1.060-1.066): XLA:CPU compiles the variadic reduce to scalar code. The native loop
(adamspike.native, the torch trainer's too, called by FFI inside the jitted step): paired
1.019-1.029 in four runs (hist/10 1.023-1.032, histograms on every step 1.053-1.057),
against 1.051 for XLA's reductions in the same run; at batch 32, 1.010 (hist/10 1.012).
On the 2-core AMD EPYC box (2026-12-05, one core, XLA level 1, 15 repeats): off 9.15 ms,
telemetry paired 1.111, telemetry+hist 1.289, xla 1.170; the trainer's one program with a
traced report, switch:sums 1.103 and switch:hist 1.294 (the switch costs nothing
measurable; its second call compiles nothing); at level 2 (9 repeats) the same ratios
(off 8.67 ms, telemetry 1.104, switch:sums 1.104): the AMD box's telemetry costs ~10 %.

    taskset -c 0 python bench/bench_telemetry_jax.py [--preset tiny] [--batch 16] [--seq 32]
                                                     [--repeats 31] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from adamspike.config import load_config
from adamspike.train_config import RunConfig
from simulate import llama_train as lt
from simulate.program import telemetry_inputs

# (telemetry, histograms, native CPU kernel, report): report None compiles what the variant
# asks for into the step; an int calls the trainer's one program (telemetry and histograms
# compiled in, what a step reports a traced input: simulate.program.Program.step) with it
VARIANTS = {"off": (False, False, True, None), "telemetry": (True, False, True, None),
            "telemetry+hist": (True, True, True, None), "xla": (True, False, False, None),
            "switch:sums": (True, True, True, 1), "switch:hist": (True, True, True, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    args = ap.parse_args(argv)
    cfg = load_config(RunConfig, None, [
        "--model.preset", args.preset, "--train.global_batch_size", str(args.batch),
        "--train.seq_len", str(args.seq), "--train.num_steps", "1000"])
    llama = cfg.model.llama()
    prog = lt.program(cfg)
    params, state = prog.init(0)
    batch = jnp.asarray(lt.batch_at(lt.dataset(cfg, llama), cfg, 1))
    ctl = prog.controls(cfg, [1]).at(0)
    spec = prog.telemetry_spec(cfg)
    compiled = {}
    for name, (tel, hist, native, report) in VARIANTS.items():
        t0 = time.perf_counter()
        static, values = telemetry_inputs(spec if tel else None)   # as Program.step_fn
        kw = {"tel_values": values} if report is None else {"report": np.int32(report),
                                                             "tel_values": values}
        fn = prog._step_jit.lower(params, state, batch, ctl, static, hist, native,
                                  **kw).compile()
        compiled[name] = lambda p, s, b, c, fn=fn, kw=kw: fn(p, s, b, c, **kw)
        jax.block_until_ready(compiled[name](params, state, batch, ctl))
        print(f"compile {name:15s} {time.perf_counter() - t0:6.2f} s")

    names = list(VARIANTS)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for r in range(args.repeats + 1):  # repeat 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, p, s = compiled[name], params, state
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                p, s, out = fn(p, s, batch, ctl)
            jax.block_until_ready((p, s, out))
            if r:
                wall[name].append((time.perf_counter() - t0) / args.steps)
                cpu[name].append((time.process_time() - c0) / args.steps)
        print(f"\rrepeat {r}/{args.repeats}", end="", file=sys.stderr)
    print("\r", end="", file=sys.stderr)
    print(f"{args.preset} preset, batch {args.batch} x {args.seq} tokens, {args.repeats} repeats"
          f" x {args.steps} steps, {len(jax.tree.leaves(params))} tensors")
    for clock, times in (("wall", wall), ("cpu", cpu)):
        base = statistics.median(times["off"])
        paired = {n: statistics.median(a / b for a, b in zip(times[n], times["off"]))
                  for n in names}
        paired["hist/10"] = paired["telemetry"] + (paired["telemetry+hist"] - paired["telemetry"]) / 10
        for name in names + ["hist/10"]:
            med = (f"{statistics.median(times[name]) * 1e3:8.3f} ms/step   ratio "
                   f"{statistics.median(times[name]) / base:5.3f}") if name in times else " " * 31
            print(f"{clock:4s} {name:15s} {med}   paired {paired[name]:5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
