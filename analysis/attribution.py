"""Spike attribution (pandas; reads a run directory's tables): for each loss spike of the
one spike rule (adamspike.spikes, as `analyze` finds them), what moved first in the
RULES["pre_steps"] steps before its onset, each series against its own pre-spike baseline,
what the numerics did, and whether a rollback's re-run recorded a recurrence; then one
verdict per spike (VERDICTS: optimizer A, optimizer B, numerics, data or loading, unknown)
with its evidence, decided by `decide`: the project's one spike-cause rule. What a log's
lines say (analysis.diagnosis.spike_log_evidence: numerics events next to the spike, a learning rate
too small to move the model, a resume just before, the grad norm's lead) goes into the same
decision, so a log, a run directory with a layers table and one without get one verdict
from one function: the telemetry's evidence where the run has it, the log's otherwise.

Series (where the run carries them):
- per depth group (adamspike.depth_groups: embed, shallow, deep, head), from `layers`:
  rho (group_rho of grad_rms / eps) and update_rms (numel-weighted rms of the unit-lr
  Adam update);
- from `steps`: the global grad norm, the lr (the factor of S = lr * lambda_P / 2 that a
  run table carries), the applied update norm;
- from `curvature`: the S proxy lr * precond_curvature / 2 per curvature group (the
  Megatron probe's secant group "update"; the toys' depth groups).

Row ordering of the tables: a steps row t holds the loss and gradient of step t's forward
pass (before the update of step t); a layers row t the update applied at step t, which
the loss of step t + 1 first sees. A series "moved first" at step u when it exceeds its
baseline there; its lead is onset - u (0: at the onset itself).

The rules are data (RULES, each threshold with its reason), fixed before the validation
on injected causes (bench/attribution_validation.py, docs/results/attribution_*.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from adamspike.depth_groups import depth_group, infer_num_layers

VERDICTS = ("optimizer A", "optimizer B", "numerics", "data or loading", "unknown")


@dataclass(frozen=True)
class Rule:
    value: float
    reason: str


RULES: dict[str, Rule] = {
    "pre_steps": Rule(10, "K: steps before the onset searched for the first mover; an Adam "
                          "instability builds over ~1/(1-b1) = 10 steps at b1 0.9. In a "
                          "log of interval n every window rule counts lines (n x the "
                          "iterations): a shorter window holds no line to judge"),
    "baseline_steps": Rule(30, "each series' own baseline: the median of its values in the "
                               "30 steps before the search window (not overlapping it)"),
    "min_baseline": Rule(5, "fewer finite baseline values: the series is not judged"),
    "jump_ratio": Rule(2.0, "a jump: at least 2x the baseline median (rho, update_rms, grad "
                            "norm: per-step noise of a healthy run is well inside 2x)"),
    "jump_sigmas": Rule(6.0, "and 6 robust sigmas (1.4826 MAD of the log values) above it, "
                             "the spike rule's own k, so a noisy series needs more"),
    "rise_ratio": Rule(1.2, "lr or S proxy at the step before onset >= 1.2x its baseline: "
                            "S = lr lambda_P / 2 crossing 1 is optimizer A; a 20% rise "
                            "within ~40 steps is no schedule's decay"),
    "near_numerics": Rule(1, "numerics events (loss-scale cut, overflow, skip, NaN, "
                             "non-finite value) from K steps before to 1 step after onset"),
}

B_GROUPS = ("embed", "shallow")   # the dormant shallow side (design.md: depth groups)
NUMERICS_EVENT_TYPES = ("nonfinite_loss", "nan_grad", "skip", "checkpoint_refused")
COLUMNS = ["start", "peak_step", "height", "source", "verdict", "first_mover", "first_lead",
           "moved", "numerics", "recurred", "evidence", "grad_note"]


def _r(name: str) -> float:
    return RULES[name].value


def _w(name: str, interval: int) -> float:
    """A window rule in iterations: its value in logged lines times the log interval (a
    run directory logs every step: interval 1)."""
    return _r(name) * max(1, int(interval))


def group_series(layers: pd.DataFrame) -> dict[str, pd.Series]:
    """{"rho:<group>", "update_rms:<group>"} -> value by step, from the layers table: per
    (group, step) adamspike.depth_groups.group_rho's statistic (numel-weighted rms, NaN
    tensors left out, NaN when none is finite), vectorized over the table."""
    if layers is None or layers.empty:
        return {}
    L = infer_num_layers(layers)
    groups = {d: depth_group(d, L) for d in layers["depth"].unique()}
    key = [layers["depth"].map(groups).rename("group"), layers["step"]]
    numel = layers["numel"].to_numpy(float)
    out: dict[str, pd.Series] = {}
    for metric in ("rho", "update_rms"):
        if metric not in layers:
            continue
        x = layers[metric].to_numpy(float)
        ok = np.isfinite(x)
        sums = pd.DataFrame({"num": np.where(ok, x * x, 0.0) * numel,
                             "den": np.where(ok, numel, 0.0)}).groupby(key).sum()
        with np.errstate(invalid="ignore", divide="ignore"):
            val = np.sqrt(sums["num"] / sums["den"].where(sums["den"] > 0))
        for g, part in val.groupby(level="group"):
            out[f"{metric}:{g}"] = part.droplevel("group")
    return out


def run_series(steps: pd.DataFrame, layers: pd.DataFrame | None,
               curvature: pd.DataFrame | None) -> dict[str, pd.Series]:
    """Every series the attribution reads, by name -> value indexed by step."""
    st = steps.set_index("step")
    out = {c: st[c].astype(float) for c in ("grad_norm", "lr", "update_norm") if c in st}
    out.update(group_series(layers))
    if curvature is not None and not curvature.empty and "precond_curvature" in curvature:
        cv = curvature.copy()
        lr = cv["lr"] if "lr" in cv else cv["step"].map(out.get("lr", pd.Series(dtype=float)))
        cv["S"] = lr.astype(float) * cv["precond_curvature"].astype(float) / 2.0
        for g, part in cv.groupby("group", observed=True):   # categorical: only groups present
            out[f"S:{g}"] = part.groupby("step")["S"].median()
    return {k: v.sort_index() for k, v in out.items()}


def _baseline(s: pd.Series, onset: int, interval: int = 1) -> np.ndarray:
    K, B = _w("pre_steps", interval), _w("baseline_steps", interval)
    x = s[(s.index >= onset - K - B) & (s.index < onset - K)].to_numpy(float)
    return x[np.isfinite(x) & (x > 0)]


def first_jump(s: pd.Series, onset: int, interval: int = 1) -> tuple[int, float] | None:
    """(step, ratio to baseline) of the first jump in [onset - K, onset], or None (also
    when the baseline is too short to judge)."""
    base = _baseline(s, onset, interval)
    if len(base) < _r("min_baseline"):
        return None
    lb = np.log(base)
    med = float(np.median(lb))
    sig = max(1.4826 * float(np.median(np.abs(lb - med))), 1e-12)
    win = s[(s.index >= onset - _w("pre_steps", interval)) & (s.index <= onset)]
    for step, x in win.items():
        if math.isfinite(x) and x > 0 and x >= _r("jump_ratio") * math.exp(med) \
                and math.log(x) - med >= _r("jump_sigmas") * sig:
            return int(step), float(x / math.exp(med))
    return None


def rise(s: pd.Series, onset: int, interval: int = 1) -> float | None:
    """The series at the last step before onset over its baseline median (None: unjudged)."""
    base = _baseline(s, onset, interval)
    before = s[(s.index < onset) & (s.index >= onset - _w("pre_steps", interval))].dropna()
    if len(base) < _r("min_baseline") or before.empty:
        return None
    return float(before.iloc[-1] / np.median(base))


def numerics_near(onset: int, series: dict[str, pd.Series], steps: pd.DataFrame,
                  numerics_events: pd.DataFrame | None, events: pd.DataFrame | None,
                  interval: int = 1) -> list[str]:
    """Numerics evidence in [onset - K, onset + near]: numerics_health's events (loss-scale
    cut, overflow, skipped, NaN iterations, non-finite loss), a non-finite value of a
    series measured in its baseline (grad norm, update norm, group rho / update_rms), and
    the run's own numerics events."""
    lo, hi = onset - _w("pre_steps", interval), onset + _w("near_numerics", interval)
    found: list[str] = []
    if numerics_events is not None and len(numerics_events):
        ne = numerics_events[(numerics_events["step"] >= lo) & (numerics_events["step"] <= hi)]
        found += [f"{r.kind} at {int(r.step)}" for r in ne.itertuples()
                  if r.kind != "loss_scale_raise"]
    bad: dict[int, list[str]] = {}
    for name, s in series.items():
        if name.startswith(("lr", "S:")):
            continue
        if not len(_baseline(s, onset, interval)):
            continue     # not measured here (a log's or the probe's NaN update norm)
        w = s[(s.index >= lo) & (s.index <= onset)]
        nf = w[~np.isfinite(w.to_numpy(float))]
        if len(nf):
            bad.setdefault(int(nf.index[0]), []).append(name)
    found += [f"non-finite at {st}: {', '.join(names)}" for st, names in sorted(bad.items())]
    if events is not None and len(events) and "step" in events:
        ev = events[events["type"].isin(NUMERICS_EVENT_TYPES)
                    & (events["step"] >= lo) & (events["step"] <= hi)]
        found += [f"event {r.type} at {int(r.step)}" for r in ev.itertuples()]
    return list(dict.fromkeys(found))


