"""Numerics health of a run, placed against its spike timeline (pandas; reads the steps
table only).

Signals, each where the run carries it (an imported Megatron-family log: adamspike
.megatron_log's columns; a run directory: its `skipped` column and its losses):
- loss-scale changes (`loss_scale`): a cut (fp16 dynamic loss scaling halves on an
  overflow) or a raise (growth after a clean stretch); a loss scale <= 0 was read as
  not measured before it got here;
- overflowed steps: DeepSpeed `OVERFLOW! ... Skipping step` lines (`overflow_lines`);
- skipped / NaN iterations: Megatron's per-interval counters (`num_skipped_iterations`,
  `num_nan_iterations`), else the `skipped` flag;
- stale grad norms (`grad_norm_stale`): the previous line's value printed again on a step
  with overflow evidence;
- a non-finite loss on a step nobody called skipped, and a line without a loss value.

Each event is placed against the spikes (`spikes`: adamspike.spikes.detect_spikes rows):
during one, NEAR_LINES logged lines before or after one, or away from all. A spike with a
loss-scale cut, an overflow, a skip or a NaN iteration in [start - near, end + near] is
reported as next to an fp16 overflow cascade (a numerics diagnosis: the loss scale, the
fp16 range, a bad batch), one without as not a numerics event by these signals (whether it
is an optimizer spike is analysis.diagnosis's verdict, from the grad norm and the lr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from adamspike.tables import md_table

NEAR_LINES = 3          # logged lines around a spike that count as "next to" it
NUMERICS_KINDS = ("loss_scale_cut", "overflow", "skipped", "nan_iterations", "nan_step")  # cascade evidence
CONSTANT_ONE = ("Loss scale 1.0 on every line: bf16 or fp32, no dynamic loss scaling, so not "
                "an overflow signal.")
EVENT_COLUMNS = ["step", "kind", "detail", "spike_start", "position", "offset"]


@dataclass
class NumericsHealth:
    signals: list[str]                 # which signals the run carries
    events: pd.DataFrame               # EVENT_COLUMNS, by step
    per_spike: pd.DataFrame            # start, end, num_events, kinds, verdict
    loss_scale: dict = field(default_factory=dict)   # first, last, min, cuts, raises
    near_steps: int = 0


def _col(steps: pd.DataFrame, name: str) -> np.ndarray | None:
    return steps[name].to_numpy(float) if name in steps else None


def _flag(steps: pd.DataFrame, name: str) -> np.ndarray | None:
    return steps[name].eq(True).to_numpy() if name in steps else None


def _g(x: float) -> str:
    return f"{x:.0f}" if x == int(x) and abs(x) < 1e15 else f"{x:g}"


def _lines(steps: pd.DataFrame) -> np.ndarray:
    """Per row, ` (log line N)` where the steps table has the log's line numbers."""
    if "line" not in steps:
        return np.array([""] * len(steps), dtype=object)
    return np.array([f" (log line {int(x)})" if x == x else "" for x in
                     steps["line"].to_numpy(float)], dtype=object)


