"""`adamspike assess RUN_OR_LOG`: one screen a training engineer reads in a minute (reads
files only).

    adamspike assess megatron.log [--predictions p.json | --rate-model model.json]
                     [--num-params N | --model PRESET] [--eps E --b2 B --clip C ...]
                     [--out DIR]
    adamspike assess RUN_DIR ...

What it prints, each from the analysis `adamspike analyze` runs (analysis.report
.analyze_run: the one spike rule, the regime card of analysis.regime, the numerics health
of analysis.numerics; a log is imported by analysis.megatron_log first, into --out or a
temporary folder):

1. the run: what was read, iterations, the optimizer settings it states;
2. regime: the regime card in a line or two (a log: rho_bar = min(gn, clip) / (sqrt(N) eps)
   at the run's eps and its eps regime; a run with telemetry: group rho per depth group,
   wake-ups);
3. spikes so far: each onset with its height, whether the grad norm led it, and the
   numerics verdict (fp16 overflow cascade or optimizer spike); the observed rate; steps
   the rule could not judge;
4. numerics health: loss scale, overflow / skipped / NaN iterations, missing values;
5. predicted rate for this setting: from a pre-registered predictions.json (the setting
   matched as `analyze --predictions` matches it: analysis.scoring), or from a spike-rate
   model (adamspike.spike_rate) where the run carries the model's features; given neither,
   from the fit shipped with the package (adamspike.package_data: its model for a run with
   per-layer telemetry, its llama2-70b predictions otherwise; --no-shipped: none); it
   says plainly which one, and when none is available;
6. settings that would lower it: the predictions file's settings with a lower predicted
   rate, grouped where the model cannot tell them apart (the same model features: a key the
   model does not use, such as the batch size, changes nothing in its prediction), each
   with its predicted rate and interval, whether that interval clears the current
   setting's, whether it is an extrapolation, and the model coefficient behind the change.

`--out DIR` also writes the full report there (analysis.report.write_run_report: report.md,
report.html, tables).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Mapping

from adamspike import package_data
from adamspike import spike_rate as SR
from adamspike.config import ConfigError, cli_main
from adamspike.llama import PRESETS
from adamspike.llama import num_params as llama_num_params
from adamspike.megatron_log import MegatronLogError
from adamspike.predictions import PredictionsError, load_predictions, model_key, model_label
from adamspike.rundir import OutputPathError, RunFormatError, check_out
from adamspike.spikes import SpikeParams, add_spike_flags
from analysis.cli import check_log_flags, count_arg
from analysis.megatron_log import import_megatron_log
from analysis.megatron_tb import is_tensorboard_dir
from analysis.numerics import CONSTANT_ONE
from analysis.report import AnalysisError, analyze_run, not_measured_note, write_run_report
from analysis.scoring import SOURCE_KEYS, run_setting, score_rate, setting_sources
from analysis.spike_rate import run_row

WIDTH = 92


def _f(x: Any, d: int = 3) -> str:
    if x is None:
        return "-"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return f"{v:.{d}g}" if math.isfinite(v) else "-"


def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


# ------------------------------------------------------------------ sections

def regime_lines(ra) -> list[str]:
    c = ra.regime_card
    if c is None:
        return _wrap(f"not computed: {ra.notes.get('regime_card')}")
    L = []
    if c.kind == "log":
        g = c.groups
        if g.empty:
            L += _wrap("no rho_bar: " + "; ".join(c.notes or ["unknown"]))
        else:
            run = g[g["is_run_eps"]] if g["is_run_eps"].any() else g.head(0)
            for r in (run if len(run) else g).itertuples():
                L += _wrap(f"rho_bar = min(gn, clip) / (sqrt(N) eps) at eps {_f(r.eps)}: median "
                           f"{_f(r.rho_bar_median)} (q10 {_f(r.rho_bar_q10)}, q90 "
                           f"{_f(r.rho_bar_q90)}), {_pct(r.frac_time_below_1)} of "
                           f"steps below 1: {r.regime}"
                           + ("" if r.is_run_eps else " (the run's eps is unknown: --eps)"))
            others = g[~g["is_run_eps"]] if len(run) else g.iloc[0:0]
            if len(others):
                L += _wrap("at other eps: " + ", ".join(
                    f"eps {_f(r.eps)}: rho_bar {_f(r.rho_bar_median)} ({r.regime})"
                    for r in others.itertuples()))
            info = c.log or {}
            L += _wrap(f"N = {info.get('num_params')} ({info.get('num_params_source')}); a log "
                       "has the global grad norm only: no per-layer (shallow vs deep) rho")
    else:
        for r in c.groups.itertuples():
            L += _wrap(f"{r.group:<8} rho median {_f(r.rho_median)} (q10 {_f(r.rho_q10)}, "
                       f"q90 {_f(r.rho_q90)}), {_pct(r.frac_time_below_1)} of steps "
                       f"below 1, {int(r.num_wakeups)} wake-up(s): {r.regime}")
    L += _wrap(f"eps {_f(c.eps)}, b1 {_f(c.b1)}, b2 {_f(c.b2)}, median lr {_f(c.lr)}, "
               f"lr/eps {_f(c.lr_over_eps)}")
    return L


def _pct(frac: float) -> str:
    """A fraction as a percentage that reads as one (100%, 37.5%, 0.12%; never 1e+02%)."""
    v = 100.0 * float(frac)
    if not math.isfinite(v):
        return "-"
    return f"{v:.0f}%" if v >= 99.5 or v == 0 else f"{v:.3g}%" if v >= 1 else f"{v:.2g}%"


def _span(ra) -> tuple[int, int, int, int]:
    """(first iteration, last, optimizer steps covered, log interval): a line stands for
    `log interval` optimizer steps, so the span is last - first + interval."""
    st = ra.run.steps
    imp = ra.meta.get("import") or {}
    interval = int(imp.get("log_interval") or 1)
    first, last = int(st["step"].min()), int(st["step"].max())
    return first, last, last - first + interval, interval


def min_rate_lines(ra) -> int:
    """Judged lines a rate needs: the spike rule's window (what it takes to learn the band;
    fewer and a count of 0 or 1 says nothing about a rate per 1000 steps)."""
    return int(ra.spike_params.window)


def rate_text(ra) -> tuple[float | None, str]:
    """(spikes per 1000 optimizer steps or None, the sentence): the log interval applied;
    "too few steps" below min_rate_lines judged lines."""
    first, last, span, interval = _span(ra)
    k = len(ra.spikes)
    judged = int((ra.coverage.get("loss") or {}).get("num_judged", ra.num_steps))
    unit = (f"{ra.num_steps} logged line(s) x log interval {interval} = {span} optimizer steps"
            if interval > 1 else f"{span} optimizer steps, one line each")
    if judged < min_rate_lines(ra):
        return None, (f"{k} loss spike(s) in iterations {first}-{last} ({unit}): too few steps "
                      f"for a rate ({judged} judged line(s); a rate needs >= "
                      f"{min_rate_lines(ra)}, the spike rule's window)")
    rate = 1000.0 * k / span
    return rate, (f"{k} loss spike(s) in iterations {first}-{last} ({unit}): {_f(rate)} per "
                  "1000 optimizer steps")


def spike_lines(ra) -> list[str]:
    sp = ra.spikes
    _, text = rate_text(ra)
    L = _wrap(text + f"; {len(ra.grad_spikes)} grad-norm spike(s)")
    dg = {int(r.start): r for r in ra.diagnosis.itertuples()} \
        if ra.diagnosis is not None else {}
    for r in sp.head(8).itertuples():
        d = dg.get(int(r.start))
        L += _wrap(f"- iteration {r.start}: loss {_f(r.peak, 4)} vs {_f(r.baseline, 4)} "
                   f"(+{_pct(r.height)}), "
                   + (f"recovered after {r.duration} iteration(s)" if r.recovered else
                      f"CENSORED: still above its band when the log ends ({r.duration} "
                      "iteration(s) observed; the duration is at least that)"))
        if d is not None:
            L += _wrap(f"cause: {d.verdict.upper()}: {d.evidence}"
                       + ("" if d.recurred == "not replayed" else f"; re-run: {d.recurred}"),
                       "      ")
            if d.grad_note and d.grad_note not in d.evidence:
                L += _wrap(f"grad norm: {d.grad_note}", "      ")
    if len(sp) > 8:
        L += _wrap(f"... {len(sp) - 8} more (the full table: --out DIR)")
    for col, cov in ra.coverage.items():
        if cov["reasons"]:
            L += _wrap(f"{col}: {cov['num_judged']} of {cov['num_rows']} lines judged; not "
                       "judged: " + "; ".join(f"{x['count']} {x['reason']}"
                                             for x in cov["reasons"]))
    val = ra.run.events[ra.run.events["type"] == "validation"] \
        if ra.run is not None and not ra.run.events.empty and "type" in ra.run.events else None
    if val is not None and len(val):
        L += _wrap(f"validation: {len(val)} value(s) read as validation, not training "
                   "iterations" + ("; last: " + ", ".join(
                       f"{v.get('name')} {_f(v.get('value'), 4)} at iteration {v.get('step')}"
                       for v in val.tail(1).to_dict("records")) if "value" in val else ""))
    return L


def numerics_lines(ra) -> list[str]:
    h = ra.numerics
    if h is None:
        return _wrap("not computed")
    L = _wrap("signals: " + (", ".join(h.signals) if h.signals else
                             "none (no loss scale, overflow lines, skip counters)"))
    ls = h.loss_scale
    if ls.get("constant_one"):
        L += _wrap(CONSTANT_ONE)
    elif ls:
        L += _wrap(f"loss scale {_f(ls['first'], 8)} -> {_f(ls['last'], 8)} (min "
                   f"{_f(ls['min'], 8)} at iteration {ls['min_step']}): {ls['cuts']} cut(s), "
                   f"{ls['raises']} raise(s)")
    if not h.events.empty:
        counts = h.events["kind"].value_counts()
        near = int((h.events["position"] != "away from spikes").sum())
        L += _wrap("events: " + ", ".join(f"{k.replace('_', ' ')} x{int(n)}"
                                         for k, n in counts.items())
                   + f"; {near} of them next to a spike")
    else:
        L += _wrap("no numerics event")
    note = not_measured_note(ra.meta.get("import") or {})
    if note:
        L += _wrap(note.replace("**", ""))
    return L


def _model_feats(s: Mapping, names: list[str]) -> dict:
    """The setting's values of the model's features (predictions schema 3: `features` holds
    every FEATURE, `model_features` names those the model uses)."""
    names = list(s.get("model_features") or names)
    f = s.get("features") or {}
    return {k: float(f[k]) for k in names if k in f and f[k] is not None}


def _same_model_features(a: Mapping, b: Mapping, names: list[str]) -> bool:
    """The model cannot tell the two apart (adamspike.predictions.model_key)."""
    ka = model_key({**a, "model_features": a.get("model_features") or names})
    return ka is not None and ka == model_key({**b, "model_features":
                                                b.get("model_features") or names})


def _diff(s: Mapping, ref: Mapping, vals: Mapping[str, float]) -> str:
    """The overrides of setting `s` that differ from the matched setting `ref`, with the
    run's own value where it states one."""
    parts = []
    for k, v in s["overrides"].items():
        r = ref["overrides"].get(k)
        if isinstance(v, (int, float)) and isinstance(r, (int, float)) and \
                math.isclose(float(v), float(r), rel_tol=1e-9):
            continue
        now = vals.get(k, r)
        parts.append(f"{k}={v:g}" + (f" (now {now:g})" if isinstance(now, (int, float)) else "")
                     if isinstance(v, (int, float)) else f"{k}={v}")
    return ", ".join(parts) or "(the same overrides)"


