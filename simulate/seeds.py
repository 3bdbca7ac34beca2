"""Seeds of one tiny-LLaMA arm as one vmapped program (never torch).

    run_arm(cfg, seeds)  ->  per-seed traces (loss, grad_norm, update_norm, group rho)

An arm is a RunConfig (the JAX trainer's settings, simulate.llama_train); its seeds differ
in train.seed only, which the trainer uses for the parameter init (PRNGKey(seed)), the data
set (the synthetic source's seed) and the batch order (adamspike.order.sample_indices), so
seed k of every arm reads the same batches from the same initial parameters: arms are
paired by seed index. The program is the trainer's own objective and optax chain
(simulate.llama_train.objective: the registry's model and eps hooks, update clipping,
clip, weight decay, the lr schedule), one `jax.lax.scan` over the steps, `jax.vmap` over the
seeds:

    (params_k, state_k) <- step(params_k, state_k, batch_{k,s}),  s = 1..num_steps

Per step and seed it keeps the loss, the pre-clip gradient norm, the update norm and, per
depth group (adamspike.depth_groups), the sum of squares of the gradient Adam consumed
(after clipping, in the loss-scale frame of the trainer's telemetry), from which

    rho_group(s) = sqrt(sumsq_group / numel_group) / eps_group

(eps_group: the group's Adam eps, all tensors of a group share one under the registry's
group_eps). Without telemetry tables or Python per step this is the cheap path for many
seeds; a seed's loss trace equals the trainer's run of the same config (test_seeds).

Not supported (ConfigError): mitigations with the `state` hook (step-indexed edits of the
optimizer state: the trainer applies them between jitted steps), the spike guard, skipped
or poisoned batches (the trainer's host-side control flow).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamspike.config import ConfigError, flatten, to_dict
from adamspike.depth_groups import GROUPS, depth_group
from adamspike.llama import spec_by_name
from adamspike.mitigations import require_hooks
from adamspike.train_config import RunConfig
from simulate import llama as jllama
from simulate import optim as jopt
from simulate.llama_train import batch_at, dataset, objective, step_plan

HOOKS = ("model", "eps", "direction")
# passed to the compiled program as traced values: arms differing only here compile once
TRACED_KEYS = frozenset({"optim.b1", "optim.b2", "optim.eps", "mitigation.eps_embed",
                         "mitigation.eps_shallow", "mitigation.eps_deep", "mitigation.eps_head"})


def with_seed(cfg: RunConfig, seed: int) -> RunConfig:
    """cfg with train.seed = seed (a copy)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=int(seed)))


def check_arm(cfg: RunConfig) -> None:
    """ConfigError for settings the vmapped program does not implement (module docstring)."""
    cfg.check()
    require_hooks(cfg, HOOKS, "the vmapped seed program (simulate.seeds)")
    if cfg.guard.enabled:
        raise ConfigError("guard.enabled: the spike guard's rollbacks are host-side; run the "
                          "trainer (adamspike simulate llama) for guarded runs")
    if cfg.data.skip_batches or cfg.data.poison_steps:
        raise ConfigError("data.skip_batches / data.poison_steps: not supported by the "
                          "vmapped seed program; run the trainer")
    if cfg.data.source != "synthetic":
        raise ConfigError(f"data.source: synthetic only (got {cfg.data.source!r})")


def arm_tokens(cfg: RunConfig, seeds: Sequence[int]) -> np.ndarray:
    """Tokens (num_seeds, num_steps, global_batch_size, seq_len + 1) int32: step s of seed k
    is the trainer's batch_at(dataset(cfg_k), cfg_k, s) with cfg_k = with_seed(cfg, k)."""
    t = cfg.train
    out = np.empty((len(seeds), t.num_steps, t.global_batch_size, t.seq_len + 1), np.int32)
    llama = cfg.model.llama()
    for j, k in enumerate(seeds):
        ck = with_seed(cfg, k)
        data = dataset(ck, llama)
        for s in range(1, t.num_steps + 1):
            out[j, s - 1] = batch_at(data, ck, s)
    return out


def group_layout(cfg: RunConfig) -> tuple[list[str], dict[str, list[str]], np.ndarray, np.ndarray]:
    """(groups present, tensor names per group, numel per group, eps per group)."""
    llama = cfg.model.llama()
    specs = spec_by_name(llama)
    plan = step_plan(cfg)
    by_group: dict[str, list[str]] = {}
    for n, s in specs.items():
        by_group.setdefault(depth_group(s.depth, llama.num_layers), []).append(n)
    groups = [g for g in GROUPS if g in by_group]
    numel = np.array([sum(specs[n].numel for n in by_group[g]) for g in groups], np.float64)
    eps = []
    for g in groups:
        values = {float(plan.tensor_eps.get(n, cfg.optim.eps)) for n in by_group[g]}
        if len(values) != 1:
            raise ConfigError(f"group {g}: tensors with different eps {sorted(values)}; "
                              "group rho needs one eps per group")
        eps.append(values.pop())
    return groups, {g: by_group[g] for g in groups}, numel, np.array(eps)


