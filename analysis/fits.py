"""Measured telemetry against the closed forms of theory/.

1. update_rms. Each (step, tensor) row gives rho = rms(g)/eps and grad_mom_cos. The theory
   stream is Gaussian AR(1) per coordinate, zero mean (snr = 0): phi follows from
   grad_mom_cos by inverting theory.adam_moments.grad_mom_cos (stationary, monotone in
   phi), and the prediction is theory.eps_regime.update_rms(rho, b1, b2, phi). A positive
   gradient mean would also raise grad_mom_cos; with snr = 0 it is read as phi (stated, not
   hidden). The prediction is tabulated once per (b1, b2) on a (log10 rho, phi) grid with
   the second-order method (within ~1 % of the exact one at phi <= 0.3, ~4 % at 0.5) and
   interpolated; outside the rho range it follows the frozen (linear) and scale-invariant
   (flat) limits. For b2 > 0.99 the grid would cost minutes, and there the v_hat
   fluctuations are negligible, so the deterministic-v limit
       update_rms = sqrt(E m_hat^2) / (rms(g) + eps)
   is used (0.2996 vs exact 0.2993 at b2 = 0.999, phi = 0.3, rho = 100).
   Reported: R^2 of log(update_rms) (measured vs predicted, no free parameter), the median
   ratio, and a one-parameter fit of an effective eps scale c (prediction at rho * c; c = 1
   means the run's eps acts as configured) with its R^2. c is identifiable only when rows
   reach rho <= 10 (in the scale-invariant regime update_rms does not depend on eps):
   `eps_scale_identifiable` is False when fewer than 5 % of the rows do. Rows before step 3 / (1 - b2) are
   left out (the tabulated theory is stationary).
2. rms_t. Bound 1/sqrt(1-b2) after a dormant stretch (theory.transients.dormant_rms_t_bound):
   fraction of rows above it. Transients: at a step-up of a tensor's gradient scale by
   kappa after a quiet stretch, the measured rms_t for k = 1..K against
   theory.transients.step_up(b1, b2, kappa) (computed for b2 <= 0.99 only: its cost grows
   like 1/(1-b2)).
3. Regime per spike: the rho of each depth group before the spike (the median over the
   window's logged steps of adamspike.depth_groups.group_rho over the group's tensors),
   classified by theory.eps_regime.regime (frozen < 0.1 <= transition <= 10 <
   scale-invariant), and Bai's eps* = lr lam (1-b1)/(2(1+b1)) where the run records a curvature.
4. update_rms with per-coordinate heterogeneity (fit_update_rms_heterogeneous), on the
   histogram steps that carry a sqrt(v_hat)/eps histogram (the vhists table): each
   coordinate at its own rho (the histogram's bin centres), the exact (Laplace) stationary
   form where the expansion is off (b2 <= 0.99; the deterministic-v limit above), phi from
   grad_mom_cos; and the same conditioned on the measured m_v_ratio. Reported per band of
   rho (< 0.1, 0.1-10, > 10) next to item 1's model on the same rows, with the measurements
   that test its assumptions (failing_assumption): gradient power over v_hat, burstiness,
   m_v_ratio against its zero-mean value, kurtosis of r.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.interpolate import RegularGridInterpolator
from scipy.optimize import minimize_scalar

from adamspike.depth_groups import group_rho
from adamspike.metrics import NUM_VHIST_BINS, shape_stats, vhist_centers
from adamspike.rundir import atomic_write_bytes
from analysis.precursors import depth_group
from theory.adam_moments import grad_mom_cos as theory_grad_mom_cos
from theory.eps_regime import RHO_FROZEN, RHO_SCALE_INVARIANT, REGIMES, regime, regimes, update_rms
from theory.quadratic import critical_eps
from theory.transients import dormant_rms_t_bound, step_up

LOG_RHO_GRID = np.linspace(-2.5, 2.5, 31)
PHI_GRID = np.array([-0.3, -0.15, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
KAPPA_GRID = np.array([1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0])
EXPENSIVE_B2 = 0.99
MAX_FIT_ROWS = 200_000


def r2_score(y: np.ndarray, yhat: np.ndarray) -> float:
    """1 - SS_res / SS_tot (can be negative: the prediction is worse than the mean)."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0:
        return math.nan
    return 1.0 - float(np.sum((y - yhat) ** 2)) / ss_tot


# ------------------------------------------------------------------ phi from grad_mom_cos

@functools.lru_cache(maxsize=16)
def _cos_table(b1: float) -> tuple[np.ndarray, np.ndarray]:
    phi = np.linspace(-0.99, 0.99, 397)
    cos = np.array([theory_grad_mom_cos(b1, phi=float(p)) for p in phi])
    return phi, cos


def phi_from_cos(cos, b1: float) -> np.ndarray:
    """Invert the stationary zero-mean grad_mom_cos(phi) (clipped to phi in [-0.99, 0.99])."""
    phi, c = _cos_table(float(b1))
    return np.interp(np.asarray(cos, float), c, phi)


