"""Precursors against control windows, and alarm scoring against the chance rate.

Precursors with controls. "r turns bimodal before spikes" (Molybog 2023) needs a control:
Sarle's bimodality coefficient BC = (skew^2 + 1) / kurt of r is high in many windows that no
spike follows, and at step 1 r = m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) ~ sign(g), so
BC ~ 1 and sat_frac ~ 1 there by construction. So, per run:

    burn-in   steps t <= ceil(3 / (1 - b2)) are dropped (the second moment has then
              forgotten all but e^-3 of its first values); it applies to both metrics
    series    per logged step and depth group (adamspike.depth_groups: embed / shallow /
              deep / head): BC per tensor from the raw moments (adamspike.metrics.
              shape_stats), reduced by the median over the group's tensors; sat_frac
              (mass at |r| > 0.9) as the numel-weighted mean, the group's mass
    window    value of a metric over steps [a, a + W): the mean of the series (NaN when
              fewer than `min_steps` post-burn-in logged steps fall in it)

For a spike starting at s the pre-spike window is [s - W, s) (skipped when it overlaps an
earlier spike of the run). Its matched controls are the same step range [s - W, s) in every
other run of the study (other seeds, other arms) whose spikes all lie >= 2W steps from it
(same phase of training, no spike near). Only when no run gives one, the fallback is windows
of the same run, tiled every W steps after the burn-in, >= 2W from every spike of that run;
each row says which controls were used. Per metric and group, with a threshold (BC: Sarle's
5/9; sat_frac: the 90th percentile of the control windows unless given), the fractions of
pre-spike and of control windows above it are compared by Fisher's exact test (one-sided:
pre-spike more often above), Holm-corrected over the metric x group rows.

Alarm lift. analysis.alarms scores precision = true alarms / alarms, an alarm at f being
true when a spike starts in [f + 1, f + H] (lead >= 1 only, here). An alarm that fires at
random logged steps has precision equal to the chance rate

    chance = fraction of logged steps t with s - H <= t <= s - 1 for some spike start s,

so lift = precision / chance, and a rule is informative when lift > 1 and the one-sided
binomial test of (true alarms out of alarms) against chance gives p < alpha.
`mark_uninformative` writes the verdict into a predictions.json dict (a new dict). The
binomial test treats alarms as independent trials; alarms inside clusters of spikes are not,
so its p-value is optimistic there (the lift itself is not affected).

References: Molybog et al. 2023, "A theory on Adam instability in large-scale machine
learning"; Pfister et al. 2013 (Sarle's bimodality coefficient); scipy.stats.fisher_exact,
scipy.stats.binomtest.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.depth_groups import GROUPS, depth_group, infer_num_layers
from adamspike.metrics import shape_stats
from adamspike.predictions import AlarmRule, from_json
from adamspike.rundir import load_run
from analysis.alarms import DEFAULT_HORIZON, fire_steps, online_alarms, score_alarms
from analysis.fits import optim_params
from analysis.report import loss_spikes, md_table
from analysis.stats import holm

CONTROL_METRICS = ("bimodality", "sat_frac")
BC_THRESHOLD = 5.0 / 9.0
DEFAULT_WINDOW = 50
CONTROL_QUANTILE = 0.9
_MOMENTS = ("r_mean", "r_m2", "r_m3", "r_m4")


def burn_in_steps(b2: float) -> int:
    """ceil(3 / (1 - b2)): steps before the second moment forgets its start (to e^-3)."""
    if not 0 <= float(b2) < 1:
        raise ValueError(f"b2 must be in [0, 1), got {b2}")
    return int(math.ceil(3.0 / (1.0 - float(b2)) - 1e-9))


def group_series(layers: pd.DataFrame, num_layers: int, burn_in: int,
                 reduce: str = "median") -> pd.DataFrame:
    """Per (step, group) BC (reduce over tensors) and sat_frac (numel-weighted), steps
    after the burn-in only. Columns: step, group, bimodality, sat_frac."""
    lay = layers.loc[layers["step"].to_numpy() > burn_in]
    cols = ["step", "group", *CONTROL_METRICS]
    if lay.empty:
        return pd.DataFrame(columns=cols)
    depth = lay["depth"].to_numpy()
    uniq, inv = np.unique(depth, return_inverse=True)     # one lookup per depth, not per row
    groups = np.array([depth_group(d, num_layers) for d in uniq])[inv.ravel()]
    df = pd.DataFrame({"step": lay["step"].to_numpy(np.int64), "group": groups})
    if set(_MOMENTS) <= set(lay):
        df["bimodality"] = shape_stats(*(lay[m] for m in _MOMENTS))["bimodality"]
    else:
        df["bimodality"] = np.nan
    numel = lay["numel"].to_numpy(np.float64)
    df["_w"] = numel
    df["_ws"] = numel * lay["sat_frac"].to_numpy(np.float64) if "sat_frac" in lay else np.nan
    df["bimodality"] = df["bimodality"].where(np.isfinite(df["bimodality"]))
    g = df.groupby(["step", "group"], sort=True)
    with np.errstate(all="ignore"):
        out = g["bimodality"].agg(reduce).to_frame()
        out["sat_frac"] = g["_ws"].sum(min_count=1) / g["_w"].sum()
    return out.reset_index()[cols]


@dataclass
class StudyRun:
    """One run of a study: its group series after the burn-in and its loss spikes."""
    name: str
    arm: str
    seed: object
    series: pd.DataFrame             # group_series output
    spikes: pd.DataFrame             # columns start, end (at least)
    logged_steps: np.ndarray         # layer-logged steps (all, burn-in included)
    burn_in: int
    num_layers: int
    layers: pd.DataFrame | None = field(default=None, repr=False)
    events: pd.DataFrame | None = field(default=None, repr=False)


def _strip_seeds(o):
    if isinstance(o, dict):
        return {k: _strip_seeds(v) for k, v in o.items() if k != "seed"}
    return o


def _find_seed(o):
    if isinstance(o, dict):
        if "seed" in o and not isinstance(o["seed"], dict):
            return o["seed"]
        for v in o.values():
            s = _find_seed(v)
            if s is not None:
                return s
    return None


def arm_key(config: Mapping) -> str:
    """The arm of a run: its config without any `seed` entry, as canonical JSON."""
    return json.dumps(_strip_seeds(dict(config or {})), sort_keys=True, default=str)


def load_study(run_dirs: Iterable[str | Path], *, arms: Mapping[str, str] | None = None,
               keep_layers: bool = False) -> list[StudyRun]:
    """Read run directories (steps + layers) into StudyRuns: spikes by the report's loss
    rule (analysis.report.loss_spikes), burn-in from the config's b2, L from the depths.
    arms: optional {run_dir: arm label}; default the config without its seeds."""
    out = []
    for p in run_dirs:
        run = load_run(p, tables=("steps", "layers"),
                       layer_columns=None if keep_layers else [*_MOMENTS, "sat_frac"])
        if run.layers.empty:
            raise ValueError(f"{p}: no per-layer telemetry (layers table is empty)")
        b2 = optim_params(run.config)["b2"]
        if b2 is None:
            raise ValueError(f"{p}: run.json config has no optim.b2 (needed for the burn-in)")
        sp, _ = loss_spikes(run.steps, config=run.config)
        L = infer_num_layers(run.layers)
        bi = burn_in_steps(b2)
        arm = (arms or {}).get(str(p)) or arm_key(run.config)
        out.append(StudyRun(name=Path(p).name, arm=arm, seed=_find_seed(run.config),
                            series=group_series(run.layers, L, bi), spikes=sp,
                            logged_steps=np.unique(run.layers["step"].to_numpy(np.int64)),
                            burn_in=bi, num_layers=L,
                            layers=run.layers if keep_layers else None, events=run.events))
    return out


def _distance(spikes: pd.DataFrame, a: int, b: int) -> float:
    """Steps between window [a, b) and the nearest spike [start, end] (0 if overlapping)."""
    if not len(spikes):
        return math.inf
    s0 = spikes["start"].to_numpy(np.int64)
    s1 = spikes["end"].to_numpy(np.int64) if "end" in spikes else s0
    after = np.where(s0 > b - 1, s0 - (b - 1), 0)
    before = np.where(s1 < a, a - s1, 0)
    return float(np.maximum(after, before).min())


def _num_steps(series: pd.DataFrame, a: int, b: int) -> int:
    st = np.unique(series["step"].to_numpy())
    return int(((st >= a) & (st < b)).sum())


def _window_values(series: pd.DataFrame, a: int, b: int, min_steps: int) -> dict:
    st = series["step"].to_numpy()
    w = series.loc[(st >= a) & (st < b)]
    out = {}
    for grp, sub in w.groupby("group"):
        for m in CONTROL_METRICS:
            v = sub[m].to_numpy(np.float64)
            v = v[np.isfinite(v)]
            out[(grp, m)] = float(v.mean()) if v.size >= min_steps else math.nan
    return out


def collect_windows(runs: Sequence[StudyRun], *, window: int = DEFAULT_WINDOW,
                    gap: int | None = None, min_steps: int | None = None) -> pd.DataFrame:
    """Pre-spike and control windows (see module doc), one row per window x group x metric.

    Columns: kind ("pre" / "control"), source ("matched" / "same-run" for controls, "" for
    pre), run, arm, spike_start (the pre-spike window it was drawn for; for a control, the
    first spike that asked for it), a, b, group, metric, value.
    """
    W = int(window)
    gap = 2 * W if gap is None else int(gap)
    min_steps = max(1, W // 2) if min_steps is None else int(min_steps)
    rows, seen = [], set()

    def add(kind, source, run, spike, a, b):
        if kind == "control":
            if (run.name, a, b) in seen:
                return
            seen.add((run.name, a, b))
        for (grp, m), v in _window_values(run.series, a, b, min_steps).items():
            rows.append({"kind": kind, "source": source, "run": run.name, "arm": run.arm,
                         "spike_start": spike, "a": a, "b": b, "group": grp, "metric": m,
                         "value": v})

    for run in runs:
        sp = run.spikes.sort_values("start")
        ends = sp["end"].to_numpy(np.int64) if "end" in sp else sp["start"].to_numpy(np.int64)
        for i, s in enumerate(sp["start"].to_numpy(np.int64)):
            a, b = int(s) - W, int(s)
            if i and ends[:i].max() >= a:       # overlaps an earlier spike: not clean
                continue
            if b - 1 <= run.burn_in:
                continue
            add("pre", "", run, int(s), a, b)
            matched = [o for o in runs if o is not run and _distance(o.spikes, a, b) >= gap
                       and _num_steps(o.series, a, b) >= min_steps]
            for o in matched:
                add("control", "matched", o, int(s), a, b)
            if not matched:
                steps = run.series["step"].to_numpy(np.int64)
                if not steps.size:
                    continue
                for a2 in range(int(steps.min()), int(steps.max()) - W + 2, W):
                    if _distance(sp, a2, a2 + W) >= gap:
                        add("control", "same-run", run, int(s), a2, a2 + W)
    df = pd.DataFrame(rows, columns=["kind", "source", "run", "arm", "spike_start", "a", "b",
                                     "group", "metric", "value"])
    return df


def compare_windows(windows: pd.DataFrame, *, thresholds: Mapping[str, float | None] | None
                    = None, alpha: float = 0.05) -> pd.DataFrame:
    """Per metric and group: fraction of pre-spike vs control windows above the threshold,
    the difference, Fisher's exact test (one-sided: pre > control), Holm over the rows and
    a verdict. thresholds: {metric: value or None}; None = the control windows' 90th
    percentile; default BC 5/9, sat_frac None."""
    thr = {"bimodality": BC_THRESHOLD, "sat_frac": None, **(thresholds or {})}
    w = windows[np.isfinite(windows["value"].to_numpy(np.float64))]
    rows = []
    for m in CONTROL_METRICS:
        for grp in GROUPS:
            sub = w[(w["metric"] == m) & (w["group"] == grp)]
            if sub.empty:
                continue
            pre = sub.loc[sub["kind"] == "pre", "value"].to_numpy(np.float64)
            ctl = sub[sub["kind"] == "control"]
            cv = ctl["value"].to_numpy(np.float64)
            t = thr.get(m)
            tsrc = "Sarle 5/9" if m == "bimodality" and t == BC_THRESHOLD else "given"
            if t is None:
                t = float(np.quantile(cv, CONTROL_QUANTILE)) if cv.size else math.nan
                tsrc = f"control q{int(CONTROL_QUANTILE * 100)}"
                if t == 0:
                    tsrc += " (= 0: any mass counts)"
            src = ctl["source"].value_counts()
            row = {"metric": m, "group": grp, "n_pre": int(pre.size), "n_control": int(cv.size),
                   "controls": ", ".join(f"{k} {int(v)}" for k, v in src.items()) or "none",
                   "threshold": t, "threshold_source": tsrc}
            if pre.size == 0 or cv.size == 0 or not math.isfinite(t):
                row.update(frac_pre=math.nan, frac_control=math.nan, diff=math.nan,
                           odds_ratio=math.nan, p=math.nan)
            else:
                ap, ac = int((pre > t).sum()), int((cv > t).sum())
                res = stats.fisher_exact([[ap, pre.size - ap], [ac, cv.size - ac]],
                                         alternative="greater")
                row.update(frac_pre=ap / pre.size, frac_control=ac / cv.size,
                           diff=ap / pre.size - ac / cv.size,
                           odds_ratio=float(res.statistic), p=float(res.pvalue))
            rows.append(row)
    df = pd.DataFrame(rows, columns=["metric", "group", "n_pre", "n_control", "controls",
                                     "threshold", "threshold_source", "frac_pre",
                                     "frac_control", "diff", "odds_ratio", "p"])
    df["p_holm"] = holm(df["p"].to_numpy(np.float64)) if len(df) else []
    df["verdict"] = [_verdict(r, alpha) for r in df.itertuples(index=False)]
    return df


def _verdict(r, alpha: float) -> str:
    if r.n_pre == 0 or r.n_control == 0 or not math.isfinite(r.p):
        return ("not testable: " + ("no pre-spike window after the burn-in" if r.n_pre == 0
                                    else "no control window"))
    if r.p_holm < alpha:
        return (f"precursor: above threshold in {r.frac_pre:.0%} of pre-spike windows vs "
                f"{r.frac_control:.0%} of controls")
    if r.diff <= 0:
        return (f"no precursor: pre-spike windows above threshold no more often than controls "
                f"({r.frac_pre:.0%} vs {r.frac_control:.0%})")
    return (f"not significant after Holm ({r.frac_pre:.0%} vs {r.frac_control:.0%}, "
            f"p_holm {r.p_holm:.2g})")


# ----------------------------------------------------------------------------- alarm lift

def chance_rate(logged_steps: Sequence[int], spike_starts: Sequence[int], horizon: int,
                min_lead: int = 1) -> float:
    """Fraction of logged steps t with s - horizon <= t <= s - min_lead for some spike s."""
    t = np.asarray(logged_steps, dtype=np.int64)
    if t.size == 0:
        return math.nan
    return float(_covered(t, spike_starts, horizon, min_lead).mean())


def _covered(t: np.ndarray, starts, horizon: int, min_lead: int) -> np.ndarray:
    s = np.sort(np.asarray(starts, dtype=np.int64))
    if s.size == 0:
        return np.zeros(t.size, bool)
    # the first spike start >= t + min_lead must be <= t + horizon
    i = np.searchsorted(s, t + min_lead, side="left")
    ok = i < s.size
    return ok & (s[np.minimum(i, s.size - 1)] <= t + horizon)


def lift_result(num_alarms: int, num_true: int, chance: float, alpha: float = 0.05) -> dict:
    """Precision, lift = precision / chance and the one-sided binomial test of num_true of
    num_alarms against chance; informative = lift > 1 and p < alpha, with a reason."""
    prec = num_true / num_alarms if num_alarms else math.nan
    if num_alarms == 0:
        return {"num_alarms": 0, "num_true_alarms": 0, "precision": math.nan,
                "chance_rate": chance, "lift": math.nan, "p": math.nan, "informative": False,
                "reason": "never fired"}
    if not (math.isfinite(chance) and chance > 0):
        return {"num_alarms": num_alarms, "num_true_alarms": num_true, "precision": prec,
                "chance_rate": chance, "lift": math.nan, "p": math.nan, "informative": False,
                "reason": "no spike to warn of (chance rate 0)"}
    lift = prec / chance
    p = float(stats.binomtest(num_true, num_alarms, min(chance, 1.0),
                              alternative="greater").pvalue) if chance < 1 else 1.0
    inf = bool(lift > 1 and p < alpha)
    if inf:
        reason = f"lift {lift:.2f} > 1, binomial p {p:.2g} < {alpha:g}"
    elif lift <= 1:
        reason = (f"lift {lift:.2f} <= 1: precision {prec:.3f} is at or below the chance "
                  f"rate {chance:.3f}")
    else:
        reason = f"lift {lift:.2f} > 1 but binomial p {p:.2g} >= {alpha:g}"
    return {"num_alarms": int(num_alarms), "num_true_alarms": int(num_true),
            "precision": prec, "chance_rate": chance, "lift": lift, "p": p,
            "informative": inf, "reason": reason}


def rule_horizon(rule: AlarmRule, horizon: int | None = None) -> int:
    """The horizon analysis.alarms uses: given, else the rule's largest expected lead."""
    if horizon is not None:
        return int(horizon)
    return int(rule.expected_lead_steps[1]) if rule.expected_lead_steps else DEFAULT_HORIZON


