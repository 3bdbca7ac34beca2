"""`adamspike spike-rate`: fit and validate the spike-rate GLM (adamspike.spike_rate) on
sweep tables and run directories.

    adamspike spike-rate [--sweep TABLE_OR_DIR ...] [--runs RUN ...] [--matched DIR ...]
                         [--map DIR ...] [--table TABLE.csv ...] --out DIR [--n-boot 200]

Training table (DIR/table.csv, one row per run, adamspike.spike_rate.TABLE_COLUMNS):
  - sweep tables (simulate.sweep; the quadratic / mlp / llama sweeps, replication cells):
    adamspike.spike_rate.sweep_rows, runs whose mitigation keys are at their neutral values
    (adamspike.mitigations.neutral_mask) only (adamspike.spike_rate.training_table, which
    `adamspike predict` uses to fit without --rate-model);
  - run directories (either backend): spikes by the report's loss rule
    (adamspike.spikes.loss_spikes), num_steps = steps with a loss; the shallow / deep side's
    rho = median over logged steps of the side's group rho (adamspike.depth_groups.
    group_rho over the side's tensors, numel-weighted rms; sides by adamspike.depth_groups.
    is_shallow, L by adamspike.depth_groups.infer_num_layers); tokens per step = the median
    step difference of the `tokens` column; b2, lr, eps, width (and tokens per step without
    a `tokens` column) from the config by adamspike.spike_rate.config_features, the row
    builder of every row type. A run without per-tensor telemetry has no rho and is left
    out of the fit (listed in the report);
  - matched-regime replications (`adamspike replicate matched`): one row per arm and seed
    (`matched_rows`), the regime the 70B predictions are about;
  - phase maps (`adamspike phase-map`): one row per lane and phase (warmup / after) with
    the mechanism features (`map_rows`): the model predictions_70b.json uses;
  - training tables an earlier `spike-rate` wrote (its table.csv: TABLE_COLUMNS, floats
    read back exactly, `table_rows`): the rows as they were, so a model refits from
    its shipped table without the maps' cells (the same rows give the same model).
Every row type has the same rho: the median over steps of the per-step group rho of the
side (adamspike.depth_groups.group_rho, sqrt(sum numel rho^2 / sum numel)); sweep tables
carry it as `median_rho` (simulate.sweep_problems: the shallow side's group_rho per step),
matched arms as rho_<group> per step (simulate.seeds.run_arm: sqrt(sumsq / numel) / eps
per group, the same statistic), combined into a side by group_rho with the groups' numel.
Then: held-out validation (adamspike.spike_rate.validate: the largest width, else the
last seed), and the final fit on every run. Writes DIR/model.json (the final model, with
the validation scores in it), DIR/calibration.csv, DIR/heldout.csv, DIR/table.csv and
DIR/report.md. An existing DIR/model.json is not overwritten (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from adamspike import spike_rate as SR
from adamspike.config import ConfigError, cli_main, flatten
from adamspike.depth_groups import GROUPS, depth_group, group_rho, infer_num_layers, is_shallow
from adamspike.llama import spec_by_name
from adamspike.cells import CellStore, CorruptCell
from adamspike.rundir import RunFormatError, atomic_write_bytes, json_clean, load_run
from adamspike.spikes import loss_spikes
from adamspike.tables import md_table
from adamspike.train_config import RunConfig


def _cell(root: Path, ref: dict | None) -> pd.DataFrame:
    """A phase-map cell's or claims arm's table from the study's cell store (`ref`: its
    {kind, key}), verified against its content hash."""
    try:
        return CellStore(root).read(ref["kind"], ref["key"])["rows"]
    except (KeyError, TypeError):
        raise SR.SpikeRateError(f"{root.parent}: names no cell (written before the one cell "
                                "store; rerun the stage that wrote it)") from None
    except CorruptCell as e:
        raise SR.SpikeRateError(str(e)) from None


def _median_over_steps(per_step) -> float:
    """Median over steps of a per-step group rho (steps where it is NaN left out)."""
    v = np.asarray(per_step, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else math.nan


def _side_rho(lay: pd.DataFrame) -> float:
    """Median over logged steps of group_rho over the rows' tensors (layers table rows with
    step, name, numel, rho; a tensor without rho at a step is left out of that step)."""
    if lay.empty:
        return math.nan
    r = lay.groupby(["step", "name"])["rho"].first().unstack("name")
    numel = lay.groupby("name")["numel"].first().reindex(r.columns).to_numpy(float)
    return _median_over_steps(group_rho(r.to_numpy(float), numel))


def group_numel(config: dict) -> dict[str, float]:
    """Parameters per depth group (adamspike.depth_groups) of a tiny-LLaMA arm's flat
    RunConfig (as simulate.seeds.group_layout counts them)."""
    llama = RunConfig.from_dict(dict(config)).model.llama()
    out = {g: 0.0 for g in GROUPS}
    for s in spec_by_name(llama).values():
        out[depth_group(s.depth, llama.num_layers)] += float(s.numel)
    return out


def run_row(path: str | Path) -> dict:
    """One training row (TABLE_COLUMNS) from a run directory (module docstring)."""
    path = Path(path)
    run = load_run(path, tables=("steps", "layers"), layer_columns=["rho"])
    st = run.steps
    if st.empty or "loss" not in st:
        raise SR.SpikeRateError(f"{path}: no steps with a loss")
    spikes, _ = loss_spikes(st, config=run.config)
    n = int(np.isfinite(st["loss"].to_numpy(float)).sum())
    rho_sh = rho_dp = math.nan
    lay = run.layers
    if not lay.empty and "rho" in lay:
        sh = np.asarray(is_shallow(lay["depth"].to_numpy(), infer_num_layers(lay)), bool)
        rho_sh, rho_dp = _side_rho(lay.loc[sh]), _side_rho(lay.loc[~sh])
    tokens = math.nan
    if "tokens" in st:
        tk = st["tokens"].to_numpy(float)
        d = np.diff(tk[np.isfinite(tk)])
        if d.size and np.isfinite(np.median(d)) and np.median(d) > 0:
            tokens = float(np.median(d))
    flat = flatten(run.config)
    seed = flat.get("train.seed", flat.get("seed", math.nan))
    prob = run.config.get("problem")
    kind = (prob.get("kind") if isinstance(prob, dict) else prob) or (
        "llama" if run.config.get("model") else run.meta.get("backend", "run"))
    if kind == "mlp" and flat.get("mlp.kind"):      # the MLP's networks are different toys
        kind = f"mlp-{flat['mlp.kind']}"
    # one source per problem kind: widths of different problems are not comparable
    # labelled by its folder and name, not its absolute path: the same study written into
    # two folders gives the same table (as the map and matched rows are labelled)
    label = f"{Path(path).parent.name}/{Path(path).name}"
    return {"source": f"run:{kind}", "run": label,
            "seed": float(seed) if seed is not None else math.nan,
            "num_spikes": float(len(spikes)), "num_steps": float(n),
            **SR.config_features(flat, rho_sh, rho_dp, tokens)}


def matched_rows(study: str | Path) -> pd.DataFrame:
    """Rows of a matched-regime replication (`adamspike replicate matched`): one per arm and
    seed, from its files (replication.json, arms/<arm>.parquet). Spikes by the report's loss
    rule; the shallow side's rho = median over steps of group_rho of the embed and shallow
    groups' rho_<group> weighted by the groups' numel (`group_numel` of the arm's config):
    rho_<group> of simulate.seeds.run_arm is sqrt(sumsq_group / numel_group) / eps_group,
    the group's group_rho, so this is group_rho over the side's tensors, the statistic of
    the other rows; the deep side's of the deep and head groups'; b2, lr, eps (optim.eps),
    batch x seq_len from the arm's config (the eps of other groups is in their rho)."""
    study = Path(study)
    try:
        meta = json.loads((study / "replication.json").read_text())
        configs = meta["arm_configs"]
    except (OSError, ValueError, KeyError) as e:
        raise SR.SpikeRateError(f"{study}: not a matched replication ({e})") from None
    rows = []
    for arm, c in configs.items():
        t = _cell(study / "cells", meta["arms"].get(arm, {}).get("cell"))
        try:
            numel = group_numel(c)
        except ConfigError as e:
            raise SR.SpikeRateError(f"{study}: arm {arm}: bad config ({e})") from None
        for seed, g in t.groupby("seed"):
            g = g.sort_values("step")
            sp, _ = loss_spikes(g[["step", "loss"]].reset_index(drop=True))
            side = {k: [x for x in grp if f"rho_{x}" in g]
                    for k, grp in (("sh", ("embed", "shallow")), ("dp", ("deep", "head")))}
            rho = {k: _median_over_steps(group_rho(g[[f"rho_{x}" for x in gs]].to_numpy(float),
                                                   [numel[x] for x in gs]))
                   if gs else math.nan for k, gs in side.items()}
            rows.append({"source": "matched", "run": f"{study.name}/{arm}/s{seed}",
                         "seed": float(seed), "num_spikes": float(len(sp)),
                         "num_steps": float(len(g)), **SR.config_features(c, rho["sh"], rho["dp"])})
    return pd.DataFrame(rows, columns=list(SR.TABLE_COLUMNS))


def map_rows(out: str | Path) -> pd.DataFrame:
    """Rows of a phase map (`adamspike phase-map`; analysis.phase_map reads it): one per lane
    (cell x seed) and phase (warmup: steps <= optim.warmup_steps; after: the rest), source
    "map" (the maps of different widths are one source, so the held-out split takes the
    widest). Spikes: the map's rule (its onsets, analysis.phase_map.analyze) starting in the
    phase; num_steps: the phase's steps the rule judged (after its min_history); the sides'
    rho: the median over the phase's steps of group_rho of the side's groups (`group_numel`
    of the cell's config), the statistic of every row type; rho_min: the smallest group's
    median rho over the phase; stability: the median of the phase's S evaluations."""
    from analysis import phase_map as PM     # the map's rule and onsets, one place
    out = Path(out)
    try:
        _, onsets, summary = PM.analyze(out)
    except (OSError, ValueError, KeyError) as e:
        raise SR.SpikeRateError(f"{out}: not a phase map ({e})") from None
    history = PM.spike_params(summary["settings"]).history
    starts = ({} if onsets.empty else
              {k: g["start"].to_numpy() for k, g in onsets.groupby(["cell", "seed"])})
    rows = []
    for c in summary["meta"]["cells"]:
        try:
            t = PM.read_cell(out, c)
        except ValueError as e:
            raise SR.SpikeRateError(str(e)) from None
        if t is None:
            continue                         # not run yet (analyze skipped it too)
        numel = group_numel(c["config"])
        W = int(c["config"]["optim.warmup_steps"])
        groups = [g for g in GROUPS if f"rho_{g}" in t]
        for seed, d in t.groupby("seed", sort=True):
            steps = d["step"].to_numpy()
            st = starts.get((c["id"], int(seed)), np.array([]))
            for phase, inside in (("warmup", lambda x: x <= W), ("after", lambda x: x > W)):
                m = inside(steps)
                judged = int((m & (steps > history)).sum())
                if not judged:
                    continue
                dd = d.loc[m]
                side = {k: _median_over_steps(group_rho(dd[[f"rho_{x}" for x in gs]].to_numpy(float),
                                                        [numel[x] for x in gs]))
                        for k, gs in (("sh", [x for x in groups if x in ("embed", "shallow")]),
                                      ("dp", [x for x in groups if x in ("deep", "head")]))}
                S = dd["S"].to_numpy(float)
                S = S[np.isfinite(S)]
                rows.append({"source": "map", "run": f"{out.name}/{c['id']}/s{seed}/{phase}",
                             "seed": float(seed), "num_spikes": float(inside(st).sum()),
                             "num_steps": float(judged),
                             **SR.config_features(
                                 c["config"], side["sh"], side["dp"],
                                 stability=float(np.median(S)) if S.size else None,
                                 rho_min=float(dd[[f"rho_{x}" for x in groups]].median().min()),
                                 warmup=float(phase == "warmup"))})
    if not rows:
        raise SR.SpikeRateError(f"{out}: no finished phase-map cells")
    return pd.DataFrame(rows, columns=list(SR.TABLE_COLUMNS))


def table_rows(path: str | Path) -> pd.DataFrame:
    """The rows of a training table written by `spike-rate` (DIR/table.csv), as written:
    floats read back bit for bit; SpikeRateError naming the
    file when it is unreadable or lacks a column of TABLE_COLUMNS."""
    try:
        # exact floats: pandas >= 3 by default (float_precision deprecated), 2.x when asked
        exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
        t = pd.read_csv(path, dtype={"source": str, "run": str}, **exact)
    except (OSError, ValueError) as e:
        raise SR.SpikeRateError(f"{path}: not a spike-rate training table ({e})") from None
    missing = [c for c in SR.TABLE_COLUMNS if c not in t.columns]
    if missing:
        raise SR.SpikeRateError(f"{path}: not a spike-rate training table (missing columns "
                                f"{missing})")
    return t[list(SR.TABLE_COLUMNS)]


def training_table(sweeps: Sequence[str | Path] = (), runs: Sequence[str | Path] = (),
                   matched: Sequence[str | Path] = (),
                   maps: Sequence[str | Path] = (),
                   tables: Sequence[str | Path] = ()) -> tuple[pd.DataFrame, list[str]]:
    """(table, notes): adamspike.spike_rate.training_table of the matched-regime
    replications (`matched_rows`), the phase maps (`map_rows`), earlier training tables
    (`table_rows`), the sweep tables and the run directories (`run_row`);
    notes say what was left out and why."""
    rows, notes = [], []
    for r in runs:
        try:
            rows.append(run_row(r))
        except (RunFormatError, SR.SpikeRateError) as e:
            notes.append(f"{r}: left out ({e})")
    parts = [*(matched_rows(m) for m in matched), *(map_rows(m) for m in maps),
             *(table_rows(t) for t in tables), *sweeps]
    if rows:
        parts.append(pd.DataFrame(rows, columns=list(SR.TABLE_COLUMNS)))
    return SR.training_table(parts, notes)


def _fmt(x, d=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{d}g}"


def report_md(model: SR.RateModel, val: dict, table: pd.DataFrame, notes: list[str],
              figure: str | None = None) -> str:
    """Markdown: data, coefficients, held-out scores, calibration table."""
    coefs = model.coefficients()
    ct = pd.DataFrame([{"term": k, "coef": v["coef"], "se": v["se"],
                        "ci_lo": v["ci"][0], "ci_hi": v["ci"][1],
                        "boot_lo": v.get("boot_ci", [math.nan])[0],
                        "boot_hi": v.get("boot_ci", [math.nan, math.nan])[1]}
                       for k, v in coefs.items()])
    by = table.groupby("source").agg(runs=("run", "size"), spikes=("num_spikes", "sum"),
                                     steps=("num_steps", "sum")).reset_index()
    L = ["### Spike-rate model (Poisson GLM on regime groups)", "",
         f"log(spikes per 1000 steps) = intercept + sum_j coef_j x_j; ridge {model.ridge:g} on "
         f"standardised slopes; quasi-Poisson dispersion {model.dispersion:.3g} (Fisher "
         f"intervals inflated by max(1, it)); {int(100 * model.ci)} % intervals (Fisher and "
         f"bootstrap over runs, {len(model.boot)} resamples). Features used: "
         f"{', '.join(model.features)} (the others are missing on some training runs or "
         "constant). Fitted on every run below.", "",
         md_table(by, ["source", "runs", "spikes", "steps"]), "",
         md_table(ct, ["term", "coef", "se", "ci_lo", "ci_hi", "boot_lo", "boot_hi"]), ""]
    if notes:
        L += ["Left out: " + "; ".join(notes), ""]
    mv, bv = val["model"], val["baseline"]
    L += ["#### Held-out validation", "",
          f"{val['split']}. Trained on {val['n_train']} runs, scored on {val['n_heldout']} "
          f"held-out runs ({val['heldout_runs_with_spikes']} with a spike, "
          f"{int(val['heldout_spikes'])} spikes) by P(>= 1 spike in the run's steps).", ""]
    if val["all_heldout_zero"]:
        L += ["**The held-out runs have zero spikes everywhere**: the scores below only "
              "measure how close to 0 each model puts P(>= 1 spike).", ""]
    L += ["| model | log-loss | Brier |", "|---|---|---|",
          f"| GLM | {mv['log_loss']:.4f} | {mv['brier']:.4f} |",
          f"| constant rate ({val['baseline_rate_per_1k']:.3g} per 1k steps) | "
          f"{bv['log_loss']:.4f} | {bv['brier']:.4f} |", "",
          "Calibration of the held-out runs (bins of predicted P; observed fraction with its "
          "Wilson 90 % interval):", "",
          md_table(val["calibration"], ["bin_lo", "bin_hi", "n_runs", "mean_predicted",
                                        "observed_fraction", "observed_lo", "observed_hi",
                                        "predicted_spikes", "observed_spikes"]), ""]
    if figure:
        L += [f"![calibration]({figure})", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike spike-rate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="append", default=[], help="sweep table or directory")
    ap.add_argument("--runs", nargs="*", default=[], help="run directories")
    ap.add_argument("--matched", action="append", default=[],
                    help="matched-regime replication directory (adamspike replicate matched)")
    ap.add_argument("--map", action="append", default=[], dest="maps",
                    help="phase-map directory (adamspike phase-map): one row per lane and phase "
                         "with the mechanism features")
    ap.add_argument("--table", action="append", default=[], dest="tables",
                    help="a training table an earlier spike-rate wrote (its table.csv): its "
                         "rows as they are (a shipped model's rows, without its maps)")
    ap.add_argument("--out", required=True, help="output directory (model.json must not exist)")
    ap.add_argument("--features", nargs="+", choices=SR.FEATURES, default=list(SR.FEATURES),
                    metavar="FEATURE", help="the features the model may use (default: every "
                    "one finite and not constant on the training runs): "
                    + ", ".join(SR.FEATURES))
    ap.add_argument("--n-boot", type=int, default=SR.N_BOOT)
    ap.add_argument("--ridge", type=float, default=SR.RIDGE)
    return cli_main(ap, argv, _main, "adamspike spike-rate", (ConfigError, SR.SpikeRateError))


def _main(args) -> int:
    out = Path(args.out)
    if (out / "model.json").exists():
        raise ConfigError(f"{out / 'model.json'}: exists; choose another --out (nothing was "
                          "overwritten)")
    if args.n_boot < 0 or not args.ridge >= 0:
        raise ConfigError("--n-boot must be >= 0 and --ridge >= 0")
    table, notes = training_table(args.sweep, args.runs, args.matched, args.maps, args.tables)
    val = SR.validate(table, ridge=args.ridge, n_boot=args.n_boot, candidates=args.features)
    model = SR.fit(table, SR.select_features(table, args.features), ridge=args.ridge,
                   n_boot=args.n_boot)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "table.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "calibration.csv", val["calibration"].to_csv(index=False).encode())
    atomic_write_bytes(out / "heldout.csv", val["per_run"].to_csv(index=False).encode())
    model.extra["validation"] = json_clean({k: v for k, v in val.items()
                                           if k not in ("calibration", "per_run")})
    model.extra["validation"]["calibration"] = json_clean(val["calibration"].to_dict("records"))
    model.extra["notes"] = notes
    atomic_write_bytes(out / "model.json",
                       json.dumps(json_clean(model.to_json()), indent=1, allow_nan=False).encode())
    atomic_write_bytes(out / "report.md", report_md(model, val, table, notes).encode())
    mv, bv = val["model"], val["baseline"]
    print(f"{model.n_runs} runs, {int(model.n_spikes)} spikes, features {model.features}; "
          f"held-out log-loss {mv['log_loss']:.4f} (constant {bv['log_loss']:.4f}), Brier "
          f"{mv['brier']:.4f} (constant {bv['brier']:.4f}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
