"""Score runs against a pre-registered predictions.json (`adamspike analyze --predictions`).

Per analysed run (telemetry run directory or an imported Megatron log):

  setting    the run's optim.eps / b2 / lr / b1 and train.global_batch_size (from run.json's
             config; for a Megatron log the batch from the log's `global_batch_size` column
             and, when --lr is not given, the largest logged learning rate, the schedule's
             peak) matched against every setting's overrides (relative tolerance 1e-6 on
             the keys the run states). Without an exact match the nearest setting by the sum
             of squared log10 ratios (b2 as 1 - b2) is used, and the row says so.
  observed   spikes per 1000 optimizer steps = 1000 k / n, k = the report's loss-spike
             count (analysis.report.loss_spikes), n = lines with a loss x the log interval
             (a log line stands for that many optimizer steps). Fewer judged lines than the
             spike rule's window: "too few steps", no rate, no p-values.
  verdict    inside / above / below the setting's rate_ci. As a count check, with
             mu = rate n / 1000: p_above = P(K >= k | mu_hi) and p_below = P(K <= k | mu_lo)
             (Poisson), small when the count is out of reach of the interval (a short run
             with k = 0 is "below" a high interval without contradicting it: p_below says so);
             count_consistent = both >= 0.05.

Alarms. The file's alarm rules evaluated offline on every run with per-tensor telemetry
(analysis.alarms.fire_steps), pooled over the runs: precision, lift over the chance rate
and the binomial test (analysis.controls.lift_table, lead >= 1 step), and the lead times
(analysis.alarms.score_alarms, lead >= 1). analysis.controls.mark_uninformative writes
the verdict into a copy of the file, OUT/predictions.scored.json (informative: false where
lift <= 1 or the test fails; such rules are not armed by the trainer), which carries
`scored_from` (path, content hash, integrity) instead of a content hash of its own: it is
not a pre-registration.

Integrity (adamspike.predictions.verify_hash): a file whose content hash does not match
is refused by `adamspike analyze` (an error, exit 2: it was edited after
pre-registration); a file without a hash is scored with a warning ("not pre-registered").
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.predictions import HASH_KEY, Predictions
from adamspike.rundir import atomic_write_bytes, json_clean
from analysis.alarms import fire_steps, score_alarms
from analysis.controls import lift_table, mark_uninformative
from analysis.fits import optim_params
from adamspike.tables import md_table

KEYS = ("optim.eps", "optim.b2", "optim.lr", "optim.b1", "train.global_batch_size")
REL_TOL = 1e-6


def run_setting(ra) -> tuple[dict, list[str]]:
    """(dotted values the run states, notes on where they came from)."""
    cfg = ra.run.config if ra.run is not None else {}
    op = optim_params(cfg)
    vals: dict[str, float] = {}
    notes = []
    for k in ("eps", "b2", "b1", "lr"):
        if op[k] is not None:
            vals[f"optim.{k}"] = float(op[k])
    st = ra.run.steps if ra.run is not None else pd.DataFrame()
    if "optim.lr" not in vals and "lr" in st and np.isfinite(st["lr"].to_numpy(float)).any():
        vals["optim.lr"] = float(np.nanmax(st["lr"].to_numpy(float)))
        notes.append("lr = the largest logged learning rate (schedule peak)")
    bs = (cfg.get("train") or {}).get("global_batch_size")
    if bs is None and "global_batch_size" in st:
        v = pd.to_numeric(st["global_batch_size"], errors="coerce").to_numpy(float)
        if np.isfinite(v).any():
            bs = float(np.nanmedian(v))
            notes.append("global batch from the log")
    if bs is not None:
        vals["train.global_batch_size"] = float(bs)
    return vals, notes


SOURCE_KEYS = ("optim.lr", "optim.b1", "optim.b2", "optim.eps", "optim.grad_clip",
               "train.global_batch_size", "train.seq_len")


def setting_sources(ra) -> dict[str, tuple[float, str]]:
    """{dotted key: (value, where it came from)} of what the run states: a flag or the
    log's argument dump (the import's `setting_sources`: "flag --eps", "log line 57:
    adam_eps"), the logged lines (lr: their largest value; the batch: the lines'
    `global batch size`), or run.json's config (a run directory). A key that nothing
    states is absent: the caller says what it assumes instead."""
    cfg = ra.run.config if ra.run is not None else {}
    imp = ra.meta.get("import") or {}
    given = imp.get("setting_sources") or {}
    st = ra.run.steps if ra.run is not None else pd.DataFrame()
    out: dict[str, tuple[float, str]] = {}
    for key in SOURCE_KEYS:
        sec, name = key.split(".")
        v = (cfg.get(sec) or {}).get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = (float(v), given.get(key) or ("run.json config" if not imp else
                                                     "run.json config of the import"))
    if "optim.lr" not in out and "lr" in st and np.isfinite(st["lr"].to_numpy(float)).any():
        lr = st["lr"].to_numpy(float)
        i = int(np.nanargmax(lr))
        ln = st["line"].iloc[i] if "line" in st else None
        out["optim.lr"] = (float(lr[i]), "the largest logged learning rate (the schedule's "
                           f"peak at most), iteration {int(st['step'].iloc[i])}"
                           + (f", log line {int(ln)}" if ln is not None and ln == ln else ""))
    if "train.global_batch_size" not in out and "global_batch_size" in st:
        v = pd.to_numeric(st["global_batch_size"], errors="coerce").to_numpy(float)
        if np.isfinite(v).any():
            lo, hi = np.nanmin(v), np.nanmax(v)
            out["train.global_batch_size"] = (float(np.nanmedian(v)), "the log's `global batch "
                                              "size` field" + (f" (median; {lo:g} to {hi:g}: "
                                                               "a ramp-up)" if lo != hi else ""))
    return out


def _dist(a: float, b: float, key: str) -> float:
    if key == "optim.b2" or key == "optim.b1":
        a, b = 1 - a, 1 - b
    if a <= 0 or b <= 0:
        return 0.0 if a == b else 1e6
    return math.log10(a / b) ** 2


def match_setting(settings: Sequence[Mapping[str, Any]], vals: Mapping[str, float]
                  ) -> tuple[Mapping[str, Any] | None, str]:
    """(setting, note): the exact match on the run's stated keys, else the nearest."""
    if not settings:
        return None, "the predictions file has no settings"
    keys = [k for k in KEYS if k in vals]
    if not keys:
        return None, "the run states none of " + ", ".join(KEYS)
    best, best_d = None, math.inf
    for s in settings:
        ov = s["overrides"]
        shared = [k for k in keys if k in ov]
        if shared and all(abs(float(ov[k]) - vals[k]) <= REL_TOL * max(abs(vals[k]), 1e-300)
                          for k in shared):
            missing = [k for k in KEYS if k not in vals]
            return s, ("exact match" + (f" (the run does not state {', '.join(missing)})"
                                        if missing else ""))
        d = sum(_dist(float(ov[k]), vals[k], k) for k in shared) if shared else math.inf
        if d < best_d:
            best, best_d = s, d
    if best is None:
        return None, "no setting shares a key with the run"
    diff = [f"{k} {best['overrides'][k]:g} (run {vals[k]:g})" for k in keys
            if k in best["overrides"] and abs(float(best["overrides"][k]) - vals[k])
            > REL_TOL * max(abs(vals[k]), 1e-300)]
    return best, "no setting matches the run's config; nearest: differs in " + ", ".join(diff)


