"""`adamspike spike-rate`: fit and validate the spike-rate GLM (adamspike.spike_rate) on
sweep tables and run directories.

    adamspike spike-rate [--sweep TABLE_OR_DIR ...] [--runs RUN ...] [--matched DIR ...]
                         --out DIR [--n-boot 200]

Training table (DIR/table.csv, one row per run, adamspike.spike_rate.TABLE_COLUMNS):
  - sweep tables (simulate.sweep; the quadratic / mlp / llama sweeps, replication cells):
    adamspike.spike_rate.sweep_rows, runs whose mitigation keys are at their neutral values
    (adamspike.mitigations.neutral_mask) only;
  - run directories (either backend): spikes by the report's loss rule
    (analysis.report.loss_spikes), num_steps = steps with a loss; the shallow / deep side's
    rho = median over logged steps of the side's group rho (adamspike.depth_groups.
    group_rho over the side's tensors, numel-weighted rms; sides by adamspike.depth_groups.
    is_shallow, L from the depths: analysis.controls.infer_num_layers); b2, lr, eps from
    the config; tokens per step = the median step
    difference of the `tokens` column (else train.global_batch_size x train.seq_len);
    width = model dim (config model.dim or its preset) or mlp.width. A run without
    per-tensor telemetry has no rho and is left out of the fit (listed in the report);
  - matched-regime replications (`adamspike replicate matched`): one row per arm and seed
    (`matched_rows`), the regime the 70B predictions are about.
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
from adamspike.config import ConfigError
from adamspike.depth_groups import GROUPS, depth_group, group_rho, is_shallow
from adamspike.llama import PRESETS, spec_by_name
from adamspike.mitigations import neutral_mask
from adamspike.rundir import RunFormatError, atomic_write_bytes, load_run
from adamspike.train_config import RunConfig
from analysis.controls import infer_num_layers
from analysis.fits import optim_params
from analysis.report import loss_spikes, md_table


def _width(config: dict) -> float:
    model = config.get("model") or {}
    if model.get("dim"):
        return float(model["dim"])
    if model.get("preset"):
        if model["preset"] in PRESETS:
            return float(PRESETS[model["preset"]].dim)
    for sec in ("mlp", "problem"):
        d = config.get(sec) or {}
        if isinstance(d, dict) and d.get("width"):
            return float(d["width"])
    if config.get("mlp.width"):
        return float(config["mlp.width"])
    return math.nan


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
    op = optim_params(run.config)
    rho_sh = rho_dp = math.nan
    lay = run.layers
    if not lay.empty and "rho" in lay:
        L = infer_num_layers(lay)
        sh = np.asarray(is_shallow(lay["depth"].to_numpy(), L), bool)
        rho_sh, rho_dp = _side_rho(lay.loc[sh]), _side_rho(lay.loc[~sh])
    tokens = math.nan
    if "tokens" in st:
        tk = st["tokens"].to_numpy(float)
        d = np.diff(tk[np.isfinite(tk)])
        if d.size and np.isfinite(np.median(d)) and np.median(d) > 0:
            tokens = float(np.median(d))
    if not np.isfinite(tokens):
        tr = run.config.get("train") or {}
        if tr.get("global_batch_size") and tr.get("seq_len"):
            tokens = float(tr["global_batch_size"]) * float(tr["seq_len"])
    feats = SR.setting_features(rho_shallow=rho_sh, rho_deep=rho_dp, b2=op["b2"], lr=op["lr"],
                                eps=op["eps"], tokens_per_step=tokens)
    seed = (run.config.get("train") or {}).get("seed", run.config.get("seed", math.nan))
    prob = run.config.get("problem")
    kind = (prob.get("kind") if isinstance(prob, dict) else prob) or (
        "llama" if run.config.get("model") else run.meta.get("backend", "run"))
    # one source per problem kind: widths of different problems are not comparable
    return {"source": f"run:{kind}", "run": str(path), "width": _width(run.config),
            "seed": float(seed) if seed is not None else math.nan,
            "num_spikes": float(len(spikes)), "num_steps": float(n), **feats}


def read_sweep_table(path: str | Path) -> pd.DataFrame:
    """A sweep table: runs.parquet / runs.csv, or a sweep directory holding runs.parquet."""
    p = Path(path)
    if p.is_dir():
        p = p / "runs.parquet"
    if not p.is_file():
        raise SR.SpikeRateError(f"{path}: sweep table not found (runs.parquet or a .csv)")
    try:
        return pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - any unreadable table is a format error
        raise SR.SpikeRateError(f"{p}: unreadable sweep table ({e})") from None


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
        path = study / "arms" / f"{arm}.parquet"
        if not path.exists():
            raise SR.SpikeRateError(f"{path}: missing (unfinished study)")
        t = pd.read_parquet(path)
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
            feats = SR.setting_features(rho_shallow=rho["sh"], rho_deep=rho["dp"],
                                        b2=c["optim.b2"], lr=c["optim.lr"], eps=c["optim.eps"],
                                        tokens_per_step=c["train.global_batch_size"] * c["train.seq_len"])
            rows.append({"source": "matched", "run": f"{study.name}/{arm}/s{seed}",
                         "width": float(c["model.dim"]), "seed": float(seed),
                         "num_spikes": float(len(sp)), "num_steps": float(len(g)), **feats})
    return pd.DataFrame(rows, columns=list(SR.TABLE_COLUMNS))


def training_table(sweeps: Sequence[str | Path] = (), runs: Sequence[str | Path] = (),
                   matched: Sequence[str | Path] = ()) -> tuple[pd.DataFrame, list[str]]:
    """(table, notes): the rows of every sweep table (neutral mitigations only), run
    directory and matched-regime replication (`matched_rows`); notes say what was left out
    and why."""
    frames, notes = [], []
    for m in matched:
        frames.append(matched_rows(m))
    for sw in sweeps:
        t = read_sweep_table(sw)
        keep = neutral_mask(t)
        if (~keep).any():
            notes.append(f"{sw}: {int((~keep).sum())} runs with an active mitigation left out")
        name = Path(sw).name if Path(sw).is_dir() else Path(sw).parent.name
        prob = str(t["problem"].iloc[0]) if "problem" in t and len(t) else "sweep"
        frames.append(SR.sweep_rows(t[keep].reset_index(drop=True), f"sweep:{prob}:{name}"))
    rows = []
    for r in runs:
        try:
            rows.append(run_row(r))
        except (RunFormatError, SR.SpikeRateError) as e:
            notes.append(f"{r}: left out ({e})")
    if rows:
        frames.append(pd.DataFrame(rows, columns=list(SR.TABLE_COLUMNS)))
    if not frames:
        raise SR.SpikeRateError("no training data: give --sweep and/or --runs")
    table = pd.concat(frames, ignore_index=True)[list(SR.TABLE_COLUMNS)]
    bad = ~np.isfinite(table["log10_rho_shallow"].to_numpy(float))
    if bad.any():   # the primary group: a run without it is left out, not the feature
        notes.append(f"{int(bad.sum())} runs without a positive shallow rho (no per-tensor "
                     "telemetry, or a gradient that reached exactly 0): "
                     + ", ".join(table.loc[bad, "run"].astype(str).head(5))
                     + (" ..." if bad.sum() > 5 else ""))
        table = table.loc[~bad].reset_index(drop=True)
    return table, notes


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


def _jsonable(o):
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, np.integer):
        return int(o)
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike spike-rate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="append", default=[], help="sweep table or directory")
    ap.add_argument("--runs", nargs="*", default=[], help="run directories")
    ap.add_argument("--matched", action="append", default=[],
                    help="matched-regime replication directory (adamspike replicate matched)")
    ap.add_argument("--out", required=True, help="output directory (model.json must not exist)")
    ap.add_argument("--n-boot", type=int, default=SR.N_BOOT)
    ap.add_argument("--ridge", type=float, default=SR.RIDGE)
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    out = Path(args.out)
    try:
        if (out / "model.json").exists():
            raise ConfigError(f"{out / 'model.json'}: exists; choose another --out (nothing was "
                              "overwritten)")
        if args.n_boot < 0 or not args.ridge >= 0:
            raise ConfigError("--n-boot must be >= 0 and --ridge >= 0")
        table, notes = training_table(args.sweep, args.runs, args.matched)
        val = SR.validate(table, ridge=args.ridge, n_boot=args.n_boot)
        model = SR.fit(table, ridge=args.ridge, n_boot=args.n_boot)
    except (ConfigError, SR.SpikeRateError) as e:
        print(f"adamspike spike-rate: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "table.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "calibration.csv", val["calibration"].to_csv(index=False).encode())
    atomic_write_bytes(out / "heldout.csv", val["per_run"].to_csv(index=False).encode())
    model.extra["validation"] = _jsonable({k: v for k, v in val.items()
                                           if k not in ("calibration", "per_run")})
    model.extra["validation"]["calibration"] = _jsonable(val["calibration"].to_dict("records"))
    model.extra["notes"] = notes
    atomic_write_bytes(out / "model.json",
                       json.dumps(_jsonable(model.to_json()), indent=1, allow_nan=False).encode())
    atomic_write_bytes(out / "report.md", report_md(model, val, table, notes).encode())
    mv, bv = val["model"], val["baseline"]
    print(f"{model.n_runs} runs, {int(model.n_spikes)} spikes, features {model.features}; "
          f"held-out log-loss {mv['log_loss']:.4f} (constant {bv['log_loss']:.4f}), Brier "
          f"{mv['brier']:.4f} (constant {bv['brier']:.4f}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