# ------------------------------------------------------------------ update_rms model

@dataclass(frozen=True)
class UpdateRmsModel:
    """Theory's update_rms(rho, phi) at fixed (b1, b2), tabulated (see module doc)."""
    b1: float
    b2: float

    @functools.cached_property
    def method(self) -> str:
        return "deterministic-v limit" if self.b2 > EXPENSIVE_B2 else "second-order grid"

    @functools.cached_property
    def _interp(self) -> RegularGridInterpolator:
        return _grid(self.b1, self.b2)

    def __call__(self, rho, phi) -> np.ndarray:
        rho = np.asarray(rho, float)
        phi = np.clip(np.asarray(phi, float), PHI_GRID[0], PHI_GRID[-1])
        if self.b2 > EXPENSIVE_B2:
            em2 = _em2(self.b1, phi)
            return np.sqrt(em2) * rho / (rho + 1.0)
        lr = np.log10(rho)
        lo, hi = LOG_RHO_GRID[0], LOG_RHO_GRID[-1]
        out = 10.0 ** self._interp(np.stack([np.clip(lr, lo, hi), phi], axis=-1))
        return np.where(lr < lo, out * 10.0 ** (lr - lo), out)  # frozen: linear in rho


def _em2(b1: float, phi: np.ndarray) -> np.ndarray:
    """Stationary E m_hat^2 / sigma^2 of a zero-mean AR(1) stream."""
    c = (1 - b1) / (1 + b1)
    return c * (1 + phi * b1) / (1 - phi * b1)


@functools.lru_cache(maxsize=8)
def _grid(b1: float, b2: float) -> RegularGridInterpolator:
    vals = np.empty((len(LOG_RHO_GRID), len(PHI_GRID)))
    for i, lr in enumerate(LOG_RHO_GRID):
        for j, p in enumerate(PHI_GRID):
            vals[i, j] = update_rms(10.0 ** lr, b1, b2, float(p), method="second_order")
    return RegularGridInterpolator((LOG_RHO_GRID, PHI_GRID), np.log10(vals))


def optim_params(config: dict) -> dict:
    """b1, b2, eps, lr, grad_clip from a run's config: the optim section (RunConfig), else
    the problem section (simulate's quadratic / mlp runs); None if absent."""
    config = config or {}
    out = {}
    for k in ("b1", "b2", "eps", "lr", "grad_clip"):
        v = None
        for sec in ("optim", "problem"):
            d = config.get(sec) or {}
            if isinstance(d, dict) and d.get(k) is not None:
                v = float(d[k])
                break
        out[k] = v
    return out


@dataclass
class UpdateFit:
    b1: float
    b2: float
    method: str
    num_rows: int
    r2_log: float            # no free parameter
    median_ratio: float      # measured / predicted
    eps_scale: float         # fitted c: prediction at rho * c
    r2_log_fitted: float
    by_group: pd.DataFrame   # group, regime: num_rows, median ratio, r2
    rows: pd.DataFrame = field(repr=False)  # step, name, depth, rho, phi, measured, predicted
    frac_eps_sensitive: float = math.nan  # rows with rho <= 10 (where eps matters)
    eps_scale_identifiable: bool = True   # False: (almost) all rows scale-invariant


