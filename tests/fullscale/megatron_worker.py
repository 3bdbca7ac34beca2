"""One rank of the megatron-core probe test (run as a script by test_megatron_probe.py).

Builds a small GPTModel (local spec, RMSNorm, SwiGLU, GQA, rope, untied embeddings),
megatron DDP and get_megatron_optimizer (bf16 or fp32, distributed optimizer on or off;
data parallel 2, tensor parallel 2 for `-tp2`, pipeline parallel 2 for `-pp2`, trained
through megatron's 1F1B schedule) on a gloo group, trains a few steps and after each step (a) runs the probe
(fullscale.megatron_probe) and (b) assembles the unsharded state (gradient Adam consumed,
exp_avg, exp_avg_sq, main parameter, and the true exp_avg of the previous step) on every
rank from each rank's optimizer pieces, checking that every element is covered exactly
once, and computes the reference sums / histograms with numpy (adamspike.metrics).

TEST HARNESS ONLY: megatron-core assumes CUDA. `cpu_redirect()` makes it run on CPU by
(1) a TorchFunctionMode that maps device="cuda" / cuda:N / int devices to cpu, makes
Tensor.cuda() a no-op and reports Tensor.type() with the `torch.cuda.` prefix megatron's
optimizers check, and (2) stand-ins for torch.cuda.current_device / synchronize /
empty_cache / manual_seed / get_rng_state and megatron's CUDA RNG state helpers. Nothing
of this is in the probe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

warnings.filterwarnings("ignore")


def _cpu(d):
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu")
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


class CudaToCpu(TorchFunctionMode):
    """Test harness: CUDA tensor creation and checks, answered on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            s = func(*args)
            return s if s.startswith("torch.cuda.") else s.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


def cpu_redirect():
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_rng_state = torch.get_rng_state
    import megatron.core.tensor_parallel.random as mrand
    mrand._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrand._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    return CudaToCpu()


def unsharded_state(model, optimizer, names):
    """{name: dict(g, m, v, p, step)} of the whole model, assembled from every rank's
    optimizer pieces (all_gather_object): data-parallel slices put back at their flat
    ranges (each element covered exactly once, replicas equal), then tensor-parallel parts
    of split tensors concatenated along their partition_dim in TP-rank order (copies of
    non-split tensors equal across TP ranks)."""
    from megatron.core import parallel_state as ps

    from fullscale.megatron_probe import _inner, leaf_optimizers

    pieces = []
    tp_rank = ps.get_tensor_model_parallel_rank()
    for leaf in leaf_optimizers(optimizer):
        inner = _inner(leaf)
        if hasattr(leaf, "shard_fp32_from_float16_groups"):
            groups = list(zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups)) + \
                list(zip(leaf.model_fp32_groups, leaf.shard_fp32_groups))
            pairs = []
            for mg, sg in groups:
                for p, main in zip(mg, sg):
                    gbuf_index, dtype, bucket_index = leaf.model_param_gbuf_map[p]
                    r = leaf.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][p]["param"]
                    pairs.append((p, main, r.start, r.end))
        elif hasattr(leaf, "fp32_from_float16_groups"):
            pairs = [(p, main, 0, p.numel()) for mg, sg in zip(leaf.float16_groups,
                                                               leaf.fp32_from_float16_groups)
                     for p, main in zip(mg, sg)]
            pairs += [(p, p, 0, p.numel()) for g in leaf.fp32_from_fp32_groups for p in g]
        else:
            pairs = [(p, p, 0, p.numel()) for g in inner.param_groups for p in g["params"]]
        for p, main, lo, hi in pairs:
            st = inner.state[main]
            split = bool(getattr(p, "tensor_model_parallel", False))
            pieces.append((names[id(p)], tuple(p.shape), split, getattr(p, "partition_dim", 0),
                           lo, hi, main.grad.double().numpy(), st["exp_avg"].double().numpy(),
                           st["exp_avg_sq"].double().numpy(),
                           main.detach().double().numpy().ravel(), int(st["step"])))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tp_rank, pieces))
    local = {}    # (name, tp rank) -> flat arrays of that TP rank's local tensor
    meta = {}
    for tpr, ps_ in gathered:
        for name, shape, split, pdim, lo, hi, g, m, v, p, step in ps_:
            key = (name, tpr)
            if key not in local:
                local[key] = {k: np.full(int(np.prod(shape)), np.nan) for k in "gmvp"}
                meta[name] = (shape, split, pdim, step)
            for k, x in zip("gmvp", (g, m, v, p)):
                prev = local[key][k][lo:hi]
                if not np.all(np.isnan(prev)):   # a data-parallel replica
                    np.testing.assert_array_equal(prev, x.ravel(), err_msg=f"{name}.{k} replicas differ")
                local[key][k][lo:hi] = x.ravel()
    full = {}
    for name, (shape, split, pdim, step) in meta.items():
        tps = sorted(t for (n, t) in local if n == name)
        for t in tps:
            for k in "gmvp":
                assert not np.isnan(local[(name, t)][k]).any(), f"{name}.{k}: elements not covered"
        if split:
            d = {k: np.concatenate([local[(name, t)][k].reshape(shape) for t in tps],
                                   axis=pdim).ravel() for k in "gmvp"}
        else:
            d = local[(name, tps[0])]
            for t in tps[1:]:
                for k in "gmvp":
                    np.testing.assert_array_equal(local[(name, t)][k], d[k],
                                                  err_msg=f"{name}.{k}: TP copies differ")
        full[name] = {**d, "step": step}
    return full


