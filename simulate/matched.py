"""Report on the rho-matched toy runs (configs/matched_70b*.toml) against the 70B profile.

    adamspike simulate matched --runs RUN... --predictions predictions_70b.json --out DIR

Reads run directories (steps, layers, curvature tables) and the 70B profile of
predictions_70b.json (`profile.by_depth`, at `profile.eps_ref`), writes DIR/report.md (the
STUDY.md section) and DIR/trajectories.csv (per run, logged step and depth group: rho,
eps_frac, dormant). Definitions, per depth group g (adamspike.depth_groups) and logged step:

    rho_g       adamspike.depth_groups.group_rho: sqrt(sum_t numel_t rho_t^2 / sum_t numel_t),
                rho_t = grad_rms_t / eps_t: the group's RMS of the gradient Adam consumed
                (after the clip) over its eps (each tensor's own eps, so per-group eps,
                mitigation.eps_*, is accounted for)
    eps_frac_g  numel-weighted mean of eps_frac (fraction of coordinates with
                sqrt(v_hat) < eps: their update r = m_hat / (sqrt(v_hat) + eps) is
                eps-dominated)
    dormant     eps_frac_g > 1/2 (most of the group's coordinates update in the eps band)
    wake-up     a logged step where a group stops being dormant after >= DORMANT_MIN logged
                steps in a row dormant
    70B target  the profile's rho of the group at eps_ref, and times eps_ref / 1e-8 for the
                eps 1e-8 twin (rms(g) held fixed)

Spikes: adamspike.spikes.detect_spikes on the loss (window 50, k = 6 MAD) with a >= 10 % and
a >= 20 % jump; a wake-up "precedes" a spike when it lies in the LEAD_WINDOW steps before the
spike's start. Curvature (when the run has the table): the largest ratio
precond_curvature / (2 / lr) over the run per group, and how many evaluations exceed 1
(Bai et al.'s threshold).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from adamspike.config import cli_main
from adamspike.depth_groups import GROUPS, depth_group, group_rho
from adamspike.rundir import (OutputPathError, RunFormatError, atomic_write_bytes, check_out,
                              claim_out, load_run)
from adamspike.spikes import detect_spikes
from adamspike.tables import md_table

DORMANT_MIN = 5
LEAD_WINDOW = 100
PHASES = (0, 250, 1000, 2000, 3000, 4000, 5000)


def trajectories(run) -> pd.DataFrame:
    """Per logged step and group: rho, eps_frac, dormant (module docstring)."""
    L = int(run.config.get("model", {}).get("num_layers") or run.layers["depth"].max())
    lay = run.layers
    df = pd.DataFrame({"step": lay["step"].to_numpy(), "numel": lay["numel"].to_numpy(float),
                       "rho": lay["rho"].to_numpy(float),
                       "eps_frac": lay["eps_frac"].to_numpy(float),
                       "group": [depth_group(int(d), L) for d in lay["depth"]]})
    df["efn"] = df["eps_frac"] * df["numel"]
    g = df.groupby(["step", "group"], as_index=False)[["efn", "numel"]].sum()
    g["rho"] = [float(group_rho(p["rho"], p["numel"]))
                for _, p in df.groupby(["step", "group"], sort=True)]
    g["eps_frac"] = g["efn"] / g["numel"]
    g["dormant"] = g["eps_frac"] > 0.5
    return g[["step", "group", "rho", "eps_frac", "dormant"]]


def wakeups(traj: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for grp, t in traj.sort_values("step").groupby("group"):
        run_len = 0
        for step, dormant in zip(t["step"], t["dormant"]):
            if dormant:
                run_len += 1
            else:
                if run_len >= DORMANT_MIN:
                    rows.append({"group": grp, "step": int(step), "dormant_logged_steps": run_len})
                run_len = 0
    return pd.DataFrame(rows, columns=["group", "step", "dormant_logged_steps"])


def _entropy_rate(events: pd.DataFrame) -> float:
    """The loss floor the trainer's "start" event records (nan when absent)."""
    if "entropy_rate" not in events:
        return math.nan
    vals = events["entropy_rate"].dropna()
    return float(vals.iloc[0]) if len(vals) else math.nan


