"""Megatron probe overhead: measured on CPU, the cost model at 70B on 128 x 8, and a one-node
smoke test on a real Megatron step for a GPU / NPU.

    python bench/bench_probe_megatron.py [--steps 20] [--sizes 128,384] [--hbm-tbs 1.0]
    python bench/bench_probe_megatron.py --smoke [--device cuda|npu] [--hidden 2048 --layers 8]

--smoke (needs megatron-core; with a GPU or an NPU: `--device npu` imports torch_npu and its
transfer_to_npu, which maps Megatron's CUDA calls to the NPU): one process, a megatron-core
GPTModel (local spec, RMSNorm, SwiGLU, GQA, rope, bf16), Megatron's DDP and distributed
optimizer, a Megatron-shaped train_step through the forward/backward schedule; the same
steps without the probe and with it (install()'s wrapper: telemetry every --every steps,
the loss / grad-norm rules and skip-step on), median step time of --steps steps after 3
warm-up steps each, device-synchronized. Prints both medians, the overhead per step and the
probe's own clock. `--device cpu` runs it on CPU through the test harness's CUDA -> CPU
redirection (tests/fullscale/megatron_worker.py) only to check the script.

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
  - communication: the probe's collectives run on its own gloo group (TCP, with a timeout:
    fail-open), modelled as ring all-reduces: 2 (N - 1) sequential hops of --gloo-hop-us
    each plus 2 x size at --gloo-gbs; per logged step two of the whole model's table (723
    tensors x 11 float64 sums + 3 [+ 64] int64 counts);
  - actions, every step: one pass over the owned gradient slice for the grad norm (4
    B/element read, 3 eager ops per tensor), one host sync for the loss and two all-reduces
    of a few numbers (the rules' inputs, then the skip decision);
  - the step time is fullscale.model_info.megatron_cost's (overlapped) at the same layout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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
from fullscale.megatron_probe import (NUM_HIST_BINS, MegatronProbe, ProbeActions,  # noqa: E402
                                      make_train_step_wrapper)
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


def cost_70b(hbm_tbs: float, dispatch_us: float, gloo_hop_us: float, gloo_gbs: float,
             hist: bool) -> dict:
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
    table = len(specs) * (11 * 8 + (3 + (NUM_HIST_BINS if hist else 0)) * 8)

    def ring(nbytes):       # one gloo ring all-reduce over the world
        return 2 * (world - 1) * gloo_hop_us * 1e-6 + 2 * nbytes / (gloo_gbs * 1e9)

    comm_s = 2 * ring(table)
    actions_s = (elems * 4 / (hbm_tbs * 1e12) + tensors_rank * 3 * dispatch_us * 1e-6
                 + 2 * ring(32))
    step = megatron_cost(cfg, world_size=world, seq_len=4096, micro_batch=1, global_batch=1024,
                         sharding="megatron:tp8pp8")["step_s_overlapped"]
    total = compute_s + dispatch_s + comm_s
    return {"elements_per_rank": elems, "tensors_per_rank": tensors_rank, "table_bytes": table,
            "compute_ms": 1e3 * compute_s, "dispatch_ms": 1e3 * dispatch_s, "comm_ms": 1e3 * comm_s,
            "probe_ms": 1e3 * total, "actions_ms": 1e3 * actions_s, "step_s": step,
            "overhead_pct": 100 * total / step, "actions_pct": 100 * actions_s / step}


def smoke(a) -> dict:
    """Probe on vs off on one device, a real megatron-core step (module doc, --smoke)."""
    import torch.distributed as dist   # noqa: E402  (only --smoke uses a process group)

    redirect = contextlib.nullcontext()
    if a.device == "npu":
        import torch_npu  # noqa: F401  (the NPU backend)
        from torch_npu.contrib import transfer_to_npu  # noqa: F401  (cuda -> npu)
    elif a.device == "cpu":
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, os.path.join(here, "tests", "fullscale"))
        from megatron_worker import cpu_redirect   # test harness: CUDA calls answered on CPU
        redirect = cpu_redirect()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[a.device]
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(minutes=5))
    dev = "cpu" if a.device == "cpu" else "cuda"      # npu: transfer_to_npu maps cuda
    sync = (lambda: None) if a.device == "cpu" else torch.cuda.synchronize
    results = {}
    with redirect:
        ps.initialize_model_parallel(1, 1)
        for mode in ("off", "on"):
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(1234)
            cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden,
                                    num_attention_heads=a.heads, num_query_groups=max(1, a.heads // 8),
                                    ffn_hidden_size=a.ffn or int(a.hidden * 8 / 3) // 64 * 64,
                                    normalization="RMSNorm", gated_linear_unit=True,
                                    activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                    bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                                    hidden_dropout=0.0, attention_dropout=0.0,
                                    use_cpu_initialization=a.device == "cpu")
            model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
                             vocab_size=a.vocab, max_sequence_length=a.seq,
                             position_embedding_type="rope",
                             share_embeddings_and_output_weights=False).bfloat16()
            if a.device != "cpu":
                model = model.cuda()
            ddp = DDP(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                         use_distributed_optimizer=True), model)
            cfg.finalize_model_grads_func = finalize_model_grads
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                         use_distributed_optimizer=True, clip_grad=1.0,
                                                         adam_eps=1e-8, adam_beta2=0.95), [ddp])
            pos = torch.arange(a.seq, device=dev)[None].expand(a.micro_batch, a.seq)

            def forward_step(data_iterator, model):
                tok = next(data_iterator)
                out = model(tok, pos, None, labels=tok)

                def loss_func(o):
                    loss = o.float().mean()
                    n = torch.tensor(float(o.numel()), device=loss.device)
                    return loss, {"lm loss": torch.stack([loss.detach() * n, n])}
                return out, loss_func

            def train_step(forward_step_func, data_iterator, model, optimizer, sched, config):
                for m in model:
                    m.zero_grad_buffer()
                optimizer.zero_grad()
                losses = get_forward_backward_func()(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=a.microbatches, seq_length=a.seq, micro_batch_size=a.micro_batch,
                    forward_only=False)
                ok, gn, nz = optimizer.step()
                return {"lm loss": torch.stack([x["lm loss"] for x in losses]).sum(0)}, 0 if ok else 1, gn, nz

            step_fn, probe = train_step, None
            tmp = tempfile.mkdtemp(prefix="probe_smoke_")
            if mode == "on":
                probe = MegatronProbe(os.path.join(tmp, "run"), every=a.every, hist_every=0,
                                      precision="float32", flush_every_s=60.0,
                                      actions=ProbeActions(("loss", "grad_norm")))
                step_fn = make_train_step_wrapper(lambda: probe)(train_step)
            gen = torch.Generator().manual_seed(1)
            times = []
            for k in range(a.steps + 3):
                data = iter([torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=gen).to(dev)
                             for _ in range(a.microbatches)])
                sync()
                t0 = time.perf_counter()
                step_fn(forward_step, data, [ddp], opt, None, cfg)
                sync()
                times.append(time.perf_counter() - t0)
            results[mode] = statistics.median(times[3:])
            if probe is not None:
                probe.close()
                results["probe_clock_s"] = probe.overhead_s / (a.steps + 3)
                results["disabled"] = probe.disabled_reason
            results["params"] = sum(p.numel() for p in model.parameters())
            del ddp, opt, model
        ps.destroy_model_parallel()
    dist.destroy_process_group()
    results["overhead_pct"] = 100 * (results["on"] - results["off"]) / results["off"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="probe on vs off on one device (module doc)")
    ap.add_argument("--device", choices=("cuda", "npu", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=0, help="default: 8/3 hidden, multiple of 64")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--every", type=int, default=1, help="--smoke: telemetry every K steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sizes", default="128,384", help="hidden sizes of the CPU toy (4 blocks)")
    ap.add_argument("--precision", choices=("float32", "float64"), default="float32",
                    help="the probe's elementwise dtype (install() default: float32)")
    ap.add_argument("--hbm-tbs", type=float, default=1.0, help="effective HBM TB/s (910B)")
    ap.add_argument("--dispatch-us", type=float, default=20.0, help="eager op dispatch, us")
    ap.add_argument("--gloo-hop-us", type=float, default=30.0,
                    help="one hop of a gloo ring all-reduce (TCP between nodes), us")
    ap.add_argument("--gloo-gbs", type=float, default=1.0, help="gloo (TCP) bandwidth, GB/s")
    a = ap.parse_args()
    if a.smoke:
        r = smoke(a)
        print(f"one {a.device}: {r['params']:,} parameters, {a.microbatches} x "
              f"{a.micro_batch} x {a.seq} tokens per step, median of {a.steps} steps")
        print(f"  probe off {1e3 * r['off']:.1f} ms/step, on (telemetry every {a.every}, rules + "
              f"skip-step) {1e3 * r['on']:.1f} ms/step: overhead {r['overhead_pct']:+.1f} % "
              f"(the probe's own clock {1e3 * r['probe_clock_s']:.1f} ms/step)"
              + (f"; PROBE DISABLED: {r['disabled']}" if r.get("disabled") else ""))
        return
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
          f"{a.dispatch_us} us, the probe's gloo ring all-reduces at {a.gloo_hop_us} us/hop and "
          f"{a.gloo_gbs} GB/s, step time from fullscale.model_info.megatron_cost "
          f"(MFU {DEFAULTS.mfu}, {DEFAULTS.peak_flops / 1e12:.0f} TF/card)")
    for hist in (False, True):
        c = cost_70b(a.hbm_tbs, a.dispatch_us, a.gloo_hop_us, a.gloo_gbs, hist)
        print(f"  telemetry, hist {'every step' if hist else 'off':>10}: {c['elements_per_rank'] / 1e6:.1f} M "
              f"elements and {c['tensors_per_rank']} tensors per rank; compute {c['compute_ms']:.1f} ms"
              f" + dispatch {c['dispatch_ms']:.1f} ms + all-reduces {c['comm_ms']:.1f} ms "
              f"= {c['probe_ms']:.1f} ms per logged step vs step {c['step_s']:.1f} s: "
              f"{c['overhead_pct']:.2f} %")
    print(f"  actions (rules + skip-step), every step: {c['actions_ms']:.1f} ms: "
          f"{c['actions_pct']:.2f} % of a step")


if __name__ == "__main__":
    main()