def lift_table(runs: Sequence[tuple[pd.DataFrame, pd.DataFrame, Sequence[int]]],
               rules: Sequence[AlarmRule], *, horizon: int | None = None,
               min_lead: int = 1, alpha: float = 0.05) -> pd.DataFrame:
    """Lift per rule pooled over runs. runs: (alarms [rule, step], spikes [start],
    logged steps) per run. True alarms are counted by analysis.alarms.score_alarms with
    min_lead (default 1); the chance rate pools the logged steps of all runs."""
    rows = []
    for r in rules:
        h = rule_horizon(r, horizon)
        n_al = n_true = cov = n_log = 0
        for alarms, spikes, logged in runs:
            sc = score_alarms(alarms, spikes, [r], horizon=h, min_lead=min_lead)
            n_al += int(sc["num_alarms"].iloc[0])
            n_true += int(sc["num_true_alarms"].iloc[0])
            t = np.asarray(logged, dtype=np.int64)
            starts = spikes["start"].to_numpy(np.int64) if len(spikes) else []
            cov += int(_covered(t, starts, h, min_lead).sum())
            n_log += int(t.size)
        chance = cov / n_log if n_log else math.nan
        rows.append({"rule": r.id, "horizon": h, "min_lead": int(min_lead),
                     **lift_result(n_al, n_true, chance, alpha)})
    return pd.DataFrame(rows, columns=["rule", "horizon", "min_lead", "num_alarms",
                                       "num_true_alarms", "precision", "chance_rate", "lift",
                                       "p", "informative", "reason"])