def _coef_evidence(pred, cur: Mapping, s: Mapping, names: list[str]) -> str:
    """The model coefficients behind a change of setting: per model feature that moves,
    its value before and after and the rate factor per decade exp(coef) with its interval."""
    coefs = (pred.rate_model or {}).get("coefficients") or {}
    fa, fb = _model_feats(cur, names), _model_feats(s, names)
    parts = []
    for k in fb:
        if k in fa and k in coefs and not math.isclose(fa[k], fb[k], rel_tol=1e-9,
                                                       abs_tol=1e-12):
            c = coefs[k]
            ci = c.get("ci") or [math.nan, math.nan]
            parts.append(f"{k} {_f(fa[k])} -> {_f(fb[k])}: rate x{_f(math.exp(c['coef']))} "
                         f"per decade (90% CI x{_f(math.exp(ci[0]))}-x{_f(math.exp(ci[1]))}), "
                         f"x{_f(math.exp(c['coef'] * (fb[k] - fa[k])))} here")
    return "; ".join(parts)


def prediction_lines(ra, pred, pred_path: str | None, model, model_path: str | None
                     ) -> tuple[list[str], list[str]]:
    """(predicted-rate lines, lower-rate settings lines)."""
    if pred is not None:
        return _from_predictions(ra, pred, pred_path)
    if model is not None:
        return _from_model(ra, model, model_path)
    none = _wrap("NONE AVAILABLE: no predictions.json (--predictions) and no spike-rate "
                 "model (--rate-model). `adamspike predict` writes one from a ladder fit and "
                 "the spike-rate GLM (`make reproduce` produces both).")
    return none, _wrap("no model available, so no ranked alternatives (see above)")


