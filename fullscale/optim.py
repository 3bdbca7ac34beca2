"""AdamW, its learning-rate schedule, gradient clipping and StableAdamW update clipping for
the torch trainer, with the same semantics as simulate/optim.py (the JAX chain):

    1. clip (torch.nn.utils.clip_grad_norm_):  n = ||g||_2 over all tensors (pre-clip),
       g <- g * min(1, c / (n + 1e-6)),  c = grad_clip * loss_scale   (grad_clip = 0: off)
    2. torch.optim.AdamW, eps outside the root:
       m_t = b1 m + (1-b1) g,  v_t = b2 v + (1-b2) g^2,
       p <- p (1 - lr_t wd) - lr_t m_hat / (sqrt(v_hat) + eps)
       m_hat = m_t / (1 - b1^t'), v_hat = v_t / (1 - b2^t'), t' = state["step"] after the
       increment = t + optim.bias_correction_offset: with an offset k > 0 a step pre-hook
       creates each tensor's state (as torch would, zeros) with step = k, so the telemetry
       and the update clip, which read state["step"], see the corrections Adam applied
       (k = 1: AscendSpeed 2023's NPU AdamW, docs/results/seed_stack_adamw.md)
    3. update clipping (the mitigation registry's `direction` hook), per tensor, from the gradient Adam consumes and
       v_hat of *this* step (v_t / (1 - b2^t), i.e. after the update of v):
           rms_t = sqrt(mean(g^2 / max(v_hat, eps^2))),  Adam term scaled by 1 / max(1, rms_t)
       The weight-decay term is not scaled (as in the JAX chain). Implemented without a
       custom optimizer: each tensor gets its own param group, and before the step the group
       gets lr = lr_t / max(1, rms_t) and weight_decay = wd * max(1, rms_t) (so lr * wd is
       unchanged). Cost: one extra pass over g and v per step and one all-reduce of a
       (num_tensors, 2) tensor; per-tensor groups make the foreach kernels batch less.
    3b. layer freezing (the registry's `update` hook): the frozen tensors get param groups of
       their own (split from the others by eps as usual); on a freeze step their groups get
       lr = 0 just before optimizer.step(), so p is unchanged exactly (AdamW's p (1 - 0 wd)
       and - 0 m_hat / (...)) while m, v and the step count accumulate as usual; the next
       scheduler.step() restores every group's lr (as for the update clip).
    4. schedule: torch.optim.lr_scheduler.LambdaLR with lambda(k) = lr_at(k + 1) / lr, so
       the lr applied at optimizer step s (1-based; s - 1 scheduler.step() calls before it)
       is exactly OptimSection.lr_at(s, num_steps).

Loss scale s: the trainer multiplies the loss by s and clips at grad_clip * s, so Adam on
s*L is Adam on L with eps / s (DESIGN.md).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch import nn

from adamspike.mitigations import StepPlan
from adamspike.train_config import OptimSection
from fullscale.device import local_shard as _local

TORCH_CLIP_EPS = 1e-6  # clip_grad_norm_ divides by (norm + 1e-6)


def _kernel_kwargs(implementation: str) -> dict:
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for-loop":
        return {"foreach": False}
    raise ValueError(f"optim.implementation: unknown {implementation!r}")


def build_optimizer(model: nn.Module, optim: OptimSection, plan: StepPlan | None = None
                    ) -> torch.optim.AdamW:
    """torch.optim.AdamW over model.named_parameters(); each param group records the names
    of its parameters ("names"). The mitigation plan (adamspike.mitigations) sets each
    tensor's eps (one group per eps value, in order of first appearance), with
    update_clip makes every tensor its own group, and with layer freezing keeps the frozen
    tensors out of the others' groups (group key: eps, frozen). optim.bias_correction_offset
    k > 0: every tensor's step counter starts at k (`_count_from`)."""
    plan = plan or StepPlan()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    eps_of = {n: float(plan.tensor_eps.get(n, optim.eps)) for n, _ in named}
    frozen = set(plan.freeze)
    if plan.update_clip:
        members = [[(n, p)] for n, p in named]
    else:
        by_key: dict[tuple[float, bool], list] = {}
        for n, p in named:
            by_key.setdefault((eps_of[n], n in frozen), []).append((n, p))
        members = list(by_key.values())
    groups = [{"params": [p for _, p in m], "names": [n for n, _ in m], "eps": eps_of[m[0][0]],
               "base_weight_decay": optim.weight_decay,
               "bias_correction_offset": optim.bias_correction_offset} for m in members]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps,
                            weight_decay=optim.weight_decay, **_kernel_kwargs(optim.implementation))
    if optim.bias_correction_offset:
        opt.register_step_pre_hook(_count_from)
    return opt


def _step_dtype(fused: bool) -> torch.dtype:
    """The dtype torch.optim.Adam gives state["step"] (float32 in torch 2.1)."""
    get = getattr(torch_optimizer, "_get_scalar_dtype", None)
    if get is None:
        return torch.float32
    try:
        return get(is_fused=fused)
    except TypeError:
        return get()


