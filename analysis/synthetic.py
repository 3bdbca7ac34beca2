"""Synthetic run directories with known ground truth, for tests, benchmarks and demos.

NOT measurements: every value is drawn from the model below, so an analysis run on it can
be checked against the truth (spike steps, precursor lead, eps scale). Layout, names,
depths and sizes come from adamspike.depth_groups import is_shallow
from adamspike.llama.param_specs (the 70B preset gives the real
723 tensors), written through RunWriter like a real backend.

Per tensor l (depth d) and step t, away from spikes:
    rho_l        = rho_shallow (embed + shallow groups of adamspike.depth_groups) or rho_deep,
                   times lognormal noise
    phi_l        fixed per tensor; grad_mom_cos = theory cos(phi) + N(0, 0.01)
    update_rms   = theory update_rms(rho * eps_scale, phi(grad_mom_cos)) x lognormal(0.03)
                   (eps_scale = 1: the run's eps acts as configured)
    rms_t ~ 1, sat_frac ~ 1e-3, r raw moments of a centred Gaussian of that rms
In the `lead` steps before a spike the shallow tensors ramp up: grad_rms x kappa, rms_t up
to min(kappa, 1/sqrt(1-b2)), sat_frac -> 0.5, grad_mom_cos -> 0.6, r turning bimodal
(kurtosis 3 -> 1, bimodality 1/3 -> 1); deep tensors do not move. The loss (2 + 3 e^{-t/T})
jumps by `height` at the spike start and decays back with time constant `decay`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.stats import norm
from tqdm import tqdm

from adamspike.depth_groups import is_shallow
from adamspike.llama import param_specs, preset
from adamspike.metrics import HIST_EDGES
from adamspike.rundir import RunWriter, environment
from analysis.fits import UpdateRmsModel, phi_from_cos
from theory.adam_moments import grad_mom_cos
from theory.transients import dormant_rms_t_bound


def _hist_probs(u: float, w: float) -> np.ndarray:
    """Bin probabilities of r: (1-w) N(0, u^2) + w (+-u with small spread)."""
    e = HIST_EDGES.copy()
    e[0], e[-1] = -np.inf, np.inf
    gauss = np.diff(norm.cdf(e / max(u, 1e-12)))
    s = 0.15 * max(u, 1e-12)
    bim = 0.5 * (np.diff(norm.cdf((e - u) / s)) + np.diff(norm.cdf((e + u) / s)))
    return (1 - w) * gauss + w * bim


def write_synthetic_run(path: str | Path, *, model: str = "tiny", num_steps: int = 600,
                        spikes: Sequence[int] = (300,), lead: int = 10, height: float = 1.0,
                        decay: float = 3.0, kappa: float = 4.0, b1: float = 0.9,
                        b2: float = 0.95, eps: float = 1e-5, lr: float = 1e-3,
                        rho_shallow: float = 0.3, rho_deep: float = 20.0,
                        eps_scale: float = 1.0, hist_every: int = 10, seed: int = 0,
                        flush_every_rows: int = 50_000, progress: bool = False) -> Path:
    """Write a run directory (backend "torch") following the module docstring's model."""
    rng = np.random.default_rng(seed)
    specs = param_specs(preset(model))
    names = [s.name for s in specs]
    depth = np.array([s.depth for s in specs], dtype=np.int32)
    kind = [s.kind for s in specs]
    numel = np.array([int(np.prod(s.shape)) for s in specs], dtype=np.int64)
    shallow = np.asarray(is_shallow(depth, preset(model).num_layers))
    num_t = len(specs)
    rho0 = np.where(shallow, rho_shallow, rho_deep) * np.exp(0.2 * rng.standard_normal(num_t))
    phi = np.clip(0.1 + 0.05 * rng.standard_normal(num_t), -0.2, 0.5)
    cos0 = np.array([grad_mom_cos(b1, phi=float(p)) for p in phi])
    umodel = UpdateRmsModel(b1, b2)
    bound = dormant_rms_t_bound(b2)
    spikes = sorted(int(s) for s in spikes)
    config = {"model": {"preset": model},
              "optim": {"lr": lr, "b1": b1, "b2": b2, "eps": eps, "grad_clip": 1.0},
              "train": {"num_steps": num_steps, "global_batch_size": 16, "seq_len": 32},
              "telemetry": {"every": 1, "hist_every": hist_every},
              "synthetic": {"spikes": spikes, "lead": lead, "height": height,
                            "kappa": kappa, "eps_scale": eps_scale, "seed": seed}}
    env = environment(device="synthetic", world_size=1)
    steps_iter = range(1, num_steps + 1)
    if progress:
        steps_iter = tqdm(steps_iter, desc="synthetic run", unit="step", mininterval=5)
    with RunWriter(path, backend="torch", config=config, env=env,
                   flush_every_rows=flush_every_rows, flush_every_s=1e9) as w:
        for t in steps_iter:
            # precursor ramp a in [0, 1] (shallow only) and spike relaxation
            a = 0.0
            bump = 0.0
            for s in spikes:
                if s - lead <= t < s:
                    a = max(a, (t - (s - lead) + 1) / lead)
                elif t >= s:
                    a = max(a, math.exp(-(t - s) / decay) if t - s < 5 * decay else 0.0)
                    bump += height * math.exp(-(t - s) / decay)
            amp = np.where(shallow, 1.0 + (kappa - 1.0) * a, 1.0)
            rho = rho0 * amp * np.exp(0.05 * rng.standard_normal(num_t))
            grad_rms = rho * eps
            cos = np.clip(cos0 + (0.6 - cos0) * a * shallow + 0.01 * rng.standard_normal(num_t),
                          -1, 1)
            # theory-consistent: the update follows the correlation the logged cosine shows
            u = umodel(rho * eps_scale, phi_from_cos(cos, b1)) * \
                np.exp(0.03 * rng.standard_normal(num_t))
            wbim = np.where(shallow, a, 0.0)
            r_m2 = u * u
            r_m4 = r_m2 * r_m2 * (3.0 * (1 - wbim) + 1.0 * wbim)
            rms_t = np.where(shallow, 1.0 + (min(kappa, bound) - 1.0) * a, 1.0) * \
                np.exp(0.02 * rng.standard_normal(num_t))
            sat = np.clip(1e-3 + 0.5 * wbim + 2e-4 * rng.standard_normal(num_t), 0, 1)
            cols = {"name": names, "depth": depth, "kind": kind, "numel": numel,
                    "grad_rms": grad_rms, "rho": rho, "update_rms": u, "rms_t": rms_t,
                    "sat_frac": sat, "eps_frac": np.where(rho < 1, 0.5, 0.01),
                    "r_mean": 1e-3 * rng.standard_normal(num_t), "r_m2": r_m2,
                    "r_m3": np.zeros(num_t), "r_m4": r_m4,
                    "m_v_ratio": u * (1 + 1 / rho), "grad_mom_cos": cos,
                    "param_rms": np.full(num_t, 0.02)}
            w.log_layers(t, columns=cols)
            loss = (2.0 + 3.0 * math.exp(-t / 2000.0)) * (1 + 0.005 * rng.standard_normal()) \
                * (1 + bump)
            gnorm = float(np.sqrt(np.sum(numel * grad_rms ** 2)))
            w.log_step(step=t, tokens=t * 16 * 32, loss=loss, lr=lr, grad_norm=gnorm,
                       clipped=gnorm > 1.0, update_norm=float(lr * np.sqrt(np.sum(numel * u * u))),
                       step_time_s=0.1, skipped=False)
            if hist_every and t % hist_every == 0:
                for i in range(num_t):
                    counts = np.rint(numel[i] * _hist_probs(float(u[i]), float(wbim[i])))
                    w.log_hist(t, names[i], int(depth[i]), kind[i], counts.astype(np.int64))
    return Path(path)
