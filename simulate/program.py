"""The one JAX training program of the tiny LLaMA (never torch).

Every tiny-LLaMA driver (the trainer simulate.llama_train, the vmapped seed arms
simulate.seeds, the width/depth ladder simulate.ladder, the causal replay simulate.replay)
runs this one step function; they differ only in how they call it:

    step(params, state, batch, c)  ->  (params, state, out)

with the per-step controls `c` (a `Controls` of traced arrays, so settings that differ only
in them share one compiled program):

    lr          ()     the step's learning rate, OptimSection.lr_at(t, num_steps)
    b1, b2      ()     Adam's decay rates
    eps         (n,)   each tensor's Adam eps (the registry's `eps` hook: group eps)
    max_norm    ()     global-norm clip threshold grad_clip * loss_scale (0: no clip)
    loss_scale  ()     s: the objective is s * loss (Adam on s L = Adam on L with eps / s)
    reset       (n,)   v <- 0 of these tensors just before the step (the `state` hook)
    frozen      (n,)   zero parameter change of these tensors (the `update` hook)
    skip        ()     the step's result is discarded: parameters and optimizer state kept
                       (Levanter's skip semantics; the lr schedule is the host's)
    poison      ()     every target replaced by POISON_TOKEN (a deterministic loss spike)

(n: the tensors in leaf order, simulate.telemetry.tensor_names). The step is, with g the
gradient of s * loss:

    v <- where(reset, 0, v)
    g <- g * min(1, max_norm / (||g|| + 1e-6))          (torch's clip_grad_norm_)
    m, v <- Adam moments;  r = m_hat / (sqrt(v_hat) + eps)   [/ max(1, rms_t): update_clip]
    p <- p - lr (r + wd p)   except where frozen;   (p, state) <- old where skip

(simulate.optim.adamw_chain with these scalars; the compiled-in rest: the architecture,
z-loss, compute dtype, the registry's model options (GLM shrink), update clipping, weight
decay, whether the clip is on, optim.bias_correction_offset: Adam's count starts there). `Program.controls(cfg, steps)` turns any RunConfig whose
static part equals the program's into its controls, so every registry mitigation works in
every driver.

Two compiled forms of the one step:
- `Program.step_fn`: jit(step), one step per call (static options: telemetry sums / r and
  sqrt(v_hat)/eps histograms, the native CPU telemetry kernel; which of them a step
  reports is a traced input, so a trainer run compiles one program; the telemetry's
  (b1, b2, eps) of a uniform eps are traced inputs too, so runs that differ only in them,
  e.g. the study's matched toy at eps 2e-3 and 2e-6, share one program). The trainer and the
  replay lanes call it, so the same settings on the same inputs give bit-identical results
  in both.
- `Program.run`: jit(vmap(scan(step))) over lanes (seeds, arms), all steps in one call;
  controls shared by the lanes or one set per lane. XLA compiles the scanned, vmapped body
  as another program: its results agree with `step_fn` to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamspike.config import ConfigError, to_dict
from adamspike.llama import spec_by_name
from adamspike.mitigations import StepPlan, plan as mitigation_plan
from adamspike.train_config import RunConfig
from simulate import llama as jllama
from simulate import native_telemetry
from simulate import optim as jopt
from simulate import telemetry as jtel
from simulate.curvature import precond_root

POISON_TOKEN = 0
TRACED = "traced"   # step(tel=(TRACED, eps > 0)): the telemetry's b1, b2, eps are inputs


def telemetry_inputs(tel: tuple | None) -> tuple[tuple | None, tuple | None]:
    """(static tel, tel_values) of `Program.step` for the config's (b1, b2, eps)
    (`Program.telemetry_spec`): one eps -> (TRACED, eps > 0) and the values as inputs; one
    eps per tensor (or None) as given, compiled in."""
    if tel is None or isinstance(tel[2], (list, tuple)):
        return tel, None
    b1, b2, eps = (float(x) for x in tel)
    return (TRACED, eps > 0), (np.float32(b1), np.float32(b2), np.float32(eps),
                               native_telemetry.exact_bits(b1, eps))


class Controls(NamedTuple):
    """Per-step traced inputs (module docstring); numpy arrays with a leading step axis
    from `Program.controls`, one step's slice (`at(i)`) for `Program.step_fn`."""
    lr: Any
    b1: Any
    b2: Any
    eps: Any
    max_norm: Any
    loss_scale: Any
    reset: Any
    frozen: Any
    skip: Any
    poison: Any

    def at(self, i: int) -> "Controls":
        return Controls(*(x[i] for x in self))