def summarize(path: Path, profile: dict) -> dict:
    run = load_run(path, tables=("steps", "layers", "curvature"),
                   layer_columns=["rho", "eps_frac"])
    cfg = run.config
    eps = float(cfg["optim"]["eps"])
    groups_eps = {g: (cfg.get("mitigation") or {}).get(f"eps_{g}") for g in GROUPS}
    steps = run.steps
    loss = steps["loss"].to_numpy(float)
    spikes = {j: detect_spikes(loss, steps["step"].to_numpy(), min_rel_jump=j)
              for j in (0.1, 0.2)}
    traj = trajectories(run)
    wake = wakeups(traj)
    out = {"name": path.name, "eps": eps, "b2": float(cfg["optim"]["b2"]),
           "eps_label": _eps_label(eps, groups_eps),
           "dtype": (cfg.get("train") or {}).get("dtype", "fp32"),
           "num_steps": int(steps["step"].max()), "final_loss": float(loss[-1]),
           "min_loss": float(np.nanmin(loss)), "clipped_frac": float(steps["clipped"].mean()),
           "median_grad_norm": float(steps["grad_norm"].median()),
           "entropy_rate": _entropy_rate(run.events),
           "spikes": {str(j): s[["start", "peak", "baseline", "height"]].to_dict("records")
                      for j, s in spikes.items()},
           "traj": traj, "wake": wake}
    lead = []
    for s in spikes[0.1]["start"]:
        w = wake[(wake["step"] <= s) & (wake["step"] >= s - LEAD_WINDOW)]
        lead.append({"spike_start": int(s), "wakeups_before": w.to_dict("records")})
    out["lead"] = lead
    cur = run.curvature
    if cur is not None and len(cur):
        cur = cur.assign(ratio=cur["precond_curvature"] * cur["lr"] / 2.0)
        out["curvature"] = {str(g): {"max_ratio": float(c["ratio"].max()),
                                     "n_above": int((c["ratio"] > 1).sum()), "n": int(len(c)),
                                     "median_raw": float(c["raw_curvature"].median())}
                            for g, c in cur.groupby("group", observed=True)}
    return out


def _eps_label(eps: float, groups_eps: dict) -> str:
    """The global eps, or each group's (mitigation.eps_*; the head falls back to eps_deep)."""
    if all(v is None for v in groups_eps.values()):
        return f"{eps:.3g}"
    head = groups_eps.get("head")
    head = groups_eps.get("deep") if head is None else head
    by = {**groups_eps, "head": head}
    return " / ".join(f"{g} {eps if by[g] is None else by[g]:.3g}" for g in GROUPS)


def _target(profile: dict, eps_run: float, eps_ref_70b: float) -> dict[str, float]:
    rows = profile.get("by_depth") or []
    by_group: dict[str, float] = {}
    for r in rows:
        by_group.setdefault(r["group"], r["rho"])
    return {g: v * profile["eps_ref"] / eps_ref_70b for g, v in by_group.items()}


