"""Paired statistics for the replication table: two arms run on the same seeds.

Seed k of the control arm and seed k of the treatment arm share the data order and the
initialisation, so the unit of analysis is the per-seed difference d_k = t_k - c_k
(treatment minus control), k = 1..n, n >= 10 by default. For each row (a claim) this gives:

    interval   BCa bootstrap interval of mean(d) (Efron 1987): percentiles of the bootstrap
               distribution corrected for its median bias z0 and for the acceleration a
               (from the jackknife). scipy.stats.bootstrap(method="BCa", paired=True).
               When every d_k is equal (the quadratic, whose seeds differ only by 1e-9
               gradient noise, gives d = [-2, -2, ...]) no resample differs from the data:
               the interval is [d, d], zero width, with a note saying so (not a NaN).
    sign test  exact binomial test of P(d > 0) = 1/2 over the non-zero d_k
               (scipy.stats.binomtest); ties (d_k = 0) carry no sign and are dropped.
    permutation  exact paired permutation test of mean(d) = 0: under H0 each pair's labels
               are exchangeable, so the sign of every d_k is flipped in all 2^n ways
               (scipy.stats.permutation_test, permutation_type="samples"); exact up to
               n = EXACT_MAX_N, Monte Carlo with 2^16 resamples above.
    multiplicity  Holm-Bonferroni over the rows of a table (`holm`): with p-values sorted
               p_(1) <= ... <= p_(m), adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j));
               controls the family-wise error rate at alpha for any dependence between rows.

Equal progress (`equal_progress`): a remedy can "avoid spikes" by training slower, so each
seed pair is also compared at the same training progress. The loss is smoothed by a
trailing running median (robust to the spikes themselves); the target is the worse (higher)
of the two arms' final smoothed losses, so both arms reach it; per arm, the spikes that
start before the first step whose smoothed loss is <= target are counted. Over the seeds
the paired differences of (spikes before target) and of the final loss are tested as above,
and `equal_progress_verdict` says "removes spikes only by slowing training" when the full-run
reduction is significant but the one at equal progress is not.

References: Efron, "Better bootstrap confidence intervals", JASA 82 (1987); Holm, "A simple
sequentially rejective multiple test procedure", Scand. J. Statist. 6 (1979); scipy.stats.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.spikes import SpikeParams, loss_spikes

MIN_SEEDS = 10
EXACT_MAX_N = 16
MC_RESAMPLES = 2 ** 16
DEFAULT_SMOOTH = 50


def paired_differences(treatment: Sequence[float], control: Sequence[float]) -> np.ndarray:
    """d_k = treatment_k - control_k (float64); raises ValueError on unequal lengths or
    non-finite values (a pair with a missing value cannot be compared)."""
    t = np.asarray(treatment, dtype=np.float64).ravel()
    c = np.asarray(control, dtype=np.float64).ravel()
    if t.shape != c.shape:
        raise ValueError(f"paired arms need the same seeds: treatment has {t.size} values, "
                         f"control {c.size}")
    d = t - c
    if not np.isfinite(d).all():
        raise ValueError(f"paired differences must be finite; seeds "
                         f"{np.flatnonzero(~np.isfinite(d)).tolist()} are not")
    return d


def _all_equal(d: np.ndarray) -> bool:
    return bool(d.size and np.ptp(d) <= 1e-12 * max(1.0, float(np.max(np.abs(d)))))


def _mean_diff(t, c, axis=-1):
    return np.mean(t - c, axis=axis)


def bca_interval(treatment: Sequence[float], control: Sequence[float], *,
                 confidence: float = 0.95, n_resamples: int = 9999, seed: int = 0
                 ) -> tuple[float, float, str]:
    """BCa bootstrap interval of mean(treatment - control) over paired seeds.

    Returns (low, high, note). note is "" for a regular BCa interval; "degenerate: ..." for
    identical differences (zero-width interval at the common value); "BCa undefined ...:
    percentile interval" when scipy's BCa returns NaN (a jackknife with zero spread but a
    non-constant sample), in which case the percentile interval of the same resamples is
    returned instead.
    """
    d = paired_differences(treatment, control)
    if d.size < 2:
        raise ValueError(f"a bootstrap interval needs >= 2 paired seeds, got {d.size}")
    if _all_equal(d):
        v = float(d.mean())
        return v, v, (f"degenerate: all {d.size} paired differences equal {v:g}; "
                      "zero-width interval (no resample differs from the data)")
    t = np.asarray(treatment, dtype=np.float64).ravel()
    c = np.asarray(control, dtype=np.float64).ravel()
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap((t, c), _mean_diff, paired=True, vectorized=True,
                              method="BCa", confidence_level=confidence,
                              n_resamples=n_resamples, rng=rng)
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi, ""
    q = (1 - confidence) / 2
    dist = res.bootstrap_distribution
    return (float(np.quantile(dist, q)), float(np.quantile(dist, 1 - q)),
            "BCa undefined for this sample (degenerate jackknife): percentile interval")


def sign_test(diffs: Sequence[float], alternative: str = "two-sided"
              ) -> tuple[float, int, int]:
    """Exact sign test of P(d > 0) = 1/2: (p, n_pos, n_neg); zeros dropped, p = 1 if no
    non-zero difference is left. alternative "greater" tests P(d > 0) > 1/2."""
    d = np.asarray(diffs, dtype=np.float64)
    n_pos, n_neg = int((d > 0).sum()), int((d < 0).sum())
    if n_pos + n_neg == 0:
        return 1.0, 0, 0
    p = stats.binomtest(n_pos, n_pos + n_neg, 0.5, alternative=alternative).pvalue
    return float(p), n_pos, n_neg


def permutation_test(treatment: Sequence[float], control: Sequence[float], *,
                     alternative: str = "two-sided", seed: int = 0) -> tuple[float, bool]:
    """Paired permutation test of mean(treatment - control) = 0: (p, exact). Exact (all
    2^n within-pair swaps) for n <= EXACT_MAX_N, else MC_RESAMPLES random swaps."""
    d = paired_differences(treatment, control)
    if not d.any():
        return 1.0, True
    t = np.asarray(treatment, dtype=np.float64).ravel()
    c = np.asarray(control, dtype=np.float64).ravel()
    exact = d.size <= EXACT_MAX_N
    res = stats.permutation_test((t, c), _mean_diff, permutation_type="samples",
                                 vectorized=True, alternative=alternative,
                                 n_resamples=np.inf if exact else MC_RESAMPLES,
                                 rng=np.random.default_rng(seed))
    return float(res.pvalue), exact


@dataclass(frozen=True)
class PairedResult:
    """One paired comparison (treatment - control) over n seeds; see the module doc."""
    n: int
    mean_diff: float
    median_diff: float
    ci_low: float
    ci_high: float
    confidence: float
    ci_note: str
    sign_p: float
    n_pos: int
    n_neg: int
    perm_p: float
    perm_exact: bool
    p: float            # the row's test p-value (permutation), before correction
    note: str

    def as_dict(self) -> dict:
        return asdict(self)


def paired_test(treatment: Sequence[float], control: Sequence[float], *,
                confidence: float = 0.95, alternative: str = "two-sided",
                min_seeds: int = MIN_SEEDS, n_resamples: int = 9999, seed: int = 0
                ) -> PairedResult:
    """BCa interval, exact sign test and paired permutation test of treatment - control.

    Raises ValueError when fewer than `min_seeds` pairs are given (the replication table's
    rule is n >= 10). `p` is the permutation p-value (it uses the sizes of the differences,
    not only their signs); correct it across rows with `holm`.
    """
    d = paired_differences(treatment, control)
    if d.size < min_seeds:
        raise ValueError(f"paired test needs >= {min_seeds} paired seeds, got {d.size}")
    lo, hi, ci_note = bca_interval(treatment, control, confidence=confidence,
                                   n_resamples=n_resamples, seed=seed)
    sp, n_pos, n_neg = sign_test(d, alternative)
    pp, exact = permutation_test(treatment, control, alternative=alternative, seed=seed)
    notes = [ci_note] if ci_note else []
    if n_pos + n_neg < d.size:
        notes.append(f"{d.size - n_pos - n_neg} tied pair(s) dropped from the sign test")
    if not exact:
        notes.append(f"permutation p from {MC_RESAMPLES} random sign flips")
    return PairedResult(n=int(d.size), mean_diff=float(d.mean()),
                        median_diff=float(np.median(d)), ci_low=lo, ci_high=hi,
                        confidence=confidence, ci_note=ci_note, sign_p=sp, n_pos=n_pos,
                        n_neg=n_neg, perm_p=pp, perm_exact=exact, p=pp,
                        note="; ".join(notes))


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (same order as given). NaN entries are not tests:
    they stay NaN and do not count in m."""
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out