def step_plan(cfg: RunConfig) -> StepPlan:
    """The mitigation registry's plan for cfg's model (tensor depths of adamspike.llama)."""
    llama = cfg.model.llama()
    return mitigation_plan(cfg, {n: s.depth for n, s in spec_by_name(llama).items()},
                           llama.num_layers)


def static_key(cfg: RunConfig) -> str:
    """What is compiled into the program (everything else is a control or host-side)."""
    t, o = cfg.train, cfg.optim
    plan = step_plan(cfg)
    key = [to_dict(cfg.model), t.z_loss, t.dtype, plan.model_options, plan.update_clip,
           o.grad_clip > 0, o.weight_decay]
    if o.bias_correction_offset:   # Adam's initial count (keys of offset 0 as before it)
        key.append({"bias_correction_offset": o.bias_correction_offset})
    return json.dumps(key, sort_keys=True)


class Program:
    """The compiled step of one static configuration (`static_key`)."""

    def __init__(self, cfg: RunConfig):
        t, o = cfg.train, cfg.optim
        self.key = static_key(cfg)
        self.llama = llama = cfg.model.llama()
        plan = step_plan(cfg)
        self.update_clip, self.clip_on, self.weight_decay = (plan.update_clip, o.grad_clip > 0,
                                                             o.weight_decay)
        self.bias_correction_offset = o.bias_correction_offset
        shapes = jax.eval_shape(functools.partial(jllama.init_params, llama),
                                jax.random.PRNGKey(0))
        self.names = jtel.tensor_names(shapes)
        self.treedef = jax.tree.structure(shapes)
        options = dict(plan.model_options)
        # the objective: (s * loss, {"loss", "ce"}) with the registry's forward options
        self.loss = lambda p, b, s: jllama.loss_fn(p, b, llama, s, t.z_loss,  # noqa: E731
                                                   compute_dtype=t.dtype, **options)
        self._value_and_grad = jax.value_and_grad(self.loss, has_aux=True)
        self._step_jit = jax.jit(self.step,
                                 static_argnames=("tel", "hist", "native", "with_grads"))
        # one program for the whole init: run eagerly, the optimizer state's zeros compile
        # one tiny program per tensor shape (issue 37: distinct programs)
        self._init_jit = jax.jit(self._init_from_key)
        self._runs: dict[bool, Any] = {}

    def step_fn(self, params, state, batch, c: Controls, tel: tuple | None = None,
                hist: bool = False, native: bool = True, with_grads: bool = False,
                report=None):
        """jit(step), the telemetry's (b1, b2, eps) passed as traced inputs when eps is one
        float (compiled in: only whether eps > 0, which picks the native kernel and the
        padding's mask); one eps per tensor stays compiled in (its tensors are grouped by
        value at trace time)."""
        tel, values = telemetry_inputs(tel)
        return self._step_jit(params, state, batch, c, tel, hist, native, with_grads, report,
                              tel_values=values)

    # ------------------------------------------------------------------ the step
    def tx(self, c: Controls) -> optax.GradientTransformation:
        """simulate.optim.adamw_chain with the step's controls (freezing: `step`)."""
        eps = self.tree(list(c.eps[i] for i in range(len(self.names))))
        return jopt.adamw_chain(c.b1, c.b2, eps, c.lr, c.max_norm, self.weight_decay,
                                StepPlan(update_clip=self.update_clip), clip=self.clip_on,
                                bias_correction_offset=self.bias_correction_offset)

    def tree(self, leaves: Sequence) -> Any:
        return jax.tree.unflatten(self.treedef, list(leaves))

    def step(self, params, state, batch, c: Controls, tel: tuple | None = None,
             hist: bool = False, native: bool = True, with_grads: bool = False,
             report=None, tel_values=None):
        """One optimizer step (module docstring). out: loss (unscaled), grad_norm (pre-clip,
        of s * loss), clipped, update_norm, tensor_sumsq (n,) of the pre-clip gradient of
        s * loss, clip_scale; with tel = (b1, b2, eps) static floats (eps: a float, or one
        per tensor; the native kernel needs them static, so they are the config's, which
        the controls must equal; or tel = (TRACED, eps > 0) with tel_values = (b1, b2, eps
        as float32, native_telemetry.exact_bits(b1, eps)): `step_fn`) the telemetry sums,
        and with hist its histograms; with
        with_grads the gradient tree itself (`grads`, of s * loss, pre-clip).

        report (traced int, with tel): what this step's telemetry computes, 0 nothing (the
        outputs are zeros), 1 the sums, 2 the sums and (hist) the histograms, by
        `lax.switch`, so a run that reports on some steps only compiles one program, not
        one per kind of step (each ~4 s at level 1 for the tiny LLaMA; XLA:CPU runs only
        the taken branch). None: everything tel and hist ask for, on every call."""
        c = Controls(*(jnp.asarray(x) for x in c))
        edited = jopt.reset_second_moment(state, [c.reset[i] for i in range(len(self.names))])
        batch = jnp.where(c.poison, batch.at[:, 1:].set(POISON_TOKEN), batch)
        (_, aux), grads = self._value_and_grad(params, batch, c.loss_scale)
        updates, new_state = self.tx(c).update(grads, edited, params)
        updates = jopt.freeze_updates(updates, self.tree([c.frozen[i]
                                                          for i in range(len(self.names))]))
        new_params = optax.apply_updates(params, updates)
        grad_norm, scale, clipped = jopt.clip_info(new_state)
        out = {"loss": aux["loss"], "grad_norm": grad_norm, "clipped": clipped & ~c.skip,
               "update_norm": jnp.where(c.skip, 0.0, jopt.global_norm(updates)),
               "tensor_sumsq": jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32)))
                                          for g in jax.tree.leaves(grads)]),
               "clip_scale": scale}
        if with_grads:
            out["grads"] = grads
        if tel is not None:
            bits, positive = None, False
            if tel[0] == TRACED:
                positive = bool(tel[1])
                b1, b2, eps, bits = tel_values
            else:
                b1, b2, eps = tel
                eps = list(eps) if isinstance(eps, tuple) else eps
            prev, new = jopt.adam_state(edited), jopt.adam_state(new_state)

            def telemetry(with_hist: bool) -> dict:
                sums, hists = jtel.step_telemetry(grads, prev, new, new_params, b1, b2, eps,
                                                  with_hist=with_hist, grad_scale=scale,
                                                  native=native, bits=bits,
                                                  eps_positive=positive)
                if not with_hist:
                    return {"sums": sums}
                return {"sums": sums, "hists": hists, "vhists": jtel.step_vhists(new, b2, eps),
                        "g_below_eps": jtel.grad_below_eps(grads, eps, scale)}

            if report is None:
                out.update(telemetry(hist))
            else:   # every branch returns every output; what a branch does not compute: 0
                full = jax.eval_shape(lambda: telemetry(hist))

                def padded(part: dict) -> dict:
                    return {k: part[k] if k in part else jnp.zeros(v.shape, v.dtype)
                            for k, v in full.items()}
                branches = [lambda: padded({}), lambda: padded(telemetry(False))]
                if hist:   # without histograms, 2 is the sums' branch (not compiled twice)
                    branches.append(lambda: padded(telemetry(True)))
                out.update(jax.lax.switch(jnp.asarray(report, jnp.int32), branches))
        keep = lambda old, new: jax.tree.map(  # noqa: E731
            lambda a, b: jnp.where(c.skip, a, b), old, new)
        return keep(params, new_params), keep(state, new_state), out

    def stability(self, params, state, batch, c: Controls, u, num_iters: int = 3,
                  precondition: bool = True):
        """Adam's stability number at (params, state) on `batch`, by `num_iters` steps of
        power iteration warm-started from the previous call's unit vector `u` (a params
        tree; the top eigenvector moves slowly, so a few products track it):

            S = lr * lambda_max(P H_s) / 2,   P = c_t diag(1 / (sqrt(v_hat) + eps)),
            c_t = (1-b1) / ((1+b1) (1-b1^t))

        (H_s: the Hessian of s * loss; Bai et al.'s preconditioner, simulate.curvature; the
        operator iterated is the symmetric P^(1/2) H_s P^(1/2)). S > 1 is past Adam's edge of
        stability (Cohen et al. 2022: lr lambda_max(diag(sqrt(v_hat)+eps)^-1 H) = 2 (1+b1) /
        (1-b1)); in the eps band (sqrt(v_hat) << eps) it is Pi_eps / 38 at b1 0.9 with
        Pi_eps = (lr / eps) lambda_max(H). lambda is the Rayleigh quotient (signed: a dominant
        negative eigenvalue gives S < 0). Returns (S, u).

        precondition=False iterates the raw Hessian of the unscaled loss instead and returns
        its top eigenvalue lambda_max(H) (the sharpness: Pi_eps = (lr / eps) lambda_max(H)
        is the eps band's stability number, threshold 2 (1+b1) / (1-b1)). `batch` (B, T+1),
        or (k, B, T+1): the Hessian of the mean loss over k chunks, one chunk in memory at a
        time (simulate.batch_sharpness evaluates large batches so)."""
        c = Controls(*(jnp.asarray(x) for x in c))

        def hvp(w):   # H w; batch (k, B, T+1): the mean over k chunks (one at a time)
            def one(b):
                return jax.jvp(jax.grad(lambda p: self.loss(p, b, c.loss_scale)[0]),
                               (params,), (w,))[1]
            if batch.ndim == 2:
                return one(batch)
            return jax.tree.map(lambda x: x.mean(0), jax.lax.map(one, batch))
        adam = jopt.adam_state(state)
        eps = self.tree(list(c.eps[i] for i in range(len(self.names))))
        root = jax.tree.map(lambda v, e: precond_root(v, adam.count, c.b1, c.b2, e)
                            if precondition else jnp.ones_like(v), adam.nu, eps)

        def dot(a, b):
            return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

        def normalize(a):
            n = jnp.sqrt(dot(a, a))
            return jax.tree.map(lambda x: x / jnp.where(n > 0, n, 1.0), a)

        def apply(u):   # P^(1/2) H P^(1/2) u
            return jax.tree.map(jnp.multiply, root, hvp(jax.tree.map(jnp.multiply, root, u)))

        def body(_, carry):
            u, _ = carry
            w = apply(u)
            return normalize(w), dot(u, w)

        u, lam = jax.lax.fori_loop(0, num_iters, body, (normalize(u), jnp.zeros([], jnp.float32)))
        return (c.lr * lam / 2 if precondition else lam / c.loss_scale), u

    # ------------------------------------------------------------------ inputs
    def init(self, seed: int | jax.Array):
        """(params, optimizer state) of train.seed `seed` (a key when traced)."""
        key = jax.random.PRNGKey(seed) if isinstance(seed, (int, np.integer)) else seed
        return self._init_jit(key)

    def _init_from_key(self, key: jax.Array):
        params = jllama.init_params(self.llama, key)
        zero = jnp.zeros([], jnp.float32)
        blank = Controls(zero, zero, zero, jnp.zeros(len(self.names)), zero, zero,
                         *(None,) * 4)
        return params, self.tx(blank).init(params)

    def controls(self, cfg: RunConfig, steps: Sequence[int], offset: int = 0) -> Controls:
        """The controls of cfg (whose static part must be this program's) at optimizer
        steps `steps` (1-based; data offset `offset`: batch s + offset is read, as the
        guard's skipped batches shift it), numpy with a leading step axis."""
        if static_key(cfg) != self.key:
            raise ConfigError("the controls' config differs from the program's in a compiled "
                              "setting (model, train.z_loss, train.dtype, model options, "
                              "mitigation.update_clip, optim.grad_clip on/off, "
                              "optim.weight_decay, optim.bias_correction_offset)")
        t, o, d = cfg.train, cfg.optim, cfg.data
        plan = step_plan(cfg)
        steps = [int(s) for s in steps]
        k, n = len(steps), len(self.names)
        full = lambda v: np.full(k, v, np.float32)  # noqa: E731
        frozen, reset = np.zeros((k, n), bool), np.zeros((k, n), bool)
        for i, s in enumerate(steps):
            f, r = set(plan.frozen_at(s)), set(plan.v_reset.get(s, ()))
            frozen[i] = [nm in f for nm in self.names]
            reset[i] = [nm in r for nm in self.names]
        eps = np.array([plan.tensor_eps.get(nm, o.eps) for nm in self.names], np.float32)
        skip, poison = set(d.skip_batches), set(d.poison_steps)
        return Controls(
            lr=np.array([o.lr_at(s, t.num_steps) for s in steps], np.float32),
            b1=full(o.b1), b2=full(o.b2), eps=np.broadcast_to(eps, (k, n)).copy(),
            max_norm=full(o.grad_clip * t.loss_scale), loss_scale=full(t.loss_scale),
            reset=reset, frozen=frozen, skip=np.array([s in skip for s in steps]),
            poison=np.array([s + offset in poison for s in steps]))

    def telemetry_spec(self, cfg: RunConfig) -> tuple:
        """The config's (b1, b2, eps) for step_fn(tel=...): eps a float when uniform (then
        traced inputs: `telemetry_inputs`), else one per tensor (compiled in)."""
        plan, o = step_plan(cfg), cfg.optim
        eps = tuple(float(plan.tensor_eps.get(nm, o.eps)) for nm in self.names)
        return (float(o.b1), float(o.b2), eps[0] if len(set(eps)) == 1 else eps)

    # ------------------------------------------------------------------ lanes
    def run(self, seeds: Sequence[int], batches, controls: Controls, *, vmapped: bool = True,
            per_lane: bool = False, curvature_every: int = 0, sharpness: bool = False,
            curvature_iters: int = 3, secant: bool = False) -> dict[str, np.ndarray]:
        """Lanes as one program: one lane per seed (init key PRNGKey(seed)), batches
        (lanes, steps, B, T+1), controls with a step axis (shared by the lanes) or
        (per_lane) a lanes axis first; vmapped=False calls the program one lane at a time
        (the same compiled scan at width 1). Returns per lane and step float64 arrays: loss,
        grad_norm, update_norm, clip_scale (lanes, steps) and tensor_sumsq (lanes, steps, n);
        with curvature_every = K > 0 (steps a multiple of K) also `stability` (lanes,
        steps // K): `stability` after every K-th step (K, 2K, ...), its vector carried from
        one to the next; sharpness=True adds `sharpness` (lanes, steps // K): lambda_max(H)
        of the unscaled loss at the same points, by its own warm-started vector;
        curvature_iters: Hessian-vector products per evaluation and vector; secant=True adds
        the online proxy of each block of K steps (`secant_readings`: S_secant and
        sharpness_secant, lanes x steps // K), from consecutive gradients and updates only."""
        K = int(curvature_every)
        num_steps = np.shape(controls.lr)[1 if per_lane else 0]
        if K and num_steps % K:
            raise ValueError(f"curvature_every {K}: the number of steps {num_steps} is not "
                             "a multiple")
        # host arrays: stacking and slicing jax arrays eagerly compiles a small program per
        # shape (issue 37: distinct programs); the jitted run takes them as they are
        keys = np.stack([np.asarray(jax.random.PRNGKey(int(k))) for k in seeds])
        batches = np.asarray(batches)
        ctl = tuple(np.asarray(x) for x in controls)
        if vmapped:
            outs = self._run(per_lane, K, sharpness, curvature_iters, secant)(keys, batches, ctl)
        else:
            one = lambda i: self._run(per_lane, K, sharpness, curvature_iters, secant)(  # noqa: E731
                keys[i:i + 1], batches[i:i + 1],
                tuple(x[i:i + 1] for x in ctl) if per_lane else ctl)
            per = jax.device_get([one(i) for i in range(len(keys))])   # all dispatched first
            outs = tuple(np.concatenate(parts) for parts in zip(*per))
        if secant and not K:
            raise ValueError("secant: needs curvature_every > 0 (one reading per block)")
        names = (RUN_OUTPUTS + (CURVATURE_OUTPUTS[:1 + bool(sharpness)] if K else ())
                 + (SECANT_OUTPUTS if secant else ()))
        return {k: np.asarray(v, np.float64) for k, v in zip(names, jax.device_get(outs))}

    def _run(self, per_lane: bool, curvature_every: int = 0, sharpness: bool = False,
             num_iters: int = 3, secant: bool = False):
        """jit(vmap(scan(step))), compiled once per lane layout of the controls (and K:
        then a scan over blocks of K steps, the block's last step followed by
        `stability`, and `sharpness` and the secant proxy when asked)."""
        K = curvature_every
        key = (per_lane, K, sharpness, num_iters, secant)
        if key not in self._runs:
            def body(carry, x):
                params, state = carry
                params, state, out = self.step(params, state, x[0], Controls(*x[1]))
                return (params, state), tuple(out[k] for k in RUN_OUTPUTS)

            def block(carry, x):   # K steps, then the stability number at the last one
                carry, us = carry
                if secant:
                    (carry, sec), (outs, sums) = jax.lax.scan(secant_body, (carry, us[-1]), x)
                else:
                    carry, outs = jax.lax.scan(body, carry, x)
                toks, ctl = jax.tree.map(lambda a: a[-1], x)
                S, u = self.stability(*carry, toks, Controls(*ctl), us[0], num_iters)
                new_us, curv = (u,), (S,)
                if sharpness:
                    lam, w = self.stability(*carry, toks, Controls(*ctl), us[1], num_iters,
                                            precondition=False)
                    new_us, curv = new_us + (w,), curv + (lam,)
                if secant:
                    new_us += (sec,)
                    curv += secant_readings(jnp.sum(sums, axis=0), ctl[0], ctl[5])
                return (carry, new_us), (outs,) + curv

            def secant_body(carry, x):
                (params, state), sec = carry
                c = Controls(*x[1])
                new_params, new_state, out = self.step(params, state, x[0], c, with_grads=True)
                sec, sums = secant_update(sec, out.pop("grads"), new_params, params,
                                          self._pinv(new_state, c))
                return ((new_params, new_state), sec), (tuple(out[k] for k in RUN_OUTPUTS),
                                                        sums)

            def run_one(key, toks, ctl):
                carry = self.init(key)
                xs = (toks, tuple(ctl))
                if not K:
                    return jax.lax.scan(body, carry, xs)[1]
                blocks = jax.tree.map(lambda a: a.reshape((-1, K) + a.shape[1:]), xs)
                leaves = jax.tree.leaves(carry[0])
                us = tuple(self.tree([jax.random.normal(k, x.shape, jnp.float32) for k, x in
                                      zip(jax.random.split(jax.random.fold_in(key, 1 + i),
                                                           len(leaves)), leaves)])
                           for i in range(1 + bool(sharpness)))
                if secant:
                    us += (secant_init(carry[0]),)
                outs, *curv = jax.lax.scan(block, (carry, us), blocks)[1]
                return tuple(a.reshape((-1,) + a.shape[2:]) for a in outs) + tuple(curv)

            self._runs[key] = jax.jit(jax.vmap(run_one, in_axes=(0, 0, 0 if per_lane else None)))
        return self._runs[key]

    def _pinv(self, state, c: Controls):
        """P^-1 per coordinate of Bai et al.'s preconditioner at `state` (`stability`)."""
        adam = jopt.adam_state(state)
        eps = self.tree(list(c.eps[i] for i in range(len(self.names))))
        return jax.tree.map(lambda v, e: 1.0 / jnp.square(precond_root(v, adam.count, c.b1,
                                                                          c.b2, e)),
                            adam.nu, eps)