def recurrence(onset: int, events: pd.DataFrame | None, interval: int = 1) -> str:
    """Whether a re-run of the spike's steps recorded it again: a guard rollback for this
    spike followed by a spike or non-finite loss on a retry (or `reproduced_from`)."""
    if events is None or events.empty or "step" not in events:
        return "not replayed"
    K = _w("pre_steps", interval)
    rb = events[(events["type"] == "rollback") & (events["step"] >= onset)
                & (events["step"] <= onset + K)]
    if rb.empty:
        return "not replayed"
    if "reproduced_from" in rb and rb["reproduced_from"].notna().any():
        return "recurred"
    again = events[events["type"].isin(("spike", "nonfinite_loss"))
                   & (events.index > rb.index[0])]
    if "retries" in again:
        again = again[again["retries"].fillna(0) > 0]
    return "recurred" if len(again) else "did not recur"


def decide(moved: dict[str, tuple[int, float]], rises: dict[str, float],
           numerics: list[str], onset: int, log: dict | None = None,
           groups: bool = True) -> tuple[str, list[str]]:
    """The one spike-cause rule: (verdict in VERDICTS, evidence lines) from the telemetry's
    movers (series -> (step, ratio)), the rises of lr / S and its numerics evidence, and
    the log's facts (`log`, analysis.diagnosis.spike_log_evidence: "numerics" and "data" lines,
    "grad_note", "grad_lead"; None: a table without a log reading). `groups`: the run has
    per-group series (a layers table). Order: numerics (either source), data or loading
    (the log's: a step too small, a resume), optimizer B, optimizer A, data or loading (the
    grad norm jumped at the onset, nothing before it), unknown."""
    log = log or {}

    def line(n):
        st, ratio = moved[n]
        return f"{n} x{ratio:.3g} at {st} ({onset - st} step(s) before onset)"
    num = list(log.get("numerics") or []) + [x for x in numerics
                                             if x not in (log.get("numerics") or [])]
    if num:
        return "numerics", num
    if log.get("data"):
        return "data or loading", list(log["data"])
    before = {n: v for n, v in moved.items() if v[0] < onset}
    b = [n for n in before if n.split(":")[0] in ("rho", "update_rms")
         and n.split(":")[-1] in B_GROUPS]
    if b:
        return "optimizer B", [line(n) for n in sorted(b, key=lambda n: before[n][0])]
    a = [n for n, x in rises.items() if x >= _r("rise_ratio")]
    a += [n for n in before if n.startswith("S:")]
    if a:
        return "optimizer A", [f"{n} x{rises[n]:.3g} over its baseline before onset"
                               if n in rises else line(n) for n in dict.fromkeys(a)]
    at = [n for n, v in moved.items() if v[0] == onset]
    if "grad_norm" in at and not before:
        return "data or loading", [line("grad_norm") + "; nothing moved before it: the "
                                   "batch of the onset step, not an optimizer build-up"]
    why: list[str] = []
    if log.get("grad_note"):
        lead = log.get("grad_lead")
        why.append(log["grad_note"] + ("" if lead is None or lead <= 0 or groups else
                                       ": an optimizer spike's signature; telling mechanism "
                                       "A from B needs per-group telemetry (the probe's run "
                                       "directory)"))
    if before and not (not groups and log.get("grad_note") and set(before) <= {"grad_norm"}):
        why.append("moved before onset, none of the rules' patterns: "
                   + "; ".join(line(n) for n in before))
    elif groups or not why:
        why.append("no series moved in the window" if not at else
                   "moved only at onset: " + "; ".join(line(n) for n in at))
    why += list(log.get("unknown") or [])
    return "unknown", why


