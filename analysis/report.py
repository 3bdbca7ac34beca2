"""One run's analysis (spikes, precursors, alarms, theory fits) and its Markdown report.

`analyze_run(path, ...)` computes everything into a RunAnalysis; `write_run_report` writes
OUT/report.md and report.html (the same, self-contained: adamspike.report_html), the tables behind it (CSV: everything the run figures draw, so `adamspike
figures` reads them instead of recomputing) and summary.json; the report links the run
figures where they already lie at their conventional path (FIGURE_DIRS);
`write_index` writes the top-level report over several runs. Each section states what it
could not compute and why (no per-layer telemetry, no b1/b2 in run.json, no predictions)
instead of leaving it out silently.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from adamspike.report_html import markdown_to_html
from adamspike.rundir import (RunFormatError, atomic_write_bytes, json_clean, load_run,
                              normalize_config)
from adamspike.tables import fmt as _f, md_table
from adamspike.spikes import (SpikeParams, anomaly_flags, detect_spikes, loss_spikes,
                              valued_rows)
from analysis.alarms import fire_steps, online_alarms, score_alarms
from analysis.diagnosis import LEAD_LINES, diagnose
from analysis.numerics import health_markdown, numerics_health
from analysis.fits import (check_rms_t, failing_assumption, fit_update_rms, fit_update_rms_heterogeneous,
                           optim_params, spike_regimes)
from analysis.precursors import precursors
from analysis.regime import SECANT_TO_S, SECANT_TO_S_IQR, card_for_run
from analysis.spikes import spike_score_olmo2, zscore_flags

LAYER_COLUMNS = ["grad_rms", "rho", "update_rms", "rms_t", "sat_frac", "grad_mom_cos",
                 "m_v_ratio", "r_mean", "r_m2", "r_m3", "r_m4", "eps_frac"]  # eps_frac: regime card


class AnalysisError(ValueError):
    """The run cannot be analysed (empty, no loss); the message says why."""


@dataclass
class RunAnalysis:
    name: str
    path: Path
    meta: dict
    num_steps: int
    num_layer_steps: int
    num_tensors: int
    spike_params: SpikeParams
    loss_log: bool
    spikes: pd.DataFrame
    grad_spikes: pd.DataFrame
    scores: dict
    events: dict
    precursors: Any = None
    alarm_scores: pd.DataFrame | None = None
    alarm_source: str = ""
    update_fit: Any = None
    rms_t: Any = None
    regimes: pd.DataFrame | None = None
    regime_card: Any = None          # analysis.regime.RegimeCard
    hetero_fit: Any = None           # analysis.fits.HeteroFit (runs with vhists)
    numerics: Any = None             # analysis.numerics.NumericsHealth
    coverage: dict = field(default_factory=dict)    # series -> judged_steps(...)
    grad_lead: pd.DataFrame | None = None           # grad_norm_leads(...)
    diagnosis: pd.DataFrame | None = None           # analysis.diagnosis.diagnose: one verdict
    attribution: pd.DataFrame | None = None         # per spike; the same table (attribution.csv)
    notes: dict[str, str] = field(default_factory=dict)
    run: Any = field(default=None, repr=False)


def analyze_run(path: str | Path, *, predictions=None, horizon: int | None = None,
                min_lead: int = 0, spike_params: SpikeParams = SpikeParams(),
                window: int = 50, baseline: int = 200, with_hists: bool = False,
                name: str | None = None, num_params: int | None = None,
                num_params_source: str = "") -> RunAnalysis:
    """Analyse one run directory (RunFormatError / AnalysisError on bad input).
    num_params: the model's parameter count for a log's regime card (rho_bar)."""
    path = Path(path)
    # every table this analysis reads, in one load_run call: a live or resuming run is then
    # one moment (its flushed.json step) in all of them
    tables = ("steps", "layers", *(("hists",) if with_hists else ()),
              *(t for t in ("vhists", "curvature") if (path / t).is_dir()))
    run = _load(path, tables)
    st = run.steps
    if st.empty:
        raise AnalysisError(f"{path}: the run has no steps rows (nothing was logged)")
    if "loss" not in st or not np.isfinite(st["loss"].to_numpy(float)).any():
        raise AnalysisError(f"{path}: no finite loss values in the steps table")
    spikes, resolved = loss_spikes(st, spike_params, config=run.config)
    gst = valued_rows(st, "grad_norm")
    gn = gst["grad_norm"].to_numpy(float)
    grad_rule = grad_norm_rule(resolved, first_step=int(st["step"].min()))
    grad_spikes = (detect_spikes(gn, gst["step"].to_numpy(), grad_rule)
                   if np.isfinite(gn).any() else detect_spikes([]))
    scores = {}
    for col in ("loss", "grad_norm"):
        v = valued_rows(st, col)[col].to_numpy(float)
        if np.isfinite(v).any():
            scores[col] = {"olmo2_spike_score_pct": spike_score_olmo2(v),
                           "olmo_core_flags": int(zscore_flags(v, "olmo-core").sum()),
                           "levanter_flags": int(zscore_flags(v, "levanter").sum())}
    ev = run.events
    ev_counts = ev["type"].value_counts().to_dict() if not ev.empty else {}
    lay = run.layers
    ra = RunAnalysis(name=name or path.name, path=path, meta=run.meta, num_steps=len(st),
                     num_layer_steps=int(lay["step"].nunique()) if not lay.empty else 0,
                     num_tensors=int(lay["name"].nunique()) if not lay.empty else 0,
                     spike_params=resolved, loss_log=resolved.log, spikes=spikes,
                     grad_spikes=grad_spikes, scores=scores,
                     events={"counts": {str(k): int(v) for k, v in ev_counts.items()},
                             "torn_lines": run.torn_event_lines}, run=run)
    log_interval = (run.meta.get("import") or {}).get("log_interval", 1) or 1
    ra.numerics = numerics_health(st, spikes, log_interval=log_interval)
    ra.coverage = {"loss": judged_steps(st, "loss", resolved)}
    if "grad_norm" in st:
        ra.coverage["grad_norm"] = judged_steps(st, "grad_norm", grad_rule)
    ra.grad_lead = grad_norm_leads(spikes, grad_spikes, log_interval)
    ra.diagnosis = diagnose(ra)
    op = optim_params(run.config)
    no_layers = "no per-layer telemetry in this run (layers table is empty)"
    if lay.empty:
        for key in ("precursors", "alarms", "update_fit", "rms_t", "regimes"):
            ra.notes[key] = no_layers
    else:
        if len(spikes):
            ra.precursors = precursors(lay, spikes, window=window, baseline=baseline)
            ra.regimes = spike_regimes(lay, spikes, run.config, window=window)
        else:
            ra.notes["precursors"] = ra.notes["regimes"] = "no spikes detected"
        if op["b1"] is None or op["b2"] is None:
            ra.notes["update_fit"] = ra.notes["rms_t"] = \
                "run.json config has no optim.b1 / optim.b2"
        else:
            try:
                ra.update_fit = fit_update_rms(lay, op["b1"], op["b2"])
            except ValueError as e:
                ra.notes["update_fit"] = str(e)
            ra.rms_t = check_rms_t(lay, op["b1"], op["b2"])
    _regime_and_hetero(ra, run, op, num_params, num_params_source)
    ra.attribution = ra.diagnosis        # one verdict per spike (analysis.attribution.decide)
    if predictions is not None and predictions.alarm_rules:
        rules = predictions.alarm_rules
        if not lay.empty:
            alarms = fire_steps(rules, lay)
            ra.alarm_source = "rules evaluated offline on the layers table"
        else:
            alarms = online_alarms(ev)
            ra.alarm_source = "alarm events logged online (no layers table)"
        ra.alarm_scores = score_alarms(alarms, spikes, rules, horizon=horizon,
                                       min_lead=min_lead)
    elif predictions is not None:
        ra.notes["alarms"] = "the predictions file has no alarm rules"
    else:
        ra.notes.setdefault("alarms", "no --predictions given")
    return ra




# A trace whose first logged iteration is at most this is the start of its job (any usual
# log interval prints its first line by then), not an excerpt or a resume.
JOB_START_STEP = 100


def grad_norm_rule(loss_rule: SpikeParams, first_step: int | None = None) -> SpikeParams:
    """The grad norm's rule: the loss rule's window, k and history, on log grad norm
    (norms span decades), every point judged as it comes (online = offline). A log that
    starts with its job (first step <= JOB_START_STEP) gets the rule's default warm-up on
    the grad norm instead of the log's one-value history (adamspike.spikes.LOG_MIN_HISTORY,
    meant for excerpts that start mid-training): a job's first steps move the grad norm by
    large factors, and one value is no band (watch and analyze both flagged iteration 2)."""
    rule = loss_rule.replace(min_rel_jump=SpikeParams().min_rel_jump, log=True, absorb=False,
                             envelope=0)
    if first_step is not None and first_step <= JOB_START_STEP and rule.min_history is not None:
        rule = rule.replace(min_history=max(rule.min_history, SpikeParams(window=rule.window).history))
    return rule


def judged_steps(steps: pd.DataFrame, column: str, rule: SpikeParams) -> dict:
    """Which steps the rule judged on `column`, and for the others why not: no value
    (skipped, or not measured: adamspike.spikes.valued_rows), or too little history
    (before `rule.history` earlier normal values existed)."""
    vr = valued_rows(steps, column)
    left = steps.loc[~steps.index.isin(vr.index)]
    reasons = []

    def add(why: str, sel: pd.DataFrame) -> None:
        if len(sel):
            reasons.append({"reason": why, "count": int(len(sel)),
                            "steps": [int(x) for x in sel["step"].head(10)]})

    if len(left):
        none = pd.Series(False, index=left.index)
        stale = left[f"{column}_stale"].eq(True) if f"{column}_stale" in left else none
        skipped = (left["skipped"].eq(True) if "skipped" in left else none) & ~stale
        add("stale (the previous line's value on an overflowed step)", left[stale])
        add("skipped step without a value", left[skipped])
        add("not measured (field absent, or a placeholder such as 0.000)",
            left[~stale & ~skipped])
    x = vr[column].to_numpy(float)
    _, base = anomaly_flags(x, rule)
    early = np.isfinite(x) & np.isnan(base)
    if rule.log:
        early &= x > 0
    add(f"too little history (the rule needs {rule.history} earlier normal value(s))",
        vr[early])
    return {"num_rows": int(len(steps)), "num_judged": int(len(vr) - early.sum()),
            "reasons": reasons}


def grad_norm_leads(spikes: pd.DataFrame, grad_spikes: pd.DataFrame,
                    log_interval: int = 1) -> pd.DataFrame:
    """Per loss spike, the grad-norm spike that led it: the latest grad-norm spike starting
    at most LEAD_LINES logged lines before the loss spike (or at it); lead = loss start -
    grad start in steps (NaN: none)."""
    reach = LEAD_LINES * max(int(log_interval), 1)
    rows = []
    gstarts = grad_spikes["start"].to_numpy() if len(grad_spikes) else np.array([], int)
    for s in spikes["start"].to_numpy():
        cand = gstarts[(gstarts <= s) & (gstarts >= s - reach)]
        g = int(cand.max()) if len(cand) else None
        rows.append({"start": int(s), "grad_start": g,
                     "lead": math.nan if g is None else float(s - g)})
    return pd.DataFrame(rows, columns=["start", "grad_start", "lead"])


def _coverage_lines(ra: "RunAnalysis") -> list[str]:
    L = []
    for col, cov in ra.coverage.items():
        if not cov["reasons"]:
            L.append(f"- {col}: every one of {cov['num_rows']} logged steps judged.")
            continue
        L.append(f"- {col}: {cov['num_judged']} of {cov['num_rows']} logged steps judged; not "
                 "judged: " + "; ".join(
                     f"{r['count']} {r['reason']} (step{'s' if r['count'] > 1 else ''} "
                     f"{', '.join(map(str, r['steps']))}{' ...' if r['count'] > 10 else ''})"
                     for r in cov["reasons"]) + ".")
    return L


def _regime_and_hetero(ra: RunAnalysis, run, op: dict, num_params, num_params_source) -> None:
    """The regime card (analysis.regime) and, where the run has sqrt(v_hat)/eps
    histograms, the heterogeneous update_rms fit (analysis.fits), into ra."""
    try:
        ra.regime_card = card_for_run(run, num_params=num_params,
                                      num_params_source=num_params_source)
    except ValueError as e:
        ra.notes["regime_card"] = str(e)
    if run.layers.empty:
        ra.notes["hetero_fit"] = "no per-layer telemetry"
        return
    if not (Path(run.path) / "vhists").is_dir():
        ra.notes["hetero_fit"] = "the run has no vhists table (sqrt(v_hat)/eps histograms)"
        return
    if op["b1"] is None or op["b2"] is None:
        ra.notes["hetero_fit"] = "run.json config has no optim.b1 / optim.b2"
        return
    try:
        ra.hetero_fit = fit_update_rms_heterogeneous(run.layers, run.vhists, op["b1"],
                                                     op["b2"])
    except ValueError as e:
        ra.notes["hetero_fit"] = str(e)


def _load(path: Path, tables):
    try:
        return load_run(path, tables=tables, layer_columns=LAYER_COLUMNS)
    except RunFormatError as e:
        if "missing column" not in str(e):
            raise
        return load_run(path, tables=tables)  # older layers parts: read what is there


# ------------------------------------------------------------------ formatting

def _config_line(meta: dict) -> str:
    cfg = normalize_config(meta.get("config", {}))
    o = cfg.get("optim", {}) or {}
    m = cfg.get("model", {}) or {}
    parts = [f"backend `{meta.get('backend')}`"]
    if m.get("preset"):
        parts.append(f"model `{m['preset']}`")
    for k in ("lr", "b1", "b2", "eps", "weight_decay", "grad_clip"):
        if o.get(k) is not None:
            parts.append(f"{k} = {_f(o[k])}")
    return ", ".join(parts)


# Where a run report (OUT/<run>/report.md) finds its run figures, relative to it: drawn into
# the report's folder, or by the figures stage beside the analysis (a study: analysis/<run>/
# and figures/<run>/). The figures are drawn after the analysis, from its tables.
FIGURE_DIRS = ("figures", "../../figures/{name}")
MAX_FIT_SCATTER = 20_000   # update_rms_fit_rows.csv: a uniform subsample (the figure's)


def linked_figures(name: str, out_dir: Path | None) -> list[str]:
    """Relative links of the PNGs at the first FIGURE_DIRS folder that has any."""
    if out_dir is None:
        return []
    for d in FIGURE_DIRS:
        rel = d.format(name=name)
        pngs = sorted((Path(out_dir) / rel).glob("*.png"))
        if pngs:
            return [posixpath.join(rel, f.name) for f in pngs]
    return []


def not_measured_note(imp: dict) -> str:
    """The import's values read as missing (NaN), never as data: what a framework prints
    when it did not measure (adamspike.megatron_log)."""
    parts = []
    n = imp.get("num_loss_missing", 0)
    if n:
        steps = imp.get("loss_missing_steps", [])
        parts.append(f"{n} line(s) without a loss value that no counter calls skipped (step"
                     f"{'s' if n > 1 else ''} {', '.join(map(str, steps[:10]))}"
                     f"{' ...' if n > 10 else ''})")
    if imp.get("num_skipped_without_loss"):
        parts.append(f"{imp['num_skipped_without_loss']} interval(s) whose iterations were all "
                     "skipped, so without a loss")
    if imp.get("num_grad_norm_zero"):
        parts.append(f"grad norm printed as 0.000 on {imp['num_grad_norm_zero']} line(s) (not "
                     "computed, e.g. by DeepSpeed's pipeline engine, or below the print "
                     "resolution)")
    if imp.get("num_grad_norm_stale"):
        parts.append(f"{imp['num_grad_norm_stale']} stale grad norm(s) (the previous line's "
                     "value again on a step with an overflow, a skip or a loss-scale cut)")
    if imp.get("num_loss_scale_unmeasured"):
        parts.append(f"loss scale <= 0 (-1.0: not measured) on "
                     f"{imp['num_loss_scale_unmeasured']} line(s)")
    if not parts:
        return ""
    return ("**Missing, not data**: " + "; ".join(parts) + ". These are NaN in the steps "
            "table: never a spike, a frozen verdict or a regime.")


def render_markdown(ra: RunAnalysis, out_dir: Path | None = None) -> str:
    sp, L = ra.spikes, []
    L += [f"# Run `{ra.name}`", "", f"`{ra.path}`", "", _config_line(ra.meta) + ".", "",
          f"{ra.num_steps} steps logged; per-layer telemetry on {ra.num_layer_steps} steps x "
          f"{ra.num_tensors} tensors."]
    imp = ra.meta.get("import")
    if imp:
        L += ["", "## Imported log", "",
              f"From `{imp.get('source')}`: {imp.get('num_lines')} lines, "
              f"{imp.get('num_iteration_lines')} iteration lines, "
              f"{imp.get('num_validation_lines')} validation lines, "
              f"**{imp.get('num_malformed')} malformed** (not imported; line numbers: "
              f"{', '.join(map(str, imp.get('malformed_lines', [])[:20])) or 'none'}"
              f"{' ...' if len(imp.get('malformed_lines', [])) > 20 else ''}), "
              f"{imp.get('num_duplicate_steps', 0)} repeated iterations (last kept). "
              f"Log interval {imp.get('log_interval')}"
              f"{' (rows are interval averages)' if (imp.get('log_interval') or 1) > 1 else ''};"
              f" loss column `{imp.get('loss_key')}`; "
              + (f"tokens from {imp['tokens_from']}." if imp.get("tokens_from") else
                 "tokens not counted (the log has neither consumed tokens nor --seq-len).")]
        missing = not_measured_note(imp)
        if missing:
            L += ["", missing]
    p = ra.spike_params
    L += ["", "## Loss spikes", "",
          f"Rule: {p.describe()}; NaN/inf count as spikes; consecutive anomalous steps form "
          "one spike.", ""]
    if sp.empty:
        L.append("**No loss spikes detected.**")
    else:
        nrec = int(sp["recovered"].sum())
        L += [f"**{len(sp)} spike(s)**, {nrec} recovered, {len(sp) - nrec} not; largest "
              f"+{_f(100 * np.nanmax(sp['height']))}% at step "
              f"{int(sp.loc[sp['height'].idxmax(), 'peak_step']) if sp['height'].notna().any() else '-'}.",
              "", md_table(sp.assign(height_pct=100 * sp["height"]),
                           ["start", "peak_step", "peak", "baseline", "height_pct", "duration",
                            "recovered", "nonfinite"],
                           ["start", "peak step", "peak", "baseline", "height %",
                            "duration (steps)", "recovered", "non-finite"])]
        cens = sp[~sp["recovered"].astype(bool)]
        if len(cens):
            L += ["", f"Censored: the spike(s) at step {', '.join(map(str, cens['start']))} had "
                      "not recovered when the run ends; their duration is a lower bound."]
    L += ["", f"Gradient-norm spikes (same rule on log grad norm, the second series): "
              f"{len(ra.grad_spikes)}" + (", starting at step " + ", ".join(
                  map(str, ra.grad_spikes["start"].head(10))) if len(ra.grad_spikes) else "")
          + "."]
    dg = ra.diagnosis
    if dg is not None and len(dg):
        L += ["", "Per spike, the cause the evidence points to (analysis.attribution.decide):", ""]
        L += [f"- loss spike at step {r.start}: **{r.verdict}**: {r.evidence}"
              + ("" if r.grad_note in r.evidence else f"; grad norm: {r.grad_note}") + "."
              for r in dg.itertuples()]
    if ra.coverage:
        L += ["", "Steps the rule judged:", ""] + _coverage_lines(ra)
    if ra.scores:
        L += ["", "Published detectors on the same traces, for comparison:", "",
              md_table(([col, s["olmo2_spike_score_pct"], s["olmo_core_flags"], s["levanter_flags"]]
                        for col, s in ra.scores.items()),
                       headers=["series", "OLMo 2 spike score (%)", "OLMo-core skips", "Levanter skips"],
                       max_rows=None)]
    if ra.events["counts"]:
        L += ["", "Events: " + ", ".join(f"{k} x{v}" for k, v in sorted(ra.events["counts"].items()))
              + (f"; {ra.events['torn_lines']} torn line(s)" if ra.events["torn_lines"] else "")
              + "."]
    if ra.numerics is not None:
        L += health_markdown(ra.numerics)
    L += ["", "## What preceded the spikes", ""]
    if ra.precursors is None:
        L.append(f"Not computed: {ra.notes.get('precursors')}.")
    else:
        pre = ra.precursors
        L += [f"Per metric, the median over each group's tensors (shallow: the embed + shallow groups, depth < "
              f"max(1, L // 10); deep: the rest), against its band (median + 4 x 1.4826 MAD"
              f" over the {pre.baseline} steps before a {pre.window}-step window). Lead = "
              "spike start - first step of the out-of-band run that lasts until the spike "
              "(sustained); 'led' counts spikes with such a run.", "",
              md_table(pre.summary, ["metric", "group", "num_led", "num_spikes", "lead_median",
                                     "lead_q25", "lead_q75", "lead_min", "lead_max"],
                       ["metric", "group", "led", "spikes", "median lead", "q25", "q75",
                        "min", "max"])]
        L += ["", _shallow_vs_deep(pre.summary)]
        first = _first_movers(pre.tensor_leads)
        if first:
            L += ["", first]
    L += ["", "## Alarm rules", ""]
    if ra.alarm_scores is None:
        L.append(f"Not scored: {ra.notes.get('alarms')}.")
    else:
        L += [f"Source: {ra.alarm_source}. An alarm at step f is true when a spike starts in "
              "[f, f + horizon] (horizon = the rule's largest expected lead); recall = spikes "
              "with such an alarm before them.", "",
              md_table(ra.alarm_scores, ["rule", "horizon", "num_alarms", "num_true_alarms",
                                         "precision", "num_detected", "num_spikes", "recall",
                                         "lead_median"],
                       ["rule", "horizon", "alarms", "true", "precision", "detected", "spikes",
                        "recall", "median lead"])]
    L += ["", "## Theory", ""]
    uf = ra.update_fit
    if uf is None:
        L.append(f"update_rms fit not computed: {ra.notes.get('update_fit')}.")
    else:
        L += [f"**update_rms vs theory** ({uf.num_rows} rows, b1 = {uf.b1:g}, b2 = {uf.b2:g}, "
              f"{uf.method}; phi from grad_mom_cos assuming zero-mean gradients): "
              f"R^2 of log values **{_f(uf.r2_log)}** with no free parameter, median "
              f"measured/theory {_f(uf.median_ratio)}. " + _eps_scale_sentence(uf),
              "", md_table(uf.by_group, ["group", "regime", "num_rows", "median_ratio",
                                         "r2_log"],
                           ["group", "regime", "rows", "median measured/theory", "R^2 (log)"])]
    ck = ra.rms_t
    if ck is None:
        L += ["", f"rms_t check not computed: {ra.notes.get('rms_t')}."]
    else:
        L += ["", f"**rms_t** (StableAdamW): bound 1/sqrt(1-b2) = {_f(ck.bound)}; "
              f"{_f(100 * ck.frac_above_bound)}% of {ck.num_rows} rows above it; max rms_t "
              f"{_f(ck.max_rms_t)} ({_f(ck.max_over_bound)} x bound). Step-up transients "
              f"(grad_rms >= 2x its recent median): {len(ck.transients)}"
              + (f", R^2 of measured vs theory.transients.step_up rms_t curves "
                 f"{_f(ck.transient_r2)}" if not math.isnan(ck.transient_r2) else "")
              + (f". {ck.note.strip().rstrip('.')}" if ck.note else "") + "."]
    if ra.regimes is not None and len(ra.regimes):
        L += ["", "**eps regime before each spike** (median rho = grad_rms / eps over the "
              "window; frozen < 0.1 <= transition <= 10 < scale-invariant):", "",
              md_table(ra.regimes, ["start", "group", "rho_median", "regime", "num_frozen",
                                    "num_transition", "num_scale_invariant", "eps_star",
                                    "eps_above_eps_star"],
                       ["spike", "group", "median rho", "regime", "frozen", "transition",
                        "scale-inv.", "Bai eps*", "eps >= eps*"])]
    elif ra.notes.get("regimes"):
        L += ["", f"Regimes not computed: {ra.notes['regimes']}."]
    L += regime_markdown(ra)
    links = linked_figures(ra.name, out_dir)
    if links:
        L += ["", "## Figures", ""] + [f"![{posixpath.basename(f)[:-4]}]({f})" for f in links]
    else:
        L += ["", "## Figures", "", f"Not drawn yet: `adamspike figures {ra.path} --analysis "
              f"{Path(out_dir).parent if out_dir is not None else 'OUT'} --out FIGURES` draws "
              "them and rewrites this report's report.html with them inline."]
    return "\n".join(L) + "\n"


def curvature_markdown(c) -> list[str]:
    """The regime card's curvature table (power iteration per group, or the probe's online
    proxy, group "update") with Adam's stability number S."""
    if c.curvature is None:
        return []
    L = ["", "Preconditioned curvature against Bai's 2/lr (S = lr precond / 2: Adam's "
         "stability number, 1 at the edge), raw curvature against the eps-band threshold "
         "2(1+b1)/((1-b1) lr/eps):", "",
         md_table(c.curvature, ["group", "num_rows", "precond_median", "precond_max",
                                "bai_threshold_median", "frac_above_bai", "S_median",
                                "S_estimate", "raw_median", "eps_band_threshold_median",
                                "frac_raw_above_eps_band"],
                  ["group", "rows", "precond median", "precond max", "2/lr", "above 2/lr",
                   "S median", "S estimate", "raw median", "eps-band threshold",
                   "raw above it"])]
    if "update" in set(c.curvature["group"]):
        L += ["", "Group `update` is the online proxy (the curvature along the updates, from "
              "consecutive gradients: the Megatron probe's), not the top eigenvector's: its S "
              f"estimate is S median / {SECANT_TO_S} (the proxy's ratio to power iteration on "
              f"the toys' runs; IQR {SECANT_TO_S_IQR[0]}-{SECANT_TO_S_IQR[1]}, so read it to a "
              "factor of 2; it ranks runs, Spearman 0.9 on the toys below the edge, but does "
              "not follow single evaluations)."]
    return L