RUN_OUTPUTS = ("loss", "grad_norm", "update_norm", "clip_scale", "tensor_sumsq")
CURVATURE_OUTPUTS = ("stability", "sharpness")
SECANT_OUTPUTS = ("S_secant", "sharpness_secant")


# ---------------------------------------------------------------- the online curvature proxy
class Secant(NamedTuple):
    """What the proxy keeps from step t-1: g_{t-1}, u_{t-1} = p_t - p_{t-1} and the products
    g_{t-1}.u_{t-1}, u_{t-1}' P_{t-1}^-1 u_{t-1}, |u_{t-1}|^2 (one parameter-sized buffer
    besides the gradient, so a 70B run can afford it: fullscale.megatron_probe)."""
    g: Any
    u: Any
    gu: jax.Array
    upu: jax.Array
    uu: jax.Array


def _dot(a, b, w=None) -> jax.Array:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    lw = jax.tree.leaves(w) if w is not None else [1.0] * len(la)
    return sum(jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32) * z)
               for x, y, z in zip(la, lb, lw))


def secant_init(params) -> Secant:
    zero = jnp.zeros([], jnp.float32)
    return Secant(jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
                  zero, zero, zero)


def secant_update(sec: Secant, g, new_params, params, pinv) -> tuple[Secant, jax.Array]:
    """One step t of the proxy: g = g_t (the gradient of s * loss at p_t, pre-clip),
    u_t = new_params - params, pinv = P_t^-1. Returns the new state and the step's terms

        [(g_t - g_{t-1}) . u_{t-1},   u_{t-1}' P_{t-1}^-1 u_{t-1},   |u_{t-1}|^2]

    g_t - g_{t-1} = H u_{t-1} + (noise of batch t) - (noise of batch t-1), so the first
    term is u' H u plus a positive bias (u_{t-1} was made from g_{t-1}'s own noise). The
    unbiased lag, (g_t - g_{t-1}) . u_{t-2}, was tried and tracked the power iteration
    worse (docs/results/science3_2026-12-05.md): at the edge consecutive updates' top
    components alternate in sign and cancel in u_{t-2}' H u_{t-1}."""
    u = jax.tree.map(jnp.subtract, new_params, params)
    terms = jnp.stack([_dot(g, sec.u) - sec.gu, sec.upu, sec.uu])
    return Secant(g, u, _dot(g, u), _dot(u, u, pinv), _dot(u, u)), terms


def secant_readings(sums: jax.Array, lr, loss_scale) -> tuple[jax.Array, jax.Array]:
    """The proxy over a block of steps from the sums of `secant_update`'s terms: the
    Rayleigh quotient of P^(1/2) H_s P^(1/2) along the block's updates (a ratio of sums, so
    the noisy single-step terms average out) as a stability number S_secant = lr q / 2, and
    that of the unscaled H (sharpness_secant). Along the update, not the top eigenvector,
    so both sit below `Program.stability`'s readings, by a factor the phase map measures
    (analysis.phase_map: rank correlation and median ratio)."""
    num, den, uu = sums[0], sums[1], sums[2]
    ratio = lambda a, b: jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), jnp.nan)  # noqa: E731
    return lr * ratio(num, den) / 2, ratio(num, uu) / loss_scale


_PROGRAMS: dict[str, Program] = {}


def program(cfg: RunConfig) -> Program:
    """The Program of cfg's static part, shared by every config (and driver) with it in
    this process (bounded cache)."""
    key = static_key(cfg)
    if key not in _PROGRAMS:
        if len(_PROGRAMS) >= 8:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = Program(cfg)
    return _PROGRAMS[key]