def _from_predictions(ra, pred, path) -> tuple[list[str], list[str]]:
    row = score_rate(ra, pred)
    prof = (pred.profile or {}).get("name", "?")
    L = _wrap(f"from {path} (profile {prof}, created {pred.created or '?'}, content hash "
              f"{(pred.integrity or {}).get('status', 'missing')})")
    L += _wrap(f"model: {model_label(pred.rate_model or {})}")
    if row.get("setting") is None:
        L += _wrap(row["verdict"])
        return L, _wrap("no setting matched, so no comparison")
    s = pred.setting(row["setting"])
    vals, notes = run_setting(ra)
    L += _wrap(f"this setting: {row['setting']} ({row['match']}"
               + (f"; {'; '.join(notes)}" if notes else "") + ")")
    L += _wrap(f"predicted {_f(s['rate_per_1k'])} spikes per 1000 optimizer steps, 90% interval "
               f"[{_f(s['rate_ci'][0])}, {_f(s['rate_ci'][1])}]; P(>= 1 spike in "
               f"{s.get('horizon_steps', '?')} steps) {_f(s.get('p_spike'))}"
               + ("; EXTRAPOLATED: " + "; ".join(s.get("extrapolation_reasons") or [])
                  if s.get("extrapolated") else ""))
    if row.get("too_few_steps"):
        L += _wrap(f"observed: too few steps to compare ({row['num_spikes']} spike(s) in "
                   f"{row['num_judged']} judged line(s) = about {row['num_steps']} optimizer "
                   f"steps at log interval {row['log_interval']}; the rule's window is "
                   f"{min_rate_lines(ra)} lines): no observed rate, no p-value")
    else:
        L += _wrap(f"observed {_f(row['observed_rate_per_1k'])} per 1000 optimizer steps "
                   f"({row['num_spikes']} in {row['num_steps']} optimizer steps"
                   + (f" = {row['num_lines']} lines x log interval {row['log_interval']}"
                      if row["log_interval"] > 1 else "")
                   + f"): {row['verdict']} the interval; the count is "
                   + ("consistent" if row.get("count_consistent") else "NOT consistent")
                   + f" with it (Poisson p_above {_f(row.get('p_above'))}, p_below "
                   f"{_f(row.get('p_below'))})")
    if prof and ra.regime_card is not None and ra.regime_card.kind == "log":
        L += _wrap(f"the predictions are for the {prof} profile; this run's own model size "
                   "and grad norms do not enter them")
    names = list((pred.rate_model or {}).get("features") or [])
    run_lr = s["overrides"].get("optim.lr", vals.get("optim.lr"))   # the matched setting's
    # lowering spikes by raising the learning rate is not advice anyone should act on: the
    # model's lr term is fitted inside its lr range, and a larger lr is the classic cause
    raises_lr = [x for x in pred.settings if run_lr is not None and
                 float(x["overrides"].get("optim.lr", run_lr)) > float(run_lr) * (1 + 1e-9)]
    lower = [x for x in pred.settings if float(x["rate_per_1k"]) < float(s["rate_per_1k"])
             and x["id"] != s["id"] and x not in raises_lr]
    same = [x for x in pred.settings if x["id"] != s["id"] and _same_model_features(x, s, names)]
    blind = sorted({k for x in same for k, v in x["overrides"].items()
                    if not (isinstance(v, (int, float)) and math.isclose(
                        float(v), float(s["overrides"].get(k, math.nan)), rel_tol=1e-9))})
    if blind:
        L += _wrap("not in the model: " + ", ".join(blind) + " (a setting that differs only "
                   "there gets the same number: the model cannot see it, which is not a "
                   "measurement of no effect)")
    A: list[str] = []
    if raises_lr:
        A += _wrap(f"left out: {len(raises_lr)} setting(s) that raise the learning rate above "
                   f"this setting's {_f(run_lr)}")
    if not lower:
        A += _wrap("none of the file's settings has a lower predicted rate")
        return L, A
    groups: list[list[Mapping]] = []
    for x in sorted(lower, key=lambda x: float(x["rate_per_1k"])):
        for g in groups:
            if _same_model_features(g[0], x, names):
                g.append(x)
                break
        else:
            groups.append([x])
    lo_cur = float(s["rate_ci"][0])
    for g in groups[:5]:
        g.sort(key=lambda y: _diff(y, s, vals).count("="))   # the smallest change first
        x = g[0]
        clears = float(x["rate_ci"][1]) < lo_cur
        A += _wrap(f"- {_diff(x, s, vals)}: {_f(x['rate_per_1k'])} /1k [{_f(x['rate_ci'][0])}, "
                   f"{_f(x['rate_ci'][1])}] "
                   + ("(interval below this setting's)" if clears else
                      "(its interval overlaps this setting's)")
                   + ("; extrapolated" if x.get("extrapolated") else ""), "  ")
        ev = _coef_evidence(pred, s, x, names)
        if ev:
            A += _wrap("evidence: " + ev, "      ")
    if len(groups) > 5:
        A += _wrap(f"... {len(groups) - 5} more group(s) in {path}")
    best = min((g[0] for g in groups), key=lambda x: (not float(x["rate_ci"][1]) < lo_cur,
                                                      float(x["rate_per_1k"])))
    ev = _coef_evidence(pred, s, best, names)
    clear = float(best["rate_ci"][1]) < lo_cur
    ra.notes["bottom_line"] = (
        ("change " if clear else "no setting with a rate clearly below this one (every lower "
         "interval overlaps it); the largest expected reduction: ")
        + f"{_diff(best, s, vals)}: expected {_f(best['rate_per_1k'])} spikes per 1000 "
        f"optimizer steps [{_f(best['rate_ci'][0])}, {_f(best['rate_ci'][1])}] instead of "
        f"{_f(s['rate_per_1k'])} [{_f(s['rate_ci'][0])}, {_f(s['rate_ci'][1])}] ("
        + ("the intervals do not overlap" if clear else "the intervals overlap")
        + ("; an extrapolation" if best.get("extrapolated") else "")
        + f"); it rests on the {model_label(pred.rate_model or {}).split(' (')[0]}"
        + (f": {ev}" if ev else ""))
    return L, A


