"""One S: the 70B's estimator of Adam's stability number applied to a phase-map toy, beside
the toy's own tracker operator (issue "Science 4" item 4), as cells of the one store.

The toys' S (phase-map lanes, Program.stability) is the preconditioned minibatch operator

    S_P  = lr_t lambda_max(P_t H_batch) / 2,   P_t = c_t diag(1 / (sqrt(v_hat) + eps)),

while the 70B's S (simulate.predict.mechanism_inputs) is built from the full-data sharpness
and the most-preconditioned group:

    S_70 = lr_t lambda_max(H_full) / (38 min_g [eps_g (1 + rho_g)])     (38 = 2 (1+b1)/(1-b1))

with rho_g = rms(consumed gradient of group g) / eps_g at that step. One cell trains one lane
of a map cell (its resolved config: calibrated group eps, lr, batch) and at each checkpoint
measures S_P by Lanczos on P^(1/2) H_s P^(1/2) (the operator the tracker follows with 3
warm power products; S_P_power: `iters` power products from a random start, signed as the
tracker's), the algebraically largest
eigenvalue lambda_max(H) by Lanczos (simulate.sharpness.lanczos: a power iteration would
return a dominant negative eigenvalue) of the minibatch and of `eval_chunks` held-out batches (the next batches of the lane's own data after its last step: full data
in the sense of the batch limit), and rho_g. analysis reads the cells and fits the
calibration S_P / S_70 that carries the 70B's S onto the toys' scale.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from adamspike.cells import Cell
from adamspike.train_config import RunConfig

KIND = "one_s"
CODE = "one-s-1"          # bump when the computation below changes meaning
PI_THRESHOLD_B1_09 = 38.0


def cell(map_cell_config: Mapping[str, Any], seed: int, checkpoints: Sequence[int],
         eval_chunks: int = 32, iters: int = 30) -> Cell:
    return Cell(KIND, CODE, {"config": dict(map_cell_config), "seed": int(seed),
                             "checkpoints": [int(c) for c in checkpoints],
                             "eval_chunks": int(eval_chunks), "iters": int(iters)},
                "simulate.one_s:compute")


def compute(config: Mapping[str, Any]) -> dict:
    """Train the lane; at each checkpoint S_P, lambda_max(H) minibatch and full, rho_g."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    from simulate.program import program   # jax: only when a cell runs
    from simulate.sharpness import lanczos
    from simulate.llama_train import batch_at, dataset
    from simulate.seeds import group_layout, with_seed

    t0 = time.perf_counter()
    cfg = RunConfig.from_dict(dict(config["config"]))
    seed, iters = int(config["seed"]), int(config["iters"])
    ck = with_seed(cfg, seed)
    T = cfg.train.num_steps
    marks = sorted(int(c) for c in config["checkpoints"] if 1 <= int(c) <= T)
    prog = program(cfg)
    ctl = prog.controls(cfg, range(1, T + 1))
    data = dataset(ck, cfg.model.llama())
    held = np.stack([batch_at(data, ck, s) for s in range(T + 1, T + 1 + int(config["eval_chunks"]))])
    groups, by_group, numel, eps = group_layout(cfg)
    index = {n: i for i, n in enumerate(prog.names)}
    cols = [[index[n] for n in by_group[g]] for g in groups]
    stab = jax.jit(prog.stability, static_argnames=("num_iters", "precondition"))
    params, state = prog.init(seed)
    unravel = ravel_pytree(params)[1]
    n_params = int(ravel_pytree(params)[0].size)
    rng = np.random.default_rng([seed, 11_000])

    @jax.jit
    def hv(p, v, b, scale):   # H v of the mean unscaled loss over the chunks of b (k, B, T+1)
        def one(bb):
            g = jax.grad(lambda q: prog.loss(q, bb, scale)[0])
            return ravel_pytree(jax.jvp(g, (p,), (unravel(v),))[1])[0]
        return jax.lax.map(one, b).mean(0) / scale

    def lam_max(p, b, scale, root=None) -> dict:
        """Top algebraic eigenvalue of H (unscaled loss), or with root = P^(1/2) (flat) of
        P^(1/2) H_s P^(1/2) with H_s the Hessian of the scaled loss (Program.stability's)."""
        bj = jnp.asarray(b)
        if root is None:
            mv = lambda v: np.asarray(hv(p, jnp.asarray(v, jnp.float32), bj, scale), np.float64)  # noqa: E731
        else:
            mv = lambda v: root * scale * np.asarray(  # noqa: E731
                hv(p, jnp.asarray(root * v, jnp.float32), bj, scale), np.float64)
        r = lanczos(mv, n_params, iters, rng)
        r.pop("y")
        return r

    def start(k):
        leaves = jax.tree.leaves(params)
        keys = jax.random.split(jax.random.PRNGKey(k), len(leaves))
        return prog.tree([jax.random.normal(q, x.shape, jnp.float32) for q, x in zip(keys, leaves)])

    rows, losses = [], []
    inv = 1.0 / cfg.train.loss_scale
    for s in range(1, T + 1):
        batch = jnp.asarray(batch_at(data, ck, s))
        params, state, out = prog.step_fn(params, state, batch, ctl.at(s - 1))
        losses.append(float(out["loss"]))
        if s not in marks:
            continue
        sumsq = np.asarray(out["tensor_sumsq"], np.float64) * (float(out["clip_scale"]) * inv) ** 2
        rho = {g: float(np.sqrt(sumsq[c].sum() / numel[i]) / eps[i])
               for i, (g, c) in enumerate(zip(groups, cols))}
        c = ctl.at(s - 1)
        S_P, _ = stab(params, state, batch, c, start(10_000 + s), num_iters=iters)
        root = 1.0 / np.sqrt(np.asarray(ravel_pytree(prog._pinv(state, c))[0], np.float64))
        rp = lam_max(params, np.asarray(batch)[None], c.loss_scale, root)
        rb = lam_max(params, np.asarray(batch)[None], c.loss_scale)
        rf = lam_max(params, held, c.loss_scale)
        lam_b, lam_f = rb["theta_1"], rf["theta_1"]
        lr = float(ctl.lr[s - 1])
        denom = min(float(eps[i]) * (1.0 + rho[g]) for i, g in enumerate(groups))
        rows.append({"step": s, "lr": lr, "S_P_power": float(S_P),
                     "S_P": lr * rp["theta_1"] / 2, "residual_P": rp["residual"],
                     "lambda_batch": float(lam_b),
                     "lambda_full": float(lam_f),
                     "S_70": lr * float(lam_f) / (PI_THRESHOLD_B1_09 * denom),
                     "S_70_batch": lr * float(lam_b) / (PI_THRESHOLD_B1_09 * denom),
                     "residual_full": rf["residual"], "theta_min_full": rf["theta_min"],
                     "residual_batch": rb["residual"],
                     "loss": float(np.mean(losses[-10:])),
                     **{f"rho_{g}": v for g, v in rho.items()},
                     **{f"eps_{g}": float(eps[i]) for i, g in enumerate(groups)}})
    return {"checkpoints": rows, "seconds": time.perf_counter() - t0,
            "eval_tokens": int(held.shape[0] * held.shape[1] * (held.shape[2] - 1))}


def map_cells(meta: Mapping[str, Any], lanes: int = 2) -> list[Cell]:
    """The One-S cells of a phase map (its map.json): the first `lanes` lane seeds of every
    cell, checkpoints at the end of the warmup, half-way after it, and the last step."""
    out = []
    for i in range(int(lanes)):
        for c in meta["cells"]:
            T = int(c["config"]["train.num_steps"])
            w = int(c["config"]["optim.warmup_steps"])
            out.append(cell(c["config"], meta["seeds"][i], [w, (w + T) // 2, T]))
    return out