def run_combo(a, bf16: bool, distopt: bool, out: str, tp: int = 1, pp: int = 1) -> None:
    """One optimizer combination: build, train a.steps steps, probe + reference."""
    from adamspike.metrics import histogram, shard_sums, update_direction
    from fullscale.megatron_probe import MegatronProbe, ProbeActions, global_names
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.makedirs(out, exist_ok=True)
    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=64,
                            use_cpu_initialization=True, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if bf16:
        model = model.bfloat16()
    ddp = DDP(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 use_distributed_optimizer=distopt), model)
    # clip_grad 0.5: clipping is active (grad norm ~1.3), so the probe must see the clipped
    # gradient Adam consumed
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16,
                                                 use_distributed_optimizer=distopt,
                                                 clip_grad=0.5, adam_eps=1e-8, adam_beta2=0.95,
                                                 weight_decay=0.1), [ddp])
    probe = MegatronProbe(os.path.join(out, "run"), every=1, hist_every=2, precision="float64",
                          config={"model": {"preset": "tiny-gpt"}}, flush_every_s=0.0,
                          actions=ProbeActions(("grad_norm",), skip=False, recipe=False))
    names = global_names([ddp])
    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())  # TP ranks: same data
    result = {"leaf": [type(o).__name__ for o in opt.chained_optimizers], "grad_norm": []}
    m_prev, tables, refs, hists = {}, [], [], []
    for step in range(1, a.steps + 1):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        tok = torch.randint(0, 64, (2, 16), generator=gen)
        pos = torch.arange(16)[None].expand(2, 16)
        if pp == 1:
            loss = ddp(tok, pos, None, labels=tok).float().mean()
            loss.backward()
            ddp.finish_grad_sync()
        else:   # megatron's 1F1B schedule (p2p between the stages), one micro batch
            from megatron.core.pipeline_parallel import get_forward_backward_func

            def forward_step(data_iterator, model):
                t = next(data_iterator)
                out_t = model(t, pos, None, labels=t)
                return out_t, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([tok]), model=[ddp],
                num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=False)
            loss = losses[0]["lm loss"] if losses else torch.tensor(float("nan"))
        # the skip rule's grad norm, before the update: the probe's owned main_grad slices,
        # all-reduced (what MegatronProbe.pre_step judges), against Megatron's own
        assert probe._ensure_layout([ddp], opt, step)
        gsq = torch.tensor(probe._local_loss_grad(opt, [], step)[2], dtype=torch.float64)
        dist.all_reduce(gsq)
        result.setdefault("pre_grad_norm", []).append(float(gsq.sqrt()))
        ok, grad_norm, _ = opt.step()
        result["grad_norm"].append(float(grad_norm))
        tab = probe.after_train_step([ddp], opt, step, loss=float(loss), skipped=not ok,
                                     grad_norm=grad_norm, step_time_s=0.0, tokens=step * 64)
        full = unsharded_state([ddp], opt, names)
        order = probe._layout[0]
        assert sorted(full) == list(order), (sorted(full), order)
        ref_rows, ref_h = [], []
        for name in order:
            d = full[name]
            bc1, bc2 = 1 - 0.9 ** d["step"], 1 - 0.95 ** d["step"]
            mp = m_prev.get(name, np.zeros_like(d["m"]))      # the true m_{t-1}
            ref_rows.append(shard_sums(d["g"], d["m"] / bc1, d["v"] / bc2, mp, d["p"], 1e-8))
            ref_h.append(histogram(update_direction(d["m"] / bc1, d["v"] / bc2, 1e-8)))
            m_prev[name] = d["m"].copy()
        tables.append(tab)
        refs.append(np.array(ref_rows))
        hists.append(np.array(ref_h))
    probe.close()
    result.update(names=list(probe._layout[0]), depth=probe._layout[1].tolist(),
                  kind=list(probe._layout[2]))
    if dist.get_rank() == 0:
        np.savez(os.path.join(out, "result.npz"), refs=np.array(refs), hists=np.array(hists),
                 **{f"table{i + 1}": t for i, t in enumerate(tables)})
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(result, fh)
    ps.destroy_model_parallel()