# one-knob changes (label, eps factor, lr factor, 1 - b2 factor), judged with the gradient
# held fixed: rho = rms(g) / eps moves as 1 / eps, lr / eps with both
KNOBS = (("eps x10", 10.0, 1.0, 1.0), ("eps / 10", 0.1, 1.0, 1.0),
         ("b2 with 1 - b2 x2 (e.g. 0.95 -> 0.90)", 1.0, 1.0, 2.0),
         ("b2 with 1 - b2 / 2 (e.g. 0.95 -> 0.975)", 1.0, 1.0, 0.5),
         ("lr / 2", 1.0, 0.5, 1.0), ("lr x2", 1.0, 2.0, 1.0))


def _from_model(ra, model, path) -> tuple[list[str], list[str]]:
    L = _wrap(f"from the spike-rate model {path}")
    L += _wrap("model: " + model_label({"features": list(model.features),
                                        "model_file": str(path)}))
    if ra.regime_card is not None and ra.regime_card.kind == "log":
        need = [f for f in model.features if f in ("log10_rho_shallow", "log10_rho_deep")]
        if need:
            return (L + _wrap(f"NOT AVAILABLE for a log: the model needs {', '.join(need)}, "
                              "per-layer rho a log does not carry (global grad norm only); a "
                              "predictions.json with a profile of this model answers instead"),
                    _wrap("no prediction for this run, so no ranked alternatives"))
    try:
        row = run_row(ra.path)
        X = model.matrix([row])
    except (SR.SpikeRateError, ValueError) as e:
        return L + _wrap(f"NOT AVAILABLE: {e}"), _wrap("no prediction, so no alternatives")
    ri = model.rate_interval(X)
    feats = {f: float(row[f]) for f in SR.FEATURES if f in row}
    ext = model.extrapolation(feats)
    out = [k for k, v in ext.items() if v != "inside"]
    L += _wrap(f"predicted {_f(ri['rate'][0])} spikes per 1000 steps, interval "
               f"[{_f(ri['lo'][0])}, {_f(ri['hi'][0])}]"
               + (f"; EXTRAPOLATED in {', '.join(out)}" if out else ""))
    coefs = model.coefficients()
    alts = []
    for label, fe, fl, fb in KNOBS:
        f2 = dict(feats)
        for k in ("log10_rho_shallow", "log10_rho_deep"):
            if k in f2:
                f2[k] -= math.log10(fe)
        if "log10_lr_over_eps" in f2:
            f2["log10_lr_over_eps"] += math.log10(fl) - math.log10(fe)
        if "log10_one_minus_b2" in f2:
            f2["log10_one_minus_b2"] += math.log10(fb)
        r2 = model.rate_interval(model.matrix([f2]))
        if r2["rate"][0] >= ri["rate"][0]:
            continue
        ev = "; ".join(f"{k} {_f(feats[k])} -> {_f(f2[k])} (rate x{_f(math.exp(coefs[k]['coef']))}"
                       f" per decade, 90% CI x{_f(math.exp(coefs[k]['ci'][0]))}-"
                       f"x{_f(math.exp(coefs[k]['ci'][1]))})" for k in model.features
                       if not math.isclose(feats[k], f2[k]))
        ex = [k for k, v in model.extrapolation(f2).items() if v != "inside"]
        alts.append((float(r2["rate"][0]), label, float(r2["lo"][0]), float(r2["hi"][0]), ev, ex))
    A = _wrap("no predictions file: one knob at a time, the model's own estimate with the "
              "gradient held fixed (rho = rms(g)/eps moves as 1/eps); `adamspike predict` "
              "ranks full settings with the profile's measured rho")
    if not alts:
        A += _wrap("no single knob lowers the model's rate")
    for rate, label, lo, hi, ev, ex in sorted(alts):
        A += _wrap(f"- {label}: {_f(rate)} /1k [{_f(lo)}, {_f(hi)}] "
                   + ("(interval below the current one)" if hi < ri["lo"][0] else
                      "(its interval overlaps the current one)")
                   + (f"; extrapolated in {', '.join(ex)}" if ex else ""), "  ")
        if ev:
            A += _wrap("evidence: " + ev, "      ")
    return L, A