def numerics_events(steps: pd.DataFrame) -> tuple[list[dict], list[str], dict]:
    """(events by step, signals present, loss-scale summary) of a steps table."""
    step = steps["step"].to_numpy()
    ev: list[dict] = []
    signals: list[str] = []
    scale_info: dict = {}
    scale = _col(steps, "loss_scale")
    if scale is not None and np.isfinite(scale).any() and \
            np.all(scale[np.isfinite(scale)] == 1.0):
        # bf16 / fp32: Megatron prints a constant loss scale 1.0, no dynamic scaling at all
        scale_info = {"constant_one": True}
        scale = None
    if scale is not None and np.isfinite(scale).any():
        signals.append("loss scale")
        prev = math.nan
        cuts = raises = 0
        for s, x in zip(step, scale):
            if not math.isfinite(x):
                continue
            if math.isfinite(prev) and x != prev:
                kind = "loss_scale_cut" if x < prev else "loss_scale_raise"
                cuts += x < prev
                raises += x > prev
                ev.append({"step": int(s), "kind": kind,
                           "detail": f"loss scale {_g(prev)} -> {_g(x)} (x{x / prev:.3g})"})
            prev = x
        fin = scale[np.isfinite(scale)]
        imin = int(np.nanargmin(np.where(np.isfinite(scale), scale, np.inf)))
        scale_info = {"first": float(fin[0]), "last": float(fin[-1]), "min": float(fin.min()),
                      "min_step": int(step[imin]), "cuts": int(cuts), "raises": int(raises)}
    over = _col(steps, "overflow_lines")
    if over is not None and np.nansum(over) > 0:
        signals.append("DeepSpeed OVERFLOW lines")
        for s, n in zip(step, over):
            if n > 0:
                ev.append({"step": int(s), "kind": "overflow",
                           "detail": f"{int(n)} DeepSpeed OVERFLOW line(s): step skipped"})
    sk, nn = _col(steps, "num_skipped_iterations"), _col(steps, "num_nan_iterations")
    if sk is not None or nn is not None:
        signals.append("skipped / nan counters")
        for name, vals, kind in (("skipped", sk, "skipped"), ("nan", nn, "nan_iterations")):
            if vals is None:
                continue
            for s, n in zip(step, vals):
                if n > 0:
                    ev.append({"step": int(s), "kind": kind,
                               "detail": f"{int(n)} {name} iteration(s) in the interval"})
    elif "skipped" in steps:
        signals.append("skipped flag")
        for s in step[_flag(steps, "skipped")]:
            ev.append({"step": int(s), "kind": "skipped", "detail": "step skipped"})
    stale = _flag(steps, "grad_norm_stale")
    if stale is not None and stale.any():
        for s in step[stale]:
            ev.append({"step": int(s), "kind": "stale_grad_norm",
                       "detail": "grad norm = the previous line's (not measured)"})
    loss = steps["loss"].to_numpy(float)
    missing = _flag(steps, "loss_missing")
    missing = np.zeros(len(steps), bool) if missing is None else missing
    skipped = _flag(steps, "skipped")
    skipped = np.zeros(len(steps), bool) if skipped is None else skipped
    for s in step[~np.isfinite(loss) & ~missing & ~skipped]:
        ev.append({"step": int(s), "kind": "nonfinite_loss", "detail": "non-finite loss"})
    nan_step = _flag(steps, "nan_step")
    nan_step = np.zeros(len(steps), bool) if nan_step is None else nan_step
    for s, ln in zip(step[nan_step], _lines(steps)[nan_step]):
        ev.append({"step": int(s), "kind": "nan_step",
                   "detail": "NaN step: grad norm nan and no loss printed" + ln})
    for s in step[missing & ~skipped & ~nan_step]:
        ev.append({"step": int(s), "kind": "no_loss", "detail": "no loss value on the line"})
    ev.sort(key=lambda e: e["step"])
    return ev, signals, scale_info


def _span(sp) -> tuple[int, int]:
    end = int(sp.start + sp.duration - 1) if sp.recovered else int(sp.end)
    return int(sp.start), max(end, int(sp.end))