def correct_rows(table: pd.DataFrame, p_col: str = "p", alpha: float = 0.05
                 ) -> pd.DataFrame:
    """A copy of `table` with `p_holm` (Holm over its rows with a finite p) and
    `reject_holm` (p_holm < alpha), and attrs["multiplicity"] stating the correction."""
    out = table.copy()
    out["p_holm"] = holm(out[p_col].to_numpy(dtype=np.float64))
    out["reject_holm"] = out["p_holm"] < alpha
    m = int(np.isfinite(out[p_col].to_numpy(dtype=np.float64)).sum())
    out.attrs["multiplicity"] = (f"Holm-Bonferroni over {m} tested rows (family-wise error "
                                 f"rate {alpha:g})")
    return out


# ----------------------------------------------------------------------------- equal progress

def smoothed_loss(steps: pd.DataFrame, smooth: int = DEFAULT_SMOOTH) -> pd.Series:
    """Trailing running median of the finite loss over `smooth` logged steps, indexed by
    step (a median, so a spike does not move the progress measure)."""
    st = steps.sort_values("step")
    x = pd.Series(st["loss"].to_numpy(np.float64), index=st["step"].to_numpy(np.int64))
    x = x.where(np.isfinite(x))
    return x.rolling(int(smooth), min_periods=1).median()