ONLINE_SPIKE_EVENTS = ("spike", "nonfinite_loss")


def unlogged_spikes(steps: pd.DataFrame, events: pd.DataFrame | None) -> pd.DataFrame:
    """Spikes the trainer's online guard saw on a step that has no steps row (a run that
    aborted on a non-finite loss before logging it, a step a rollback discarded): start,
    peak_step, height (NaN), source. The spike rule cannot see these; their events can."""
    cols = ["start", "peak_step", "height", "source"]
    if events is None or events.empty or "step" not in events:
        return pd.DataFrame(columns=cols)
    ev = events[events["type"].isin(ONLINE_SPIKE_EVENTS) & events["step"].notna()]
    ev = ev[~ev["step"].astype(int).isin(set(steps["step"].astype(int)))]
    rows = {int(r.step): {"start": int(r.step), "peak_step": int(r.step), "height": math.nan,
                          "source": f"{r.type} event (no steps row)"} for r in ev.itertuples()}
    return pd.DataFrame(list(rows.values()), columns=cols)


def attribute(spikes: pd.DataFrame, steps: pd.DataFrame, layers: pd.DataFrame | None = None,
              curvature: pd.DataFrame | None = None, events: pd.DataFrame | None = None,
              numerics_events: pd.DataFrame | None = None, interval: int = 1,
              log_facts: dict[int, dict] | None = None) -> pd.DataFrame:
    """One row per spike (COLUMNS; the spike rule's, then unlogged_spikes'): verdict
    (`decide`), first mover, every mover, numerics evidence, recurrence and the evidence
    lines joined by " | ". interval: the log interval (windows are in logged lines).
    log_facts: onset -> what the log's lines say (analysis.diagnosis.spike_log_evidence)."""
    series = run_series(steps, layers, curvature)
    groups = any(n.startswith(("rho:", "update_rms:")) for n in series)
    rows = []
    spikes = pd.concat([spikes.assign(source="spike rule")[["start", "peak_step", "height",
                                                            "source"]],
                        unlogged_spikes(steps, events)], ignore_index=True)
    for sp in spikes.itertuples():
        onset = int(sp.start)
        moved = {n: j for n, s in series.items()
                 if not n.startswith(("lr", "S:")) and (j := first_jump(s, onset, interval))}
        moved.update({n: j for n, s in series.items() if n.startswith("S:")
                      and (j := first_jump(s, onset, interval))})
        rises = {n: x for n, s in series.items() if n == "lr" or n.startswith("S:")
                 if (x := rise(s, onset, interval)) is not None}
        num = numerics_near(onset, series, steps, numerics_events, events, interval)
        facts = (log_facts or {}).get(onset)
        v, ev = decide(moved, rises, num, onset, facts, groups)
        first = min(moved.items(), key=lambda kv: kv[1][0]) if moved else None
        rows.append({"start": onset, "peak_step": int(sp.peak_step), "height": sp.height,
                     "source": sp.source,
                     "verdict": v, "first_mover": first[0] if first else "",
                     "first_lead": onset - first[1][0] if first else math.nan,
                     "moved": "; ".join(f"{n}@{s}" for n, (s, _) in
                                        sorted(moved.items(), key=lambda kv: kv[1][0])),
                     "numerics": "; ".join(num), "recurred": recurrence(onset, events, interval),
                     "evidence": " | ".join(ev),
                     "grad_note": (facts or {}).get("grad_note", "")})
    return pd.DataFrame(rows, columns=COLUMNS)


