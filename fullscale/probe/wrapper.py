"""The train_step wrapper (loss capture, pre-update skip, telemetry after the step) and install()."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import os
import sys
import time
from typing import Any, Optional, Tuple

import torch

from fullscale.probe.actions import ProbeActions
from fullscale.probe.core import MegatronProbe
from fullscale.probe.loop import find_loop
from fullscale.probe.settings import ENV_PREFIX, ProbeError, _env_flag, _env_int, env_skip_iterations
from fullscale.probe.skipping import consume_batch, honour_exit, num_microbatches, skipped_return


TRAIN_STEP = "megatron.training.training.train_step"

_PROBE: Optional[MegatronProbe] = None


def _megatron_args():
    for name in ("megatron.training", "megatron"):   # Megatron-LM >= 2024.03, then older
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "get_args"):
            try:
                return mod.get_args()
            except Exception:  # noqa: BLE001 - arguments not parsed (not Megatron's loop)
                return None
    return None


def _train_step_module():
    """The module that defines train_step: megatron.training.training (Megatron-LM since
    2024.03, MindSpeed-LLM) or megatron.training (older Megatron-LM, ModelLink of early
    2024)."""
    for name in (TRAIN_STEP.rsplit(".", 1)[0], "megatron.training"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(mod, "train_step", None)):
            return mod
    raise ProbeError("no megatron train_step found (megatron.training.training or "
                     "megatron.training): is Megatron-LM on the python path?")


def _loss_of(ret) -> float:
    """'lm loss' (or the first value) of train_step's loss dict; NaN where it is empty
    (ranks off the last pipeline stage)."""
    d = ret[0] if isinstance(ret, tuple) and ret and isinstance(ret[0], dict) else None
    if not d:
        return math.nan
    v = d.get("lm loss", next(iter(d.values())))
    if isinstance(v, (tuple, list)) and len(v) == 2:    # (sum, num_tokens): core_v0.12
        return float(v[0]) / max(float(v[1]), 1.0)
    if isinstance(v, torch.Tensor):
        v = v.float()
        v = (v[0] / v[1]) if v.numel() == 2 else v.mean()
        return float(v.item())
    return float(v)


def _tokens(args) -> Optional[int]:
    if args is None:
        return None
    try:
        # lazy: Megatron is the training script's, present only under it (older ones lack this)
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size
        gbs = get_current_global_batch_size()
    except Exception:  # noqa: BLE001 - older Megatron
        gbs = getattr(args, "global_batch_size", None)
    seq = getattr(args, "seq_length", None)
    done = getattr(args, "consumed_train_samples", None)
    if gbs is None or seq is None or done is None:
        return None
    return int((done + gbs) * seq)   # train() adds this step's samples after train_step


def _loss_pair(ret) -> Optional[Tuple[Any, Any]]:
    """(sum, count) of one loss-function return's 'lm loss' (or first) value, as device
    tensors or numbers: Megatron's loss functions return (loss, {'lm loss': v}) or
    (loss, num_tokens, {'lm loss': v}) with v a scalar (older: averaged over data parallel),
    a (sum, num_tokens) pair or a 2-element tensor (core_v0.12 and newer)."""
    d = ret[-1] if isinstance(ret, tuple) and ret and isinstance(ret[-1], dict) else None
    if not d:
        return None
    v = d.get("lm loss", next(iter(d.values())))
    if isinstance(v, (tuple, list)) and len(v) == 2:
        return (v[0].detach() if isinstance(v[0], torch.Tensor) else v[0],
                v[1].detach() if isinstance(v[1], torch.Tensor) else v[1])
    if isinstance(v, torch.Tensor):
        v = v.detach().float()
        if v.numel() == 2:
            return v[0], v[1]
        return v.mean(), 1.0
    return float(v), 1.0


def _record_losses(forward_step_func, sink: list):
    """forward_step_func whose loss function also appends its (sum, count) to `sink`
    (no host sync: the values stay on the device until the optimizer step)."""

    @functools.wraps(forward_step_func)
    def forward_step(*a, **k):
        out = forward_step_func(*a, **k)
        if not (isinstance(out, tuple) and len(out) >= 2 and callable(out[1])):
            return out
        loss_func = out[1]

        def recording_loss_func(*x, **y):
            r = loss_func(*x, **y)
            try:
                pair = _loss_pair(r)
                if pair is not None:
                    sink.append(pair)
            except Exception:  # noqa: BLE001 - never in Megatron's way; no loss recorded
                pass
            return r

        return (out[0], recording_loss_func) + tuple(out[2:])

    return forward_step


def make_train_step_wrapper(probe_factory, skip_iterations=frozenset()):
    """A wrapper for train_step (name ends in `_wrapper`, as MindSpeed's patch manager
    requires for stacking): calls it, then the probe with its model and optimizer.

    With the probe's rules on, train_step's forward_step_func records the loss values and
    optimizer.step is replaced for the call: before the update the probe judges the loss
    and grad norm (MegatronProbe.pre_step, collective) and, to skip, returns Megatron's
    "update not successful" (False, None, None) without stepping: Megatron's train_step
    then counts a skipped iteration and leaves the lr schedule, as at a loss-scale
    overflow. Fail-open: an error inside the probe never reaches Megatron (the probe
    disables itself on every rank and train_step runs unwrapped).

    For the stack, whether or not the probe runs (fullscale.probe.skipping): the logged
    iterations in `skip_iterations` are skipped (batch drawn, no update) where the loop
    does not skip them itself, and the rerun state machine's checkpoint-and-exit is carried
    out where the loop ignores it."""

    def train_step_wrapper(fn):
        state = {"step": None, "grad_norm": None, "ok": True}

        def wrapped(*args, **kwargs):
            loop = find_loop(1)          # the loop that called us (MindSpeed-LLM's, Megatron's)
            if loop is None and skip_iterations and not state.get("no_loop"):
                state["no_loop"] = True
                print("adamspike probe: the training loop's source cannot be read (no .py?): "
                      f"{ENV_PREFIX}SKIP_ITERATIONS still applies (train_step's return shape "
                      "from megatron's version); the rerun's checkpoint-and-exit is left to the "
                      "loop", flush=True)
            margs = _megatron_args()
            it = loop.frame.f_locals.get("iteration") if loop is not None else None
            if margs is not None and getattr(margs, "curr_iteration", None) is not None:
                step = int(margs.curr_iteration) + 1
            elif isinstance(it, int):     # the loop's own count of completed iterations
                step = it + 1
            elif kwargs.get("iteration") is not None:
                step = int(kwargs["iteration"]) + 1
            else:
                step = (state["step"] or 0) + 1
            state["step"] = step
            try:
                if step in skip_iterations:
                    return _skip_listed(args, kwargs, step, margs, loop)
                ret = probed(step, margs, loop, *args, **kwargs)
                honour_exit(ret, loop, _arg(args, kwargs, "model", 2),
                            _arg(args, kwargs, "optimizer", 3),
                            _arg(args, kwargs, "opt_param_scheduler", 4))
                return ret
            finally:
                if loop is not None:
                    loop.frame = None    # no reference to the loop's frame kept

        def _probe():
            try:
                return probe_factory()
            except Exception as e:  # noqa: BLE001 - fail open: the probe cannot start
                if not state.get("said"):
                    state["said"] = True
                    print(f"adamspike probe: not started ({type(e).__name__}: {e}); "
                          "training continues without it", flush=True)
                return None

        def _skip_listed(args, kwargs, step, margs, loop):
            t0 = time.perf_counter()
            drawn = consume_batch(_arg(args, kwargs, "data_iterator", 1), num_microbatches(margs))
            ret = skipped_return(loop)
            probe = _probe()
            if probe is not None and not probe.disabled:
                model = _arg(args, kwargs, "model", 2)
                probe._skip_reason = (f"probe: logged iteration {step} is in {ENV_PREFIX}"
                                      f"SKIP_ITERATIONS ({drawn} micro batches drawn, no update)")
                try:
                    probe.after_train_step(model if isinstance(model, (list, tuple)) else [model],
                                           _arg(args, kwargs, "optimizer", 3), step, skipped=True,
                                           step_time_s=time.perf_counter() - t0,
                                           tokens=_tokens(margs), margs=margs)
                except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                    probe._fail(e, step)
            return ret

        def probed(step, margs, loop, *args, **kwargs):
            probe = _probe()
            if probe is None or probe.disabled:
                return fn(*args, **kwargs)
            if loop is not None and probe.loop is None:
                probe.loop = loop
                if probe.rank == probe.writer_rank:
                    probe._say(loop.describe())
            model = kwargs.get("model", args[2] if len(args) > 2 else None)
            optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
            opt_step = getattr(optimizer, "step", None)
            chunks = model if isinstance(model, (list, tuple)) else [model]
            losses: list = []
            rules = probe.rules_on
            if rules:
                if "forward_step_func" in kwargs:
                    kwargs["forward_step_func"] = _record_losses(kwargs["forward_step_func"], losses)
                elif args and callable(args[0]):
                    args = (_record_losses(args[0], losses),) + tuple(args[1:])

            def step_capture(*a, **k):   # Megatron's step returns (ok, grad_norm, num_zeros)
                try:
                    skip = rules and probe.pre_step(chunks, optimizer, losses, step)
                except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                    probe._fail(e, step)
                    skip = False
                if skip:
                    state["ok"], state["grad_norm"] = False, None
                    return False, None, None
                try:   # the secant's first copy of the parameters (p_t), every rank
                    probe.before_update(chunks, optimizer, step)
                except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                    probe._fail(e, step)
                out = opt_step(*a, **k)
                state["grad_norm"] = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                state["ok"] = out[0] if isinstance(out, tuple) and out else True
                return out

            state["ok"], state["grad_norm"] = True, None
            own = "step" in getattr(optimizer, "__dict__", {})   # someone's instance patch
            if opt_step is not None:
                try:
                    optimizer.step = step_capture
                except Exception as e:  # noqa: BLE001 - cannot patch: no capture, no skip
                    probe._fail(e, step)
                    opt_step = None
            t0 = time.perf_counter()
            try:
                ret = fn(*args, **kwargs)
            finally:
                if opt_step is not None:
                    if own:
                        optimizer.step = opt_step
                    else:
                        del optimizer.step   # back to the class method
            dt = time.perf_counter() - t0
            try:
                skipped = not bool(state["ok"])
                if isinstance(ret, tuple) and len(ret) > 1 and isinstance(ret[1], int):
                    skipped = skipped or ret[1] > 0
                gn = state["grad_norm"]
                if gn is None and isinstance(ret, tuple) and len(ret) == 4 and \
                        isinstance(ret[2], (int, float)) and not isinstance(ret[2], bool):
                    gn = ret[2]   # (loss dict, skipped, grad_norm, num_zeros): Megatron < 2024.06
                gn = math.nan if gn is None else float(gn)
                loss, tokens = _loss_of(ret), _tokens(margs)
                extra = {"megatron_args": _args_summary(margs)} if margs is not None else None
            except Exception as e:  # noqa: BLE001 - fail open
                probe._fail(e, step)
                skipped, gn, loss, tokens, extra = False, math.nan, math.nan, None, None
            try:
                probe.after_train_step(chunks, optimizer, step, loss=loss, skipped=skipped,
                                       grad_norm=gn, step_time_s=dt, tokens=tokens,
                                       env_extra=extra, margs=margs)
            except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                probe._fail(e, step)
            return ret

        wrapped.__wrapped__ = fn
        return wrapped

    return train_step_wrapper


def _arg(args, kwargs, name: str, pos: int):
    """train_step's argument by name or position (forward_step_func, data_iterator, model,
    optimizer, opt_param_scheduler, config: the order since 2023)."""
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


def _args_summary(args) -> dict:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
            "hidden_size", "seq_length", "global_batch_size", "micro_batch_size",
            "use_distributed_optimizer", "bf16", "fp16", "clip_grad", "adam_beta1",
            "adam_beta2", "adam_eps", "lr", "train_iters")
    return {k: getattr(args, k) for k in keys if isinstance(getattr(args, k, None),
                                                               (int, float, bool, str))}


def install(out: Optional[str] = None, *, every: Optional[int] = None,
            hist_every: Optional[int] = None, precision: str = "float32",
            actions: Optional[ProbeActions] = None, secant: Optional[bool] = None,
            skip_iterations: Optional[frozenset] = None) -> None:
    """Wrap `megatron.training.training.train_step` with the probe.

    Under MindSpeed (mindspeed.patch_utils importable): registered with
    MindSpeedPatchesManager as a wrapper and applied (call it after MindSpeed-LLM's
    `megatron_adaptor` import, whose FeatureAdaptor.execute removes earlier patches).
    Otherwise: setattr on megatron.training.training, and every loaded module that
    imported the original `train_step` by name is pointed at the wrapper too.

    `actions` default: ProbeActions.from_env() (rules, skip-step, recipe, alarms);
    `secant` default: ADAMSPIKE_PROBE_SECANT (1: the online curvature proxy on).
    `skip_iterations` default: ADAMSPIKE_PROBE_SKIP_ITERATIONS (logged iterations whose
    batches are drawn without an update where the loop has no --iterations-to-skip).
    A bad setting raises ProbeError here, before training (the launcher then runs the
    script without the probe); from the first train_step on the probe fails open."""
    skip_iterations = env_skip_iterations() if skip_iterations is None else frozenset(skip_iterations)
    out = out or os.environ.get(ENV_PREFIX + "OUT")
    if not out:
        raise ProbeError(f"no run directory: pass install(out=...) or set {ENV_PREFIX}OUT")
    every = _env_int("EVERY", 10) if every is None else int(every)
    hist_every = _env_int("HIST_EVERY", 100) if hist_every is None else int(hist_every)
    secant = _env_flag("SECANT", True) if secant is None else bool(secant)
    flush = float(os.environ.get(ENV_PREFIX + "FLUSH_S", "60"))
    timeout = float(os.environ.get(ENV_PREFIX + "TIMEOUT_S", "120"))
    if every < 1 or hist_every < 0:
        raise ProbeError(f"every must be >= 1 and hist_every >= 0, got {every}, {hist_every}")
    actions = ProbeActions.from_env() if actions is None else actions

    def factory():
        global _PROBE
        if _PROBE is None:
            _PROBE = MegatronProbe(out, every=every, hist_every=hist_every, precision=precision,
                                   flush_every_s=flush, actions=actions, timeout_s=timeout,
                                   secant=secant)
            atexit.register(_PROBE.close)
            if _PROBE.rank == _PROBE.writer_rank:
                _PROBE._say(f"on, run directory {out}: telemetry every {every} steps, "
                            f"curvature proxy {'on' if secant else 'off'}; "
                            f"{actions.describe()} (docs/mindspeed_probe.md)")
        return _PROBE

    wrapper = make_train_step_wrapper(factory, skip_iterations)
    try:
        # lazy: optional, only MindSpeed-LLM stacks have it
        from mindspeed.patch_utils import MindSpeedPatchesManager
    except ImportError:
        MindSpeedPatchesManager = None
    if MindSpeedPatchesManager is not None and _train_step_module().__name__ == TRAIN_STEP.rsplit(".", 1)[0]:
        MindSpeedPatchesManager.register_patch(TRAIN_STEP, wrapper)
        MindSpeedPatchesManager.apply_patches()
        return
    mod = _train_step_module()
    orig = mod.train_step
    new = wrapper(orig)
    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "train_step", None) is orig:
            try:
                setattr(m, "train_step", new)
            except (AttributeError, TypeError):
                pass
    mod.train_step = new
