"""What the per-layer Adam telemetry did before each spike, and how early.

For a spike starting at step s, two stretches of the layers table are used:

    baseline  steps [s - window - baseline, s - window)   the metric's normal band
    window    steps [s - window, s)                       where a precursor may show

Per metric and tensor group (shallow: the embed and shallow groups of adamspike.depth_groups,
depth < max(1, L // 10); deep: the deeper blocks and the head) the
per-step values are reduced across the group's tensors (median by default), and the band
is  median(baseline) + max(k * 1.4826 * MAD(baseline), rel_margin * |median|)  (upper side;
`two_sided=True` also flags drops below the mirrored lower edge). Lead times, in steps:

    lead_sustained  s - first step of the out-of-band run that lasts up to the last logged
                    step before s (NaN when that step is back inside the band)
    lead_first      s - first out-of-band step anywhere in the window (NaN if none)

`lead_sustained` is the honest precursor number; `lead_first` shows how noisy the metric
is. Metrics: rho, rms_t, update_rms, sat_frac, grad_mom_cos, m_v_ratio and the
bimodality coefficient of r (from the raw moments, adamspike.metrics.shape_stats).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from adamspike.depth_groups import infer_num_layers, is_shallow
from adamspike.metrics import shape_stats
from analysis.spikes import MAD_TO_SIGMA

PRECURSOR_METRICS = ("rho", "rms_t", "update_rms", "sat_frac", "bimodality", "grad_mom_cos",
                     "m_v_ratio")


@dataclass
class Precursors:
    trajectories: pd.DataFrame   # spike_id, start, step, rel_step, group, metric, value
    leads: pd.DataFrame          # spike_id, start, group, metric, baseline, band, lead_*
    summary: pd.DataFrame        # group, metric, num_spikes, num_led, lead quantiles
    window: int
    baseline: int
    tensor_leads: pd.DataFrame | None = None  # spike_id, name, depth, group, metric, lead


def depth_group(depth, num_layers: int | None = None) -> np.ndarray:
    """'shallow' for the embed and shallow groups of adamspike.depth_groups (depth <
    max(1, L // 10)), else 'deep'. num_layers: L, by default the largest depth given (the
    head's, in a whole layers table)."""
    depth = np.asarray(depth)
    if num_layers is None:
        num_layers = infer_num_layers(depth.ravel())
    return np.where(is_shallow(depth.ravel(), num_layers), "shallow", "deep").reshape(depth.shape)


def with_derived(layers: pd.DataFrame) -> pd.DataFrame:
    """layers plus the bimodality coefficient (when the raw r moments are present)."""
    if "bimodality" in layers or not {"r_mean", "r_m2", "r_m3", "r_m4"} <= set(layers):
        return layers
    out = layers.copy()
    out["bimodality"] = shape_stats(layers["r_mean"], layers["r_m2"], layers["r_m3"],
                                    layers["r_m4"])["bimodality"].astype(np.float32)
    return out


def group_series(layers: pd.DataFrame, metrics=PRECURSOR_METRICS, reduce: str = "median"
                 ) -> pd.DataFrame:
    """Per (step, group) reduction of each metric across the group's tensors."""
    metrics = [m for m in metrics if m in layers]
    df = layers[["step", "depth", *metrics]].copy()
    df["group"] = depth_group(df["depth"])
    with np.errstate(all="ignore"):
        g = df.groupby(["step", "group"], sort=True)[metrics].agg(reduce)
    return g.reset_index()


def _band(base: np.ndarray, k: float, rel_margin: float) -> tuple[float, float, float]:
    base = base[np.isfinite(base)]
    if base.size == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(base))
    mad = float(np.median(np.abs(base - med)))
    half = max(k * MAD_TO_SIGMA * mad, rel_margin * abs(med), 1e-12)
    return med, med + half, med - half


def lead_times(steps: np.ndarray, values: np.ndarray, start: int, hi: float, lo: float,
               two_sided: bool) -> tuple[float, float, int | None]:
    """(lead_sustained, lead_first, onset step) for one series within the window."""
    with np.errstate(invalid="ignore"):
        out = values > hi
        if two_sided:
            out |= values < lo
    if not len(steps):
        return math.nan, math.nan, None
    first = float(start - steps[np.argmax(out)]) if out.any() else math.nan
    if not out[-1]:
        return math.nan, first, None
    i = len(out) - 1
    while i > 0 and out[i - 1]:
        i -= 1
    return float(start - steps[i]), first, int(steps[i])


def precursors(layers: pd.DataFrame, spikes: pd.DataFrame, *, window: int = 50,
               baseline: int = 200, k: float = 4.0, rel_margin: float = 0.1,
               two_sided: bool = False, reduce: str = "median",
               metrics=PRECURSOR_METRICS) -> Precursors:
    """Trajectories and lead times of each metric before each spike (see module doc)."""
    # only the rows around spikes are needed: select them before any copy (70B traces)
    st = layers["step"].to_numpy()
    keep = np.zeros(len(st), bool)
    for s in spikes["start"].to_numpy(dtype=np.int64):
        keep |= (st >= s - window - baseline) & (st <= s + window)
    layers = with_derived(layers.loc[keep])
    metrics = [m for m in metrics if m in layers]
    series = group_series(layers, metrics, reduce)
    steps_all = series["step"].to_numpy()
    traj, leads = [], []
    for sid, sp in enumerate(spikes.itertuples(index=False)):
        s = int(sp.start)
        lo_i = np.searchsorted(steps_all, s - window - baseline, side="left")
        hi_i = np.searchsorted(steps_all, s + window, side="right")
        seg = series.iloc[lo_i:hi_i]
        for grp, gseg in seg.groupby("group", sort=True):
            st = gseg["step"].to_numpy()
            in_base = st < s - window
            in_win = (st >= s - window) & (st < s)
            for m in metrics:
                v = gseg[m].to_numpy(dtype=np.float64)
                traj.append(pd.DataFrame({"spike_id": sid, "start": s, "step": st,
                                          "rel_step": st - s, "group": grp, "metric": m,
                                          "value": v}))
                med, hi, lo = _band(v[in_base], k, rel_margin)
                if math.isnan(med) or not in_win.any():
                    sus, first, onset = math.nan, math.nan, None
                else:
                    sus, first, onset = lead_times(st[in_win], v[in_win], s, hi, lo, two_sided)
                pre = v[in_win]
                leads.append({"spike_id": sid, "start": s, "group": grp, "metric": m,
                              "baseline": med, "band_hi": hi, "num_baseline": int(in_base.sum()),
                              "pre_max": float(np.nanmax(pre)) if np.isfinite(pre).any()
                              else math.nan,
                              "lead_sustained": sus, "lead_first": first,
                              "onset_step": onset})
    traj_df = (pd.concat(traj, ignore_index=True) if traj else
               pd.DataFrame(columns=["spike_id", "start", "step", "rel_step", "group",
                                     "metric", "value"]))
    lead_df = pd.DataFrame(leads, columns=["spike_id", "start", "group", "metric", "baseline",
                                           "band_hi", "num_baseline", "pre_max",
                                           "lead_sustained", "lead_first", "onset_step"])
    return Precursors(traj_df, lead_df, summarize_leads(lead_df), window, baseline,
                      tensor_leads(layers, spikes, window=window, baseline=baseline, k=k,
                                   rel_margin=rel_margin, two_sided=two_sided,
                                   metrics=metrics))


def tensor_leads(layers: pd.DataFrame, spikes: pd.DataFrame, *, window: int = 50,
                 baseline: int = 200, k: float = 4.0, rel_margin: float = 0.1,
                 two_sided: bool = False, metrics=PRECURSOR_METRICS) -> pd.DataFrame:
    """The sustained lead per tensor against its own band (same rule as the groups'), for
    'which layer moved first'. Vectorised over tensors on a (step x tensor) matrix."""
    layers = with_derived(layers)
    metrics = [m for m in metrics if m in layers]
    rows = []
    st_all = layers["step"].to_numpy()
    for sid, s in enumerate(spikes["start"].to_numpy(dtype=np.int64)):
        part = layers.loc[(st_all >= s - window - baseline) & (st_all < s)]
        if part.empty:
            continue
        names = part["name"].astype(str).to_numpy()
        uniq, col = np.unique(names, return_inverse=True)
        steps, row = np.unique(part["step"].to_numpy(), return_inverse=True)
        depth = np.zeros(len(uniq), np.int64)
        depth[col] = part["depth"].to_numpy()
        in_base, in_win = steps < s - window, steps >= s - window
        for m in metrics:
            mat = np.full((len(steps), len(uniq)), np.nan)
            mat[row, col] = part[m].to_numpy(dtype=np.float64)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
                base = mat[in_base]
                med = np.nanmedian(base, axis=0) if len(base) else np.full(len(uniq), np.nan)
                mad = np.nanmedian(np.abs(base - med), axis=0) if len(base) else med
                half = np.maximum(np.maximum(k * MAD_TO_SIGMA * mad, rel_margin * np.abs(med)),
                                  1e-12)
                win = mat[in_win]
                out = win > med + half
                if two_sided:
                    out |= win < med - half
            lead = np.full(len(uniq), np.nan)
            if len(win):
                # length of the out-of-band run that ends at the last pre-spike step
                trail = np.cumprod(out[::-1], axis=0).sum(axis=0)
                ok = (trail > 0) & np.isfinite(med)
                sw = steps[in_win]
                lead[ok] = s - sw[len(sw) - trail[ok]]
            rows.append(pd.DataFrame({"spike_id": sid, "start": int(s), "name": uniq,
                                      "depth": depth, "metric": m, "lead": lead}))
    df = (pd.concat(rows, ignore_index=True) if rows else
          pd.DataFrame(columns=["spike_id", "start", "name", "depth", "metric", "lead"]))
    df["group"] = depth_group(df["depth"]) if len(df) else pd.Series(dtype=str)
    return df


def summarize_leads(leads: pd.DataFrame) -> pd.DataFrame:
    """Lead-time distribution per (group, metric) over spikes."""
    rows = []
    for (grp, m), g in leads.groupby(["group", "metric"], sort=True):
        led = g["lead_sustained"].dropna().to_numpy()
        rows.append({"group": grp, "metric": m, "num_spikes": len(g), "num_led": len(led),
                     "frac_led": len(led) / len(g) if len(g) else math.nan,
                     "lead_median": float(np.median(led)) if len(led) else math.nan,
                     "lead_q25": float(np.quantile(led, 0.25)) if len(led) else math.nan,
                     "lead_q75": float(np.quantile(led, 0.75)) if len(led) else math.nan,
                     "lead_min": float(led.min()) if len(led) else math.nan,
                     "lead_max": float(led.max()) if len(led) else math.nan})
    return pd.DataFrame(rows, columns=["group", "metric", "num_spikes", "num_led", "frac_led",
                                       "lead_median", "lead_q25", "lead_q75", "lead_min",
                                       "lead_max"])