def attribute_run(ra, log_facts: dict[int, dict] | None = None) -> pd.DataFrame:
    """attribute() on an analysed run (analysis.report.RunAnalysis); log_facts: what its
    lines say per onset (analysis.diagnosis.diagnose passes them)."""
    run = ra.run
    interval = (ra.meta.get("import") or {}).get("log_interval", 1) or 1
    return attribute(ra.spikes, run.steps, run.layers, getattr(run, "curvature", None),
                     run.events, None if ra.numerics is None else ra.numerics.events,
                     interval=int(interval), log_facts=log_facts)


def confusion(truth: list[str], verdicts: list[str]) -> pd.DataFrame:
    """Counts of (true cause, verdict): rows the true causes in order of first appearance,
    columns every verdict (VERDICTS)."""
    if len(truth) != len(verdicts):
        raise ValueError(f"{len(truth)} true causes but {len(verdicts)} verdicts")
    bad = sorted(set(verdicts) - set(VERDICTS))
    if bad:
        raise ValueError(f"unknown verdict(s) {bad}; expected {list(VERDICTS)}")
    rows = list(dict.fromkeys(truth))
    m = pd.DataFrame(0, index=pd.Index(rows, name="true cause"), columns=list(VERDICTS))
    for t, v in zip(truth, verdicts):
        m.loc[t, v] += 1
    return m
