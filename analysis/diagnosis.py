"""What a log's lines say about each loss spike (pandas; reads the analysis of
analysis.report only), as facts for the one spike-cause rule (analysis.attribution.decide,
which also weighs a run's per-group telemetry where it has a layers table). `diagnose(ra)`
is the one verdict per spike: analysis.attribution.attribute_run with these facts.

Facts per spike, each with the lines that show it:
  numerics         a loss-scale cut, an overflowed / skipped / NaN iteration or a NaN step
                   (`grad norm: nan`, no loss printed) within NEAR_LINES logged lines of the
                   spike (analysis.numerics), or a non-finite loss in it;
  data or loading  the learning rate at the onset is too small to move a trained model
                   (below LR_TOO_SMALL absolute, or below LR_TOO_SMALL_FRAC of the run's
                   largest logged lr): the optimizer step cannot explain the jump, so a
                   checkpoint, a batch, a loading or a dtype fault must; or the onset comes
                   within NEAR_LINES logged lines after a resume (a checkpoint load the log
                   prints, or a repeated iteration: a restarted job appending to the log);
  grad note        what the grad norm shows: its lead (it left its band at most LEAD_LINES
                   logged lines before the onset), no measured value, too few lines.
Nothing is claimed from a series the run does not have: the grad-norm note says how many
measured values precede the onset, and "no grad-norm spike before it" only where at least
one was measured. A grad-norm lead alone is an optimizer spike's signature, but which
mechanism (A: stability, B: dormant shallow groups) needs the per-group telemetry, so a log
without it gets "unknown" with that note, not a guess.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.attribution import attribute_run
from analysis.numerics import NEAR_LINES, NUMERICS_KINDS

LR_TOO_SMALL = 1e-7          # absolute: Adam moves each coordinate by ~lr per step
LR_TOO_SMALL_FRAC = 1e-3     # relative to the largest learning rate the run logged
LEAD_LINES = 10              # logged lines before a loss spike in which a grad-norm spike
                             # leads it (analysis.report.grad_norm_leads)


def _line_of(steps: pd.DataFrame) -> dict[int, int]:
    if "line" not in steps:
        return {}
    ln = steps["line"].to_numpy(float)
    return {int(s): int(x) for s, x in zip(steps["step"].to_numpy(), ln) if x == x}


def _at(step: int, lines: dict[int, int]) -> str:
    return f"iteration {step}" + (f" (log line {lines[step]})" if step in lines else "")


def diagnose(ra) -> pd.DataFrame:
    """One row per loss spike of `ra` (analysis.report.RunAnalysis; analysis.attribution
    COLUMNS): its verdict and evidence from analysis.attribution.decide, given the
    telemetry the run has and what its lines say (spike_log_evidence)."""
    return attribute_run(ra, spike_log_evidence(ra))


def spike_log_evidence(ra) -> dict[int, dict]:
    """onset -> {"numerics": [...], "data": [...], "grad_note": str, "grad_lead": int |
    None, "unknown": [...]}: what the lines show about each spike (module doc)."""
    st = ra.run.steps if ra.run is not None else pd.DataFrame()
    sp = ra.spikes
    if sp is None or not len(sp) or st.empty:
        return {}
    imp = ra.meta.get("import") or {}
    interval = max(int(imp.get("log_interval") or 1), 1)
    near = NEAR_LINES * interval
    lines = _line_of(st)
    step = st["step"].to_numpy()
    lr = st["lr"].to_numpy(float) if "lr" in st else np.full(len(st), np.nan)
    lr_max = float(np.nanmax(lr)) if np.isfinite(lr).any() else math.nan
    gn = st["grad_norm"].to_numpy(float) if "grad_norm" in st else np.full(len(st), np.nan)
    ev = ra.numerics.events if ra.numerics is not None else pd.DataFrame()
    leads = {int(r.start): r for r in ra.grad_lead.itertuples()} \
        if ra.grad_lead is not None and len(ra.grad_lead) else {}
    resumes = [(int(r["iteration"]), int(r["line"])) for r in imp.get("resumes") or []]
    restarts = [int(s) for s in imp.get("duplicate_steps") or []]
    out: dict[int, dict] = {}
    for r in sp.itertuples():
        a = int(r.start)
        end = int(r.end)
        i0 = int(np.searchsorted(step, a))
        before = slice(max(0, i0 - LEAD_LINES), i0)
        measured_before = int(np.isfinite(gn[before]).sum())
        lines_before = i0
        numerics: list[str] = []
        data: list[str] = []
        # numerics
        near_ev = ev[(ev["step"] >= a - near) & (ev["step"] <= end + near)
                     & ev["kind"].isin(NUMERICS_KINDS)] if len(ev) else ev
        numerics += [f"{e.detail} at {_at(int(e.step), lines)}"
                     for e in near_ev.head(4).itertuples()]
        if bool(getattr(r, "nonfinite", False)):
            numerics.append(f"non-finite loss in the spike ({_at(a, lines)})")
        # data or loading: a step too small, or a resume just before
        lr_a = lr[i0] if i0 < len(lr) else math.nan
        if math.isfinite(lr_a) and (
                lr_a < LR_TOO_SMALL or (math.isfinite(lr_max) and lr_a < LR_TOO_SMALL_FRAC * lr_max)):
            data.append(f"learning rate {lr_a:.3g} at {_at(a, lines)} ({lr_a / lr_max:.2g} of "
                        f"the run's largest, {lr_max:.3g}): a step that small cannot move a "
                        "trained model this far; look for a checkpoint, batch, loading or "
                        "dtype fault")
        rs = [(it, ln) for it, ln in resumes if a - near <= it <= a]
        rr = [s for s in restarts if a - near <= s <= a]
        if rs or rr:
            data += [f"checkpoint loaded at iteration {it} (log line {ln}), "
                     f"{a - it} iteration(s) before the onset" for it, ln in rs[:2]]
            data += [f"iteration {s} repeated (a restarted job appending to the log), "
                     f"{a - s} iteration(s) before the onset" for s in rr[:2]]
            data.append("a jump right after a resume points to the checkpoint or the "
                        "data position, not to the optimizer")
        # the grad norm, where it was measured
        lead = leads.get(a)
        if "grad_norm" not in st or not np.isfinite(gn).any():
            gnote = "the log has no measured grad norm: the lead cannot be judged"
        elif measured_before == 0:
            gnote = (f"no measured grad norm in the {min(LEAD_LINES, lines_before)} logged "
                     "line(s) before it: the lead cannot be judged")
        elif lead is not None and lead.lead == lead.lead:
            g = int(lead.grad_start)
            gnote = (f"grad norm left its band at {_at(g, lines)}, {int(lead.lead)} iteration(s) "
                     "before" if lead.lead > 0 else
                     f"grad norm left its band at the same line ({_at(g, lines)})")
        else:
            gnote = (f"no grad-norm spike in the {measured_before} measured line(s) before it"
                     + (f" (only {lines_before} logged line(s) precede it)"
                        if lines_before < LEAD_LINES else ""))
        why = []
        if not (ra.numerics is not None and ra.numerics.signals):
            why.append("no numerics signal in the log (loss scale, overflow, counters)")
        else:
            why.append(f"no numerics event within {near} iteration(s)")
        out[a] = {"numerics": numerics, "data": data, "grad_note": gnote,
                  "grad_lead": (int(lead.lead) if lead is not None and lead.lead == lead.lead
                                else None), "unknown": why}
    return out