def hyper(cfg: RunConfig) -> dict:
    """The traced hyperparameters of an arm: b1, b2 and the per-tensor eps pytree (arms
    differing only in these share one compiled program)."""
    llama = cfg.model.llama()
    shapes = jax.eval_shape(functools.partial(jllama.init_params, llama), jax.random.PRNGKey(0))
    plan = step_plan(cfg)
    names = jopt.tensor_names(shapes)
    eps = [jnp.float32(plan.tensor_eps.get(n, cfg.optim.eps)) for n in names]
    return {"b1": jnp.float32(cfg.optim.b1), "b2": jnp.float32(cfg.optim.b2),
            "eps": jax.tree.unflatten(jax.tree.structure(shapes), eps)}


def arm_program(cfg: RunConfig):
    """run_one(key, tokens (num_steps, B, T+1), hyper) -> (loss, grad_norm, update_norm
    (num_steps,), group_sumsq (num_steps, num_groups)): one seed's whole run, pure and
    traceable (vmap it over seeds, or jit it and call it per seed); `hyper` as `hyper(cfg)`."""
    check_arm(cfg)
    llama = cfg.model.llama()
    t, o = cfg.train, cfg.optim
    _, value_and_grad, _ = objective(cfg)
    plan = step_plan(cfg)
    _, names, _, _ = group_layout(cfg)
    inv_scale = 1.0 / t.loss_scale

    def run_one(key, toks, hp):
        # the trainer's chain (simulate.optim.adamw) with b1, b2, eps as traced values
        tx = jopt.adamw_chain(hp["b1"], hp["b2"], hp["eps"], jopt.lr_schedule(o, t.num_steps),
                              o.grad_clip * t.loss_scale, o.weight_decay, plan)
        params = jllama.init_params(llama, key)
        state = tx.init(params)

        def step(carry, batch):
            params, state = carry
            (_, aux), grads = value_and_grad(params, batch)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            grad_norm, scale, _ = jopt.clip_info(state)
            sumsq = jnp.stack([sum(jnp.sum(jnp.square(grads[n].astype(jnp.float32)))
                                   for n in group) for group in names.values()])
            sumsq = sumsq * jnp.square(scale * inv_scale)
            return (params, state), (aux["loss"], grad_norm * inv_scale,
                                     jopt.global_norm(updates), sumsq)

        _, outs = jax.lax.scan(step, (params, state), toks)
        return outs

    return run_one


_PROGRAMS: dict[tuple, Any] = {}


def _compiled(cfg: RunConfig, vmapped: bool):
    """jit(vmap(run_one)) or jit(run_one), cached per config up to the traced b1, b2, eps."""
    flat = flatten(to_dict(cfg))
    key = (vmapped, json.dumps({k: v for k, v in flat.items()
                                if k not in TRACED_KEYS and k != "train.seed"},
                               sort_keys=True, default=str))
    if key not in _PROGRAMS:
        if len(_PROGRAMS) >= 8:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        run_one = arm_program(cfg)
        _PROGRAMS[key] = jax.jit(jax.vmap(run_one, in_axes=(0, 0, None)) if vmapped else run_one)
    return _PROGRAMS[key]


def run_arm(cfg: RunConfig, seeds: Sequence[int], *, vmapped: bool = True,
            tokens: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Train len(seeds) copies of cfg (train.seed = each seed); vmapped=True as one
    program, False one after another (the same jitted per-seed function: the bench compares
    the two). Returns float64 arrays loss, grad_norm, update_norm (num_seeds, num_steps),
    rho (num_seeds, num_steps, num_groups) and groups, group_eps, group_numel."""
    check_arm(cfg)
    groups, _, numel, eps = group_layout(cfg)
    toks = jnp.asarray(arm_tokens(cfg, seeds) if tokens is None else tokens)
    keys = jnp.stack([jax.random.PRNGKey(int(k)) for k in seeds])
    hp = hyper(cfg)
    fn = _compiled(cfg, vmapped)
    if vmapped:
        outs = fn(keys, toks, hp)
    else:
        per = [fn(keys[i], toks[i], hp) for i in range(len(seeds))]
        outs = tuple(jnp.stack([p[j] for p in per]) for j in range(4))
    loss, gn, un, sumsq = (np.asarray(x, np.float64) for x in jax.device_get(outs))
    rho = np.sqrt(sumsq / numel) / eps
    return {"loss": loss, "grad_norm": gn, "update_norm": un, "rho": rho,
            "groups": np.array(groups), "group_eps": eps, "group_numel": numel}