# ------------------------------------------------------------------ the command

def assess(path: str | Path, *, predictions: str | None = None, rate_model: str | None = None,
           shipped: bool = True, optim: dict | None = None, seq_len: int | None = None, clip: float | None = None,
           num_params: int | None = None, num_params_source: str = "",
           spike_params: SpikeParams = SpikeParams(), out: str | Path | None = None) -> str:
    """The assessment text of a run directory or a training log."""
    path = Path(path)
    pred = load_predictions(predictions) if predictions else None
    model = SR.load_model(rate_model) if rate_model else None
    shipped_note = ""
    with tempfile.TemporaryDirectory(prefix="adamspike-assess-") as tmp:
        if path.is_dir() and not is_tensorboard_dir(path):   # a TensorBoard dir is a log
            run_dir = path
        else:
            run_dir = Path(out) / (path.name + ".run") if out else Path(tmp) / "run"
            import_megatron_log(path, run_dir, seq_len=seq_len, clip=clip, optim=optim or {})
        ra = analyze_run(run_dir, spike_params=spike_params, num_params=num_params,
                         num_params_source=num_params_source, name=path.name)
        if out:
            write_run_report(ra, Path(out) / "report")
        if pred is None and model is None and shipped:
            pred, predictions, model, rate_model, shipped_note = _shipped(ra)
        return render(ra, path, pred, predictions, model, rate_model, out, shipped_note)


