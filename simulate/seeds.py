"""Seeds of one tiny-LLaMA arm as one vmapped program (never torch).

    run_arm(cfg, seeds)  ->  per-seed traces (loss, grad_norm, update_norm, group rho)

An arm is a RunConfig (the JAX trainer's settings, simulate.llama_train); its seeds differ
in train.seed only, which the trainer uses for the parameter init (PRNGKey(seed)), the data
set (the synthetic source's seed) and the batch order (adamspike.order.sample_indices), so
seed k of every arm reads the same batches from the same initial parameters: arms are
paired by seed index. The program is simulate.program's one step, its `run` form (all
steps in one `jax.lax.scan`, `jax.vmap` over the seeds), with the arm's per-step controls:

    (params_k, state_k) <- step(params_k, state_k, batch_{k,s}, controls_s),  s = 1..num_steps

Arms that differ only in controls (lr and its schedule, b1, b2, eps and group eps, clip
threshold, loss scale, v resets, freezing, skipped or poisoned batches) share one compiled
program. Per step and seed it keeps the loss, the pre-clip gradient norm, the update norm
and, per depth group (adamspike.depth_groups), the sum of squares of the gradient Adam
consumed (after clipping), from which

    rho_group(s) = sqrt(sumsq_group / numel_group) / eps_group

in the frame of the unscaled loss (eps_group: the group's Adam eps, all tensors of a group
share one under the registry's group_eps). Without telemetry tables or Python per step this
is the cheap path for many seeds. The spike guard (host-side rollbacks) is the trainer's
only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from adamspike.config import ConfigError
from adamspike.depth_groups import GROUPS, depth_group
from adamspike.llama import spec_by_name
from adamspike.train_config import RunConfig
from simulate.llama_train import batch_at, dataset
from simulate.program import SECANT_OUTPUTS, program, step_plan


def with_seed(cfg: RunConfig, seed: int) -> RunConfig:
    """cfg with train.seed = seed (a copy)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=int(seed)))


def check_arm(cfg: RunConfig) -> None:
    """ConfigError for settings the vmapped program does not implement (module docstring)."""
    cfg.check()
    if cfg.guard.enabled:
        raise ConfigError("guard.enabled: the spike guard's rollbacks are host-side; run the "
                          "trainer (adamspike simulate llama) for guarded runs")
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


def run_arm(cfg: RunConfig, seeds: Sequence[int], *, vmapped: bool = True,
            tokens: np.ndarray | None = None, curvature_every: int = 0,
            secant: bool = False) -> dict[str, np.ndarray]:
    """Train len(seeds) copies of cfg (train.seed = each seed); vmapped=True as one
    program, False one seed per call of the same program (the bench compares the two).
    Returns float64 arrays loss, grad_norm, update_norm (num_seeds, num_steps),
    rho (num_seeds, num_steps, num_groups) and groups, group_eps, group_numel; with
    curvature_every = K, also stability (num_seeds, num_steps // K): Program.stability
    after every K-th step, and with secant the online proxy's readings of each K-step block
    (simulate.program.SECANT_OUTPUTS)."""
    check_arm(cfg)
    groups, by_group, numel, eps = group_layout(cfg)
    prog = program(cfg)
    outs = prog.run(seeds, arm_tokens(cfg, seeds) if tokens is None else tokens,
                    prog.controls(cfg, range(1, cfg.train.num_steps + 1)), vmapped=vmapped,
                    curvature_every=curvature_every, secant=secant)
    inv = 1.0 / cfg.train.loss_scale
    index = {n: i for i, n in enumerate(prog.names)}
    cols = [[index[n] for n in by_group[g]] for g in groups]
    sumsq = np.stack([outs["tensor_sumsq"][..., c].sum(-1) for c in cols], axis=-1)
    sumsq *= np.square(outs["clip_scale"] * inv)[..., None]   # consumed, unscaled frame
    rho = np.sqrt(sumsq / numel) / eps
    return {"loss": outs["loss"], "grad_norm": outs["grad_norm"] * inv,
            "update_norm": outs["update_norm"], "rho": rho,
            "groups": np.array(groups), "group_eps": eps, "group_numel": numel,
            **{k: outs[k] for k in ("stability",) + SECANT_OUTPUTS if k in outs}}
