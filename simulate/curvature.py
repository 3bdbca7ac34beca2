"""Top curvature per depth group by power iteration with Hessian-vector products (JAX).

For a group g of parameter tensors (adamspike.depth_groups: embed, shallow, deep, head),
H_gg is the block of the Hessian of the differentiated minibatch loss restricted to the
group's coordinates (the other parameters held fixed). Two numbers per group:

    raw_curvature      lambda(H_gg)
    precond_curvature  lambda(P_g^(1/2) H_gg P_g^(1/2)) = lambda(P_g H_gg), with Bai et al.'s
                       preconditioner (arXiv 2506.04805; notes/theory.md section 4)
                       P = [(1-b1)/(1+b1)] / (1-b1^t) * diag(1 / (sqrt(v_hat) + eps)),
                       v_hat = v_t / (1-b2^t) the bias-corrected second moment, t Adam's
                       step count. Bai's stability condition is precond_curvature < 2/lr;
                       in the eps band (sqrt(v_hat) << eps) P -> c/eps, so it reads
                       raw_curvature < 2 (1+b1) / ((1-b1) lr / eps) there.

lambda is the eigenvalue of largest magnitude found by `num_iters` steps of power iteration
from a seeded Gaussian start (the Rayleigh quotient u^T M u of the last unit iterate; signed:
a dominant negative eigenvalue comes out negative). P^(1/2) H P^(1/2) is symmetric with the
same eigenvalues as P H, so the iteration is on a symmetric operator. Hessian-vector
products are forward-over-reverse, jax.jvp of jax.grad (Pearlmutter), all groups and both
operators at once under one jax.vmap over 2 x num_groups tangents (each tangent is zero
outside its group).

In the JAX trainer (simulate/llama_train.py, telemetry.curvature_every = K > 0) the
curvatures are taken every K steps at the parameters after the step, on that step's batch
(the loss Adam's gradient came from, times loss_scale, before clipping), with Adam's state
after the step, and written to the run directory's `curvature` table (step, group,
precond_curvature, raw_curvature, lr).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp


def precond_root(nu, count, b1, b2, eps):
    """Per coordinate sqrt(P) of Bai et al.'s preconditioner (module docstring):
    sqrt(c_t / (sqrt(v_t / (1-b2^t)) + eps)), c_t = (1-b1) / ((1+b1) (1-b1^t)), t = Adam's
    step count (at least 1). Shared by the power iteration here and Program.stability."""
    t = jnp.maximum(count.astype(jnp.float32), 1.0)
    c = (1 - b1) / (1 + b1) / (1 - b1 ** t)
    return jnp.sqrt(c / (jnp.sqrt(nu / (1 - b2 ** t)) + eps))


def make_curvature_fn(loss: Callable, groups: Mapping[str, str], group_names: Sequence[str],
                      num_iters: int = 20):
    """A jitted fn(params, batch, nu, count, b1, b2, eps, key) -> (raw (G,), precond (G,));
    eps: a scalar or a dict of one eps per parameter name.

    loss(params, batch) -> scalar; groups: parameter name -> group name; group_names: the
    G groups in output order (groups without parameters give 0); nu: Adam's v_t tree (same
    keys as params), count: Adam's step count t."""
    if num_iters < 1:
        raise ValueError(f"num_iters: must be >= 1, got {num_iters}")
    G = len(group_names)
    index = {g: i for i, g in enumerate(group_names)}
    member = {n: index[g] for n, g in groups.items()}

    def fn(params, batch, nu, count, b1, b2, eps, key):
        grad = jax.grad(lambda p: loss(p, batch))

        def hvp(t):
            return jax.jvp(grad, (params,), (t,))[1]

        scale = {}
        for n, p in params.items():
            mask = jnp.array([1.0 if member[n] == k % G else 0.0 for k in range(2 * G)],
                             p.dtype).reshape((2 * G,) + (1,) * p.ndim)
            e = eps[n] if isinstance(eps, dict) else eps   # per-tensor eps (per-group eps)
            pre = precond_root(nu[n], count, b1, b2, e).astype(p.dtype)
            is_pre = (jnp.arange(2 * G) >= G).reshape((2 * G,) + (1,) * p.ndim)
            scale[n] = mask * jnp.where(is_pre, pre[None], jnp.ones_like(p)[None])
        keys = jax.random.split(key, len(params))
        u = {n: jax.random.normal(k, (2 * G,) + p.shape, p.dtype) * scale[n].astype(bool)
             for (n, p), k in zip(params.items(), keys)}

        def norm(tree):
            return jnp.sqrt(sum(jnp.sum(jnp.square(x).reshape(2 * G, -1), axis=1)
                                for x in tree.values()))

        def normalize(tree):
            nrm = norm(tree)
            safe = jnp.where(nrm > 0, nrm, 1.0)
            return {n: x / safe.reshape((2 * G,) + (1,) * (x.ndim - 1)) for n, x in tree.items()}

        def apply(u):
            w = {n: scale[n] * u[n] for n in u}
            hw = jax.vmap(hvp)(w)
            return {n: scale[n] * hw[n] for n in u}

        def body(_, state):
            u, _ = state
            mu = apply(u)
            lam = sum(jnp.sum((u[n] * mu[n]).reshape(2 * G, -1), axis=1) for n in u)
            return normalize(mu), lam

        u = normalize(u)
        _, lam = jax.lax.fori_loop(0, num_iters, body, (u, jnp.zeros(2 * G, jnp.float32)))
        return lam[:G], lam[G:]

    return jax.jit(fn)