@torch.no_grad()
def _count_from(optimizer: torch.optim.AdamW, args, kwargs) -> None:
    """Step pre-hook: the state of each tensor about to take its first step, created as
    torch.optim.Adam's _init_group creates it (step where torch keeps it, zero moments)
    but with step = the group's bias_correction_offset, so its step t uses 1 - b^(t + k)."""
    for group in optimizer.param_groups:
        k = float(group.get("bias_correction_offset", 0))
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if p.grad is None or optimizer.state.get(p):
                continue
            dtype = _step_dtype(bool(group.get("fused")))
            optimizer.state[p] = {
                "step": (torch.full((), k, dtype=dtype, device=p.device) if on_device
                         else torch.tensor(k, dtype=dtype)),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


@torch.no_grad()
def reset_second_moment(optimizer: torch.optim.AdamW, names) -> int:
    """exp_avg_sq <- 0 for the named tensors (adamspike.mitigations' v_reset; call just
    before the step's update): m, the step count and the other tensors are untouched. A
    tensor without state yet has v = 0 already. Returns the number of tensors reset."""
    names, count = set(names), 0
    for group in optimizer.param_groups:
        for n, p in zip(group["names"], group["params"]):
            state = optimizer.state.get(p)
            if n in names and state and "exp_avg_sq" in state:
                state["exp_avg_sq"].zero_()
                count += 1
    return count


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSection,
                    num_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose lr at optimizer step s (after s-1 scheduler steps) is lr_at(s)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: optim.lr_at(k + 1, num_steps) / optim.lr)


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def clip_gradients(params, max_norm: float) -> tuple[float, bool]:
    """Clip in place (torch formula); returns (global pre-clip grad norm, clipped). With
    max_norm <= 0 only the norm is computed. Works on FSDP2 DTensor gradients (the norm is
    all-reduced inside clip_grad_norm_)."""
    params = [p for p in params if p.grad is not None]
    limit = max_norm if max_norm > 0 else math.inf
    norm = float(_full(torch.nn.utils.clip_grad_norm_(params, limit, foreach=None)))
    clipped = max_norm > 0 and max_norm / (norm + TORCH_CLIP_EPS) < 1.0
    return norm, bool(clipped)


def _all_reduce_shards(t: torch.Tensor, params) -> torch.Tensor:
    """Sum over the ranks the parameters are sharded across (no-op for plain tensors)."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.size() > 1 and any(pl.is_shard() for pl in p.placements):
            dist.all_reduce(t, group=mesh.get_group())
            break
    return t


@torch.no_grad()
def update_clip_rms(optimizer: torch.optim.AdamW) -> torch.Tensor:
    """rms_t per param group (one tensor each) for the step about to be taken, from p.grad
    and v_hat after this step's update of v. Shards are summed across ranks."""
    rows = []
    for group in optimizer.param_groups:
        (p,) = group["params"]
        _, b2 = group["betas"]
        eps = group["eps"]
        g = _local(p.grad).double()
        state = optimizer.state.get(p, {})
        v = _local(state["exp_avg_sq"]).double() if "exp_avg_sq" in state else torch.zeros_like(g)
        t = int(state["step"]) + 1 if "step" in state else 1 + group.get("bias_correction_offset", 0)
        v_hat = (b2 * v + (1 - b2) * g * g) / (1 - b2 ** t)
        denom = v_hat.clamp_min(eps * eps)
        q = torch.where(denom > 0, g * g / torch.where(denom > 0, denom, 1.0), 0.0)
        rows.append(torch.stack([q.sum(), torch.tensor(float(g.numel()), dtype=torch.float64,
                                                          device=g.device)]))
    sums = _all_reduce_shards(torch.stack(rows), [g["params"][0] for g in optimizer.param_groups])
    return torch.sqrt(sums[:, 0] / sums[:, 1].clamp_min(1.0))


def apply_mitigations(optimizer: torch.optim.AdamW, plan: StepPlan, step: int, lr: float
                      ) -> torch.Tensor | None:
    """The plan's hooks for optimizer step `step` at scheduled lr `lr`, called just before
    optimizer.step() (after clipping): the state edits (v <- 0 of the tensors
    plan.v_reset names at this step), then the direction hook (update clipping), then the
    update hook (lr 0 for the groups of the tensors frozen at this step). Returns the
    update clip's rms_t per param group, or None."""
    if step in plan.v_reset:
        reset_second_moment(optimizer, plan.v_reset[step])
    rms = apply_update_clip(optimizer, lr) if plan.update_clip else None
    apply_freeze(optimizer, plan.frozen_at(step))
    return rms


def apply_freeze(optimizer: torch.optim.AdamW, names) -> int:
    """lr <- 0 for the param groups of the named tensors (call just before optimizer.step();
    the next scheduler.step() restores it). Every group must be wholly frozen or not
    (build_optimizer with the same plan keeps them apart). Returns the groups frozen."""
    names, count = set(names), 0
    if not names:
        return 0
    for group in optimizer.param_groups:
        inside = [n in names for n in group["names"]]
        if any(inside):
            if not all(inside):
                raise ValueError(f"apply_freeze: param group {group['names']} is only partly "
                                 "frozen; build the optimizer with the same StepPlan")
            group["lr"] = 0.0
            count += 1
    return count


def apply_update_clip(optimizer: torch.optim.AdamW, lr: float) -> torch.Tensor:
    """Set each group's lr / weight_decay for StableAdamW clipping at scheduled lr `lr`
    (call just before optimizer.step(); the next scheduler.step() resets every group's lr
    from its base lr); returns rms_t per tensor."""
    rms = update_clip_rms(optimizer)
    factors = rms.clamp_min(1.0).tolist()
    for group, f in zip(optimizer.param_groups, factors):
        group["lr"] = lr / f
        group["weight_decay"] = group["base_weight_decay"] * f
    return rms