# ----------------------------------------------------------------------------- actions

# the probe's actions and fail-open (test_megatron_probe_actions.py): a Megatron-shaped
# train_step (zero grad buffers, megatron's forward_backward schedule over 2 micro batches
# with finalize_model_grads, optimizer.step(), Megatron's return value) wrapped exactly as
# install() wraps Megatron's; bf16 + distributed optimizer, data parallel 2
SPIKE_SCALE = 30.0
PREDICTION_RULES = [
    {"id": "sat", "metric": "sat_frac", "depths": [-1, 0], "op": ">", "threshold": 0.5,
     "consecutive": 1},
    {"id": "rms_t_2", "metric": "rms_t", "op": ">", "threshold": 0.0, "consecutive": 2},
    {"id": "dead", "metric": "grad_rms", "op": ">", "threshold": 0.0, "consecutive": 1,
     "informative": False, "informative_reason": "lift <= 1"}]


def _scenario_cfg(name):
    """(probe on, injected loss-spike steps, harness skip steps, probe kwargs, inject)."""
    return {
        "off": (False, (), (), {}),
        "off_spike_skipped": (False, (10,), (10,), {}),      # what skip-step should equal
        "on": (True, (), (), {}),
        "skip": (True, (10,), (), {}),
        "budget": (True, (8, 10, 12), (), {"skip_budget": 2}),
        "error_rank0": (True, (), (), {"inject": ("pre_step", 0, 4, "probe")}),
        "disk_full": (True, (), (), {"inject": ("writer", 1, 3, "disk")}),
        "error_layout_rank1": (True, (), (), {"inject": ("layout", 1, 1, "probe")}),
        "hang_rank0": (True, (), (), {"inject": ("collective", 0, 3, "hang"), "timeout_s": 2.0}),
        # pipeline parallel 2: the loss exists on the last stage only, rank 0 skips by the
        # all-reduced decision
        "off_spike_skipped_pp2": (False, (10,), (10,), {}),
        "skip_pp2": (True, (10,), (), {}),
    }[name]