def fit_update_rms(layers: pd.DataFrame, b1: float, b2: float, *, min_step: int | None = None,
                   max_rows: int = MAX_FIT_ROWS, seed: int = 0) -> UpdateFit:
    """Measured update_rms against theory (module doc, item 1)."""
    need = ["step", "name", "depth", "rho", "update_rms", "grad_mom_cos"]
    missing = [c for c in need if c not in layers]
    if missing:
        raise ValueError(f"layers table lacks column(s) {missing} for the update_rms fit")
    min_step = int(math.ceil(3.0 / (1.0 - b2))) if min_step is None else int(min_step)
    col = {c: layers[c].to_numpy() for c in ("step", "rho", "update_rms", "grad_mom_cos")}
    ok = ((col["step"] >= min_step) & np.isfinite(col["rho"]) & (col["rho"] > 0)
          & np.isfinite(col["update_rms"]) & (col["update_rms"] > 0)
          & np.isfinite(col["grad_mom_cos"]))
    idx = np.flatnonzero(ok)
    if len(idx) > max_rows:  # a seeded uniform subsample keeps 70B-sized traces cheap
        idx = np.sort(np.random.default_rng(seed).choice(idx, max_rows, replace=False))
    if len(idx) < 3:
        raise ValueError(f"only {len(idx)} usable layer rows (step >= {min_step}, finite "
                         "positive rho and update_rms) for the update_rms fit")
    sub = layers.iloc[idx][need]
    rho = sub["rho"].to_numpy(float)
    phi = phi_from_cos(sub["grad_mom_cos"].to_numpy(float), b1)
    meas = sub["update_rms"].to_numpy(float)
    model = UpdateRmsModel(float(b1), float(b2))
    pred = model(rho, phi)
    y = np.log(meas)
    r2 = r2_score(y, np.log(pred))

    def loss(logc):
        return float(np.mean((y - np.log(model(rho * 10.0 ** logc, phi))) ** 2))

    res = minimize_scalar(loss, bounds=(-4, 4), method="bounded", options={"xatol": 1e-4})
    c = 10.0 ** res.x
    pred_c = model(rho * c, phi)
    rows = pd.DataFrame({"step": sub["step"].to_numpy(), "name": sub["name"].astype(str).to_numpy(),
                         "depth": sub["depth"].to_numpy(), "rho": rho, "phi": phi,
                         "measured": meas, "predicted": pred})
    rows["group"] = depth_group(rows["depth"])
    rows["regime"] = regimes(rho)
    by = []
    for (g, rg), part in rows.groupby(["group", "regime"], sort=True):
        by.append({"group": g, "regime": rg, "num_rows": len(part),
                   "median_ratio": float(np.median(part["measured"] / part["predicted"])),
                   "r2_log": r2_score(np.log(part["measured"]), np.log(part["predicted"]))
                   if len(part) > 2 else math.nan})
    frac_sens = float(np.mean(rho <= RHO_SCALE_INVARIANT))
    return UpdateFit(b1=float(b1), b2=float(b2), method=model.method, num_rows=len(rows),
                     frac_eps_sensitive=frac_sens, eps_scale_identifiable=frac_sens >= 0.05,
                     r2_log=r2, median_ratio=float(np.median(meas / pred)), eps_scale=float(c),
                     r2_log_fitted=r2_score(y, np.log(pred_c)), by_group=pd.DataFrame(by),
                     rows=rows)


# ------------------------------------------------------------------ rms_t

@dataclass
class RmsTCheck:
    bound: float
    num_rows: int
    frac_above_bound: float
    max_rms_t: float
    max_over_bound: float
    transients: pd.DataFrame        # one row per detected step-up event
    transient_r2: float             # measured vs theory curve, over all events' points
    note: str = ""