def _shipped(ra) -> tuple:
    """(pred, pred_path, model, model_path, note): the fit shipped with the package
    (adamspike.package_data): its spike-rate model for a run with per-layer telemetry (the
    run's own features), else its llama2-70b predictions; nothing (and why) when absent."""
    try:
        m = package_data.manifest("llama2-70b")
        if ra.regime_card is not None and ra.regime_card.kind == "run":
            # the run's own regime features: the sweep-trained model (the mechanism model
            # needs Adam's stability number, which a run's telemetry does not give)
            p = package_data.rate_model_path("llama2-70b", mechanism=False)
            return None, None, SR.load_model(p), str(p), f"the {package_data.describe(m)}"
        p = package_data.predictions_path("llama2-70b")
        if p is None:
            return None, None, None, None, "the shipped fit has no predictions.json"
        return load_predictions(p), str(p), None, None, f"the {package_data.describe(m)}"
    except (package_data.PackageDataError, PredictionsError, SR.SpikeRateError) as e:
        return None, None, None, None, f"no shipped fit ({e})"


FLAG_OF = {"optim.lr": "--lr", "optim.b1": "--b1", "optim.b2": "--b2", "optim.eps": "--eps",
           "optim.grad_clip": "--clip", "train.global_batch_size": None,
           "train.seq_len": "--seq-len"}