def score_rate(ra, pred: Predictions) -> dict:
    vals, notes = run_setting(ra)
    s, how = match_setting(pred.settings, vals)
    st = ra.run.steps if ra.run is not None else pd.DataFrame()
    lines = int(np.isfinite(st["loss"].to_numpy(float)).sum()) if "loss" in st else ra.num_steps
    # a log line stands for `log_interval` optimizer steps: rates are per optimizer step
    interval = max(int((ra.meta.get("import") or {}).get("log_interval") or 1), 1)
    n = lines * interval
    k = int(len(ra.spikes))
    judged = int((getattr(ra, "coverage", {}).get("loss") or {}).get("num_judged", lines))
    need = int(getattr(ra.spike_params, "window", 0) or 0)
    too_few = judged < need
    rate = 1000.0 * k / n if n and not too_few else math.nan
    row = {"run": ra.name, "backend": ra.meta.get("backend", ""), "num_steps": n,
           "num_lines": lines, "log_interval": interval, "num_judged": judged,
           "num_spikes": k, "observed_rate_per_1k": rate, "match": how,
           "run_values": vals, "value_notes": notes, "too_few_steps": too_few}
    if s is None or "rate_ci" not in s:
        row.update(setting=None, verdict="not scored: " + (how if s is None else
                                                          "the setting has no rate_ci"))
        return row
    if too_few:
        row.update(setting=s["id"], predicted_rate_per_1k=float(s["rate_per_1k"]),
                   rate_lo=float(s["rate_ci"][0]), rate_hi=float(s["rate_ci"][1]),
                   verdict=f"too few steps ({judged} judged line(s), the rule's window is "
                           f"{need}): not scored", extrapolated=bool(s.get("extrapolated", False)),
                   p_above=math.nan, p_below=math.nan, count_consistent=None)
        return row
    lo, hi = (float(x) for x in s["rate_ci"])
    verdict = "inside" if lo <= rate <= hi else "above" if rate > hi else "below"
    mu_lo, mu_hi = lo * n / 1000.0, hi * n / 1000.0
    row.update(setting=s["id"], predicted_rate_per_1k=float(s["rate_per_1k"]), rate_lo=lo,
               rate_hi=hi, verdict=verdict,
               p_above=float(stats.poisson.sf(k - 1, mu_hi)) if k > 0 else 1.0,
               p_below=float(stats.poisson.cdf(k, mu_lo)),
               extrapolated=bool(s.get("extrapolated", False)))
    row["count_consistent"] = bool(row["p_above"] >= 0.05 and row["p_below"] >= 0.05)
    return row


