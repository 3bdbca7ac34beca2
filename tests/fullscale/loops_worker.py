"""One rank of test_probe_loops.py: the upstream training loops (tests/fullscale/upstream_loops.py,
vendored excerpts of MindSpeed-LLM's and Megatron-LM's train()) around Megatron's train_step
with megatron-core's real rerun state machine, a small GPTModel, megatron DDP and the
distributed optimizer (fp32, data parallel 2) on gloo, with and without the probe's
train_step wrapper (fullscale.probe.wrapper.make_train_step_wrapper, as install() applies it).

Each scenario writes RANK.json: the data batches the model trained on (each micro batch has an
id), the optimizer's Adam step count, the lr-schedule steps, the loop's final iteration and
consumed samples, the checkpoints the loop's save function was asked for, and the exit code
when the job stopped (SystemExit). CPU harness: megatron_worker.cpu_redirect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TRAIN_ITERS, MICRO = 6, 2       # iterations; micro batches per iteration (per rank)

# name: (loop, train_step values, the loop's --iterations-to-skip, probe wrapper on,
#        ADAMSPIKE_PROBE_SKIP_ITERATIONS for the wrapper, rerun mode, NaN at logged iteration)
SCENARIOS = {
    "ms_bare_skip": ("train_mindspeed_llm", 7, [2, 3], False, "", "disabled", None),
    "ms_probe_skip": ("train_mindspeed_llm", 7, [2, 3], True, "3-4", "disabled", None),
    "m012_flag_and_probe": ("train_megatron_0_12", 7, [2, 3], True, "3-4", "disabled", None),
    "m012_probe_only": ("train_megatron_0_12", 7, [], True, "3-4", "disabled", None),
    "m017_flag": ("train_megatron_0_17", 8, [3, 4], False, "", "disabled", None),
    "m017_flag_and_probe": ("train_megatron_0_17", 8, [3, 4], True, "3-4", "disabled", None),
    "ml2024_probe_skip": ("train_modellink_2024", 4, [], True, "3-4", "disabled", None),
    "m016_flag_and_probe": ("train_megatron_0_16", 8, [2, 3], True, "3-4", "disabled", None),
    "ms_rerun_bare": ("train_mindspeed_llm", 7, [], False, "", "validate_results", 4),
    "ms_rerun_probe": ("train_mindspeed_llm", 7, [], True, "", "validate_results", 4),
    "m012_rerun_probe": ("train_megatron_0_12", 7, [], True, "", "validate_results", 4),
}


def run(name: str, out: str) -> dict:
    import upstream_loops as L
    from fullscale.probe.core import MegatronProbe
    from fullscale.probe.settings import parse_iterations
    from fullscale.probe.wrapper import make_train_step_wrapper
    from megatron.core import parallel_state as ps
    from megatron.core import rerun_state_machine as rsm
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           get_num_microbatches,
                                                           init_num_microbatches_calculator)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    loop_name, returns, flag, wrap, probe_list, mode, nan_at = SCENARIOS[name]
    torch.manual_seed(0)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    init_num_microbatches_calculator(dist.get_rank(), None, L.MBS * MICRO * 2, L.MBS, 2)
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode(mode))
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            add_bias_linear=False)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=L.SEQ,
                     position_embedding_type="rope")
    ddp = DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                 clip_grad=1.0), [ddp])
    sched = types.SimpleNamespace(steps=0)
    sched.step = lambda increment: setattr(sched, "steps", sched.steps + 1)
    args = types.SimpleNamespace(iteration=0, train_iters=TRAIN_ITERS, curr_iteration=None,
                                 micro_batch_size=L.MBS, data_parallel_size=2,
                                 global_batch_size=L.MBS * MICRO * 2, consumed_train_samples=0,
                                 skipped_train_samples=0, num_floating_point_operations_so_far=0,
                                 iterations_to_skip=list(flag), save="ckpt", save_interval=0)
    saves, trained = [], []

    def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                 num_floating_point_operations_so_far, checkpointing_context=None,
                                 **kw):
        saves.append(int(iteration))

    L.args, L.mpu, L.get_num_microbatches = args, ps, get_num_microbatches
    L.get_forward_backward_func, L.get_rerun_state_machine = get_forward_backward_func, rsm.get_rerun_state_machine
    L.save_checkpoint_and_time = save_checkpoint_and_time
    step_fn = L.train_step_modellink_2024 if returns == 4 else L.make_train_step(returns)
    if wrap:
        probe = MegatronProbe(os.path.join(out, "run"), every=2, hist_every=0, precision="float64",
                              flush_every_s=0.0, secant=False)
        step_fn = make_train_step_wrapper(lambda: probe, parse_iterations(probe_list))(step_fn)
    L.train_step = step_fn
    pos = torch.arange(L.SEQ)[None].expand(L.MBS, L.SEQ)
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    batches = [(i, torch.randint(0, 32, (L.MBS, L.SEQ), generator=gen))
               for i in range(TRAIN_ITERS * MICRO)]
    data = rsm.RerunDataIterator(iter(batches))

    def forward_step(data_iterator, model):
        idx, tok = next(data_iterator)
        logged = args.curr_iteration + 1
        if rsm.get_rerun_state_machine().state == rsm.RerunState.INITIAL_RUN or mode == "disabled":
            trained.append((logged, idx))
        out_t = model(tok, pos, None, labels=tok)

        def loss_func(o):
            loss = o.float().mean()
            if nan_at == logged:        # a NaN forward result, reproducible on a re-run
                loss = loss * float("nan")
            # Megatron's --check-for-nan-in-loss-and-grad (pretrain_gpt.py, core_v0.12.1 l. 186)
            rsm.get_rerun_state_machine().validate_result(
                result=loss, rejection_func=torch.isnan,
                message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
            return loss, {"lm loss": loss.detach()}
        return out_t, loss_func

    code = error = None
    try:
        ret = getattr(L, loop_name)(forward_step, [ddp], opt, sched, data, None, None, cfg)
        iteration = ret[0] if isinstance(ret, tuple) else ret     # ModelLink 2024: iteration only
    except SystemExit as e:
        code, iteration = e.code, args.curr_iteration
    except RuntimeError as e:   # what the rerun machine does when its exit is ignored
        error, iteration = str(e), args.curr_iteration
    adam_steps = sorted({int(s["step"]) for s in opt.optimizer.state.values() if "step" in s})
    res = {"trained": trained, "saves": saves, "exit_code": code, "error": error, "iteration": iteration,
           "consumed": args.consumed_train_samples, "sched_steps": sched.steps,
           "adam_steps": adam_steps}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(res, fh)
    if wrap:
        probe.close()
    dist.barrier()
    destroy_num_microbatches_calculator()
    ps.destroy_model_parallel()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=a.rank, world_size=2)
    from megatron_worker import cpu_redirect
    with cpu_redirect():
        for name in a.scenarios.split(","):
            os.makedirs(os.path.join(a.out, name), exist_ok=True)
            print(f"=== start {name} rank {a.rank}", flush=True)
            run(name, os.path.join(a.out, name))
            print(f"=== end {name} rank {a.rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
