"""AdamW for the JAX backend, built from optax pieces, matching torch.optim.AdamW semantics.

The chain `adamw(optim, num_steps, loss_scale)` applies, per optimizer step t (1-based):

    1. global-norm clipping, torch formula (`clip_by_global_norm_torch`):
           n = sqrt(sum_tensors sum g^2)                     (before clipping)
           s = min(1, c / (n + 1e-6)),  c = grad_clip * loss_scale,   g <- s g
       (torch.nn.utils.clip_grad_norm_; optax's clip_by_global_norm uses c / n instead.
       With grad_clip = 0 the norm is still recorded and s = 1.)
    2. Adam (optax.scale_by_adam, eps outside the root, eps_root = 0):
           m_t = b1 m_{t-1} + (1-b1) g,   v_t = b2 v_{t-1} + (1-b2) g^2
           m_hat = m_t / (1-b1^t),  v_hat = v_t / (1-b2^t),  r = m_hat / (sqrt(v_hat) + eps)
    (eps may be given per tensor: adamspike.mitigations' group eps; with
    optim.bias_correction_offset = k Adam's count starts at k, so t reads t + k in the
    corrections here and in everything that takes them from the count: the update clip,
    the telemetry's v_hat, the curvature's preconditioner. k = 1 is AscendSpeed 2023's NPU
    AdamW, docs/results/seed_stack_adamw.md)
    3. optional StableAdamW update clipping per tensor (the registry's `direction` hook):
           rms_t = sqrt(mean(g^2 / max(v_hat, eps^2))),   r <- r / max(1, rms_t)
       (only the Adam direction is divided; the weight-decay term below is not. With
       eps = 0, coordinates with v_hat = 0 have g = 0 and count 0 in the mean.)
    4. decoupled weight decay and the learning rate (torch AdamW):
           p <- p - lr_t (r + wd p),   lr_t = optim.lr_at(t, num_steps)
    5. optional layer freezing (the registry's `update` hook, `freeze_updates`, applied by
       simulate.program per step): the change of the frozen tensors is 0 (p_t = p_{t-1});
       Adam's m, v and count above still accumulate.

Loss scaling: the caller multiplies the loss by s; passing `loss_scale=s` scales the clip
threshold with it, so Adam on s*L equals Adam on L with eps/s (see DESIGN.md).

Telemetry needs the gradient Adam consumed (after clipping): the clip transform keeps the
pre-clip norm and the factor s in its state, so `consumed_grads(grads, opt_state)` gives
exactly the tensors Adam saw (the same multiplication), `clip_info(opt_state)` gives
(grad_norm, scale, clipped) and `adam_state(opt_state)` the ScaleByAdamState.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamspike.mitigations import StepPlan
from adamspike.train_config import OptimSection

TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds this to the norm


# ----------------------------------------------------------------------------- schedule

def lr_schedule(optim: OptimSection, num_steps: int) -> optax.Schedule:
    """count (0-based optax count) -> optim.lr_at(count + 1, num_steps).

    Exact by construction: the host values lr_at(1..num_steps) are tabulated and indexed;
    counts past num_steps keep the last value (lr_at is constant there)."""
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    table = np.array([optim.lr_at(s, num_steps) for s in range(1, num_steps + 1)])

    def schedule(count):
        lrs = jnp.asarray(table)  # float64 when x64 is enabled, else float32
        return lrs[jnp.clip(count, 0, num_steps - 1)]

    return schedule


# ----------------------------------------------------------------------------- clipping

class ClipState(NamedTuple):
    """Of the last step: global gradient norm before clipping and the factor applied."""
    grad_norm: jax.Array
    scale: jax.Array


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def clip_by_global_norm_torch(max_norm, enabled: bool | None = None
                              ) -> optax.GradientTransformation:
    """g <- g * min(1, max_norm / (||g|| + 1e-6)) (torch's clip_grad_norm_); max_norm <= 0:
    no clipping (scale 1). max_norm may be traced when `enabled` (static) says whether to
    clip. The state records the pre-clip norm and the scale."""
    enabled = max_norm > 0 if enabled is None else enabled

    def init_fn(params):
        del params
        return ClipState(grad_norm=jnp.zeros([]), scale=jnp.ones([]))

    def update_fn(updates, state, params=None):
        del params, state
        norm = global_norm(updates)
        if enabled:
            scale = jnp.minimum(1.0, max_norm / (norm + TORCH_CLIP_EPS))
            updates = jax.tree.map(lambda g: g * scale.astype(g.dtype), updates)
        else:
            scale = jnp.ones_like(norm)
        return updates, ClipState(grad_norm=norm, scale=scale)

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------- adam

def rms_t(g, v_hat, eps) -> jax.Array:
    """StableAdamW staleness signal of one tensor: sqrt(mean(g^2 / max(v_hat, eps^2)))."""
    denom = jnp.maximum(v_hat, eps * eps)
    ok = denom > 0  # only false with eps = 0 and v_hat = 0, where g = 0 too
    q = jnp.where(ok, g * g / jnp.where(ok, denom, 1.0), 0.0)
    return jnp.sqrt(jnp.mean(q))


def _per_leaf(eps) -> bool:
    """eps given per tensor (a pytree of scalars shaped like the parameters)."""
    return isinstance(eps, (dict, list, tuple))


def scale_by_adam_stable(b1=0.9, b2=0.999, eps=1e-8, update_clip: bool = False,
                         bias_correction_offset: int = 0) -> optax.GradientTransformation:
    """optax.scale_by_adam, optionally followed by per-tensor update clipping
    r <- r / max(1, rms_t). The state is the plain ScaleByAdamState. b1, b2 and a scalar
    eps may be traced scalars (vmapped sweeps); eps may also be a pytree like the
    parameters (one eps per tensor: adamspike.mitigations' group eps), then
    r = m_hat / (sqrt(v_hat) + eps_tensor) with optax's moments and bias corrections.
    update_clip is static. bias_correction_offset k (static): the count starts at k, so
    step t's corrections are 1 - b^(t + k) (optax's own, from the count)."""
    per_leaf = _per_leaf(eps)
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=0.0 if per_leaf else eps)
    if bias_correction_offset:
        adam = _count_from(adam, bias_correction_offset)
    if not (update_clip or per_leaf):
        return adam

    def update_fn(updates, state, params=None):
        r, new_state = adam.update(updates, state, params)
        bc2 = 1 - b2 ** new_state.count
        eps_tree = eps if per_leaf else jax.tree.map(lambda _: eps, updates)
        if per_leaf:
            bc1 = 1 - b1 ** new_state.count
            r = jax.tree.map(
                lambda m, nu, e: (m / bc1.astype(m.dtype))
                / (jnp.sqrt(nu / bc2.astype(nu.dtype)) + jnp.asarray(e, m.dtype)),
                new_state.mu, new_state.nu, eps_tree)
        if update_clip:
            r = jax.tree.map(
                lambda ri, g, nu, e: ri / jnp.maximum(
                    1.0, rms_t(g, nu / bc2.astype(nu.dtype), e)).astype(ri.dtype),
                r, updates, new_state.nu, eps_tree)
        return r, new_state

    return optax.GradientTransformation(adam.init, update_fn)


def _count_from(adam: optax.GradientTransformation, start: int) -> optax.GradientTransformation:
    """`adam` whose ScaleByAdamState.count starts at `start` instead of 0."""
    def init_fn(params):
        state = adam.init(params)
        return state._replace(count=jnp.full_like(state.count, start))

    return optax.GradientTransformation(init_fn, adam.update)


def freeze_updates(updates, frozen):
    """The `update` hook's edit: updates with the leaves where `frozen` (a pytree of bools
    like updates, static or traced) is true set to exactly 0."""
    return jax.tree.map(lambda u, f: jnp.where(f, jnp.zeros_like(u), u), updates, frozen)


def adamw_chain(b1, b2, eps, lr, max_norm, weight_decay: float = 0.0,
                plan: StepPlan | None = None, clip: bool | None = None,
                bias_correction_offset: int = 0) -> optax.GradientTransformation:
    """Steps 1-4 of the module docstring from scalars (b1, b2, eps, lr, max_norm may be
    traced, lr may be an optax schedule; eps a scalar or a per-tensor pytree): clip at
    max_norm (the torch formula; off when `clip` is False, or with clip None when
    max_norm <= 0) -> Adam (bias corrections at t + bias_correction_offset) -> [update
    clip: the plan's `direction` hook] -> [+ wd*p] -> * -lr. Freezing (step 5) and v
    resets are per-step edits around the chain (simulate.program's controls)."""
    plan = plan or StepPlan()
    parts = [clip_by_global_norm_torch(max_norm, clip),
             scale_by_adam_stable(b1, b2, eps, plan.update_clip, bias_correction_offset)]
    if weight_decay > 0:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(lr))
    return optax.chain(*parts)


def adamw(optim: OptimSection, num_steps: int, loss_scale: float = 1.0, *,
          plan: StepPlan | None = None) -> optax.GradientTransformation:
    """`adamw_chain` for a config section (the MLP and quadratic toys; the tiny LLaMA's is
    simulate.program): clip at grad_clip * loss_scale, lr_at(t), optim.eps, and the plan's
    update clipping, optim.bias_correction_offset."""
    if loss_scale <= 0:
        raise ValueError(f"loss_scale: must be > 0, got {loss_scale}")
    return adamw_chain(optim.b1, optim.b2, optim.eps, lr_schedule(optim, num_steps),
                       optim.grad_clip * loss_scale, optim.weight_decay, plan,
                       bias_correction_offset=optim.bias_correction_offset)


def reset_second_moment(opt_state, reset: Sequence):
    """The chain state with Adam's v set to 0 for the leaves where `reset` is true (leaf
    order; bools, static or traced); m, the step count and every other state untouched
    (adamspike.mitigations' v_reset, applied just before a step's update)."""
    adam = adam_state(opt_state)
    leaves, tree = jax.tree.flatten(adam.nu)
    if len(reset) != len(leaves):
        raise ValueError(f"reset: {len(reset)} flags for {len(leaves)} tensors")
    nu = jax.tree.unflatten(tree, [jnp.where(r, jnp.zeros_like(x), x)
                                   for x, r in zip(leaves, reset)])
    return _replace_state(opt_state, adam, adam._replace(nu=nu))


def _replace_state(state: Any, old, new) -> Any:
    if state is old:
        return new
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(_replace_state(s, old, new) for s in state)
    if isinstance(state, list):
        return [_replace_state(s, old, new) for s in state]
    return state


# ----------------------------------------------------------------------------- state access

def _find(state: Any, cls) -> Any:
    if isinstance(state, cls):
        return state
    if isinstance(state, (tuple, list)):
        for s in state:
            found = _find(s, cls)
            if found is not None:
                return found
    return None


def adam_state(opt_state) -> optax.ScaleByAdamState:
    """The ScaleByAdamState inside an (arbitrarily nested) optax chain state."""
    found = _find(opt_state, optax.ScaleByAdamState)
    if found is None:
        raise ValueError("opt_state: no optax.ScaleByAdamState found in the chain")
    return found


def clip_info(opt_state) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre-clip global grad norm, clip factor, clipped flag) of the last step; the flag is
    True when the gradient was actually scaled (factor < 1)."""
    found = _find(opt_state, ClipState)
    if found is None:
        raise ValueError("opt_state: no ClipState found (build the chain with adamw())")
    return found.grad_norm, found.scale, found.scale < 1.0


def consumed_grads(grads, opt_state):
    """The gradient Adam consumed at the last step: grads * clip factor (bit-identical to
    what the clip transform passed on)."""
    _, scale, _ = clip_info(opt_state)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