def run_scenario(a, name: str, out: str) -> None:
    import errno
    import time

    from fullscale.megatron_probe import MegatronProbe, ProbeActions, ProbeError, make_train_step_wrapper
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    probe_on, spikes, harness_skips, kw = _scenario_cfg(name)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    pp = 2 if name.endswith("_pp2") else 1
    ps.initialize_model_parallel(1, pp)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(pipeline_model_parallel_size=pp, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, use_cpu_initialization=True, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                            pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage()).bfloat16()
    ddp = DDP(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 use_distributed_optimizer=True), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                 use_distributed_optimizer=True, clip_grad=1.0,
                                                 adam_eps=1e-8, adam_beta2=0.95), [ddp])
    it = {"n": 0}
    pos = torch.arange(16)[None].expand(2, 16)

    def forward_step(data_iterator, model):
        tok = next(data_iterator)
        out_t = model(tok, pos, None, labels=tok)

        def loss_func(o):
            loss = o.float().mean()
            if it["n"] in spikes:           # an injected loss spike (the batch is "bad")
                loss = loss * SPIKE_SCALE
            n = torch.tensor(float(o.numel()))
            # core_v0.12's reporting form: (sum, num_tokens)
            return loss, {"lm loss": torch.stack([loss.detach() * n, n])}
        return out_t, loss_func

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
        """Megatron's train_step contract (megatron/training/training.py)."""
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=2, seq_length=16, micro_batch_size=2, forward_only=False)
        if it["n"] in harness_skips:      # the reference: this update not applied
            ok, gn, nz = False, None, None
        else:
            ok, gn, nz = optimizer.step()
        if not losses:            # not the last pipeline stage: no loss here
            return {"lm loss": torch.tensor(float("nan"))}, 0 if ok else 1, gn, nz
        v = torch.stack([x["lm loss"] for x in losses]).sum(0)
        dist.all_reduce(v, group=ps.get_data_parallel_group())
        return {"lm loss": v[0] / v[1]}, 0 if ok else 1, gn, nz

    probe = None
    step_fn = train_step
    if probe_on:
        inj = kw.pop("inject", None)
        timeout_s = kw.pop("timeout_s", 30.0)

        def inject(point, step):
            if inj and point == inj[0] and dist.get_rank() == inj[1] and step == inj[2]:
                if inj[3] == "probe":
                    raise ProbeError("injected error on one rank")
                if inj[3] == "disk":
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                if inj[3] == "hang":
                    time.sleep(2.5 * timeout_s)   # a hung rank

        preds = None
        if name == "on":     # online alarms: two armed rules and one marked uninformative
            preds = os.path.join(out, f"predictions{dist.get_rank()}.json")
            with open(preds, "w") as fh:
                json.dump({"schema": "adamspike.predictions", "schema_version": 3, "settings": [],
                           "alarm_rules": PREDICTION_RULES}, fh)
        actions = ProbeActions(("loss", "grad_norm"), skip_budget=kw.pop("skip_budget", 10),
                               window=6, predictions=preds)
        probe = MegatronProbe(os.path.join(out, "run"), every=2, hist_every=0, precision="float64",
                              flush_every_s=0.0, actions=actions, inject=inject,
                              timeout_s=timeout_s)
        step_fn = make_train_step_wrapper(lambda: probe)(train_step)
    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    res = {"loss": [], "skipped": [], "grad_norm": []}
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        it["n"] = step
        data = iter([torch.randint(0, 64, (2, 16), generator=gen) for _ in range(2)])
        ld, skipped, gn, _ = step_fn(forward_step, data, [ddp], opt, None, cfg)
        res["loss"].append(float(ld["lm loss"]))
        res["skipped"].append(int(skipped))
        res["grad_norm"].append(None if gn is None else float(gn))
        if probe is not None:     # what the rules judged before the update
            res.setdefault("rule_inputs", []).append(list(probe.last_rule_inputs))
            probe.last_rule_inputs = (None, None)
    res["seconds"] = time.perf_counter() - t0
    if probe is not None:
        probe.close()
        res.update(disabled=probe.disabled, reason=probe.disabled_reason, skips=probe.skips)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(res, fh)
    print(f"=== end {name} rank {dist.get_rank()}", flush=True)
    dist.barrier()
    ps.destroy_model_parallel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--combos", default="fp32,fp32-distopt,bf16,bf16-distopt,fp32-tp2,bf16-distopt-tp2,"
                                            "fp32-pp2,bf16-distopt-pp2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scenarios", default="", help="the actions / fail-open scenarios instead")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    with cpu_redirect():
        for name in filter(None, a.scenarios.split(",")):
            print(f"=== start {name} rank {a.rank}", flush=True)
            run_scenario(a, name, os.path.join(a.out, name))
        for combo in (a.combos.split(",") if not a.scenarios else []):
            run_combo(a, combo.startswith("bf16"), "distopt" in combo,
                      os.path.join(a.out, combo), tp=2 if combo.endswith("tp2") else 1,
                      pp=2 if combo.endswith("pp2") else 1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