def steps_to_target(smoothed: pd.Series, target: float) -> float:
    """First step whose smoothed loss is <= target (NaN if never)."""
    hit = np.flatnonzero(smoothed.to_numpy() <= target)
    return float(smoothed.index[hit[0]]) if hit.size else math.nan


SpikeFn = Callable[[pd.DataFrame], pd.DataFrame]


def _report_spikes(steps: pd.DataFrame) -> pd.DataFrame:
    return loss_spikes(steps, SpikeParams())[0]


def equal_progress_pair(control_steps: pd.DataFrame, treatment_steps: pd.DataFrame, *,
                        smooth: int = DEFAULT_SMOOTH, target: float | None = None,
                        spikes: SpikeFn = _report_spikes,
                        control_spikes: pd.DataFrame | None = None,
                        treatment_spikes: pd.DataFrame | None = None) -> dict:
    """One seed pair at equal progress.

    target: the loss both arms must reach; default the worse (higher) of the two final
    smoothed losses. Spikes come from `spikes(steps)` (default: the report's loss-spike
    rule, analysis.report.loss_spikes) unless given. Returns a dict with target, per arm
    the final smoothed loss, the step the target is first reached, spikes in the whole run
    and spikes starting before that step.
    """
    out = {}
    sm = {"control": smoothed_loss(control_steps, smooth),
          "treatment": smoothed_loss(treatment_steps, smooth)}
    finals = {k: float(v.dropna().iloc[-1]) if v.notna().any() else math.nan
              for k, v in sm.items()}
    tgt = max(finals.values()) if target is None else float(target)
    out["target"] = tgt
    given = {"control": control_spikes, "treatment": treatment_spikes}
    tables = {"control": control_steps, "treatment": treatment_steps}
    for arm in ("control", "treatment"):
        sp = given[arm] if given[arm] is not None else spikes(tables[arm])
        starts = sp["start"].to_numpy(np.int64) if len(sp) else np.zeros(0, np.int64)
        reach = steps_to_target(sm[arm], tgt)
        out[f"{arm}_final_loss"] = finals[arm]
        out[f"{arm}_steps_to_target"] = reach
        out[f"{arm}_spikes"] = int(starts.size)
        out[f"{arm}_spikes_before_target"] = (int((starts < reach).sum())
                                              if math.isfinite(reach) else int(starts.size))
    return out


