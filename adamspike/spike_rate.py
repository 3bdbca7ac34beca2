"""Spike rate as a function of dimensionless regime groups: a ridge-penalised Poisson GLM.

The model. A run i with n_i optimizer steps shows k_i loss spikes (the project's detector;
for sweep tables the `num_spikes` column, for run directories analysis.spike_rate). With
features x_i (the regime groups below) the counts are modelled as

    k_i ~ Poisson(mu_i),   log mu_i = log(n_i / 1000) + beta_0 + sum_j beta_j z_ij

so exp(beta_0 + z beta) is the spike rate per 1000 steps (capped at MAX_RATE_PER_1K = 1000,
one spike start per step, when a prediction far outside the data would exceed it), and the
probability of at least one spike in N steps is P(>= 1 | N) = 1 - exp(-rate N / 1000).
z_ij = (x_ij - mean_j) / sd_j are the features standardised over the training runs (the
coefficients are reported back in the original units).

Features (FEATURES; each one dimensionless):
    log10_rho_shallow   log10 of rho = rms(g) / eps of the gradient Adam consumes, shallow
                        side (adamspike.depth_groups.shallow_depths: embed + shallow
                        groups), median over logged steps of the side's group rho
                        (adamspike.depth_groups.group_rho: the numel-weighted rms over the
                        side's tensors; the sweep tables' `median_rho`, the same for run
                        directories and matched arms: analysis.spike_rate)
    log10_rho_deep      the same on the deep side (deep + head groups)
    log10_one_minus_b2  log10 (1 - b2): the second moment's memory
    log10_lr_over_eps   log10 (lr / eps): the largest per-coordinate step a frozen
                        coordinate (sqrt(v) << eps) can take relative to eps; for the
                        quadratic it is the curvature ratio eps* / eps up to lam (1-b1) /
                        (2 (1+b1))
    log10_tokens_per_step  log10 of tokens (LLaMA) or samples (MLP) per optimizer step
  the mechanism groups (issue "Science 3"; finite on the phase map's rows only, so a model
  fitted on sweeps never selects them):
    log10_stability     log10 of Adam's stability number S = lr lambda_max(P H) / 2 (median
                        over the row's evaluations; S = 1 is the edge; in the eps band S =
                        Pi_eps / 38 with Pi_eps = (lr / eps) lambda_max(H): mechanism A)
    log10_rho_min       log10 of the smallest depth group's median rho: how deep the most
                        dormant group sits in its eps band (mechanism B)
    warmup              1 for the warmup part of a run, 0 for the rest (the lr ramp: the
                        70B's spikes came inside LLaMA2's 2000-step warmup)
A fit uses the features that are finite on every training run and not constant there
(`select_features`); which ones it used is stored with the model.

Fit. Newton-Raphson (= IRLS for the canonical log link) on the penalised log-likelihood

    l(beta) = sum_i [k_i eta_i - exp(eta_i)] - (ridge / 2) sum_{j >= 1} beta_j^2

with eta_i = log(n_i / 1000) + beta_0 + z_i beta and ridge = RIDGE = 0.1 on the
standardised slopes (the intercept is not penalised): a weak N(0, 1 / ridge) prior that
keeps the estimate finite when a feature separates runs with and without spikes, and moves
a well-identified slope by a relative O(ridge / n).

Uncertainty. (1) The observed Fisher information of the penalised likelihood,
H = Z' diag(mu) Z + ridge I (observed = expected for the log link), inflated by the
quasi-Poisson dispersion phi = max(1, Pearson chi^2 / (n - p)) (seed-to-seed spread beyond
Poisson): cov(beta) = phi H^-1; a rate interval is exp(eta +- z_(1+ci)/2 sqrt(z' cov z)).
(2) A nonparametric bootstrap over runs (N_BOOT resamples of the training rows, refit each):
the percentile interval of eta. The interval a prediction states is the union of both.

Scores of P(>= 1 spike in N) on held-out runs (y = 1 when the run spiked): log-loss
-mean[y log p + (1 - y) log(1 - p)] (p clipped to [1e-6, 1 - 1e-6]) and the Brier score
mean (p - y)^2, each against the constant-rate baseline (the training runs' pooled rate
sum k / sum n, the same for every run); a calibration table bins the held-out runs by
predicted p and compares the mean predicted p with the observed fraction that spiked.

References: McCullagh & Nelder, Generalized Linear Models (2nd ed., 1989), ch. 6 (Poisson
log-linear models, quasi-likelihood dispersion); Efron & Tibshirani (1993) (bootstrap);
Brier (1950); Gneiting & Raftery (2007) (proper scoring rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.llama import PRESETS
from adamspike.mitigations import neutral_mask
from adamspike.rundir import read_json

FEATURES = ("log10_rho_shallow", "log10_rho_deep", "log10_one_minus_b2", "log10_lr_over_eps",
            "log10_tokens_per_step", "log10_stability", "log10_rho_min", "warmup")
RIDGE = 0.1
N_BOOT = 200
CI = 0.9
P_CLIP = 1e-6
CALIBRATION_EDGES = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
MODEL_SCHEMA = "adamspike.spike_rate_model"
MODEL_VERSION = 1
WIDTH_COLUMNS = ("width", "model.dim", "mlp.width", "problem.width", "dim")
TABLE_COLUMNS = ("source", "run", "width", "seed", "num_spikes", "num_steps", *FEATURES)


class SpikeRateError(ValueError):
    """Bad training data or model file; the message names the problem."""


# ----------------------------------------------------------------------------- features

def setting_features(*, rho_shallow: float | None = None, rho_deep: float | None = None,
                     b2: float | None = None, lr: float | None = None,
                     eps: float | None = None, tokens_per_step: float | None = None,
                     stability: float | None = None, rho_min: float | None = None,
                     warmup: float | None = None) -> dict:
    """The feature dict (FEATURES) of one setting; missing inputs give NaN."""
    def lg(v):
        return math.log10(v) if v is not None and np.isfinite(v) and v > 0 else math.nan
    return {"log10_rho_shallow": lg(rho_shallow), "log10_rho_deep": lg(rho_deep),
            "log10_one_minus_b2": lg(None if b2 is None else 1.0 - b2),
            "log10_lr_over_eps": lg(None if lr is None or not eps else lr / eps),
            "log10_tokens_per_step": lg(tokens_per_step), "log10_stability": lg(stability),
            "log10_rho_min": lg(rho_min),
            "warmup": math.nan if warmup is None else float(warmup)}


def _first(flat: Mapping[str, Any], keys: Sequence[str]) -> float:
    """The first finite value of `keys` in a flat config / table row (NaN if none)."""
    for k in keys:
        v = flat.get(k)
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and np.isfinite(v):
            return float(v)
    return math.nan


def config_features(flat: Mapping[str, Any], rho_shallow: float | None = None,
                    rho_deep: float | None = None, tokens_per_step: float | None = None,
                    **mechanism) -> dict:
    """The one row builder of every training table (sweep rows, run directories, matched
    arms): FEATURES plus `width` of a run from its flat (dotted) config or sweep-table row.
    b2, lr, eps: optim.* (problem.* in simulate's quadratic / mlp run directories); tokens
    per step, unless given: train.global_batch_size x train.seq_len (llama), mlp.batch or
    mlp.num_points for a full batch (mlp), none (quadratic); width: the first of
    WIDTH_COLUMNS, else the dim of model.preset; `mechanism`: stability, rho_min, warmup of
    `setting_features` (the phase map's rows)."""
    b2, lr, eps = (_first(flat, (f"optim.{k}", f"problem.{k}")) for k in ("b2", "lr", "eps"))
    if tokens_per_step is None or not np.isfinite(tokens_per_step):
        tokens_per_step = (_first(flat, ("train.global_batch_size",))
                           * _first(flat, ("train.seq_len",)))
        if not np.isfinite(tokens_per_step) and "mlp.num_points" in flat:
            bs = _first(flat, ("mlp.batch",))
            tokens_per_step = bs if bs > 0 else _first(flat, ("mlp.num_points",))
    width = _first(flat, WIDTH_COLUMNS)
    if not np.isfinite(width) and str(flat.get("model.preset")) in PRESETS:
        width = float(PRESETS[str(flat["model.preset"])].dim)
    return {"width": width, **setting_features(rho_shallow=rho_shallow, rho_deep=rho_deep, b2=b2,
                                               lr=lr, eps=eps, tokens_per_step=tokens_per_step,
                                               **mechanism)}


def sweep_rows(table: pd.DataFrame, source: str = "sweep") -> pd.DataFrame:
    """Training rows (TABLE_COLUMNS) from a sweep table (simulate.sweep: one row per cell x
    seed with num_spikes, train.num_steps, optim.*, median_rho: the median over steps of
    the shallow side's group_rho), by `config_features`. Only runs with the mitigations at
    their neutral values are kept by the caller's choice (`training_table`)."""
    need = {"num_spikes", "train.num_steps", "optim.b2", "optim.eps", "optim.lr"}
    missing = sorted(need - set(table.columns))
    if missing:
        raise SpikeRateError(f"{source}: not a sweep table (missing columns {missing})")
    df = pd.DataFrame([config_features(r, rho_shallow=r.get("median_rho"))
                       for r in table.to_dict("records")], columns=["width", *FEATURES])
    n = len(table)
    df.insert(0, "source", source)
    df.insert(1, "run", [f"{c}-s{s}" for c, s in zip(
        table["cell_id"] if "cell_id" in table else range(n),
        table["seed"] if "seed" in table else [0] * n)])
    df["seed"] = table["seed"].to_numpy(float) if "seed" in table else np.nan
    df["num_spikes"] = table["num_spikes"].to_numpy(float)
    df["num_steps"] = table["train.num_steps"].to_numpy(float)
    return df[list(TABLE_COLUMNS)]


def read_sweep_table(path: str | Path) -> pd.DataFrame:
    """A sweep table: runs.parquet / runs.csv, or a sweep directory holding runs.parquet."""
    p = Path(path)
    if p.is_dir():
        p = p / "runs.parquet"
    if not p.is_file():
        raise SpikeRateError(f"{path}: sweep table not found (runs.parquet or a .csv)")
    try:
        return pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - any unreadable table is a format error
        raise SpikeRateError(f"{p}: unreadable sweep table ({e})") from None


def training_table(parts: Sequence[str | Path | pd.DataFrame],
                   notes: Sequence[str] = ()) -> tuple[pd.DataFrame, list[str]]:
    """(table, notes): the training rows of `parts`, in order: a path is a sweep table
    (`read_sweep_table`; its runs with every mitigation at its neutral value, `sweep_rows`,
    source sweep:<problem>:<sweep directory>), a DataFrame rows already in TABLE_COLUMNS
    (run directories, matched replications: analysis.spike_rate). Runs without a positive
    shallow rho are left out; `notes` (after the sweeps' own) say what was left out and why."""
    frames, out_notes = [], []
    for part in parts:
        if isinstance(part, pd.DataFrame):
            frames.append(part)
            continue
        t = read_sweep_table(part)
        keep = neutral_mask(t)
        if (~keep).any():
            out_notes.append(f"{part}: {int((~keep).sum())} runs with an active mitigation left out")
        name = Path(part).name if Path(part).is_dir() else Path(part).parent.name
        prob = str(t["problem"].iloc[0]) if "problem" in t and len(t) else "sweep"
        frames.append(sweep_rows(t[keep].reset_index(drop=True), f"sweep:{prob}:{name}"))
    out_notes += notes
    if not frames:
        raise SpikeRateError("no training data: give --sweep and/or --runs")
    table = pd.concat(frames, ignore_index=True)[list(TABLE_COLUMNS)]
    bad = ~np.isfinite(table["log10_rho_shallow"].to_numpy(float))
    if bad.any():   # the primary group: a run without it is left out, not the feature
        out_notes.append(f"{int(bad.sum())} runs without a positive shallow rho (no per-tensor "
                         "telemetry, or a gradient that reached exactly 0): "
                         + ", ".join(table.loc[bad, "run"].astype(str).head(5))
                         + (" ..." if bad.sum() > 5 else ""))
        table = table.loc[~bad].reset_index(drop=True)
    # the mechanism groups: a source that measures them (the phase map) loses the rows where
    # they have no log (S median <= 0: a dominant negative eigenvalue; a group's gradient
    # exactly 0), rather than every row losing the feature
    for f, why in (("log10_stability", "a median S <= 0: a dominant negative eigenvalue"),
                   ("log10_rho_min", "a depth group's gradient exactly 0")):
        v = np.isfinite(table[f].to_numpy(float))
        src = table["source"].astype(str)
        measured = src.isin(set(src[v])).to_numpy()
        bad = measured & ~v
        if bad.any():
            out_notes.append(f"{int(bad.sum())} runs without a finite {f} ({why}): "
                             + ", ".join(table.loc[bad, "run"].astype(str).head(5))
                             + (" ..." if bad.sum() > 5 else ""))
            table = table.loc[~bad].reset_index(drop=True)
    return table, out_notes


def select_features(table: pd.DataFrame, candidates: Sequence[str] = FEATURES) -> list[str]:
    """Features finite on every row and not constant there."""
    out = []
    for f in candidates:
        v = table[f].to_numpy(float) if f in table else np.array([np.nan])
        if np.isfinite(v).all() and np.ptp(v) > 1e-12:
            out.append(f)
    return out


def usable(table: pd.DataFrame, features: Sequence[str]) -> pd.DataFrame:
    """Rows with finite counts, a positive step count and finite features."""
    ok = np.isfinite(table["num_spikes"].to_numpy(float)) & (table["num_steps"].to_numpy(float) > 0)
    for f in features:
        ok &= np.isfinite(table[f].to_numpy(float))
    return table.loc[ok].reset_index(drop=True)


# ----------------------------------------------------------------------------- GLM

def poisson_irls(Z: np.ndarray, k: np.ndarray, offset: np.ndarray, ridge: float = RIDGE,
                 beta0: np.ndarray | None = None, max_iter: int = 100,
                 tol: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """Penalised Poisson log-linear fit (module docstring). Z: (n, p) design whose column 0
    is the intercept (unpenalised). Returns (beta, H) with H the penalised observed Fisher
    information at beta. Newton steps with step halving on the penalised log-likelihood."""
    n, p = Z.shape
    pen = np.full(p, float(ridge))
    pen[0] = 0.0
    beta = np.zeros(p) if beta0 is None else np.array(beta0, float)
    if beta0 is None:
        beta[0] = math.log(max(k.sum(), 0.5) / np.exp(offset).sum())

    def loglik(b):
        eta = offset + Z @ b
        return float(k @ eta - np.exp(np.minimum(eta, 700)).sum() - 0.5 * (pen * b * b).sum())

    ll = loglik(beta)
    for _ in range(max_iter):
        mu = np.exp(np.minimum(offset + Z @ beta, 700))
        grad = Z.T @ (k - mu) - pen * beta
        H = (Z * mu[:, None]).T @ Z + np.diag(pen)
        H[np.diag_indices(p)] += 1e-12
        step = np.linalg.solve(H, grad)
        t = 1.0
        while t > 1e-8:
            new = beta + t * step
            new_ll = loglik(new)
            if new_ll >= ll - 1e-12:
                break
            t /= 2
        done = abs(new_ll - ll) < tol * (1 + abs(ll)) and np.max(np.abs(t * step)) < 1e-8
        beta, ll = new, new_ll
        if done:
            break
    mu = np.exp(np.minimum(offset + Z @ beta, 700))
    H = (Z * mu[:, None]).T @ Z + np.diag(pen)
    return beta, H


@dataclass
class RateModel:
    """A fitted spike-rate model (coefficients in standardised units + the scaling)."""
    features: list[str]
    beta: np.ndarray                 # [intercept, slopes] on standardised features
    cov: np.ndarray                  # phi H^-1, standardised units
    x_mean: np.ndarray
    x_std: np.ndarray
    boot: np.ndarray                 # (N_BOOT, p) bootstrap replicates of beta
    ridge: float = RIDGE
    dispersion: float = 1.0          # Pearson chi^2 / (n - p) (before the max with 1)
    ci: float = CI
    n_runs: int = 0
    n_spikes: float = 0.0
    total_steps: float = 0.0
    train_range: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    # ranges of every FEATURE over the training runs that have it (also the unused ones)
    data_range: dict = field(default_factory=dict)
    # the training features (n, p), original units: the joint-support check
    train_x: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    # -- design
    def design(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(np.asarray(X, float))
        return np.column_stack([np.ones(len(X)), (X - self.x_mean) / self.x_std])

    def matrix(self, rows: pd.DataFrame | Sequence[Mapping[str, float]]) -> np.ndarray:
        df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        missing = [f for f in self.features if f not in df or not np.isfinite(df[f].to_numpy(float)).all()]
        if missing:
            raise SpikeRateError(f"features {missing} are missing or not finite; the model "
                                 f"needs {self.features}")
        return df[self.features].to_numpy(float)

    # -- coefficients in original units: rate = exp(a + sum_j b_j x_j)
    def coefficients(self) -> dict:
        p = len(self.beta)
        A = np.zeros((p, p))
        A[0, 0] = 1.0
        A[0, 1:] = -self.x_mean / self.x_std
        A[1:, 1:] = np.diag(1.0 / self.x_std)
        b = A @ self.beta
        cov = A @ self.cov @ A.T
        se = np.sqrt(np.diag(cov))
        z = stats.norm.ppf(0.5 + self.ci / 2)
        boot = self.boot @ A.T if len(self.boot) else np.zeros((0, p))
        a = (1 - self.ci) / 2
        out = {}
        for i, name in enumerate(["intercept", *self.features]):
            row = {"coef": float(b[i]), "se": float(se[i]),
                   "ci": [float(b[i] - z * se[i]), float(b[i] + z * se[i])]}
            if len(boot):
                row["boot_ci"] = [float(np.quantile(boot[:, i], a)),
                                  float(np.quantile(boot[:, i], 1 - a))]
            out[name] = row
        return out

    # -- predictions
    def eta(self, X: np.ndarray) -> np.ndarray:
        return self.design(X) @ self.beta

    def rate(self, X: np.ndarray) -> np.ndarray:
        """Spikes per 1000 steps (at most MAX_RATE_PER_1K)."""
        return _rate(self.eta(X))

    def rate_interval(self, X: np.ndarray) -> dict:
        """Per row: rate, the Fisher (quasi-Poisson) and bootstrap intervals and their
        union (module docstring), at level ci."""
        D = self.design(X)
        eta = D @ self.beta
        se = np.sqrt(np.einsum("ij,jk,ik->i", D, self.cov, D))
        z = stats.norm.ppf(0.5 + self.ci / 2)
        f_lo, f_hi = eta - z * se, eta + z * se
        if len(self.boot):
            e = D @ self.boot.T
            a = (1 - self.ci) / 2
            b_lo, b_hi = np.quantile(e, a, axis=1), np.quantile(e, 1 - a, axis=1)
        else:
            b_lo, b_hi = f_lo, f_hi
        return {"rate": _rate(eta), "fisher": (_rate(f_lo), _rate(f_hi)),
                "boot": (_rate(b_lo), _rate(b_hi)),
                "lo": _rate(np.minimum(f_lo, b_lo)), "hi": _rate(np.maximum(f_hi, b_hi))}

    def extrapolation(self, feats: Mapping[str, float]) -> dict:
        """Per model feature: 'inside', 'below' or 'above' the training range."""
        out = {}
        for f in self.features:
            lo, hi = self.train_range[f]
            v = feats[f]
            out[f] = "below" if v < lo - 1e-9 else "above" if v > hi + 1e-9 else "inside"
        return out

    def support(self, feats: Mapping[str, float]) -> dict:
        """Joint support: the standardised distance from the setting to its nearest
        training run against the largest nearest-neighbour distance between the training
        runs' distinct feature points (the sparsest spot of the data: a setting farther from
        every run than that lies where the data are not; seeds of one cell differ a little,
        so a percentile would mostly measure the seed scatter) (a setting inside every feature's range can still lie where no training
        run is); and the features the model does not use, against the training data's
        range of them ("not in the training data" when no training run has one)."""
        out: dict[str, Any] = {}
        if self.train_x.size:
            Z = (self.train_x - self.x_mean) / self.x_std
            z = (np.array([feats[f] for f in self.features]) - self.x_mean) / self.x_std
            d = float(np.sqrt(((Z - z) ** 2).sum(1)).min())
            U = np.unique(np.round(Z, 9), axis=0)       # distinct points (seeds repeat cells)
            D = np.sqrt(((U[:, None, :] - U[None, :, :]) ** 2).sum(-1))
            np.fill_diagonal(D, np.inf)
            nn = D.min(1)
            ref = float(nn[np.isfinite(nn)].max()) if np.isfinite(nn).any() else 0.0
            out.update(nearest_run_distance=d, nn_distance_max=ref,
                       outside_joint_support=bool(d > max(ref, 1e-9)))
        unused = {}
        for f in FEATURES:
            if f in self.features or feats.get(f) is None or not np.isfinite(feats[f]):
                continue
            r = self.data_range.get(f)
            if not r:
                unused[f] = "not in the training data"
            else:
                unused[f] = ("below" if feats[f] < r[0] - 1e-9 else "above"
                             if feats[f] > r[1] + 1e-9 else "inside") + " (not a model feature)"
        out["unmodelled"] = unused
        return out

    # -- file
    def to_json(self) -> dict:
        return {"schema": MODEL_SCHEMA, "version": MODEL_VERSION, "features": self.features,
                "beta_std": self.beta.tolist(), "cov_std": self.cov.tolist(),
                "x_mean": self.x_mean.tolist(), "x_std": self.x_std.tolist(),
                "boot_std": self.boot.tolist(), "ridge": self.ridge,
                "dispersion": self.dispersion, "ci": self.ci, "n_runs": self.n_runs,
                "n_spikes": self.n_spikes, "total_steps": self.total_steps,
                "baseline_rate_per_1k": baseline_rate(self.n_spikes, self.total_steps),
                "train_range": self.train_range, "data_range": self.data_range,
                "train_x": self.train_x.tolist(), "sources": self.sources,
                "coefficients": self.coefficients(), **self.extra}


MAX_RATE_PER_1K = 1000.0   # the detector counts at most one spike start per step


def _rate(eta) -> np.ndarray:
    """exp(eta) spikes per 1000 steps, capped at one per step: a log-linear model carried
    far outside its data (a 70B candidate) can reach any number, the detector cannot."""
    return np.exp(np.minimum(np.asarray(eta, float), math.log(MAX_RATE_PER_1K)))


def model_from_json(d: Mapping[str, Any], where: str = "model") -> RateModel:
    if not isinstance(d, Mapping) or d.get("schema") != MODEL_SCHEMA:
        raise SpikeRateError(f"{where}: not a spike-rate model (schema {MODEL_SCHEMA!r})")
    if d.get("version") != MODEL_VERSION:
        raise SpikeRateError(f"{where}: model version {d.get('version')!r} is not supported "
                             f"(expected {MODEL_VERSION}); refit it with `adamspike spike-rate`")
    try:
        known = {"schema", "version", "features", "beta_std", "cov_std", "x_mean", "x_std",
                 "boot_std", "ridge", "dispersion", "ci", "n_runs", "n_spikes", "total_steps",
                 "baseline_rate_per_1k", "train_range", "sources", "coefficients",
                 "data_range", "train_x"}
        return RateModel(features=list(d["features"]), beta=np.asarray(d["beta_std"], float),
                         cov=np.asarray(d["cov_std"], float), x_mean=np.asarray(d["x_mean"], float),
                         x_std=np.asarray(d["x_std"], float),
                         boot=np.asarray(d.get("boot_std", []), float).reshape(-1, len(d["beta_std"])),
                         ridge=float(d["ridge"]), dispersion=float(d["dispersion"]),
                         ci=float(d["ci"]), n_runs=int(d["n_runs"]), n_spikes=float(d["n_spikes"]),
                         total_steps=float(d["total_steps"]),
                         train_range={k: list(v) for k, v in d["train_range"].items()},
                         data_range={k: list(v) for k, v in d.get("data_range", {}).items()},
                         train_x=np.asarray(d.get("train_x", []), float).reshape(
                             -1, len(d["features"])),
                         sources=list(d.get("sources", [])),
                         extra={k: v for k, v in d.items() if k not in known})
    except (KeyError, TypeError, ValueError) as e:
        raise SpikeRateError(f"{where}: malformed spike-rate model ({e})") from None


def load_model(path: str | Path) -> RateModel:
    return model_from_json(read_json(path, SpikeRateError, f"{path}: spike-rate model not found"),
                           str(path))


def baseline_rate(n_spikes: float, total_steps: float) -> float:
    """Pooled spikes per 1000 steps (half a spike when none was seen, so the baseline's
    probabilities stay inside (0, 1))."""
    return 1000.0 * max(float(n_spikes), 0.5) / float(total_steps)


def fit(table: pd.DataFrame, features: Sequence[str] | None = None, *, ridge: float = RIDGE,
        n_boot: int = N_BOOT, ci: float = CI, seed: int = 0) -> RateModel:
    """Fit the GLM on a training table (TABLE_COLUMNS; rows with missing features dropped)."""
    feats = list(select_features(table) if features is None else features)
    t = usable(table, feats)
    if len(t) < len(feats) + 2:
        raise SpikeRateError(f"{len(t)} usable training runs for {len(feats)} features: too few "
                             "to fit a spike-rate model")
    X = t[feats].to_numpy(float)
    k = t["num_spikes"].to_numpy(float)
    n = t["num_steps"].to_numpy(float)
    off = np.log(n / 1000.0)
    mean, std = X.mean(0), X.std(0)
    std = np.where(std > 0, std, 1.0)
    Z = np.column_stack([np.ones(len(X)), (X - mean) / std])
    beta, H = poisson_irls(Z, k, off, ridge)
    mu = np.exp(off + Z @ beta)
    dof = max(len(k) - Z.shape[1], 1)
    phi = float(((k - mu) ** 2 / np.maximum(mu, 1e-300)).sum() / dof)
    cov = max(1.0, phi) * np.linalg.inv(H)
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(int(n_boot)):
        idx = rng.integers(0, len(k), len(k))
        b, _ = poisson_irls(Z[idx], k[idx], off[idx], ridge, beta0=beta)
        boot.append(b)
    return RateModel(features=feats, beta=beta, cov=cov, x_mean=mean, x_std=std,
                     boot=np.asarray(boot).reshape(-1, Z.shape[1]), ridge=float(ridge),
                     dispersion=phi, ci=float(ci), n_runs=int(len(k)), n_spikes=float(k.sum()),
                     total_steps=float(n.sum()),
                     train_range={f: [float(X[:, j].min()), float(X[:, j].max())]
                                  for j, f in enumerate(feats)},
                     data_range={f: [float(np.nanmin(v)), float(np.nanmax(v))]
                                 for f in FEATURES if f in t
                                 for v in [t[f].to_numpy(float)] if np.isfinite(v).any()},
                     train_x=X.copy(),
                     sources=sorted(set(t["source"].astype(str))))


def p_spike(rate_per_1k, num_steps) -> np.ndarray:
    """P(>= 1 spike in num_steps) for a Poisson process of the given rate per 1000 steps."""
    return -np.expm1(-np.asarray(rate_per_1k, float) * np.asarray(num_steps, float) / 1000.0)


# ----------------------------------------------------------------------------- validation

def heldout_split(table: pd.DataFrame) -> tuple[np.ndarray, str]:
    """(held-out mask, description): per source (sweep / run set) with runs at >= 2 widths,
    the runs at its largest width (widths of different problems are not comparable; rows
    without a width and sources with one width stay in training); when no source has two
    widths, the runs of the largest seed (a split over seeds: it tests the seed-to-seed
    noise, not extrapolation)."""
    w = table["width"].to_numpy(float)
    src = table["source"].astype(str).to_numpy()
    mask = np.zeros(len(table), bool)
    parts = []
    for s_ in sorted(set(src)):
        m = (src == s_) & np.isfinite(w)
        if m.any() and len(np.unique(w[m])) >= 2:
            top = float(w[m].max())
            sel = m & (w == top)
            mask |= sel
            parts.append(f"{s_} width {top:g} ({int(sel.sum())} runs)")
    if mask.any():
        return mask, ("held out: the largest width of each source with several widths: "
                      + ", ".join(parts) + "; trained on the narrower widths and the other runs")
    s = table["seed"].to_numpy(float)
    if np.isfinite(s).any() and len(np.unique(s[np.isfinite(s)])) >= 2:
        top = float(np.nanmax(s))
        return s == top, (f"held out: the runs of seed {top:g} ({int((s == top).sum())} runs; "
                          "no width axis in the data, so this split over seeds tests the "
                          "seed-to-seed noise, not extrapolation)")
    raise SpikeRateError("no held-out group: the training data have neither two widths nor "
                         "two seeds")


def scores(p: np.ndarray, y: np.ndarray) -> dict:
    p = np.clip(np.asarray(p, float), P_CLIP, 1 - P_CLIP)
    y = np.asarray(y, float)
    return {"log_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))),
            "brier": float(np.mean((p - y) ** 2))}


def calibration_table(p: np.ndarray, y: np.ndarray, k: np.ndarray | None = None,
                      mu: np.ndarray | None = None,
                      edges: Sequence[float] = CALIBRATION_EDGES) -> pd.DataFrame:
    """Held-out runs binned by predicted P(>= 1 spike): count, mean predicted p, observed
    fraction with a spike (and its Wilson 90 % interval), predicted vs observed spikes."""
    p, y = np.asarray(p, float), np.asarray(y, float)
    rows = []
    e = np.asarray(edges, float)
    idx = np.clip(np.searchsorted(e, p, side="right") - 1, 0, len(e) - 2)
    z = stats.norm.ppf(0.95)
    for b in range(len(e) - 1):
        m = idx == b
        n = int(m.sum())
        if not n:
            continue
        f = float(y[m].mean())
        den = 1 + z * z / n
        c = (f + z * z / (2 * n)) / den
        h = z * math.sqrt(f * (1 - f) / n + z * z / (4 * n * n)) / den
        rows.append({"bin_lo": float(e[b]), "bin_hi": float(e[b + 1]), "n_runs": n,
                     "mean_predicted": float(p[m].mean()), "observed_fraction": f,
                     "observed_lo": max(0.0, c - h), "observed_hi": min(1.0, c + h),
                     "predicted_spikes": float(mu[m].sum()) if mu is not None else math.nan,
                     "observed_spikes": float(k[m].sum()) if k is not None else math.nan})
    return pd.DataFrame(rows, columns=["bin_lo", "bin_hi", "n_runs", "mean_predicted",
                                       "observed_fraction", "observed_lo", "observed_hi",
                                       "predicted_spikes", "observed_spikes"])


def validate(table: pd.DataFrame, *, ridge: float = RIDGE, n_boot: int = N_BOOT,
             seed: int = 0, candidates: Sequence[str] = FEATURES) -> dict:
    """Held-out validation (heldout_split): fit on the rest, score P(>= 1 spike in the
    run's steps) of the held-out runs against the constant-rate baseline. Returns the
    scores, the calibration table, per-run predictions and the split's description.
    candidates: the features the model may use (`select_features` keeps the usable ones)."""
    feats = select_features(table, candidates)
    t = usable(table, feats)
    mask, desc = heldout_split(t)
    train, test = t.loc[~mask].reset_index(drop=True), t.loc[mask].reset_index(drop=True)
    if test.empty or train.empty:
        raise SpikeRateError(f"held-out split left an empty side ({desc})")
    feats_train = [f for f in feats if f in select_features(train, candidates)]
    m = fit(train, feats_train, ridge=ridge, n_boot=n_boot, seed=seed)
    n = test["num_steps"].to_numpy(float)
    k = test["num_spikes"].to_numpy(float)
    y = (k > 0).astype(float)
    rate = m.rate(m.matrix(test))
    p = p_spike(rate, n)
    r0 = baseline_rate(train["num_spikes"].sum(), train["num_steps"].sum())
    p0 = p_spike(np.full(len(n), r0), n)
    mu = rate * n / 1000.0
    per_run = test[["source", "run", "width", "seed", "num_spikes", "num_steps"]].copy()
    per_run["rate_pred_per_1k"] = rate
    per_run["p_pred"] = p
    per_run["p_baseline"] = p0
    return {"split": desc, "features": feats_train, "n_train": int(len(train)),
            "n_heldout": int(len(test)), "heldout_spikes": float(k.sum()),
            "heldout_runs_with_spikes": int(y.sum()),
            "all_heldout_zero": bool(k.sum() == 0),
            "model": scores(p, y), "baseline": scores(p0, y), "baseline_rate_per_1k": r0,
            "calibration": calibration_table(p, y, k, mu), "per_run": per_run,
            "coefficients": m.coefficients(), "dispersion": m.dispersion}