def report(summaries: list[dict], profile: dict) -> str:
    lines = [f"The 70B profile: {profile.get('source', '?')}.", "",
             "Runs (configs/matched_70b*.toml: one global eps, or per-group eps in the "
             "*groupeps* configs; rho of a group uses each tensor's own eps). The 70B target of "
             "a run is the profile's rho at the 70B eps the run stands for (1e-5 for the "
             "matched eps, 1e-8 for its twin at eps / 1000).", ""]
    spikes10 = [", ".join(f"{int(r['start'])} (+{100 * r['height']:.0f} %)" for r in s["spikes"]["0.1"])
                or "none" for s in summaries]
    lines.append(md_table(
        ([s["name"], s["eps_label"], f"{s['b2']:g}", s["dtype"], str(s["num_steps"]),
          f"{s['final_loss']:.3f} ({s['entropy_rate']:.3f})", f"{100 * s['clipped_frac']:.0f} %",
          f"{s['median_grad_norm']:.3g}", f"{len(s['spikes']['0.1'])}: {sp}", str(len(s["spikes"]["0.2"]))]
         for s, sp in zip(summaries, spikes10)),
        headers=["run", "eps", "b2", "compute", "steps", "final loss (floor)", "clipped",
                 "median grad norm", "spikes >= 10 %", "spikes >= 20 %"], max_rows=None))
    lines += ["", "Answers, from the numbers below:"]
    for s in summaries:
        t = s["traj"]
        dorm = {g: float(t.loc[t["group"] == g, "dormant"].mean()) for g in GROUPS
                if (t["group"] == g).any()}
        n10, n20 = len(s["spikes"]["0.1"]), len(s["spikes"]["0.2"])
        led = sum(bool(x["wakeups_before"]) for x in s["lead"])
        lines.append(
            f"- {s['name']} (eps {s['eps_label']}, b2 {s['b2']:g}, {s['num_steps']} steps): "
            f"{n10} loss spike(s) >= 10 % ({n20} >= 20 %); dormant (eps_frac > 1/2) on "
            + ", ".join(f"{g} {100 * v:.0f} %" for g, v in dorm.items())
            + f" of the logged steps; {len(s['wake'])} wake-up(s)"
            + (f"; {led} of {n10} spikes had a wake-up in the {LEAD_WINDOW} steps before"
               if n10 else "")
            + f"; final loss {s['final_loss']:.3f} against the floor {s['entropy_rate']:.3f}.")
    for s in summaries:
        eps70 = 1e-8 if "1e-8" in s["name"] or "1e8" in s["name"] else profile["eps_ref"]
        tgt = _target(profile, s["eps"], eps70)
        t = s["traj"]
        phases = [(a, b) for a, b in zip(PHASES[:-1], PHASES[1:]) if a < s["num_steps"]]
        rows = []
        for g in GROUPS:
            tg = t[t["group"] == g]
            if tg.empty:
                continue
            ws = [tg[(tg["step"] > a) & (tg["step"] <= b)] for a, b in phases]
            rows.append([g, f"{tgt.get(g, math.nan):.3g}",
                         *(f"{w['rho'].median():.3g}" if len(w) else "-" for w in ws),
                         f"{tg['eps_frac'].median():.2f}", f"{int(tg['dormant'].sum())} of {len(tg)}",
                         str(int((s["wake"]["group"] == g).sum()))])
        lines += ["", f"### {s['name']}: rho per group over training (median in each phase; "
                  f"70B target at eps {eps70:g}), eps_frac, dormant fraction", "",
                  md_table(rows, headers=["group", "70B target", *(f"{a}-{b}" for a, b in phases),
                                          "eps_frac (median)", "dormant logged steps", "wake-ups"],
                           max_rows=None)]
        if s["lead"]:
            txt = "; ".join(f"spike at {x['spike_start']}: " + (", ".join(
                f"{w['group']} woke at {w['step']}" for w in x["wakeups_before"]) or
                f"no wake-up in the {LEAD_WINDOW} steps before") for x in s["lead"])
            lines += ["", f"Wake-ups before spikes (>= 10 % rule): {txt}."]
        if "curvature" in s:
            lines += ["", "Preconditioned curvature / (2/lr), per group: " + "; ".join(
                f"{g} max {c['max_ratio']:.3g} ({c['n_above']} of {c['n']} evaluations > 1)"
                for g, c in s["curvature"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike simulate matched", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, type=Path)
    ap.add_argument("--predictions", required=True, type=Path, help="predictions_70b.json")
    ap.add_argument("--out", required=True, type=Path)
    return cli_main(ap, argv, _main, "adamspike simulate matched: error",
                    (OSError, json.JSONDecodeError, KeyError, RunFormatError, OutputPathError))


def _main(args) -> int:
    claim_out(check_out(args.out, owner="matched"), "matched")   # new, empty or its own
    profile = json.loads(args.predictions.read_text())["profile"]
    sums = [summarize(r, profile) for r in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    traj = pd.concat([s["traj"].assign(run=s["name"]) for s in sums], ignore_index=True)
    atomic_write_bytes(args.out / "trajectories.csv", traj.to_csv(index=False).encode())
    atomic_write_bytes(args.out / "report.md", report(sums, profile).encode())
    print(args.out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
