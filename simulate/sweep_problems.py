"""The problems `adamspike sweep` can grid over: batched adapters around simulate/.

Each adapter is a `simulate.sweep.Problem`: its parameters (static ones fix shapes / code
paths, the others are vmapped per run), and `run(static, scalars, seeds)` returning traces
[N, T]: loss, an optional detection signal, and the precursors of the problem's "shallow"
parameters (rms_t, sat_frac, bimodality, grad_mom_cos, rho; adamspike.metrics definitions).

quadratic  simulate.quadratic (Bai et al.): 1/2 theta^T H theta under Adam, float64 with an
           exact power-of-two rescaling. Spikes are counted by simulate.quadratic.count_spikes
           (analysis.spikes on the running max of log10 loss, >= min_decades high), so
           spike heights are in decades. Seeds only matter through gradient noise
           (`noise` > 0). The single tensor theta is its own "shallow layer".
"""

from __future__ import annotations

import functools

import numpy as np

from adamspike.config import ConfigError
from simulate.sweep import Param, Problem

_B = dict(lo=0.0, hi=1.0, hi_open=True)


# ----------------------------------------------------------------------------- quadratic

@functools.lru_cache(maxsize=32)
def _quadratic_fn(spec):
    import jax

    from simulate.quadratic import simulate_quadratic
    return jax.jit(jax.vmap(lambda hp: simulate_quadratic(hp, spec)))


def _precursors(sums: np.ndarray, eps: np.ndarray) -> dict[str, np.ndarray]:
    """[N, T, NUM_SUMS] telemetry sums -> precursor traces [N, T] (per-run eps)."""
    from adamspike.metrics import finalize, shape_stats

    out = {k: [] for k in ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    for s, e in zip(sums, eps):
        with np.errstate(all="ignore"):
            m = finalize(s, float(e)) if e > 0 else finalize(s, 1.0)
            bc = shape_stats(m["r_mean"], m["r_m2"], m["r_m3"], m["r_m4"])["bimodality"]
        for k in ("rms_t", "sat_frac", "grad_mom_cos", "rho"):
            out[k].append(m[k] if (k != "rho" or e > 0) else np.full_like(m[k], np.inf))
        out["bimodality"].append(bc)
    return {k: np.asarray(v) for k, v in out.items()}


def _quadratic_spec(p: dict):
    from simulate.quadratic import QuadraticSpec
    return QuadraticSpec(num_steps=p["steps"], dim=p["dim"], lam_min=p["lam_min"],
                         lam_max=p["lam_max"], rotate=p["rotate"], record_sums=True)


def _check_quadratic(cell: dict) -> None:
    try:
        _quadratic_spec(cell)
    except ValueError as e:
        raise ConfigError(f"quadratic cell: {e}") from None


def _run_quadratic(static: dict, scalars: dict, seeds: np.ndarray) -> dict:
    import jax

    spec = _quadratic_spec(static)
    hp = {k: np.asarray(scalars[k], np.float64) for k in ("lr", "eps", "b1", "b2", "noise", "theta0")}
    hp["seed"] = np.asarray(seeds, np.uint32)
    with jax.enable_x64(True):
        out = jax.tree.map(np.asarray, _quadratic_fn(spec)(hp))
    return {"loss": out["loss"], "signal": out["log10_loss"],
            **_precursors(out["sums"], hp["eps"])}


def _detect_quadratic(signal: np.ndarray, **kw):
    from simulate.quadratic import count_spikes
    sp = count_spikes(signal, **kw)
    sp["height"] = sp["log10_height"]
    return sp


QUADRATIC = Problem(
    name="quadratic",
    params={
        "steps": Param(20_000, static=True, lo=10),
        "dim": Param(1, static=True, lo=1),
        "lam_min": Param(1.0, static=True, lo=0.0, lo_open=True),
        "lam_max": Param(1.0, static=True, lo=0.0, lo_open=True),
        "rotate": Param(False, static=True),
        "lr": Param(1e-2, lo=0.0, lo_open=True),
        "eps": Param(1e-8, lo=0.0),
        "b1": Param(0.9, **_B),
        "b2": Param(0.999, **_B),
        "noise": Param(0.0, lo=0.0),
        "theta0": Param(1.0),
    },
    run=_run_quadratic,
    spikes={},
    max_vmap=128,
    detect=_detect_quadratic,
    spike_keys=("window", "min_decades", "detect_window", "k"),
    height_unit="decades",
    check=_check_quadratic,
)