def mark_uninformative(predictions: Mapping, lift: pd.DataFrame | Mapping[str, Mapping]
                       ) -> dict:
    """A copy of a predictions.json dict with, on every scored alarm rule,
    "informative": bool and "informative_reason": str (False when lift <= 1, or lift > 1
    without p < alpha). Rules without a score are left as they are. The input is not
    modified."""
    if isinstance(lift, pd.DataFrame):
        lift = {r["rule"]: r for r in lift.to_dict("records")}
    out = copy.deepcopy(dict(predictions))
    for rule in out.get("alarm_rules", []):
        res = lift.get(rule.get("id"))
        if res is None:
            continue
        rule["informative"] = bool(res["informative"])
        rule["informative_reason"] = (
            f"{res['reason']} (precision {res['precision']:.3g} over {res['num_alarms']} "
            f"alarms, lead >= {res.get('min_lead', 1)}, horizon {res['horizon']})"
            if res["num_alarms"] else res["reason"])
    return out


# ----------------------------------------------------------------------------- report

def report_section(run_dirs: Iterable[str | Path], *, predictions: str | Path | Mapping |
                   None = None, window: int = DEFAULT_WINDOW, horizon: int | None = None,
                   alpha: float = 0.05) -> str:
    """Markdown section: precursors against control windows over the runs, and, when
    predictions (path or dict) are given or the runs logged online alarms, alarm lift."""
    run_dirs = [Path(p) for p in run_dirs]
    runs = load_study(run_dirs, keep_layers=predictions is not None)
    arms = sorted({r.arm for r in runs})
    n_sp = sum(len(r.spikes) for r in runs)
    bis = sorted({r.burn_in for r in runs})
    L = [f"### Precursors against control windows ({len(runs)} runs, {len(arms)} arm(s), "
         f"{n_sp} spikes)", "",
         f"Pre-spike windows [s - {window}, s) against the same step range in runs with no "
         f"spike within {2 * window} steps (matched), else same-run windows >= "
         f"{2 * window} steps from any spike (same-run); burn-in of ceil(3 / (1 - b2)) = "
         f"{', '.join(map(str, bis))} steps excluded (step 1 gives r = sign(g)). BC: "
         "median over the group's tensors; sat_frac: the group's mass at |r| > 0.9. "
         "Fisher's exact test (one-sided), Holm over the rows.", ""]
    win = collect_windows(runs, window=window)
    pre = win[(win["kind"] == "pre") & np.isfinite(win["value"].to_numpy(np.float64))]
    n_pre = len(pre[["run", "spike_start"]].drop_duplicates())
    L += [f"{n_pre} of {n_sp} spikes have a clean pre-spike window (after the burn-in, not "
          "overlapping an earlier spike).", ""]
    tab = compare_windows(win, alpha=alpha)
    if tab.empty:
        L += ["No pre-spike window after the burn-in: nothing to compare.", ""]
    else:
        L += [md_table(tab, ["metric", "group", "n_pre", "n_control", "controls",
                             "threshold", "threshold_source", "frac_pre", "frac_control",
                             "diff", "p", "p_holm", "verdict"]), ""]
    rules: list[AlarmRule] = []
    if predictions is not None:
        data = predictions if isinstance(predictions, Mapping) else \
            json.loads(Path(predictions).read_text())
        rules = from_json(data).alarm_rules
    items, source = [], ""
    if rules:
        source = "rules evaluated over each run's layers table"
        for r in runs:
            items.append((fire_steps(rules, r.layers), r.spikes, r.logged_steps))
    else:
        al = [online_alarms(r.events) for r in runs]
        ids = sorted({x for a in al for x in a["rule"]})
        if ids:
            source = ("alarms the trainer logged online (events.jsonl; no rule definitions, "
                      f"so H = {horizon or DEFAULT_HORIZON} steps)")
            rules = [AlarmRule(id=i, metric="rms_t") for i in ids]   # ids only; horizon default
            items = [(a, r.spikes, r.logged_steps) for a, r in zip(al, runs)]
    if items:
        lt = lift_table(items, rules, horizon=horizon, alpha=alpha)
        L += ["### Alarm lift (lead >= 1 step)", "",
              f"Source: {source}. Chance rate = fraction of logged steps within [s - H, s - 1] "
              "of a spike start s; lift = precision / chance; informative = lift > 1 with a "
              f"one-sided binomial p < {alpha:g}.", "",
              md_table(lt, ["rule", "horizon", "num_alarms", "num_true_alarms", "precision",
                            "chance_rate", "lift", "p", "informative", "reason"]), ""]
    return "\n".join(L)