def numerics_health(steps: pd.DataFrame, spikes: pd.DataFrame,
                    log_interval: int = 1) -> NumericsHealth:
    """Events (numerics_events) placed against the spikes; a verdict per spike."""
    ev, signals, scale_info = numerics_events(steps)
    near = NEAR_LINES * max(int(log_interval or 1), 1)
    spans = [_span(sp) for sp in spikes.itertuples(index=False)]
    for e in ev:
        s = e["step"]
        best = None
        for a, b in spans:
            if a <= s <= b:
                best = (0, a, "during", s - a)
                break
            d = a - s if s < a else s - b
            if d <= near and (best is None or d < best[0]):
                best = (d, a, "before" if s < a else "after", s - a if s < a else s - b)
        e.update(spike_start=best[1] if best else None,
                 position=best[2] if best else "away from spikes",
                 offset=best[3] if best else None)
    events = pd.DataFrame(ev, columns=EVENT_COLUMNS)
    rows = []
    for a, b in spans:
        sel = [e for e in ev if a - near <= e["step"] <= b + near]
        kinds = sorted({e["kind"] for e in sel})
        cascade = [e for e in sel if e["kind"] in NUMERICS_KINDS]
        if cascade:
            cuts = [e for e in sel if e["kind"] == "loss_scale_cut"]
            what = []
            if cuts:
                what.append(f"{len(cuts)} loss-scale cut(s): "
                            + "; ".join(e["detail"].replace("loss scale ", "") for e in cuts[:4]))
            for k, label in (("overflow", "overflowed step(s)"),
                             ("skipped", "line(s) with skipped iterations"),
                             ("nan_iterations", "line(s) with NaN iterations")):
                n = sum(e["kind"] == k for e in sel)
                if n:
                    what.append(f"{n} {label}")
            verdict = ("next to fp16 overflow activity (" + ", ".join(what) + "): check it as a "
                       "numerics event (loss scale, fp16 range, a bad batch) before reading it "
                       "as an Adam spike")
        elif {"loss scale", "DeepSpeed OVERFLOW lines", "skipped / nan counters"} & set(signals):
            verdict = (f"no loss-scale cut, overflow, skip or NaN iteration within {near} "
                       "steps: not a numerics event by these signals (the cause: see the "
                       "per-spike diagnosis)")
        else:
            verdict = ("the run prints no loss scale, overflow or skip counters (bf16, or not "
                       "logged): numerics cannot be told apart here")
        rows.append({"start": a, "end": b, "num_events": len(sel), "kinds": ", ".join(kinds),
                     "verdict": verdict})
    per_spike = pd.DataFrame(rows, columns=["start", "end", "num_events", "kinds", "verdict"])
    return NumericsHealth(signals=signals, events=events, per_spike=per_spike,
                          loss_scale=scale_info, near_steps=near)


def health_markdown(h: NumericsHealth, max_rows: int = 30) -> list[str]:
    """The report's '## Numerics health' section."""
    L = ["", "## Numerics health", ""]
    if not h.signals:
        L.append("The run carries no numerics signal (no loss scale, overflow lines, skip "
                 "counters or skipped flag).")
    else:
        L.append("Signals in this run: " + ", ".join(h.signals) + ".")
    ls = h.loss_scale
    if ls.get("constant_one"):
        L += ["", CONSTANT_ONE]
    elif ls:
        L += ["", f"Loss scale {_g(ls['first'])} -> {_g(ls['last'])} (min {_g(ls['min'])} at "
                  f"step {ls['min_step']}): {ls['cuts']} cut(s), {ls['raises']} raise(s)."]
    ev = h.events
    if ev.empty:
        L += ["", "No numerics event (loss-scale change, overflow, skipped or NaN iteration, "
                  "stale grad norm, non-finite or missing loss)."]
    else:
        counts = ev["kind"].value_counts()
        L += ["", "Events: " + ", ".join(f"{k.replace('_', ' ')} x{int(n)}"
                                           for k, n in counts.items()) + ". "
              f"Placed against the spikes (next to one: within {h.near_steps} steps):", "",
              md_table(ev.assign(where=[_where(r) for r in ev.itertuples(index=False)]),
                       ["step", "kind", "detail", "where"],
                       ["step", "what", "detail", "against the spikes"], max_rows=max_rows)]
    if len(h.per_spike):
        L += ["", "Per spike:", ""]
        L += [f"- spike at step {r.start}: {r.verdict}." for r in h.per_spike.itertuples()]
    return L


def _where(r) -> str:
    if r.position == "away from spikes" or r.spike_start is None or \
            (isinstance(r.spike_start, float) and math.isnan(r.spike_start)):
        return "away from spikes"
    s = int(r.spike_start)
    if r.position == "during":
        return f"during the spike at {s} (+{int(r.offset)})"
    return f"{abs(int(r.offset))} step(s) {r.position} the spike at {s}"