def regime_markdown(ra: RunAnalysis) -> list[str]:
    """The '## Regime card' section (+ the heterogeneous update_rms fit)."""
    L = ["", "## Regime card", ""]
    c = ra.regime_card
    if c is None:
        return L + [f"Not computed: {ra.notes.get('regime_card')}."]
    L.append(f"eps = {_f(c.eps)}, b1 = {_f(c.b1)}, b2 = {_f(c.b2)}, median lr = {_f(c.lr)}, "
             f"lr/eps = {_f(c.lr_over_eps)} (the momentum-SGD step where rho << 1).")
    if c.kind == "log":
        info = c.log or {}
        L += ["", f"From the log's global grad norm (median {_f(info.get('grad_norm_median'))}"
              f", clip {_f(info.get('clip'))}, {_f(100 * info.get('frac_clipped', math.nan))}% "
              f"of steps clipped), N = {info.get('num_params') or '?'} parameters "
              f"({info.get('num_params_source') or 'unknown'}): rho_bar = min(gn, clip) / "
              "(sqrt(N) eps), the rms rho over all coordinates of the gradient Adam consumed; "
              "the bound is clip / (sqrt(N) eps)."]
        if not c.groups.empty:
            L += ["", md_table(c.groups, ["eps", "is_run_eps", "rho_bar_median", "rho_bar_q10",
                                          "rho_bar_q90", "rho_bar_max", "bound",
                                          "frac_time_below_1", "regime", "lr_over_eps"],
                               ["eps", "run's eps", "rho_bar median", "q10", "q90", "max",
                                "bound", "time below rho 1", "regime", "lr/eps"])]
        L += curvature_markdown(c)
        for n in c.notes:
            L += ["", f"Note: {n}."]
        return L
    L += ["", "Per depth group (adamspike.depth_groups, L = "
          f"{c.num_layers}): group rho = rms of the group's whole consumed gradient (after "
          "clipping, at the run's loss scale) over eps, per logged step; fractions of "
          "coordinates with sqrt(v_hat) < eps (every logged step) and with |g| < eps "
          "(histogram steps); snr from m_v_ratio (i.i.d.-noise inversion); "
          "dormancy = consecutive logged steps with the tensor's rho < 1, also in units of "
          "the b2 memory 1/(1-b2) steps; wake-up = rho >= 1 after >= 10 dormant steps; "
          "relative update = lr(t) rms(r) / rms(p); Pi_eps = (lr/eps) lambda_max(H_g) "
          "(threshold 2(1+b1)/(1-b1), 38 at b1 0.9) and Pi_adam = lr lambda_max(P H_g) "
          "(threshold 2) where the run has a curvature table.", "",
          md_table(c.groups, ["group", "num_tensors", "rho_median", "rho_q10", "rho_q90",
                              "rho_tensor_min", "rho_tensor_max", "frac_time_below_1",
                              "eps_frac_median", "g_below_eps_median", "snr_median",
                              "max_dormancy", "max_dormancy_memories", "num_wakeups",
                              "rel_update_median", "pi_eps_median", "pi_adam_median", "regime"],
                   ["group", "tensors", "rho median", "q10", "q90", "min tensor", "max tensor",
                    "time below 1", "sqrt(v)<eps", "abs(g)<eps", "snr", "max dormancy",
                    "in b2 memories", "wake-ups", "rel. update", "Pi_eps", "Pi_adam",
                    "regime"])]
    if len(c.wakeups):
        w = c.wakeups.sort_values("dormant_steps", ascending=False)
        L += ["", f"**{len(w)} wake-up(s)** (longest first):", "",
              md_table(w, ["name", "group", "step", "dormant_steps", "dormant_memories",
                           "rho_dormant_median", "rho_at_wake", "rms_t_at_wake"],
                       ["tensor", "group", "step", "dormant steps", "in b2 memories",
                        "rho dormant", "rho at wake", "rms_t at wake"], max_rows=10)]
    else:
        L += ["", "No wake-ups (no tensor stayed below rho = 1 for 10 logged steps)."]
    L += curvature_markdown(c)
    hf = ra.hetero_fit
    L += ["", "**update_rms fit per regime band, before and after** "]
    if hf is None:
        L[-1] += f"not computed: {ra.notes.get('hetero_fit')}."
        return L
    L[-1] += (f"({hf.num_stationary} stationary rows of {hf.num_rows} with a sqrt(v_hat)/eps "
              f"histogram, step >= 3/(1-b2); {hf.method}). before: the per-tensor fit above "
              "on the same rows; heterogeneous: each coordinate at its own rho (vhist), exact "
              "forms; + measured m_v: conditioned on the measured m_v_ratio. Median ln "
              "(measured / predicted); goal |.| < 0.1 and R^2 >= 0.8.")
    L += ["", md_table(hf.bands, ["band", "model", "num_rows", "r2_log", "median_log_ratio"],
                       ["rho band", "model", "rows", "R^2 (log)", "median ln ratio"]),
          "", md_table(hf.diagnostics, ["band", "rho_median", "phi_median", "rms_t_median",
                                        "g2_over_v_median", "burstiness_median",
                                        "mv_excess_median",
                                        "r_kurtosis_median", "vhist_spread_median"],
                       ["rho band", "rho", "phi", "rms_t", "g^2 / v_hat", "burstiness",
                        "m_v^2 / zero-mean value", "kurtosis r", "vhist spread (decades)"]),
          "", "Assumption check: " + failing_assumption(hf) + "."]
    return L