@dataclass
class EqualProgress:
    """Per-seed equal-progress rows and the paired tests over the seeds."""
    per_seed: pd.DataFrame
    spikes_full: PairedResult          # treatment - control, whole runs
    spikes_at_target: PairedResult     # treatment - control, before reaching the target
    final_loss: PairedResult           # treatment - control final smoothed loss
    verdict: str


def equal_progress(control: Sequence[pd.DataFrame], treatment: Sequence[pd.DataFrame], *,
                   smooth: int = DEFAULT_SMOOTH, target: float | None = None,
                   spikes: SpikeFn = _report_spikes, alpha: float = 0.05,
                   min_seeds: int = MIN_SEEDS, seed: int = 0,
                   control_spikes: Sequence[pd.DataFrame] | None = None,
                   treatment_spikes: Sequence[pd.DataFrame] | None = None) -> EqualProgress:
    """Compare two arms at equal training progress over paired seeds.

    control[k] and treatment[k] are the steps tables (Run.steps) of seed k. target: one
    fixed loss for every pair, default per pair the worse final smoothed loss (so both arms
    of a pair reach it). Returns the per-seed table, paired tests of spike counts (whole
    run and before the target) and of the final loss, and `equal_progress_verdict`.
    control_spikes / treatment_spikes: per-seed spike tables (column start) instead of
    `spikes(steps)`.
    """
    if len(control) != len(treatment):
        raise ValueError(f"paired arms need the same seeds: {len(control)} control runs, "
                         f"{len(treatment)} treatment runs")
    cs = list(control_spikes) if control_spikes is not None else [None] * len(control)
    ts = list(treatment_spikes) if treatment_spikes is not None else [None] * len(control)
    rows = [{"seed": k, **equal_progress_pair(c, t, smooth=smooth, target=target,
                                              spikes=spikes, control_spikes=a,
                                              treatment_spikes=b)}
            for k, (c, t, a, b) in enumerate(zip(control, treatment, cs, ts))]
    df = pd.DataFrame(rows)
    kw = dict(min_seeds=min_seeds, seed=seed)
    full = paired_test(df["treatment_spikes"], df["control_spikes"], **kw)
    at = paired_test(df["treatment_spikes_before_target"],
                     df["control_spikes_before_target"], **kw)
    fl = paired_test(df["treatment_final_loss"], df["control_final_loss"], **kw)
    return EqualProgress(df, full, at, fl, equal_progress_verdict(full, at, fl, alpha))


def _decreases(r: PairedResult, alpha: float) -> bool:
    return r.ci_high < 0 and r.p < alpha


def equal_progress_verdict(spikes_full: PairedResult, spikes_at_target: PairedResult,
                           final_loss: PairedResult, alpha: float = 0.05) -> str:
    """A sentence for the table's equal-progress column.

    A reduction is significant when the interval lies below 0 and p < alpha (uncorrected:
    the table's Holm correction applies to the row's main test)."""
    slower = final_loss.ci_low > 0 and final_loss.p < alpha
    loss = (f"final loss {final_loss.mean_diff:+.3g} "
            f"[{final_loss.ci_low:.3g}, {final_loss.ci_high:.3g}]")
    full = f"spikes {spikes_full.mean_diff:+.3g} per run"
    at = f"{spikes_at_target.mean_diff:+.3g} before the common loss target"
    if not _decreases(spikes_full, alpha):
        return f"no significant spike reduction over the whole run ({full}; {at}; {loss})"
    if _decreases(spikes_at_target, alpha):
        return (f"reduces spikes at equal progress ({full}; {at}; {loss})")
    tail = "; trains slower" if slower else ""
    return (f"removes spikes only by slowing training: the reduction is not significant at "
            f"equal progress ({full}; {at}; {loss}{tail})")
