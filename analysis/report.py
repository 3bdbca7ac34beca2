"""One run's analysis (spikes, precursors, alarms, theory fits) and its Markdown report.

`analyze_run(path, ...)` computes everything into a RunAnalysis; `write_run_report` writes
OUT/report.md, the tables behind it (CSV), summary.json and, optionally, the run figures;
`write_index` writes the top-level report over several runs. Each section states what it
could not compute and why (no per-layer telemetry, no b1/b2 in run.json, no predictions)
instead of leaving it out silently.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from adamspike.rundir import RunFormatError, atomic_write_bytes, load_run
from analysis.spikes import detect_spikes, spike_score_olmo2, zscore_flags

LAYER_COLUMNS = ["grad_rms", "rho", "update_rms", "rms_t", "sat_frac", "grad_mom_cos",
                 "m_v_ratio", "r_mean", "r_m2", "r_m3", "r_m4"]


class AnalysisError(ValueError):
    """The run cannot be analysed (empty, no loss); the message says why."""


@dataclass
class SpikeParams:
    window: int = 50
    k: float = 6.0
    min_rel_jump: float = 0.2
    log: bool | None = None          # None: log scale when the loss spans > 2 decades
    absorb: bool | None = None       # None: on with log scale (a trend over decades)
    envelope: int | None = None      # running max over N steps first; None: 50 for
                                     # quadratic problems (dips where theta crosses 0)

    def resolved(self, x: np.ndarray, config: dict | None = None) -> "SpikeParams":
        log = self.log
        if log is None:
            pos = x[np.isfinite(x) & (x > 0)]
            log = bool(len(pos) and np.log10(pos.max()) - np.log10(pos.min()) > 2)
        env = self.envelope
        if env is None:
            kind = ((config or {}).get("problem") or {}).get("kind")
            env = 50 if kind == "quadratic" else 0
        return SpikeParams(self.window, self.k, self.min_rel_jump, log,
                           log if self.absorb is None else self.absorb, int(env))

    def describe(self) -> str:
        s = (f"loss > median + {self.k:g} x 1.4826 MAD of the previous {self.window} normal "
             f"steps and > (1 + {self.min_rel_jump:g}) x median")
        if self.log:
            s += " (on log loss)"
        if self.envelope:
            s += f", applied to the {self.envelope}-step running max of the loss"
        if self.absorb:
            s += ("; every finite value enters the history (the band follows the level: "
                  "'recovered' means the rise stopped, not a return to the old level)")
        return s


def loss_spikes(steps: pd.DataFrame, params: SpikeParams = SpikeParams(),
                column: str = "loss", config: dict | None = None
                ) -> tuple[pd.DataFrame, SpikeParams]:
    """Spikes of a steps column with the report's rule; returns (spikes, resolved rule)."""
    x = steps[column].to_numpy(float)
    p = params.resolved(x, config)
    if p.envelope > 1:
        x = pd.Series(x).rolling(p.envelope, min_periods=1).max().to_numpy()
    sp = detect_spikes(x, steps["step"].to_numpy(), window=p.window, k=p.k,
                       min_rel_jump=p.min_rel_jump, log=p.log, absorb=p.absorb)
    return sp, p


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
    notes: dict[str, str] = field(default_factory=dict)
    run: Any = field(default=None, repr=False)


def analyze_run(path: str | Path, *, predictions=None, horizon: int | None = None,
                min_lead: int = 0, spike_params: SpikeParams = SpikeParams(),
                window: int = 50, baseline: int = 200, with_hists: bool = False,
                name: str | None = None) -> RunAnalysis:
    """Analyse one run directory (RunFormatError / AnalysisError on bad input)."""
    from analysis.alarms import fire_steps, online_alarms, score_alarms
    from analysis.fits import check_rms_t, fit_update_rms, optim_params, spike_regimes
    from analysis.precursors import precursors

    path = Path(path)
    tables = ("steps", "layers", "hists") if with_hists else ("steps", "layers")
    run = _load(path, tables)
    st = run.steps
    if st.empty:
        raise AnalysisError(f"{path}: the run has no steps rows (nothing was logged)")
    if "loss" not in st or not np.isfinite(st["loss"].to_numpy(float)).any():
        raise AnalysisError(f"{path}: no finite loss values in the steps table")
    spikes, resolved = loss_spikes(st, spike_params, config=run.config)
    gn = st["grad_norm"].to_numpy(float)
    grad_spikes = (detect_spikes(gn, st["step"].to_numpy(), window=spike_params.window,
                                 k=spike_params.k, log=True)
                   if np.isfinite(gn).any() else detect_spikes([]))
    scores = {}
    for col in ("loss", "grad_norm"):
        v = st[col].to_numpy(float)
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


def _load(path: Path, tables):
    try:
        return load_run(path, tables=tables, layer_columns=LAYER_COLUMNS)
    except RunFormatError as e:
        if "missing column" not in str(e):
            raise
        return load_run(path, tables=tables)  # older layers parts: read what is there


# ------------------------------------------------------------------ formatting

def _f(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def md_table(df: pd.DataFrame, cols: list[str] | None = None, headers=None,
             max_rows: int = 40) -> str:
    cols = cols or list(df.columns)
    headers = headers or cols
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(cols)]
    for _, r in df.head(max_rows).iterrows():
        lines.append("| " + " | ".join(_f(r[c]) for c in cols) + " |")
    if len(df) > max_rows:
        lines.append(f"| ... {len(df) - max_rows} more rows (see the CSV) |" + " |" * (len(cols) - 1))
    return "\n".join(lines)