def _eps_scale_sentence(uf) -> str:
    if not uf.eps_scale_identifiable:
        return (f"The effective-eps scale is not identifiable here: only "
                f"{_f(100 * uf.frac_eps_sensitive)}% of rows have rho <= 10, and in the "
                "scale-invariant regime update_rms does not depend on eps.")
    s = (f"A fitted effective-eps scale c = {_f(uf.eps_scale)} (theory at rho x c) gives "
         f"R^2 {_f(uf.r2_log_fitted)}")
    if abs(math.log10(uf.eps_scale)) > 0.3:
        s += "; c far from 1 means the layers do not behave as the configured eps predicts"
    return s + "."


def _lead_text(row) -> str:
    led = f"{int(row.num_led)}/{int(row.num_spikes)}"
    return led + (f" (median {_f(row.lead_median)} steps)" if row.num_led else "")


def _first_movers(tl: pd.DataFrame | None, metric: str = "rms_t", top: int = 3) -> str:
    """Per spike, the tensors whose own rms_t band broke earliest (sustained)."""
    if tl is None or tl.empty:
        return ""
    d = tl[(tl["metric"] == metric) & tl["lead"].notna()]
    if d.empty:
        return f"No single tensor's {metric} left its own band in a sustained way before a spike."
    parts = []
    for (sid, s), g in d.groupby(["spike_id", "start"]):
        g = g.sort_values(["lead", "depth"], ascending=[False, True]).head(top)
        parts.append(f"spike {s}: " + ", ".join(f"`{r.name}` ({int(r.lead)})"
                                                for r in g.itertuples()))
    n_t = tl.loc[tl["metric"] == metric, "name"].nunique()
    return (f"Earliest tensors by their own {metric} band (lead in steps; {len(d)} "
            f"tensor-spike pairs led out of {n_t} tensors x {tl['spike_id'].nunique()} "
            "spikes): " + "; ".join(parts) + ".")