def settings_lines(ra, pred=None) -> list[str]:
    """Each run setting with its value and source (analysis.scoring.setting_sources); a
    setting nothing states says so, and what the prediction assumes for it (the matched
    setting's value) or that nothing uses it; the parameter count N with its source."""
    got = setting_sources(ra)
    assumed: dict = {}
    if pred is not None:
        row = score_rate(ra, pred)
        if row.get("setting") is not None:
            assumed = dict(pred.setting(row["setting"])["overrides"])
    L = []
    for key in SOURCE_KEYS:
        if key in got:
            v, src = got[key]
            L += _wrap(f"{key} {_f(v, 6)}: {src}")
        else:
            flag = FLAG_OF.get(key)
            how = (f"the prediction assumes {_f(assumed[key], 6)} (its matched setting's)"
                   if key in assumed else "nothing below uses a value for it")
            L += _wrap(f"{key}: NOT STATED (no flag, not in the log"
                       + (f"; give {flag}" if flag else "") + f"): {how}")
    c = ra.regime_card
    info = (c.log or {}) if c is not None and c.kind == "log" else {}
    if c is not None and c.kind == "log":
        n = info.get("num_params")
        L += _wrap(f"N (parameters) {n:,}: {info.get('num_params_source')}" if n else
                   "N (parameters): NOT STATED (no --num-params / --model, no count or model "
                   "arguments in the log): no rho_bar")
    return L


def bottom_lines(ra) -> list[str]:
    """What to change, the expected effect with its interval and the evidence behind it
    (the lower-rate setting prediction_lines chose), and which of the run's spikes a
    setting change can address at all (analysis.attribution.decide: optimizer spikes only)."""
    L = _wrap(ra.notes.get("bottom_line") or "no setting change the model supports (see above)")
    dg = ra.diagnosis
    if dg is not None and len(dg):
        counts = dg["verdict"].value_counts()
        L += _wrap("this run's spikes: " + ", ".join(f"{int(n)} {c}" for c, n in counts.items())
                   + "; a setting change addresses optimizer spikes only"
                   + ("; fix the numerics / data / loading causes first"
                      if set(counts.index) & {"numerics", "data or loading"} else ""))
    return L