def _config_line(meta: dict) -> str:
    cfg = meta.get("config", {})
    o = cfg.get("optim", {}) or {}
    m = cfg.get("model", {}) or {}
    parts = [f"backend `{meta.get('backend')}`"]
    if m.get("preset"):
        parts.append(f"model `{m['preset']}`")
    for k in ("lr", "b1", "b2", "eps", "weight_decay", "grad_clip"):
        if o.get(k) is not None:
            parts.append(f"{k} = {_f(o[k])}")
    return ", ".join(parts)


def render_markdown(ra: RunAnalysis, figures: list[Path] | None = None,
                    out_dir: Path | None = None) -> str:
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
              f" loss column `{imp.get('loss_key')}`; tokens from {imp.get('tokens_from')}."]
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
    L += ["", f"Gradient-norm spikes (same rule on log grad norm): {len(ra.grad_spikes)}."]
    if ra.scores:
        L += ["", "Published detectors on the same traces, for comparison:", "",
              "| series | OLMo 2 spike score (%) | OLMo-core skips | Levanter skips |",
              "|---|---|---|---|"]
        for col, s in ra.scores.items():
            L.append(f"| {col} | {_f(s['olmo2_spike_score_pct'])} | {s['olmo_core_flags']} | "
                     f"{s['levanter_flags']} |")
    if ra.events["counts"]:
        L += ["", "Events: " + ", ".join(f"{k} x{v}" for k, v in sorted(ra.events["counts"].items()))
              + (f"; {ra.events['torn_lines']} torn line(s)" if ra.events["torn_lines"] else "")
              + "."]
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
    skipped = {k[len("figure "):]: v for k, v in ra.notes.items() if k.startswith("figure ")}
    if figures or skipped:
        L += ["", "## Figures", ""]
        for f in figures or []:
            if f.suffix == ".png":
                rel = f.relative_to(out_dir) if out_dir else f
                L.append(f"![{f.stem}]({rel})")
        for name, why in skipped.items():
            L.append(f"- {name}: not drawn ({why})")
    return "\n".join(L) + "\n"


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
        "notes": ra.notes, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _clean(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return _clean(float(o))
    if isinstance(o, np.bool_):
        return bool(o)
    return o


def write_run_report(ra: RunAnalysis, out_dir: str | Path, *,
                     figures: Callable[[RunAnalysis, Path], list[Path]] | None = None
                     ) -> list[Path]:
    """report.md + CSV tables + summary.json (+ figures/) into out_dir; returns the files.
    figures: the caller's figure maker, figures(ra, out_dir / "figures") -> the files it
    wrote (figures.cli.analysis_figures from `adamspike analyze`); None: no figures."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    _write_csv(ra.spikes, out / "spikes.csv", written)
    _write_csv(ra.grad_spikes, out / "grad_norm_spikes.csv", written)
    if ra.precursors is not None:
        _write_csv(ra.precursors.leads, out / "precursor_leads.csv", written)
        _write_csv(ra.precursors.summary, out / "lead_summary.csv", written)
        _write_csv(ra.precursors.tensor_leads, out / "tensor_leads.csv", written)
    _write_csv(ra.alarm_scores, out / "alarm_scores.csv", written)
    if ra.update_fit is not None:
        _write_csv(ra.update_fit.by_group, out / "update_rms_fit.csv", written)
    if ra.rms_t is not None and len(ra.rms_t.transients):
        _write_csv(ra.rms_t.transients.drop(columns=["rms_t"]), out / "rms_t_transients.csv",
                   written)
    _write_csv(ra.regimes, out / "regimes.csv", written)
    figs: list[Path] = []
    if figures is not None:
        figs = list(figures(ra, out / "figures"))
        written += figs
    md = render_markdown(ra, figs, out)
    atomic_write_bytes(out / "report.md", md.encode())
    atomic_write_bytes(out / "summary.json",
                       json.dumps(_clean(summary_dict(ra)), indent=2).encode())
    return written + [out / "report.md", out / "summary.json"]


def write_index(analyses: list[RunAnalysis], out_dir: str | Path,
                run_dirs: list[str]) -> Path:
    """OUT/report.md: one line per run and each run's report inlined below."""
    out = Path(out_dir)
    L = ["# Loss-spike analysis", "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by "
         "`adamspike analyze`.", "",
         "| run | backend | steps | spikes | recovered | max height % | update_rms R^2 (log) "
         "| eps scale c (n/i: not identifiable) | max rms_t / bound |",
         "|---|---|---|---|---|---|---|---|---|"]
    for ra, d in zip(analyses, run_dirs):
        s = summary_dict(ra)
        uf, ck = s["update_fit"] or {}, s["rms_t"] or {}
        mh = s["max_height"]
        L.append(f"| [{ra.name}]({d}/report.md) | {s['backend']} | {s['num_steps']} | "
                 f"{s['num_spikes']} | {s['num_recovered']} | "
                 f"{_f(100 * mh) if mh is not None else '-'} | {_f(uf.get('r2_log'))} | "
                 f"{_f(uf.get('eps_scale')) if uf.get('eps_scale_identifiable') else 'n/i'} | "
                 f"{_f(ck['max_rms_t'] / ck['bound']) if ck else '-'} |")
    for ra, d in zip(analyses, run_dirs):
        body = (out / d / "report.md").read_text().replace("](figures/", f"]({d}/figures/")
        L += [""] + [("#" + ln) if ln.startswith("#") else ln for ln in body.splitlines()]
    path = out / "report.md"
    atomic_write_bytes(path, ("\n".join(L) + "\n").encode())
    return path