def _name_codes(layers: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(tensor names, per-row code) without materialising one string per row."""
    cat = layers["name"]
    if not isinstance(cat.dtype, pd.CategoricalDtype):
        cat = cat.astype("category")
    return np.asarray(cat.cat.categories, dtype=object), cat.cat.codes.to_numpy()


def _matrix(layers: pd.DataFrame, column: str, codes, num_names, steps) -> np.ndarray:
    """(num_steps, num_tensors) matrix of one column, NaN where a tensor was not logged."""
    si = np.searchsorted(steps, layers["step"].to_numpy())
    m = np.full((len(steps), num_names), np.nan)
    m[si, codes] = layers[column].to_numpy(dtype=np.float64)
    return m


def find_step_ups(layers: pd.DataFrame, *, kappa_min: float = 2.0, quiet: int = 20,
                  max_k: int = 20) -> pd.DataFrame:
    """Per tensor: steps where grad_rms jumps >= kappa_min x the median of the previous
    `quiet` consecutive logged steps; the loud stretch lasts while grad_rms stays >= half
    the jump (and steps stay consecutive), at most max_k steps; the next event may start
    `quiet` steps after it. Returns name, depth, onset, kappa, and rms_t for k = 1..K."""
    names, codes = _name_codes(layers)
    steps = np.unique(layers["step"].to_numpy())
    gr = _matrix(layers, "grad_rms", codes, len(names), steps)
    rt = _matrix(layers, "rms_t", codes, len(names), steps)
    depth = np.zeros(len(names), np.int64)
    depth[codes] = layers["depth"].to_numpy()
    # the median of the previous `quiet` rows is >= their minimum, so only points above
    # kappa_min x the rolling minimum (cheap) can qualify; the median is taken there
    low = pd.DataFrame(gr).rolling(quiet, min_periods=quiet).min().shift(1).to_numpy()
    consec = np.zeros(len(steps), bool)
    consec[quiet:] = steps[quiet:] - steps[:-quiet] == quiet
    with np.errstate(invalid="ignore"):
        pre = consec[:, None] & (low > 0) & (gr >= kappa_min * low)
    out = []
    for ti in np.unique(np.nonzero(pre)[1]):
        rows = np.flatnonzero(pre[:, ti])
        next_free = -1
        for i in rows:
            if i < next_free:
                continue
            b = float(np.median(gr[i - quiet:i, ti]))
            if not (b > 0 and gr[i, ti] >= kappa_min * b):
                continue
            kappa = gr[i, ti] / b
            j = i
            while (j + 1 < len(steps) and j + 1 - i < max_k and steps[j + 1] == steps[j] + 1
                   and gr[j + 1, ti] >= 0.5 * kappa * b):
                j += 1
            out.append({"name": str(names[ti]), "depth": int(depth[ti]),
                        "onset": int(steps[i]), "kappa": float(kappa),
                        "rms_t": rt[i:j + 1, ti].tolist()})
            next_free = j + quiet + 1
    return pd.DataFrame(out, columns=["name", "depth", "onset", "kappa", "rms_t"])


@functools.lru_cache(maxsize=128)
def _step_up_curve(b1: float, b2: float, kappa: float, steps: int) -> np.ndarray:
    return step_up(b1, b2, kappa, steps=steps)["rms_t"]


def transient_curve(b1: float, b2: float, kappa: float, steps: int) -> np.ndarray:
    """theory.transients.step_up rms_t for k = 1..steps at the nearest KAPPA_GRID value."""
    kb = float(KAPPA_GRID[np.argmin(np.abs(np.log(KAPPA_GRID) - math.log(kappa)))])
    return _step_up_curve(float(b1), float(b2), kb, int(steps))


def _transient_points(events: pd.DataFrame, b1: float, b2: float, max_k: int):
    ys, yh = [], []
    for ev in events.itertuples(index=False):
        meas = np.asarray(ev.rms_t, float)[:max_k]
        th = transient_curve(b1, b2, ev.kappa, max_k)[:len(meas)]
        ok = np.isfinite(meas)
        ys.append(meas[ok])
        yh.append(th[ok])
    if not ys:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(ys), np.concatenate(yh)


def check_rms_t(layers: pd.DataFrame, b1: float, b2: float, *, max_k: int = 20,
                max_events: int = 200) -> RmsTCheck:
    """rms_t against its dormant bound and the step-up transient (module doc, item 2)."""
    bound = dormant_rms_t_bound(b2)
    rt = layers["rms_t"].to_numpy(float)
    rt = rt[np.isfinite(rt)]
    events = find_step_ups(layers, max_k=max_k) if "grad_rms" in layers else \
        pd.DataFrame(columns=["name", "depth", "onset", "kappa", "rms_t"])
    note = ""
    r2 = math.nan
    if len(events) > max_events:
        events = events.nlargest(max_events, "kappa")
        note = f"the {max_events} largest step-ups are compared. "
    if b2 > EXPENSIVE_B2:
        note += (f"b2 = {b2} > {EXPENSIVE_B2}: theory.transients.step_up not evaluated "
                 "(its cost grows like 1/(1-b2)); bound check only.")
    elif len(events):
        y, yh = _transient_points(events, b1, b2, max_k)
        r2 = r2_score(y, yh) if len(y) > 2 else math.nan
        events = events.assign(peak=[max(v) if v else math.nan for v in events["rms_t"]],
                               theory_peak=[float(transient_curve(b1, b2, k, max_k).max())
                                            for k in events["kappa"]])
    return RmsTCheck(bound=bound, num_rows=len(rt),
                     frac_above_bound=float(np.mean(rt > bound * (1 + 1e-6))) if len(rt)
                     else math.nan,
                     max_rms_t=float(rt.max()) if len(rt) else math.nan,
                     max_over_bound=float(rt.max() / bound) if len(rt) else math.nan,
                     transients=events, transient_r2=r2, note=note)


# ------------------------------------------------------------------ regime per spike

def _find_curvature(config: dict) -> float | None:
    """A recorded curvature (lam_max / lam / curvature) anywhere in the config."""
    stack = [config or {}]
    while stack:
        d = stack.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                stack.append(v)
            elif k in ("lam_max", "lam", "curvature") and isinstance(v, (int, float)) and v > 0:
                return float(v)
    return None


def spike_regimes(layers: pd.DataFrame, spikes: pd.DataFrame, config: dict, *,
                  window: int = 50) -> pd.DataFrame:
    """Per spike and depth group: the group's rho before the spike (rho_median: median over
    the window's logged steps of group_rho over the group's tensors with a positive rho,
    numel-weighted; layers needs numel), its regime, the number of tensors in each regime
    (each by its own median rho over the window), and Bai's eps* where a curvature is
    recorded."""
    op = optim_params(config)
    lam = _find_curvature(config)
    rows = []
    st = layers["step"].to_numpy()
    for sid, sp in enumerate(spikes.itertuples(index=False)):
        s = int(sp.start)
        lo, hi = np.searchsorted(st, s - window), np.searchsorted(st, s)
        pre = layers.iloc[lo:hi]
        if pre.empty:
            continue
        per_tensor = pre.groupby("name", observed=True).agg(rho=("rho", "median"),
                                                            depth=("depth", "first"))
        per_tensor = per_tensor[np.isfinite(per_tensor["rho"]) & (per_tensor["rho"] > 0)]
        per_tensor["group"] = depth_group(per_tensor["depth"])
        for g, part in per_tensor.groupby("group"):
            sub = pre[pre["name"].isin(part.index)]
            rt = sub.groupby(["step", "name"], observed=True)["rho"].first().unstack("name")
            w = sub.groupby("name", observed=True)["numel"].first().reindex(rt.columns)
            per_step = group_rho(rt.to_numpy(float), w.to_numpy(float))
            per_step = per_step[~np.isnan(per_step)]
            med = float(np.median(per_step)) if per_step.size else math.nan
            regs = [regime(r) for r in part["rho"]]
            row = {"spike_id": sid, "start": s, "group": g, "rho_median": med,
                   "regime": regime(med), "num_tensors": len(part),
                   "num_frozen": regs.count("frozen"),
                   "num_transition": regs.count("transition"),
                   "num_scale_invariant": regs.count("scale_invariant"),
                   "eps_star": math.nan, "eps_above_eps_star": None}
            if lam is not None and op["lr"] and op["b1"] is not None:
                es = critical_eps(op["lr"], lam, op["b1"])
                row["eps_star"] = es
                row["eps_above_eps_star"] = bool(op["eps"] is not None and op["eps"] >= es)
            rows.append(row)
    return pd.DataFrame(rows, columns=["spike_id", "start", "group", "rho_median", "regime",
                                       "num_tensors", "num_frozen", "num_transition",
                                       "num_scale_invariant", "eps_star",
                                       "eps_above_eps_star"])


# ------------------------------------------------------------------ heterogeneous update_rms

HET_LOG_RHO_GRID = np.arange(-2.5, 3.51, 0.25)
BANDS = ((f"rho<{RHO_FROZEN:g}", 0.0, RHO_FROZEN),                # theory.eps_regime.REGIMES
         (f"{RHO_FROZEN:g}-{RHO_SCALE_INVARIANT:g}", RHO_FROZEN, RHO_SCALE_INVARIANT),
         (f"rho>{RHO_SCALE_INVARIANT:g}", RHO_SCALE_INVARIANT, math.inf))


@functools.lru_cache(maxsize=256)
def _exact_column(b1: float, b2: float, phi: float) -> np.ndarray:
    """log10 of theory.eps_regime.update_rms(rho, b1, b2, phi, method="exact") (the Laplace
    integral) on HET_LOG_RHO_GRID: ~0.02-0.1 s a point, so columns are built only for the
    phi the data needs (cached per process, and on disk in $ADAMSPIKE_CACHE_DIR when set:
    `adamspike reproduce` sets it to OUT/.cache, so the study's analyses compute each column
    once)."""
    cache = os.environ.get("ADAMSPIKE_CACHE_DIR")
    key = hashlib.sha1(repr((b1, b2, phi, HET_LOG_RHO_GRID.tolist())).encode()).hexdigest()[:16]
    path = Path(cache) / "exact_update_rms" / f"{key}.npy" if cache else None
    if path is not None and path.is_file():
        try:
            col = np.load(path)
            if col.shape == HET_LOG_RHO_GRID.shape:
                return col
        except (OSError, ValueError):
            pass   # a damaged entry is recomputed and replaced
    col = np.log10([update_rms(10.0 ** lr, b1, b2, phi, method="exact")
                    for lr in HET_LOG_RHO_GRID])
    if path is not None:
        buf = io.BytesIO()
        np.save(buf, col)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
    return col


class ExactUpdateRms:
    """Stationary zero-mean AR(1) update_rms(rho, phi) at (b1, b2).

    b2 <= EXPENSIVE_B2: the exact (Laplace) form, tabulated on HET_LOG_RHO_GRID x the
    PHI_GRID points spanning `phi_range` and interpolated in (log10 rho, phi); below the
    grid linear in rho (frozen limit), above it flat (scale-invariant limit; the grid ends
    where both limits hold to < 1 %). b2 > EXPENSIVE_B2: the exact form costs ~1 s a point
    and the v_hat fluctuations vanish like sqrt((1-b2)/(1+b2)), so the deterministic-v
    limit sqrt(E m_hat^2) rho / (rho + 1) is used (0.2996 vs exact 0.2993 at b2 = 0.999,
    phi = 0.3, rho = 100; the second-order expansion, 54 % off at phi = 0.9 for b2 = 0.95,
    is not used)."""

    def __init__(self, b1: float, b2: float, phi_range=(PHI_GRID[0], PHI_GRID[-1])):
        self.b1, self.b2 = float(b1), float(b2)
        if self.b2 > EXPENSIVE_B2:
            self.method = "deterministic-v limit"
            return
        self.method = "exact (Laplace)"
        lo = np.searchsorted(PHI_GRID, max(PHI_GRID[0], phi_range[0]), side="right") - 1
        hi = np.searchsorted(PHI_GRID, min(PHI_GRID[-1], phi_range[1]), side="left")
        lo, hi = max(0, lo), min(len(PHI_GRID) - 1, max(hi, lo + 1))
        self.phis = PHI_GRID[lo:hi + 1]
        tab = np.stack([_exact_column(self.b1, self.b2, float(p)) for p in self.phis], axis=1)
        self._interp = RegularGridInterpolator((HET_LOG_RHO_GRID, self.phis), tab)

    def __call__(self, rho, phi) -> np.ndarray:
        rho = np.asarray(rho, float)
        phi = np.broadcast_to(np.asarray(phi, float), rho.shape)
        if self.b2 > EXPENSIVE_B2:
            phi = np.clip(phi, PHI_GRID[0], PHI_GRID[-1])
            return np.sqrt(_em2(self.b1, phi)) * rho / (rho + 1.0)
        phi = np.clip(phi, self.phis[0], self.phis[-1])
        lo, hi = HET_LOG_RHO_GRID[0], HET_LOG_RHO_GRID[-1]
        with np.errstate(divide="ignore"):
            lr = np.log10(np.maximum(rho, 1e-300))
        out = 10.0 ** self._interp(np.stack([np.clip(lr, lo, hi), phi], axis=-1))
        return np.where(lr < lo, out.reshape(rho.shape) * 10.0 ** (lr - lo),
                        out.reshape(rho.shape))


def heterogeneous_update_rms(counts, phi, model: ExactUpdateRms, centers=None) -> np.ndarray:
    """sqrt(sum_b w_b f(x_b, phi)^2): each coordinate at its own rho, x_b the geometric
    centre of its sqrt(v_hat)/eps bin (w_b = counts_b / n), f the stationary exact
    update_rms. counts (rows, bins), phi (rows,)."""
    c = np.asarray(counts, float)
    x = vhist_centers() if centers is None else np.asarray(centers, float)
    w = c / np.maximum(c.sum(axis=1, keepdims=True), 1.0)
    phi = np.asarray(phi, float)
    f2 = model(np.broadcast_to(x, c.shape), np.broadcast_to(phi[:, None], c.shape)) ** 2
    return np.sqrt(np.sum(w * f2, axis=1))


def _stationary(layers: pd.DataFrame, window: int, factor: float = 1.5) -> pd.Series:
    """Per row: the tensor's median grad_rms over its last `window` logged steps is within
    `factor` of the median over the `window` before (a slowly varying gradient scale)."""
    d = layers[["step", "name", "grad_rms"]].sort_values(["name", "step"])
    g = d.groupby("name", observed=True)["grad_rms"]
    now = g.transform(lambda s: s.rolling(window, min_periods=max(2, window // 2)).median())
    before = now.groupby(d["name"], observed=True).shift(window)
    with np.errstate(all="ignore"):
        ratio = (now / before).to_numpy(float)
    ok = np.isfinite(ratio) & (ratio < factor) & (ratio > 1.0 / factor)
    return pd.Series(ok, index=d.index).reindex(layers.index)


def _burstiness(layers: pd.DataFrame, window: int) -> pd.Series:
    """Per row: mean / median of the tensor's grad_rms^2 over its last `window` logged
    steps (1 for a steady gradient power; >> 1 when it comes in bursts)."""
    d = layers[["step", "name", "grad_rms"]].sort_values(["name", "step"])
    g2 = (d["grad_rms"].astype(float) ** 2).groupby(d["name"], observed=True)
    mp = max(2, window // 2)
    mean = g2.transform(lambda s: s.rolling(window, min_periods=mp).mean())
    med = g2.transform(lambda s: s.rolling(window, min_periods=mp).median())
    with np.errstate(all="ignore"):
        return (mean / med).reindex(layers.index)


@dataclass
class HeteroFit:
    b1: float
    b2: float
    method: str
    num_rows: int
    num_stationary: int
    bands: pd.DataFrame            # band, model, rows, r2_log, median_log_ratio (ln)
    diagnostics: pd.DataFrame      # per band: medians of rms_t, m_v^2 / theory, kurtosis,
                                   # vhist spread
    rows: pd.DataFrame = field(repr=False)


MODELS = (("before", "pred_before"), ("heterogeneous", "pred_het"),
          ("heterogeneous + measured m_v", "pred_het_mv"))


def fit_update_rms_heterogeneous(layers: pd.DataFrame, vhists: pd.DataFrame, b1: float,
                                 b2: float, *, min_step: int | None = None,
                                 stationary_only: bool = True) -> HeteroFit:
    """update_rms against three predictions on the rows that have a sqrt(v_hat)/eps
    histogram (histogram steps), from step 3 / (1 - b2) on:

      before         the per-tensor model of fit_update_rms (rho = grad_rms / eps, phi from
                     grad_mom_cos, second-order grid / deterministic-v limit)
      heterogeneous  each coordinate at its own rho = sqrt(v_hat)/eps (the vhist), the
                     exact stationary form (ExactUpdateRms), phi from grad_mom_cos:
                     sqrt(mean_i f(rho_i, phi)^2)
      + measured m_v the same, times m_v_ratio / sqrt(E m_hat^2 / E v_hat of the zero-mean
                     AR(1) stream at phi): conditions on the measured momentum-to-second-
                     moment ratio, which a mean gradient (snr > 0) or a lagging v_hat (non-
                     stationary scale) moves off the stationary zero-mean value
    `stationary_only`: keep rows whose tensor's gradient scale is slowly varying
    (_stationary, window 1 / (1 - b2) logged steps capped at 200). Reported per band of the
    tensor's rho (< 0.1, 0.1-10, > 10): R^2 of log update_rms and the median of
    ln(measured / predicted), with diagnostics of the assumptions (module doc of
    analysis/regime.py for snr): median rms_t (stationary theory ~ 1), median
    m_v^2 / (its zero-mean value) (1 without a mean gradient or lag), median kurtosis of r
    (Gaussian-stream theory ~ 3 at phi = 0), median spread of log10 sqrt(v_hat)/eps
    (decades between the 10 % and 90 % coordinates), median mean g^2 / mean v_hat (the
    step's gradient power over its b2-window average, v_hat from the vhist bin centres;
    ~ 1 for a stationary Gaussian stream) and the burstiness, mean / median of the
    tensor's grad_rms^2 over the last 1 / (1 - b2) logged steps (~ 1 for a steady power)."""
    need = ["step", "name", "depth", "rho", "update_rms", "grad_mom_cos", "grad_rms",
            "m_v_ratio", "rms_t"]
    missing = [c for c in need if c not in layers]
    if missing:
        raise ValueError(f"layers table lacks column(s) {missing} for the heterogeneous fit")
    if vhists is None or vhists.empty:
        raise ValueError("no sqrt(v_hat)/eps histograms (vhists table) in this run")
    min_step = int(math.ceil(3.0 / (1.0 - b2))) if min_step is None else int(min_step)
    lay = layers.copy()
    lay["name"] = lay["name"].astype(str)
    window = int(min(200, math.ceil(1.0 / (1.0 - b2))))
    lay["stationary"] = _stationary(lay, window).to_numpy()
    lay["burstiness"] = _burstiness(lay, window).to_numpy()
    vh = vhists[["step", "name", "counts"]].copy()
    vh["name"] = vh["name"].astype(str)
    m = lay.merge(vh, on=["step", "name"], how="inner")
    ok = ((m["step"] >= min_step) & np.isfinite(m["rho"]) & (m["rho"] > 0)
          & np.isfinite(m["update_rms"]) & (m["update_rms"] > 0)
          & np.isfinite(m["grad_mom_cos"]) & np.isfinite(m["m_v_ratio"]))
    m = m[ok.to_numpy()].reset_index(drop=True)
    num_all = len(m)
    if stationary_only:
        m = m[m["stationary"].to_numpy(bool)].reset_index(drop=True)
    if len(m) < 3:
        raise ValueError(f"only {len(m)} usable rows with a vhist (step >= {min_step}"
                         f"{', slowly varying gradient scale' if stationary_only else ''}; "
                         f"{num_all} before that filter) for the heterogeneous fit")
    counts = np.stack([np.asarray(c, float) for c in m["counts"]])
    if counts.shape[1] != NUM_VHIST_BINS:
        raise ValueError(f"vhists have {counts.shape[1]} bins, expected {NUM_VHIST_BINS}")
    rho = m["rho"].to_numpy(float)
    phi = phi_from_cos(m["grad_mom_cos"].to_numpy(float), b1)
    meas = m["update_rms"].to_numpy(float)
    before = UpdateRmsModel(float(b1), float(b2))(rho, phi)
    ex = ExactUpdateRms(b1, b2, (float(phi.min()), float(phi.max())))
    het = heterogeneous_update_rms(counts, phi, ex)
    em2 = _em2(b1, np.clip(phi, PHI_GRID[0], PHI_GRID[-1]))
    mv_excess = m["m_v_ratio"].to_numpy(float) ** 2 / em2
    het_mv = het * np.sqrt(mv_excess)
    # vhist spread: decades between the 10 % and 90 % coordinates
    cdf = np.cumsum(counts, axis=1) / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    lx = np.log10(vhist_centers())
    w = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    g2_over_v = rho ** 2 / np.sum(w * vhist_centers() ** 2, axis=1)
    q10 = lx[np.argmax(cdf >= 0.1, axis=1)]
    q90 = lx[np.argmax(cdf >= 0.9, axis=1)]
    kurt = math.nan * np.ones(len(m))
    if {"r_mean", "r_m2", "r_m3", "r_m4"} <= set(m.columns):
        kurt = shape_stats(m["r_mean"], m["r_m2"], m["r_m3"], m["r_m4"])["kurtosis"]
    rows = pd.DataFrame({"step": m["step"].to_numpy(), "name": m["name"].to_numpy(),
                         "depth": m["depth"].to_numpy(), "rho": rho, "phi": phi,
                         "measured": meas, "pred_before": before, "pred_het": het,
                         "pred_het_mv": het_mv, "rms_t": m["rms_t"].to_numpy(float),
                         "mv_excess": mv_excess, "r_kurtosis": np.asarray(kurt, float),
                         "g2_over_v": g2_over_v,
                         "burstiness": m["burstiness"].to_numpy(float),
                         "vhist_spread_decades": q90 - q10})
    rows["band"] = pd.Series(regimes(rho)).map(dict(zip(REGIMES, (b[0] for b in BANDS)))).to_numpy()
    brows, drows = [], []
    for band, _, _ in (*BANDS, ("all", 0, 0)):
        part = rows if band == "all" else rows[rows["band"] == band]
        if part.empty:
            continue
        y = np.log(part["measured"].to_numpy(float))
        for label, col in MODELS:
            yh = np.log(part[col].to_numpy(float))
            brows.append({"band": band, "model": label, "num_rows": len(part),
                          "r2_log": r2_score(y, yh) if len(part) > 2 else math.nan,
                          "median_log_ratio": float(np.median(y - yh))})
        drows.append({"band": band, "num_rows": len(part),
                      "rho_median": float(part["rho"].median()),
                      "phi_median": float(part["phi"].median()),
                      "rms_t_median": float(part["rms_t"].median()),
                      "g2_over_v_median": float(part["g2_over_v"].median()),
                      "burstiness_median": float(part["burstiness"].median()),
                      "mv_excess_median": float(part["mv_excess"].median()),
                      "r_kurtosis_median": float(np.nanmedian(part["r_kurtosis"]))
                      if part["r_kurtosis"].notna().any() else math.nan,
                      "vhist_spread_median": float(part["vhist_spread_decades"].median()),
                      "sd_ln_measured": float(np.std(y)),
                      "sd_ln_mv_scatter": float(np.std(0.5 * np.log(part["mv_excess"])))})
    return HeteroFit(b1=float(b1), b2=float(b2), method=ex.method, num_rows=num_all,
                     num_stationary=len(rows), bands=pd.DataFrame(brows),
                     diagnostics=pd.DataFrame(drows), rows=rows)