def render(ra, path: Path, pred, pred_path, model, model_path, out, shipped_note: str = "") -> str:
    rate_l, lower_l = prediction_lines(ra, pred, pred_path, model, model_path)
    imp = ra.meta.get("import") or {}
    L = [f"ASSESSMENT of {path}", "=" * min(WIDTH, 14 + len(str(path))),
         *_wrap(f"{ra.num_steps} logged iterations ({ra.meta.get('backend')}"
                + (f", log interval {imp.get('log_interval')}" if imp else "") + ")", ""),
         "", "SETTINGS (each with its source)", *settings_lines(ra, pred),
         "", "REGIME", *regime_lines(ra),
         "", "SPIKES SO FAR", *spike_lines(ra),
         "", "NUMERICS HEALTH", *numerics_lines(ra),
         "", "PREDICTED SPIKE RATE FOR THIS SETTING",
         *(_wrap(f"none given (--predictions, --rate-model): using {shipped_note}")
           if shipped_note and (pred is not None or model is not None) else
           _wrap(f"none given; {shipped_note}") if shipped_note else []), *rate_l,
         "", "SETTINGS THAT WOULD LOWER IT", *lower_l,
         "", "BOTTOM LINE", *bottom_lines(ra)]
    if out:
        L += ["", f"Full report: {Path(out) / 'report' / 'report.md'} (and report.html)"]
    return "\n".join(L) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adamspike assess", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("path", metavar="RUN_OR_LOG", help="a run directory or a training log")
    ap.add_argument("--predictions", help="a pre-registered predictions.json")
    ap.add_argument("--rate-model", help="a spike-rate model (adamspike spike-rate's model.json)")
    ap.add_argument("--no-shipped", action="store_true",
                    help="without --predictions / --rate-model, do not fall back to the fit "
                         "shipped with the package")
    ap.add_argument("--out", help="also write the full report here (a new directory)")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--clip", type=float, help="grad-clip threshold of the log's run")
    for b in ("b1", "b2", "eps", "lr"):
        ap.add_argument(f"--{b}", type=float, help=f"optimizer {b} of the log's run")
    ap.add_argument("--num-params", type=count_arg, metavar="N")
    ap.add_argument("--model", metavar="PRESET")
    add_spike_flags(ap, log_loss=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    """`adamspike assess`."""
    return cli_main(_parser(), argv, _main, "adamspike assess",
                    (ConfigError, MegatronLogError, RunFormatError, AnalysisError,
                     PredictionsError, SR.SpikeRateError))


def _main(args) -> int:
    check_log_flags(args)
    path = Path(args.path)
    if not path.exists():
        raise RunFormatError(f"{path}: no such run directory or log")
    if path.is_dir() and not is_tensorboard_dir(path) and not (path / "run.json").is_file():
        raise RunFormatError(f"{path}: not a run directory (no run.json)")
    if args.out:
        try:
            check_out(args.out)       # before anything is computed: new or empty, writable
        except OutputPathError as e:
            raise ConfigError(str(e)) from None
    n, src = args.num_params, "--num-params" if args.num_params else ""
    if args.model:
        if args.model not in PRESETS:
            raise ConfigError(f"--model: unknown preset {args.model!r}; known: "
                              f"{', '.join(PRESETS)}")
        if n is None:
            n, src = llama_num_params(PRESETS[args.model]), f"preset {args.model}"
    optim = {k: getattr(args, k) for k in ("b1", "b2", "eps", "lr") if getattr(args, k) is not None}
    spike_params = SpikeParams.from_flags(args)
    text = assess(path, predictions=args.predictions, rate_model=args.rate_model,
                  shipped=not args.no_shipped, optim=optim,
                  seq_len=args.seq_len, clip=args.clip, num_params=n, num_params_source=src,
                  spike_params=spike_params,
                  out=args.out)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