def score_alarms_over(analyses: Sequence[Any], pred: Predictions) -> tuple[pd.DataFrame, str]:
    """Pooled lift (lead >= 1) and lead times per rule over the runs with telemetry."""
    rules = pred.alarm_rules
    if not rules:
        return pd.DataFrame(), "the predictions file has no alarm rules"
    items, lead_rows, used = [], [], []
    for ra in analyses:
        lay = ra.run.layers if ra.run is not None else pd.DataFrame()
        if lay is None or lay.empty:
            continue
        alarms = fire_steps(rules, lay)
        logged = np.unique(lay["step"].to_numpy(np.int64))
        items.append((alarms, ra.spikes, logged))
        sc = score_alarms(alarms, ra.spikes, rules, min_lead=1)
        lead_rows.append(sc[sc["rule"] != "any"])
        used.append(ra.name)
    if not items:
        return pd.DataFrame(), ("no run has per-tensor telemetry (a Megatron log has none): "
                                "the alarm rules cannot be evaluated")
    lt = lift_table(items, rules, min_lead=1)
    leads = pd.concat(lead_rows, ignore_index=True)
    agg = leads.groupby("rule").agg(num_spikes=("num_spikes", "sum"),
                                    num_detected=("num_detected", "sum"),
                                    lead_min=("lead_min", "min"), lead_max=("lead_max", "max"),
                                    lead_median=("lead_median", "median")).reset_index()
    out = lt.merge(agg, on="rule", how="left")
    return out, f"rules evaluated offline on the layers of {', '.join(used)}"


def scored_copy(pred_data: Mapping[str, Any], lift: pd.DataFrame, path: str | Path,
                integrity: Mapping[str, Any]) -> dict:
    """mark_uninformative on the file's object; the copy is not a pre-registration."""
    out = mark_uninformative(pred_data, lift) if len(lift) else dict(pred_data)
    out = {k: v for k, v in out.items() if k != HASH_KEY}
    out["scored_from"] = {"path": str(path), HASH_KEY: pred_data.get(HASH_KEY),
                          "integrity": integrity.get("status")}
    return out