def problem_key(config: Mapping) -> str:
    """Runs whose windows can be each other's controls: the same model and data (the
    sections model / data / mlp / quadratic, seeds stripped); optimizer settings and
    mitigations may differ (other arms at the same phase of training are controls)."""
    keep = {k: v for k, v in dict(config or {}).items() if k in ("model", "data", "mlp", "quadratic")}
    return arm_key(keep)


def study_sections(run_dirs: Iterable[str | Path], *, predictions: str | Path | None = None,
                   window: int = DEFAULT_WINDOW, alpha: float = 0.05) -> str:
    """`report_section` per problem (runs grouped by `problem_key`, those with per-layer
    telemetry): the analyze report's precursor-controls and alarm-lift sections."""
    groups: dict[str, list[Path]] = {}
    for p in map(Path, run_dirs):
        try:
            run = load_run(p, tables=())   # its config only: report_section reads the tables
        except Exception:   # noqa: BLE001  (a bad run is reported by its own analysis)
            continue
        if not (p / "layers").exists():
            continue
        groups.setdefault(problem_key(run.config), []).append(p)
    out = ["## Precursors against controls, alarm lift", ""]
    if not groups:
        return "\n".join(out + ["No run with per-layer telemetry.", ""])
    for paths in groups.values():
        names = ", ".join(p.name for p in paths)
        try:
            out += [f"Runs: {names}", "", report_section(paths, predictions=predictions,
                                                          window=window, alpha=alpha)]
        except (ValueError, KeyError) as e:
            out += [f"Runs: {names}: not compared ({e})", ""]
    return "\n".join(out)
