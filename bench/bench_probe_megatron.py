"""Megatron probe overhead: measured on CPU, and the cost model at 70B on 128 x 8.

    python bench/bench_probe_megatron.py [--steps 20] [--sizes 128,384] [--hbm-tbs 1.0]

Part 1 (measured): a Megatron-shaped model (tests/compat/probe_adamw.py's Toy: embedding,
blocks with fused qkv / fc1, final norm, output) trained with torch.optim.AdamW through the
train_step wrapper, probe every step (every = 1), histograms every step or never. Reported:
the step time without the probe, the probe's time per logged step (MegatronProbe.overhead_s,
its own clock) and their ratio, median of `--steps` steps after 3 warm-up steps, one CPU
thread. The probe is memory-bound (~35 eager passes over each tensor): the bytes per element
it moves (the pass model below) over the measured time give the effective bandwidth. Its
cost grows with the parameter count, a step's with parameters x tokens: the toy's 256
tokens per step make the ratio large; 70B's 4M tokens per step make it small (part 2).

Part 2 (model, not a measurement): per-step probe cost of LLaMA2-70B on 1024 910B cards,
TP8 x PP8 x DP16, distributed optimizer, probe every step, with the assumptions printed:
  - elements per rank: the largest pipeline stage's parameters (10 blocks, plus the
    embedding or the output layer) / TP8 / DP16 (the distributed optimizer's shard);
  - passes: shard_sums does ~22 elementwise ops that read <= 2 float32 operands and write
    one (12 B/element) and 13 reductions (4 B/element): ~316 B/element; histograms add
    bucketize, isnan, where, bincount (~45 B/element); at an assumed effective HBM
    bandwidth for eager elementwise kernels (--hbm-tbs, 910B peak ~1.6 TB/s);
  - host dispatch: ~40 eager ops per tensor at --dispatch-us each (torch_npu eager);
  - communication: two all-reduces per logged step of the whole model's table (723
    tensors x 11 float32 sums + 3 [+ 64] int64 counts) over all 1024 ranks, ring volume
    2 x size at the inter-node bandwidth, plus 2 x 2 x log2(1024) x --latency-us;
  - the step time is fullscale.model_info.megatron_cost's (overlapped) at the same layout.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from adamspike.llama import PRESETS, param_specs  # noqa: E402
from fullscale.megatron_probe import NUM_HIST_BINS, MegatronProbe, make_train_step_wrapper  # noqa: E402
from fullscale.model_info import DEFAULTS, megatron_cost  # noqa: E402

BYTES_PER_ELEMENT = 22 * 12 + 13 * 4     # shard_sums, float32 operands
HIST_BYTES_PER_ELEMENT = 45
OPS_PER_TENSOR = 40


def _demo():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("probe_adamw", os.path.join(here, "tests", "compat", "probe_adamw.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(d: int, layers: int, steps: int, hist: bool, out: str, precision: str) -> dict:
    demo = _demo()
    torch.manual_seed(0)
    model = demo.Toy(vocab=4 * d, d=d, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 4 * d, (4, 65), generator=gen) for _ in range(steps + 3)]
    cfg = {"clip": 1.0, "iteration": 0, "skip": None}
    # without the probe
    it = iter(data)
    base = []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        demo.train_step(None, it, [model], opt, None, cfg)
        base.append(time.perf_counter() - t0)
    probe = MegatronProbe(out, every=1, hist_every=1 if hist else 0, precision=precision,
                          plain=True, flush_every_s=1e9)
    wrapped = make_train_step_wrapper(lambda: probe)(demo.train_step)
    it = iter(data)
    over = []
    for k in range(steps + 3):
        before = probe.overhead_s
        wrapped(None, it, [model], opt, None, cfg)
        over.append(probe.overhead_s - before)
    step_s, probe_s = statistics.median(base[3:]), statistics.median(over[3:])
    moved = numel * (BYTES_PER_ELEMENT + (HIST_BYTES_PER_ELEMENT if hist else 0)) * (
        2 if precision == "float64" else 1)
    return {"numel": numel, "tensors": len(list(model.parameters())), "step_ms": 1e3 * step_s,
            "probe_ms": 1e3 * probe_s, "ratio": (step_s + probe_s) / step_s,
            "gbs": moved / probe_s / 1e9}


def cost_70b(hbm_tbs: float, dispatch_us: float, latency_us: float, hist: bool) -> dict:
    cfg = PRESETS["llama2-70b"]
    tp, pp, dp, world = 8, 8, 16, 1024
    specs = param_specs(cfg)
    per_block = sum(math.prod(s.shape) for s in specs if s.depth == 0)
    embed = cfg.vocab_size * cfg.dim
    blocks = cfg.num_layers // pp
    elems = (blocks * per_block + embed) / tp / dp
    tensors_rank = blocks * sum(1 for s in specs if s.depth == 0) + 2
    compute_s = elems * (BYTES_PER_ELEMENT + (HIST_BYTES_PER_ELEMENT if hist else 0)) / (hbm_tbs * 1e12)
    dispatch_s = tensors_rank * (OPS_PER_TENSOR + (4 if hist else 0)) * dispatch_us * 1e-6
    table = len(specs) * (11 * 4 + (3 + (NUM_HIST_BINS if hist else 0)) * 8)
    comm_s = 2 * table / (DEFAULTS.inter_node_gbs * 1e9) + 2 * 2 * math.log2(world) * latency_us * 1e-6
    step = megatron_cost(cfg, world_size=world, seq_len=4096, micro_batch=1, global_batch=1024,
                         sharding="megatron:tp8pp8")["step_s_overlapped"]
    total = compute_s + dispatch_s + comm_s
    return {"elements_per_rank": elems, "tensors_per_rank": tensors_rank, "table_bytes": table,
            "compute_ms": 1e3 * compute_s, "dispatch_ms": 1e3 * dispatch_s, "comm_ms": 1e3 * comm_s,
            "probe_ms": 1e3 * total, "step_s": step, "overhead_pct": 100 * total / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sizes", default="128,384", help="hidden sizes of the CPU toy (4 blocks)")
    ap.add_argument("--precision", choices=("float32", "float64"), default="float32",
                    help="the probe's elementwise dtype (install() default: float32)")
    ap.add_argument("--hbm-tbs", type=float, default=1.0, help="effective HBM TB/s (910B)")
    ap.add_argument("--dispatch-us", type=float, default=20.0, help="eager op dispatch, us")
    ap.add_argument("--latency-us", type=float, default=20.0, help="collective step latency, us")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"Part 1: measured on this CPU (1 thread, {a.precision} probe, every step, 4 x 64 "
          "tokens per step)")
    print(f"{'d':>5} {'params':>9} {'tensors':>7} {'hist':>4} {'step ms':>8} {'probe ms':>8} "
          f"{'ratio':>6} {'GB/s':>5}")
    for d in (int(x) for x in a.sizes.split(",")):
        for hist in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                r = measure(d, 4, a.steps, hist, os.path.join(tmp, "run"), a.precision)
            print(f"{d:>5} {r['numel']:>9} {r['tensors']:>7} {'yes' if hist else 'no':>4} "
                  f"{r['step_ms']:>8.2f} {r['probe_ms']:>8.2f} {r['ratio']:>6.3f} {r['gbs']:>5.1f}")
    print()
    print("Part 2: cost model, LLaMA2-70B, 128 x 8 910B, TP8 PP8 DP16, distributed optimizer, "
          "probe every step")
    print(f"assumptions: effective HBM {a.hbm_tbs} TB/s, {BYTES_PER_ELEMENT} B/element "
          f"(+{HIST_BYTES_PER_ELEMENT} with histograms), {OPS_PER_TENSOR} eager ops/tensor at "
          f"{a.dispatch_us} us, inter-node {DEFAULTS.inter_node_gbs} GB/s, collective latency "
          f"{a.latency_us} us/hop, step time from fullscale.model_info.megatron_cost "
          f"(MFU {DEFAULTS.mfu}, {DEFAULTS.peak_flops / 1e12:.0f} TF/card)")
    for hist in (False, True):
        c = cost_70b(a.hbm_tbs, a.dispatch_us, a.latency_us, hist)
        print(f"  hist {'every step' if hist else 'off':>10}: {c['elements_per_rank'] / 1e6:.1f} M "
              f"elements and {c['tensors_per_rank']} tensors per rank; compute {c['compute_ms']:.1f} ms"
              f" + dispatch {c['dispatch_ms']:.1f} ms + all-reduce {c['comm_ms']:.2f} ms "
              f"= {c['probe_ms']:.1f} ms per logged step vs step {c['step_s']:.1f} s: "
              f"{c['overhead_pct']:.2f} %")


if __name__ == "__main__":
    main()