def _f(x, d=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{d}g}" if isinstance(x, float) else str(x)


def section(rates: list[dict], lift: pd.DataFrame, alarm_source: str, pred: Predictions,
            path: str | Path) -> str:
    integ = pred.integrity or {}
    status = integ.get("status", "missing")
    L = ["## Scores against the predictions", "",
         f"Predictions: `{path}`, created {pred.created or '?'}; content hash "
         + ({"ok": f"verified ({integ.get('stored', '')[:16]}...)",
             "missing": "**absent: the file is not pre-registered**",
             "mismatch": "**does not match**"}[status]) + ".", "",
         "Observed spike rate (the report's loss-spike rule) per 1000 optimizer steps (a log "
         "line counts as its log interval of steps; no rate below the rule's window of judged "
         "lines: 'too few steps') against the matched setting's interval; p_above = P(K >= k | upper rate), p_below = P(K <= k | lower rate); the "
         "count is consistent with the interval when both are >= 0.05 (a short run can be "
         "'below' without contradicting it).", ""]
    rows = [{"run": r["run"], "steps": r["num_steps"], "spikes": r["num_spikes"],
             "observed /1k": r["observed_rate_per_1k"], "setting": r.get("setting") or "-",
             "predicted /1k": r.get("predicted_rate_per_1k"),
             "interval": (f"[{_f(r['rate_lo'])}, {_f(r['rate_hi'])}]" if "rate_lo" in r else "-"),
             "verdict": r["verdict"], "p_above": r.get("p_above"), "p_below": r.get("p_below"),
             "count consistent": r.get("count_consistent", "-"),
             "match": r["match"] + ("; " + "; ".join(r["value_notes"]) if r["value_notes"] else "")}
            for r in rates]
    L += [md_table(pd.DataFrame(rows)), ""]
    L += ["### Alarm precision, lift and lead (lead >= 1 step)", ""]
    if lift.empty:
        L += [alarm_source + ".", ""]
    else:
        L += [f"Source: {alarm_source}. Chance rate = fraction of logged steps within "
              "[s - H, s - 1] of a spike start s; lift = precision / chance; rules with lift "
              "<= 1 (or a binomial p >= 0.05) are marked uninformative in "
              "predictions.scored.json.", "",
              md_table(lift, ["rule", "horizon", "num_alarms", "num_true_alarms", "precision",
                              "chance_rate", "lift", "p", "informative", "num_spikes",
                              "num_detected", "lead_min", "lead_median", "lead_max", "reason"]),
              ""]
        bad = lift.loc[~lift["informative"].astype(bool), "rule"].tolist()
        if bad:
            L += [f"Uninformative: {', '.join(bad)}.", ""]
    return "\n".join(L)


def score(analyses: Sequence[Any], pred: Predictions, pred_data: Mapping[str, Any],
          path: str | Path, out: str | Path) -> str:
    """Score every run, write OUT/prediction_scores.{md,json} and OUT/predictions.scored.json;
    returns the Markdown section."""
    out = Path(out)
    rates = [score_rate(ra, pred) for ra in analyses]
    lift, src = score_alarms_over(analyses, pred)
    md = section(rates, lift, src, pred, path)
    atomic_write_bytes(out / "prediction_scores.md", (md + "\n").encode())
    blob = {"predictions": str(path), "integrity": pred.integrity, "rates": rates,
            "alarms": lift.to_dict("records") if len(lift) else [], "alarm_source": src}
    atomic_write_bytes(out / "prediction_scores.json",
                       json.dumps(json_clean(blob), indent=1, allow_nan=False).encode())
    atomic_write_bytes(out / "predictions.scored.json",
                       json.dumps(json_clean(scored_copy(pred_data, lift, path, pred.integrity)),
                                  indent=2, allow_nan=False).encode())
    return md