def _shallow_vs_deep(summary: pd.DataFrame) -> str:
    s = summary.set_index(["group", "metric"])
    parts = []
    for m in ("rms_t", "update_rms", "sat_frac", "bimodality", "grad_mom_cos", "rho"):
        if ("shallow", m) in s.index and ("deep", m) in s.index:
            a, b = s.loc[("shallow", m)], s.loc[("deep", m)]
            parts.append(f"{m}: shallow led {_lead_text(a)}, deep {_lead_text(b)}")
    return ("Shallow vs deep: " + "; ".join(parts) + ".") if parts else ""


# ------------------------------------------------------------------ writing

def _write_csv(df: pd.DataFrame | None, path: Path, written: list[Path]) -> None:
    if df is None:
        return
    atomic_write_bytes(path, df.to_csv(index=False).encode())
    written.append(path)


def summary_dict(ra: RunAnalysis) -> dict:
    uf, ck = ra.update_fit, ra.rms_t
    return {
        "name": ra.name, "path": str(ra.path), "backend": ra.meta.get("backend"),
        "num_steps": ra.num_steps, "num_spikes": len(ra.spikes),
        "num_recovered": int(ra.spikes["recovered"].sum()) if len(ra.spikes) else 0,
        "max_height": float(np.nanmax(ra.spikes["height"])) if ra.spikes["height"].notna().any()
        else None,
        "spike_starts": [int(s) for s in ra.spikes["start"]],
        "num_grad_norm_spikes": len(ra.grad_spikes), "scores": ra.scores,
        "grad_norm_spike_starts": [int(s) for s in ra.grad_spikes["start"]],
        "grad_norm_leads": None if ra.grad_lead is None else ra.grad_lead.to_dict("records"),
        "judged": ra.coverage,
        "precursor_window": None if ra.precursors is None else ra.precursors.window,
        "spike_rule": {"window": ra.spike_params.window, "k": ra.spike_params.k,
                       "min_rel_jump": ra.spike_params.min_rel_jump, "log": ra.loss_log,
                       "describe": ra.spike_params.describe()},
        "update_fit": None if uf is None else {"r2_log": uf.r2_log, "eps_scale": uf.eps_scale,
                                               "eps_scale_identifiable":
                                                   uf.eps_scale_identifiable,
                                               "r2_log_fitted": uf.r2_log_fitted,
                                               "median_ratio": uf.median_ratio,
                                               "num_rows": uf.num_rows, "method": uf.method},
        "rms_t": None if ck is None else {"bound": ck.bound, "frac_above_bound":
                                          ck.frac_above_bound, "max_rms_t": ck.max_rms_t,
                                          "num_transients": len(ck.transients),
                                          "transient_r2": ck.transient_r2},
        "alarms": None if ra.alarm_scores is None else ra.alarm_scores.to_dict("records"),
        "regime_card": None if ra.regime_card is None else {
            "kind": ra.regime_card.kind, "eps": ra.regime_card.eps, "b2": ra.regime_card.b2,
            "lr_over_eps": ra.regime_card.lr_over_eps, "log": ra.regime_card.log,
            "groups": ra.regime_card.groups.to_dict("records"),
            "num_wakeups": len(ra.regime_card.wakeups)},
        "update_fit_bands": None if ra.hetero_fit is None else
        ra.hetero_fit.bands.to_dict("records"),
        "numerics": None if ra.numerics is None else {
            "signals": ra.numerics.signals, "loss_scale": ra.numerics.loss_scale,
            "event_counts": {str(k): int(v) for k, v in
                             ra.numerics.events["kind"].value_counts().items()},
            "per_spike": ra.numerics.per_spike.to_dict("records")},
        "notes": ra.notes, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_report(ra: RunAnalysis, out_dir: str | Path) -> list[Path]:
    """report.md + CSV tables + summary.json into out_dir; returns the files. The tables
    are what the run figures read (`adamspike figures --analysis OUT`): spikes.csv,
    grad_norm_spikes.csv, precursor_trajectories.csv, update_rms_fit_rows.csv,
    regime_trajectory.csv, attribution.csv (a verdict per spike: analysis.attribution),
    summary.json (spike rule, fit, regime card)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    _write_csv(ra.spikes, out / "spikes.csv", written)
    _write_csv(ra.grad_spikes, out / "grad_norm_spikes.csv", written)
    if ra.precursors is not None:
        _write_csv(ra.precursors.leads, out / "precursor_leads.csv", written)
        _write_csv(ra.precursors.summary, out / "lead_summary.csv", written)
        _write_csv(ra.precursors.tensor_leads, out / "tensor_leads.csv", written)
        _write_csv(ra.precursors.trajectories, out / "precursor_trajectories.csv", written)
    _write_csv(ra.alarm_scores, out / "alarm_scores.csv", written)
    _write_csv(ra.attribution, out / "attribution.csv", written)
    if ra.numerics is not None:
        _write_csv(ra.numerics.events, out / "numerics_events.csv", written)
    if ra.update_fit is not None:
        _write_csv(ra.update_fit.by_group, out / "update_rms_fit.csv", written)
        rows = ra.update_fit.rows
        if len(rows) > MAX_FIT_SCATTER:
            rows = rows.sample(MAX_FIT_SCATTER, random_state=0).sort_index()
        _write_csv(rows, out / "update_rms_fit_rows.csv", written)
    if ra.rms_t is not None and len(ra.rms_t.transients):
        _write_csv(ra.rms_t.transients.drop(columns=["rms_t"]), out / "rms_t_transients.csv",
                   written)
    _write_csv(ra.regimes, out / "regimes.csv", written)
    if ra.regime_card is not None:
        _write_csv(ra.regime_card.groups, out / "regime_card.csv", written)
        _write_csv(ra.regime_card.trajectory, out / "regime_trajectory.csv", written)
        if ra.regime_card.kind == "run":
            _write_csv(ra.regime_card.tensors, out / "regime_tensors.csv", written)
            _write_csv(ra.regime_card.wakeups, out / "regime_wakeups.csv", written)
        _write_csv(ra.regime_card.curvature, out / "regime_curvature.csv", written)
    if ra.hetero_fit is not None:
        _write_csv(ra.hetero_fit.bands, out / "update_rms_fit_bands.csv", written)
        _write_csv(ra.hetero_fit.diagnostics, out / "update_rms_fit_diagnostics.csv", written)
    write_report_page(ra, out)
    atomic_write_bytes(out / "summary.json",
                       json.dumps(json_clean(summary_dict(ra)), indent=2, allow_nan=False).encode())
    return written + [out / "report.md", out / "report.html", out / "summary.json"]


def write_report_page(ra: RunAnalysis, out_dir: str | Path) -> None:
    """report.md and report.html (self-contained: the figures at FIGURE_DIRS inline) of a
    run; rewritten after `adamspike analyze` has drawn the run's figures."""
    out = Path(out_dir)
    md = render_markdown(ra, out)
    atomic_write_bytes(out / "report.md", md.encode())
    atomic_write_bytes(out / "report.html", markdown_to_html(md, out, f"Run {ra.name}").encode())


_LINK = re.compile(r"\]\((?![a-z]+:|/|#)([^)\s]+)\)")


def rebase_links(markdown: str, prefix: str) -> str:
    """The relative links of a markdown file inlined into one `prefix` folders above it,
    rewritten to stay valid (`](figures/a.png)` -> `](prefix/figures/a.png)`, normalized)."""
    return _LINK.sub(lambda m: f"]({posixpath.normpath(posixpath.join(prefix, m.group(1)))})",
                     markdown)


def write_index(analyses: list[RunAnalysis], out_dir: str | Path,
                run_dirs: list[str]) -> Path:
    """OUT/report.md: one line per run and each run's report inlined below."""
    out = Path(out_dir)
    L = ["# Loss-spike analysis", "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by "
         "`adamspike analyze`.", "", md_table(map(_index_row, analyses, run_dirs), headers=[
             "run", "backend", "steps", "spikes", "recovered", "max height %", "update_rms R^2 (log)",
             "eps scale c (n/i: not identifiable)", "max rms_t / bound"], max_rows=None)]
    L += index_regime_sections(analyses, run_dirs)
    for ra, d in zip(analyses, run_dirs):
        body = rebase_links((out / d / "report.md").read_text(), d)
        L += [""] + [("#" + ln) if ln.startswith("#") else ln for ln in body.splitlines()]
    path = out / "report.md"
    md = "\n".join(L) + "\n"
    atomic_write_bytes(path, md.encode())
    atomic_write_bytes(out / "report.html", markdown_to_html(md, out, "Loss-spike analysis").encode())
    return path


def _index_row(ra: RunAnalysis, d: str) -> list:
    s = summary_dict(ra)
    uf, ck, mh = s["update_fit"] or {}, s["rms_t"] or {}, s["max_height"]
    return [f"[{ra.name}]({d}/report.md)", s["backend"], s["num_steps"], s["num_spikes"],
            s["num_recovered"], None if mh is None else 100 * mh, uf.get("r2_log"),
            uf.get("eps_scale") if uf.get("eps_scale_identifiable") else "n/i",
            ck["max_rms_t"] / ck["bound"] if ck else None]


def _regime_row(ra: RunAnalysis, d: str) -> list:
    link, c = f"[{ra.name}]({d}/report.md)", ra.regime_card
    if c is None:
        return [link, "-", *[""] * 8, ra.notes.get("regime_card", "")]
    if c.kind == "log":
        g = c.groups
        r = g[g["is_run_eps"]] if len(g) and g["is_run_eps"].any() else g.head(1)
        rb = _f(r["rho_bar_median"].iloc[0]) if len(r) else "-"
        below = r["frac_time_below_1"].iloc[0] if len(r) else None
        return [link, "log", c.eps, c.b2, c.lr_over_eps, f"(all: rho_bar {rb})", "", "", "", below, "-"]
    med = {r.group: r for r in c.groups.itertuples()}
    return [link, "run", c.eps, c.b2, c.lr_over_eps,
            *(med[g].rho_median if g in med else None for g in ("embed", "shallow", "deep", "head")),
            med["shallow"].frac_time_below_1 if "shallow" in med else None, len(c.wakeups)]


def index_regime_sections(analyses: list[RunAnalysis], run_dirs: list[str]) -> list[str]:
    """The index's regime overview (one row per run) and the update_rms fit per band,
    before and after, over all runs."""
    L = ["", "## Regime overview", "",
         "Median rho per depth group (rms of the group's consumed gradient / eps; for a log "
         "rho_bar = min(gn, clip) / (sqrt(N) eps) at the run's eps), fraction of logged steps "
         "with the shallow group below rho = 1, wake-ups (tensor rho >= 1 after >= 10 "
         "dormant steps). Details: each run's Regime card.", "",
         md_table(map(_regime_row, analyses, run_dirs), headers=[
             "run", "kind", "eps", "b2", "lr/eps", "embed", "shallow", "deep", "head",
             "shallow time below 1", "wake-ups"], max_rows=None)]
    rows = [(ra, d) for ra, d in zip(analyses, run_dirs) if ra.hetero_fit is not None]
    L += ["", "## update_rms fit per regime band: before and after", "",
          "Same rows per run (histogram steps, step >= 3/(1-b2), slowly varying gradient "
          "scale). before = the per-tensor homogeneous fit (second-order grid / deterministic-"
          "v limit); het = each coordinate at its own rho from the sqrt(v_hat)/eps histogram "
          "with the exact forms; het+mv = het conditioned on the measured m_v_ratio. Goal: "
          "|median ln(measured/predicted)| < 0.1 and R^2 (log) >= 0.8.", ""]
    if not rows:
        return L + ["No run has sqrt(v_hat)/eps histograms with stationary rows."]
    models = ("before", "heterogeneous", "heterogeneous + measured m_v")
    band_rows = []
    for ra, d in rows:
        b = ra.hetero_fit.bands
        for band in b["band"].unique():
            part = b[b["band"] == band].set_index("model")
            band_rows.append([f"[{ra.name}]({d}/report.md)", band, int(part["num_rows"].iloc[0]),
                              *(part.loc[m, k] if m in part.index else None
                                for k in ("r2_log", "median_log_ratio") for m in models)])
    return L + [md_table(band_rows, headers=["run", "band", "rows", "R^2 before", "R^2 het", "R^2 het+mv",
                                             "med ln before", "med ln het", "med ln het+mv"],
                         max_rows=None)]
