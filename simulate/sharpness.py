"""Converged sharpness of a trained ladder rung: Lanczos on the Hessian, one cell per
(rung, lr, eps, steps, seed) in the one cell store (adamspike.cells).

The batch-sharpness study (simulate.batch_sharpness) read lambda_max(H) by warm-started
power iteration and judged convergence by the last product's change; one rung-seed ((64, 8)
seed 1) converged to a dominant *negative* eigenvalue and still carried the 70B law's depth
exponent. Here each evaluation is a Lanczos run with full reorthogonalisation:

    K_m = span{q, Hq, ..., H^(m-1) q},   T_m = Q' H Q (tridiagonal),   theta = eig(T_m)

giving the algebraically largest Ritz values theta_1 >= theta_2 and the smallest theta_min
(signs kept), and the true residual of the top pair, ||H y - theta_1 y|| / |theta_1| (one
more product), which the plan's QC (docs/plan/science4_v1.toml [sharpness.qc]) judges.
H is the Hessian of the mean unscaled loss over n evaluation tokens (nested samples,
simulate.batch_sharpness.eval_batches), at the parameters after `steps` training steps of
the ladder's recipe (simulate.ladder.run_config) at the cell's lr and eps. With `track`
steps, lambda is also measured at 8192 tokens at those steps of training (lambda against
tokens seen).

The analysis half (QC, the law across rungs, the 70B's reading) is analysis/sharpness.py;
it reads these cells and knows nothing of JAX.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.linalg import eigh_tridiagonal

from adamspike.cells import Cell
from simulate import batch_sharpness as BS
from simulate import ladder as LD

KIND = "sharpness_rung"
CODE = "lanczos-2"        # bump when the computation below changes meaning
TRACK_TOKENS = 8192


def cell_config(dim: int, layers: int, lr: float, seed: int, *, steps: int = 150,
                eps: float | None = None, eval_tokens: Sequence[int] = (512, 2048, 8192, 32768),
                iters: int = 30, start: int = 0, track: Sequence[int] = ()) -> dict:
    """The cell's resolved input (every number the result depends on)."""
    spec = LD.full_spec("constant")
    return {"dim": int(dim), "layers": int(layers), "lr": float(lr), "seed": int(seed),
            "steps": int(steps), "eps": float(spec.eps if eps is None else eps),
            "warmup_steps": spec.warmup_steps, "b2": spec.b2, "grad_clip": spec.grad_clip,
            "weight_decay": spec.weight_decay, "seq_len": spec.seq_len,
            "vocab_size": spec.vocab_size, "batch": 16,
            "eval_tokens": [int(n) for n in eval_tokens], "iters": int(iters),
            "start": int(start), "track": [int(s) for s in track]}


def cell(dim: int, layers: int, lr: float, seed: int, **kw):
    return Cell(KIND, CODE, cell_config(dim, layers, lr, seed, **kw),
                "simulate.sharpness:compute")


def lanczos(matvec, n: int, iters: int, rng: np.random.Generator,
            start: np.ndarray | None = None, tol: float = 1e-3, min_iters: int = 10) -> dict:
    """Lanczos with full reorthogonalisation on a symmetric operator (float64 basis), at
    most `iters` steps; from `min_iters` on, every 5 steps, it stops once the Ritz estimate
    of the top pair's residual is below `tol` (a tenth of the plan's QC bound).

    Returns theta_1, theta_2 (largest), theta_min, the true residual of the top pair
    ||A y - theta_1 y|| / |theta_1| (one more product), the Ritz vector y and the number
    of products."""
    q = rng.standard_normal(n)
    if start is not None:     # warm start from a previous top vector, plus fresh directions
        q = start / np.linalg.norm(start) + 0.3 * q / np.linalg.norm(q)
    q /= np.linalg.norm(q)
    Q = np.zeros((iters, n))
    alpha, beta = [], []
    for j in range(iters):
        Q[j] = q
        w = matvec(q)
        a = float(q @ w)
        alpha.append(a)
        for _ in range(2):    # twice is enough (Kahan): the basis stays orthogonal in fp64
            w -= Q[:j + 1].T @ (Q[:j + 1] @ w)
        b = float(np.linalg.norm(w))
        if j == iters - 1 or b <= 1e-12 * max(1.0, abs(a)):
            break
        if j + 1 >= min_iters and (j + 1) % 5 == 0:
            # Ritz estimate of the top pair's residual, |beta_j s_j| / |theta| (no product):
            # stop early once it is far inside the QC's bound; the QC reads the true one
            th, sv = eigh_tridiagonal(np.array(alpha), np.array(beta))
            if abs(b * sv[-1, -1]) <= tol * abs(th[-1]):
                break
        beta.append(b)
        q = w / b
    m = len(alpha)
    theta, s = eigh_tridiagonal(np.array(alpha), np.array(beta[:m - 1]))
    y = Q[:m].T @ s[:, -1]
    y /= np.linalg.norm(y)
    t1 = float(theta[-1])
    r = matvec(y) - t1 * y
    return {"theta_1": t1, "theta_2": float(theta[-2]) if m > 1 else math.nan,
            "theta_min": float(theta[0]), "residual": float(np.linalg.norm(r) / abs(t1))
            if t1 else math.inf, "products": m + 1, "y": y}


