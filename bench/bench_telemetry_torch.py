"""Cost of per-tensor Adam telemetry in the torch trainer's step, on CPU.

One training step = forward + backward + clip + AdamW step of a LLaMA preset (tiny, small)
on a synthetic batch, timed several ways, interleaved in every repeat so that machine noise
hits all variants alike:
    off        no telemetry
    every      fullscale.telemetry every step (the trainer's defaults: float32, compiled
               kernels), metrics only
    every+hist the same plus the r histogram (64 bins) of every tensor, every step
    hist/10    metrics every step, histograms every 10th (the trainer's default): the
               amortised cost, median of its steps without histograms + (median of those
               with - median without) / 10
    inductor   as "every" without the native CPU kernel (fullscale/cpu_kernel.py): the
               inductor kernels fed through the copy buffer (what cuda runs, and cpu where
               no C compiler is found)
    eager      as "every" with compile = "off": the same kernels run op by op (what npu, or
               a machine where torch.compile fails, gets)
The order of the variants rotates between repeats, and an untimed step follows each eager
one: a step that follows an eager step runs slower (its temporaries churn the caches and
the allocator), and with a fixed order, "off" always followed "eager": the small preset
measured ratios below 1, and tiny/32 1.051-1.053 with the code that measured 1.060-1.071
rotated. Prints median ms per step and the ratio to "off" (target for "every" and
"hist/10": <= 1.05), for wall-clock time and for this process's CPU time (the robust
number on a shared machine: with one thread, CPU time is what the step costs, whatever
else runs), the "paired" ratio (median over repeats of each variant's CPU time / the "off"
step of the same repeat: steadier when the machine's speed drifts between repeats; hist/10
from those of every and every+hist), and the one-time build seconds (paid at the first
logged step: the native kernel's C compile or inductor's, both cached on disk).

    python bench/bench_telemetry_torch.py [--repeats 30] [--threads 1] [--presets tiny small]
                                          [--batch 16] [--seq-lens 32 64]

The telemetry cost is per parameter (one fused pass over g, m, v, p of each local shard),
independent of the tokens in the step, so the ratio falls as tokens per step grow. Both
sequence lengths are measured by default: 32 is configs/tiny.toml's (and the trainer's
default) 16 x 32 batch, 64 doubles the tokens; try `--presets small --batch 64 --seq-lens 128`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from adamspike.llama import PRESETS, spec_by_name
from adamspike.train_config import OptimSection
from fullscale.model import Transformer
from fullscale.optim import build_optimizer, clip_gradients
from fullscale.telemetry import Telemetry

VARIANTS = ("off", "every", "every+hist", "hist/10", "inductor", "eager")


def make_setup(preset: str, batch: int, seq_len: int):
    cfg = PRESETS[preset]
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OptimSection(lr=1e-3, eps=1e-8))
    specs = spec_by_name(cfg)
    tel = {"off": None,
           "every": Telemetry(opt, specs, every=1, hist_every=0, compile="on"),
           "every+hist": Telemetry(opt, specs, every=1, hist_every=1, compile="on"),
           "hist/10": Telemetry(opt, specs, every=1, hist_every=10, compile="on"),
           "inductor": Telemetry(opt, specs, every=1, hist_every=0, compile="on"),
           "eager": Telemetry(opt, specs, every=1, hist_every=0, compile="off")}
    tel["inductor"]._native = None
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1))
    return model, opt, tel, x


def one_step(model, opt, tel, x, step) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    clip_gradients(model.parameters(), 1.0)
    if tel is not None:
        tel.before_step(step)
    opt.step()
    if tel is not None:
        tel.after_step(step)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32, 64])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch} sequences, "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'preset':8s} {'tensors':>7s} {'clock':>5s} " + " ".join(f"{v + ' ms':>14s}" for v in VARIANTS)
          + "   " + " ".join(f"{'ratio ' + v:>16s}" for v in VARIANTS[1:]))
    for preset, seq_len in [(pr, sl) for pr in args.presets for sl in args.seq_lens]:
        seq_len = min(seq_len, PRESETS[preset].max_seq_len)
        model, opt, tel, x = make_setup(preset, args.batch, seq_len)
        label = f"{preset}/{seq_len}"
        times = {v: ([], []) for v in VARIANTS}
        hist_steps = ([], [])          # hist/10's steps that drew histograms
        paired = {v: [] for v in VARIANTS}   # per repeat: cpu time / that repeat's "off"
        step = 0
        t0 = time.perf_counter()
        for v in ("every", "every+hist", "inductor"):   # build the kernels (shared by variants)
            step += 1
            one_step(model, opt, tel[v], x, step)
        compile_s = time.perf_counter() - t0
        for r in range(args.warmup + args.repeats):
            # the order rotates between repeats: a step runs slower after one that churned
            # the caches and the allocator (eager), which must not always hit one variant
            for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                step += 1
                # hist/10 draws its histograms on every 10th of its own steps (repeat r)
                wall, cpu = one_step(model, opt, tel[v], x, r + 1 if v == "hist/10" else step)
                if v == "eager":   # an untimed step lets the caches and allocator settle
                    step += 1
                    one_step(model, opt, None, x, step)
                if r >= args.warmup and v != "hist/10":
                    paired[v].append(cpu)
                if r >= args.warmup:
                    into = hist_steps if v == "hist/10" and (r + 1) % 10 == 0 else times[v]
                    into[0].append(wall)
                    into[1].append(cpu)
            print(f"\r{label}: repeat {r + 1}/{args.warmup + args.repeats}", end="", file=sys.stderr)
        print("\r", end="", file=sys.stderr)
        for k, clock in enumerate(("wall", "cpu")):
            med = {v: statistics.median(t[k]) * 1e3 for v, t in times.items()}
            if hist_steps[k]:
                med["hist/10"] += (statistics.median(hist_steps[k]) * 1e3 - med["hist/10"]) / 10
            print(f"{label:8s} {len(tel['every'].names):7d} {clock:>5s} "
                  + " ".join(f"{med[v]:14.2f}" for v in VARIANTS)
                  + "   " + " ".join(f"{med[v] / med['off']:16.3f}" for v in VARIANTS[1:]))
        # the steps of one repeat share the machine's state: the median of their ratios is
        # steadier than the ratio of medians when the machine's speed drifts
        ratio = {v: statistics.median(a / b for a, b in zip(paired[v], paired["off"]))
                 for v in VARIANTS[1:] if v != "hist/10"}
        ratio["hist/10"] = ratio["every"] + (ratio["every+hist"] - ratio["every"]) / 10
        print(f"{label:8s} {'':7s} {'paired':>5s} {'':{15 * len(VARIANTS) - 1}s}   " + " ".join(
            f"{ratio[v]:16.3f}" if v in ratio else f"{'-':>16s}" for v in VARIANTS[1:]))
        print(f"{label:8s} compiling the kernels (first logged steps): {compile_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