def failing_assumption(fit: HeteroFit, band: str = "all") -> str:
    """One sentence naming what the diagnostics show where the heterogeneous prediction
    misses (|median ln ratio| >= 0.1 or R^2 < 0.8), from the measured numbers."""
    b = fit.bands[(fit.bands["band"] == band) & (fit.bands["model"] == "heterogeneous")]
    d = fit.diagnostics[fit.diagnostics["band"] == band]
    if b.empty or d.empty:
        return "no rows"
    b, d = b.iloc[0], d.iloc[0]
    ok = abs(b["median_log_ratio"]) < 0.1 and (b["r2_log"] >= 0.8 or math.isnan(b["r2_log"]))
    if ok:
        return (f"goal met (median ln ratio {b['median_log_ratio']:+.3f}, R^2 "
                f"{b['r2_log']:.2f})")
    parts = []
    if d["mv_excess_median"] > 1.5 or d["mv_excess_median"] < 0.67:
        parts.append(f"m_v_ratio^2 is {d['mv_excess_median']:.3g} x its zero-mean stationary "
                     "value (a mean gradient if > 1, a lagging v_hat if < 1)")
    if d["g2_over_v_median"] < 0.7 or d["g2_over_v_median"] > 1.5:
        parts.append(f"the step's gradient power over its b2-window average (mean g^2 / "
                     f"mean v_hat, v_hat from the vhist) has median {d['g2_over_v_median']:.3g}"
                     " (a stationary Gaussian stream: ~ 1): on most steps g^2 is below what "
                     "v_hat remembers; the tensor's gradient power over a b2 window has mean / "
                     f"median {d['burstiness_median']:.3g} ("
                     + ("bursts: heavy tails in time" if d["burstiness_median"] > 1.3 else
                        "steady power: a scale that changes faster than v_hat forgets, "
                        "non-stationarity") + ")")
    if math.isfinite(d["r_kurtosis_median"]) and d["r_kurtosis_median"] > 4.5:
        parts.append(f"median kurtosis of r {d['r_kurtosis_median']:.3g} (Gaussian stream "
                     "~ 3): heavy tails or a spread of per-coordinate SNR")
    if not parts:
        mv = fit.bands[(fit.bands["band"] == band)
                       & (fit.bands["model"] == "heterogeneous + measured m_v")].iloc[0]
        parts.append(f"g^2 / v_hat, m_v_ratio and the kurtosis of r are near their "
                     f"stationary values; ln update_rms spreads over the rows with sd "
                     f"{d['sd_ln_measured']:.3g}, ln m_v_ratio scatters step to step around "
                     f"its stationary value with sd {d['sd_ln_mv_scatter']:.3g}, and a "
                     f"stationary expectation does not follow that scatter (conditioned on "
                     f"the measured m_v: R^2 {mv['r2_log']:.2f}, "
                     f"median ln ratio {mv['median_log_ratio']:+.3f})")
    return (f"goal not met (median ln ratio {b['median_log_ratio']:+.3f}, R^2 "
            f"{b['r2_log']:.2f}): " + "; ".join(parts))