def compute(config: Mapping[str, Any]) -> dict:
    """Train the rung-seed, then Lanczos at each evaluation size (module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    from simulate.program import program   # jax: only when a cell runs

    c = dict(config)
    t0 = time.perf_counter()
    spec = dataclasses.replace(LD.full_spec("constant"), lr=c["lr"], eps=c["eps"],
                               num_steps=c["steps"], lr_scaling="constant")
    rc = LD.run_config(LD.llama_config(c["dim"], c["layers"], spec), spec, c["batch"])
    prog = program(rc)
    tokens = LD.batches(spec, c["batch"], [c["seed"]])[:, 0]
    ctl = prog.controls(rc, range(1, spec.num_steps + 1))
    params, state = prog.init(c["seed"])
    rng = np.random.default_rng([c["seed"], c["start"], 7_000])
    unravel = ravel_pytree(params)[1]

    cc = ctl.at(spec.num_steps - 1)

    @jax.jit
    def hv(params, v, b):   # H v, H of the mean unscaled loss over the chunks of b
        def one(bb):
            g = jax.grad(lambda p: prog.loss(p, bb, cc.loss_scale)[0])
            return ravel_pytree(jax.jvp(g, (params,), (unravel(v),))[1])[0]
        return jax.lax.map(one, b).mean(0) / cc.loss_scale

    def hessian_at(params, batch: np.ndarray):
        bj = jnp.asarray(batch)
        return lambda v: np.asarray(hv(params, jnp.asarray(v, jnp.float32), bj), np.float64)

    n = int(ravel_pytree(params)[0].size)
    batches = BS.eval_batches(spec, c["seed"], c["eval_tokens"])
    track_batch = BS.eval_batches(spec, c["seed"], [TRACK_TOKENS])[0] if c["track"] else None
    track, losses = [], []
    for s in range(spec.num_steps):
        params, state, out = prog.step_fn(params, state, jnp.asarray(tokens[s]), ctl.at(s))
        losses.append(float(out["loss"]))
        if s + 1 in c["track"] and s + 1 < spec.num_steps:
            r = lanczos(hessian_at(params, track_batch), n, c["iters"], rng)
            track.append({"step": s + 1, "tokens_seen": (s + 1) * c["batch"] * c["seq_len"],
                          **{k: v for k, v in r.items() if k != "y"}})
    evals, y = [], None
    for tok, b in zip(c["eval_tokens"], batches):
        r = lanczos(hessian_at(params, b), n, c["iters"], rng, start=y)
        y = r.pop("y")
        evals.append({"tokens": int(tok), **r})
    if c["track"] and c["steps"] in c["track"]:
        final = [e for e in evals if e["tokens"] == TRACK_TOKENS]
        if final:
            track.append({"step": c["steps"], "tokens_seen": c["steps"] * c["batch"] * c["seq_len"],
                          **{k: v for k, v in final[0].items() if k != "tokens"}})
    return {"final_loss": float(np.mean(losses[-10:])), "num_params": n, "eval": evals,
            "track": track, "seconds": time.perf_counter() - t0}


def plan_cells(plan: Mapping[str, Any], rerun: bool = False,
               include_optional: bool = True) -> list:
    """The plan's new rungs as cells ([sharpness.rungs] x seeds_per_rung seeds); with
    rerun=True the rerun variant of each (rerun_iters Lanczos steps from another start)."""
    qc = plan["sharpness"]["qc"]
    out = []
    for r in plan["sharpness"]["rungs"]:
        if r.get("optional") and not include_optional:
            continue
        steps = int(r["steps"])
        track = [steps // 4, steps // 2, steps] if steps >= 1000 else []
        for seed in range(int(qc["seeds_per_rung"])):
            out.append(cell(r["dim"], r["layers"], r["lr"], seed, steps=steps,
                            eps=r.get("eps"), track=track,
                            iters=int(qc["rerun_iters" if rerun else "lanczos_iters"]),
                            start=1 if rerun else 0))
    return out

