"""`adamspike predict`: pre-registered predictions.json (schema v3): the spike-rate GLM's
rate per candidate setting, alarm rules from sweep results.

    adamspike predict (--profile (llama2-70b | PROFILE.json | RUN_DIR) | --profile-from-log LOG
                       | --profile-from-run RUN) [--ladder DIR] [--sweep TABLE ...]
                      [--rate-model MODEL.json] [--horizon-steps 2000]
                      [--candidates candidates.toml | --setting KEY=V,...] --out predictions.json
    adamspike predict --profile llama2-70b --setting optim.eps=1e-6,optim.b2=0.95   (prints)

The file is pre-registered (adamspike.predictions.save_predictions: UTC creation time and
the sha256 of its canonical JSON); an existing --out is never overwritten (exit 2).

Profile: per-depth gradient scale of the model the predictions are for, as
rho_ref(depth) = rms(g) / eps_ref of the gradient Adam consumes, at the eps it refers to.
  - llama2-70b (--ladder DIR, a finished `adamspike simulate ladder` directory; without it
    the ladder shipped with the package, adamspike.package_data, named in `source`): the
    ladder fit (simulate.ladder) extrapolated to dim 8192, 80 layers, 1024 x 4096 tokens per
    step under the clip constraint sum_g N_g rms_g^2 = min(gn, 1)^2, at eps_ref = 1e-5; each
    depth takes its group's rho with the bootstrap prediction interval (rho_lo, rho_hi);
    phi = 0; lr 1.5e-4, batch 1024 (configs/llama2-70b.toml). `source` names the ladder, its
    R^2 (log) per group and the interval.
  - --profile-from-log LOG (Megatron / ModelLink / MindSpeed training log; --ladder for the
    depth shape, else the shipped ladder): rho_bar(t) = min(grad_norm_t, clip) / (sqrt(N) eps)
    (N: --num-params, else the count the log prints, else the llama2-70b preset's; clip and
    eps: --clip / --eps-ref, else the log's argument dump (adamspike.log_facts), else the 70B
    run's, each input said with its source; the depth shape, numel per depth and candidates stay the llama2-70b's), its median over
    the second half of the log,
    spread over depth by the ladder's shape rho_g / mean_rho (the N-weighted rms of the
    result is rho_bar); the interval is the shipped profile's computation (rho_from_level:
    each ladder draw's shape times a level, the log's grad norms standing in for the
    ladder's extrapolated level by quantile mapping), so a log whose inputs equal the
    shipped profile's gives its numbers. This replaces the ladder's absolute level by a measurement.
  - --profile-from-run RUN / RUN_DIR: a run directory (either backend; a telemetry run of the
    70B replaces the ladder entirely): per logged step and depth the numel-weighted rms of
    grad_rms over the depth's tensors (adamspike.depth_groups.group_rho, numel from the
    layers table), its median over steps, interval = its 10-90 % range over steps,
    numel_by_depth = the depth's numel, eps_ref = the run's optim.eps; phi per
    depth from the median grad_mom_cos, inverted through theory.adam_moments.grad_mom_cos
    (zero-mean AR(1) assumption); lr, b1, batch from the run's config.
  - PROFILE.json: {"name", "num_layers", "eps_ref", "rho_by_depth": {"-1": ..., ...}}
    (optional: "phi", "lr", "b1", "global_batch_size", "numel_by_depth": {"-1": ..., ...};
    without it the numel of the preset named "name" when it has num_layers, else equal
    numel per depth, said in numel_source).
The llama2-70b and log profiles take numel_by_depth from adamspike.llama.param_specs of the
llama2-70b preset.
The profile section of predictions.json carries `by_depth`: one row per depth with depth,
group (adamspike.depth_groups), rho, rho_lo, rho_hi at eps_ref, and numel_by_depth.
A candidate eps moves every depth to rho = rho_ref * eps_ref / eps (rms(g) held fixed).

Candidates are dicts of dotted RunConfig keys (CANDIDATE_KEYS: optim.b1, optim.b2,
optim.eps, optim.lr, train.global_batch_size; a candidates TOML gives [[candidate]] tables
of them, missing ones taken from the profile), validated by RunConfig.from_dict; each
setting of predictions.json carries them as its `overrides`.

Spike rate of a candidate (the GLM of adamspike.spike_rate, which replaced the heuristic
risk): the model comes from --rate-model (model.json of `adamspike spike-rate`: sweeps and
run directories, held-out validated), or, without it, is fitted here on the --sweep tables'
runs (neutral mitigations only; validation by adamspike.spike_rate.validate where the table
allows a split), or, with neither, is the model shipped with the package
(adamspike.package_data: what the study's spike_rate stage wrote; rate_model.shipped). The candidate's features (adamspike.spike_rate.FEATURES): the shallow side's
rho = group_rho (adamspike.depth_groups: sqrt(sum numel rho^2 / sum numel), the GLM's
training statistic) over the profile's embed + shallow depths of rho_ref * eps_ref / eps
weighted by numel_by_depth, the deep side's over the other depths (deep + head), log10 (1 - b2), log10 (lr / eps), tokens per step = global
batch x the profile's seq_len. The per-depth interval (rho_lo, rho_hi) of the profile gives
features_lo / features_hi; the stated rate interval is the union of the GLM's intervals
(quasi-Poisson Fisher and bootstrap) at the low, central and high rho. With a ladder
profile the mean rho respects the clip bound rho_bar <= clip / (sqrt(N) eps) at every eps
(rms(g) is held fixed, so both sides scale by eps_ref / eps; checked and stored). Every
feature outside the model's training range is flagged (extrapolation: below / above);
at 70B scale every setting is an extrapolation and the file says so.
  rate     spikes per 1000 steps with rate_ci (level of the model, 90 %)
  p_spike  P(>= 1 spike in --horizon-steps steps) = 1 - exp(-rate N / 1000), with p_spike_ci
  risk     = p_spike; label low (< 1/3), medium (< 2/3), high
Settings are ranked by rate (rank 1 = lowest); settings with the same model features (the
model cannot tell them apart: adamspike.predictions.model_key, e.g. two batch sizes when
tokens per step is not a model feature) name each other in `same_prediction_as`;
`validate` lists the three lowest-rate ids with distinct model features.
The per-depth theory (theory.risk.layer_risk: regime, update_rms, rms_t bound, on a
1/20-decade rho grid and a 0.05 phi grid, cached) stays in `per_depth` and the rationale as
context; it no longer sets the risk.

Alarm rules (each rule's `source` says where its threshold comes from):
  rms_t / sat_frac / grad_mom_cos of shallow tensors (max): the threshold maximising
      Youden's J between pre-spike maxima (sweep column pre_<m>, the PRE_WINDOW steps before
      each spike) of spiking runs and run maxima (max_<m>) of runs without spikes; expected
      lead = the 10-90% range of the measured lead_<m>. Without enough sweep data (< 3 runs
      per class) or when the best split is poor (Youden J = TPR - FPR < 0.2): rms_t 2.0 with lead [1, 8] (Wortsman 2023a, as in notes/theory.md);
      grad_mom_cos = theory.adam_moments.grad_mom_cos at the SNR where the r-bimodality
      crosses 5/9 (theory.bimodality.snr_bc_crossing); sat_frac is then left out.
  bimodality of shallow tensors (median > 5/9: most shallow tensors bimodal): Sarle's
      threshold (theory.bimodality.BC_THRESHOLD).
  rho of the shallow side (group_rho over the shallow tensors, weighted by their numel, the
      GLM's statistic; < 0.1 for 5 logged steps): frozen band (theory.eps_regime.RHO_FROZEN).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import copy
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from adamspike import package_data
from adamspike import spike_rate as SR
from adamspike.config import (ConfigError, cli_main, flatten, parse_setting_text, read_toml,
                              to_dict)
from adamspike.depth_groups import depth_group, group_rho
from adamspike.depth_groups import shallow_depths as group_shallow_depths
from adamspike.llama import PRESETS, num_params, param_specs, preset
from adamspike.log_facts import log_facts
from adamspike.megatron_log import MegatronLogError, read_megatron_log
from adamspike.predictions import (AlarmRule, Predictions, PredictionsError, indistinguishable,
                                   model_key, model_label, not_in_model, save_predictions)
from adamspike.rundir import OutputPathError, RunFormatError, check_out, json_clean, load_run, read_json
from adamspike.sharpness_law import label as law_label, law_at
from adamspike.train_config import RunConfig
from simulate import ladder as LD
from theory.adam_moments import grad_mom_cos
from theory.bimodality import BC_THRESHOLD, snr_bc_crossing
from theory.eps_regime import RHO_FROZEN, regime
from theory.risk import layer_risk

DEFAULT_HORIZON_STEPS = 2000   # P(>= 1 spike) horizon (the seed report's run stopped at 1543)
MIN_CLASS_RUNS = 3
MIN_YOUDEN_J = 0.2           # a data threshold must separate the classes at least this well
NUM_VALIDATE = 3
# What the theory can compute: its EMA windows hold ~39 / (1 - b) terms per array, so
# 1 - b below MIN_ONE_MINUS_BETA would allocate gigabytes (b = 0.999999: > 5 GB); rho
# outside RHO_RANGE (a huge or tiny eps, an extreme eps_ref or grad norm) underflows the
# closed forms and lies decades beyond any data the rate model saw
MIN_ONE_MINUS_BETA = 1e-4
RHO_RANGE = (1e-8, 1e8)


def check_beta(name: str, b: float, where: str = "") -> float:
    """An Adam beta the theory can evaluate: finite, 0 <= b and 1 - b >= MIN_ONE_MINUS_BETA."""
    b = float(b)
    if not (math.isfinite(b) and 0.0 <= b and 1.0 - b >= MIN_ONE_MINUS_BETA):
        raise ConfigError(f"{where}{name}: must be in [0, {1 - MIN_ONE_MINUS_BETA:g}] (the "
                          f"theory's windows hold ~39 / (1 - {name}) steps), got {b!r}")
    return b


def check_positive(name: str, x: float, where: str = "") -> float:
    """A finite number > 0 (eps_ref, clip, eps)."""
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ConfigError(f"{where}{name}: must be a finite number > 0, got {x!r}")
    return x


def check_rho(what: str, rho: float, why: str) -> None:
    """rho inside RHO_RANGE (module constants); ConfigError naming the input behind it."""
    lo, hi = RHO_RANGE
    if not (math.isfinite(rho) and lo <= rho <= hi):
        raise ConfigError(f"{what}: rho {rho:.3g} is outside the range the theory and the rate "
                          f"model can evaluate ({lo:g} to {hi:g}); {why}")


# ----------------------------------------------------------------------------- profiles

LLAMA2_70B_SETTINGS = {"lr": 1.5e-4, "b1": 0.9, "global_batch_size": 1024, "eps_ref": 1e-5,
                      "clip": 1.0, "seq_len": 4096}   # configs/llama2-70b.toml (the seed report's run)


def preset_numel_by_depth(name: str) -> dict[int, int]:
    """Parameters per depth of a model preset (adamspike.llama.param_specs: -1 the
    embedding, 0..L-1 the blocks, L the final norm and the head)."""
    out: dict[int, int] = {}
    for s in param_specs(preset(name)):
        out[s.depth] = out.get(s.depth, 0) + int(s.numel)
    return out


def _by_depth(num_layers: int, rho: Mapping[int, float], lo: Mapping[int, float],
              hi: Mapping[int, float]) -> list[dict]:
    return [{"depth": int(d), "group": depth_group(int(d), num_layers), "rho": float(rho[d]),
             "rho_lo": float(lo[d]), "rho_hi": float(hi[d])} for d in sorted(rho)]


def _ladder_source(ladder_dir: str | Path, fit: Mapping[str, Any], ext: Mapping[str, Any]) -> str:
    r2 = ", ".join(f"{g} {v['r2_log']:.3f}" for g, v in fit["groups"].items())
    ho = [f"{g} {v['heldout_widest']['mean_log10_error']:+.2f}" for g, v in fit["groups"].items()
          if v.get("heldout_widest")]
    lr = fit.get("ladder_spec", {}).get("lr_scaling", "constant")
    return (f"ladder fit ({ladder_dir}: {len(fit['rungs'])} rungs, {fit['num_rows']} rung x seed "
            f"rows, lr {lr} over width; power law in dim, layers, tokens/step per depth group; R^2 (log) {r2}"
            + (f"; held-out widest dim {fit['heldout_dim']} mean log10 error {', '.join(ho)}"
               if ho else "")
            + f"; {int(100 * fit['ci'])}% bootstrap prediction interval, n_boot {fit['n_boot']})"
            f" extrapolated to dim {ext['dim']}, {ext['num_layers']} layers, "
            f"{ext['tokens_per_step']} tokens/step: raw grad norm {ext['raw_grad_norm']:.3g} "
            f"[{ext['raw_grad_norm_lo']:.3g}, {ext['raw_grad_norm_hi']:.3g}], clip "
            f"{ext['clip']:g} -> mean rho {ext['mean_rho']:.3g} at eps {ext['eps']:g} "
            f"(bound clip/(sqrt(N) eps) = {ext['mean_rho_bound']:.3g})")


def _llama70b_profile(L: int, eps_ref: float, clip: float, rho: Mapping[int, float],
                      lo: Mapping[int, float], hi: Mapping[int, float], **extra) -> dict:
    """The LLaMA2-70B profile (the seed report's run settings) of per-depth rho and its
    interval at eps_ref: the one shape of ladder_profile and profile_from_log."""
    s = LLAMA2_70B_SETTINGS
    return {"name": "llama2-70b", "num_layers": L, "eps_ref": eps_ref, "rho_by_depth": dict(rho),
            "phi_by_depth": {d: 0.0 for d in rho}, "lr": s["lr"], "b1": s["b1"],
            "global_batch_size": s["global_batch_size"], "seq_len": s["seq_len"], "clip": clip,
            "num_params": int(num_params(preset("llama2-70b"))),
            "numel_by_depth": preset_numel_by_depth("llama2-70b"),
            "by_depth": _by_depth(L, rho, lo, hi), **extra}


def _with_law(ext: Mapping[str, Any], shipped: bool = True) -> dict:
    """The ladder's 70B reading with the shipped sharpness law under Science 4's plan QC
    (package data science4/law.json, adamspike.sharpness_law) put in its sharpness: the
    law's regression prediction interval replaces the batch-sharpness reading's
    leave-one-rung-out range (mechanism_inputs). Only for the shipped data: a ladder or
    batch-sharpness folder the user names keeps its own reading."""
    ext = copy.deepcopy(dict(ext))
    law = package_data.sharpness_law("llama2-70b") if shipped else None
    if law is not None and ext.get("sharpness"):
        ext["sharpness"]["law"] = law
    return ext


def ladder_profile(ladder_dir: str | Path, batch_sharpness: str | Path | None = None) -> dict:
    """The LLaMA2-70B profile from a ladder directory (module docstring); batch_sharpness:
    simulate.ladder.ladder_70b's."""
    s = LLAMA2_70B_SETTINGS
    fit, ext = LD.ladder_70b(ladder_dir, eps=s["eps_ref"], clip=s["clip"],
                             batch_sharpness=batch_sharpness)
    level = ladder_level_draws(ext)
    rho, lo, hi, level_ci = rho_from_level(fit, ext, float(ext["mean_rho"]), level)
    inputs = profile_inputs(
        eps_ref=(s["eps_ref"], "the 70B run's (configs/llama2-70b.toml)"),
        clip=(s["clip"], "the 70B run's (configs/llama2-70b.toml)"),
        N=(int(num_params(preset("llama2-70b"))), "the llama2-70b preset"),
        rho_bar=(float(ext.get("mean_rho", math.nan)), "extrapolated: the ladder's fit carried "
                 "to dim 8192, 80 layers"),
        rho_bar_interval=(level_ci, f"the ladder's {int(100 * fit['ci'])} % bootstrap "
                          "interval of it"))
    return _llama70b_profile(int(ext["num_layers"]), s["eps_ref"], s["clip"], rho, lo, hi,
                             ladder={"fit": LD.public(fit), "llama2_70b": _with_law(
                                 LD.public(ext), shipped=batch_sharpness is None and
                                 Path(ladder_dir).resolve() == package_data.ladder_dir("llama2-70b").resolve())},
                             inputs=inputs, source=_ladder_source(ladder_dir, fit, ext))


def ladder_level_draws(ext: Mapping[str, Any]) -> np.ndarray:
    """The ladder's bootstrap draws of the 70B's level, the N-weighted rms of rho over the
    groups (min(raw grad norm, clip) / (sqrt(N) eps) of each draw)."""
    Ng = np.array([ext["group_numel"][g] for g in ext["_groups"]], float)
    return np.sqrt((ext["_draws_rho"] ** 2 * Ng).sum(1) / Ng.sum())


def rho_from_level(fit: Mapping[str, Any], ext: Mapping[str, Any], level: float,
                   level_samples: np.ndarray) -> tuple[dict, dict, dict, list]:
    """Per depth rho and its interval from a level (the N-weighted rms of rho: the
    ladder's extrapolation, or a log's measured rho_bar) and samples of it, spread over depth
    by the ladder's shape: the one computation of every llama2-70b profile source. Each
    bootstrap draw of the ladder is (its shape) x (its level); the samples replace the
    levels by quantile mapping (the draw of rank k gets the samples' quantile k / (m - 1)),
    so the ladder's pairing of level and shape is kept, and with the ladder's own level draws
    this is the ladder's interval exactly. Interval: the fit's ci (e.g. 5-95 %) over the
    draws. Returns rho, rho_lo, rho_hi by depth and the level's interval at that ci."""
    groups = ext["_groups"]
    draws = ext["_draws_rho"]
    own = ladder_level_draws(ext)
    shape_draws = draws / own[:, None]
    m = len(own)
    rank = np.empty(m, int)
    rank[np.argsort(own, kind="stable")] = np.arange(m)
    samples = np.asarray(level_samples, float)
    mapped = samples if samples.shape == own.shape and np.array_equal(samples, own) else \
        np.quantile(samples, rank / max(m - 1, 1))
    a = (1 - fit["ci"]) / 2
    joint = shape_draws * mapped[:, None]
    g_lo = dict(zip(groups, np.quantile(joint, a, axis=0)))
    g_hi = dict(zip(groups, np.quantile(joint, 1 - a, axis=0)))
    shape = {g: ext["rho"][g] / ext["mean_rho"] for g in groups}
    L = int(ext["num_layers"])
    depths = range(-1, L + 1)
    rho = {d: level * shape[depth_group(d, L)] for d in depths}
    lo = {d: float(g_lo[depth_group(d, L)]) for d in depths}
    hi = {d: float(g_hi[depth_group(d, L)]) for d in depths}
    return rho, lo, hi, [float(np.quantile(samples, a)), float(np.quantile(samples, 1 - a))]


def profile_inputs(**kv: tuple[Any, str]) -> dict:
    """{input: {"value", "source"}}: each input of a profile with where it came from
    (measured / read from the log / given by flag / assumed / extrapolated)."""
    return {k: {"value": v, "source": src} for k, (v, src) in kv.items()}


def profile_from_log(log: str | Path, ladder_dir: str | Path, clip: float | None = None,
                     eps_ref: float | None = None, num_params_log: int | None = None) -> dict:
    """LLaMA2-70B profile from a training log's grad norms, shaped by the ladder (module
    docstring)."""
    # each input: the flag, else what the log states (adamspike.log_facts: the argument
    # dump's adam_eps / clip_grad, the printed parameter count), else the 70B run's, said so
    facts = log_facts(log)

    def stated(flag_value, arg: str, flag: str, default: float) -> tuple[float, str]:
        if flag_value is not None:
            return flag_value, f"given by flag {flag}"
        text, line = facts.args.get(arg, (None, None))
        try:
            v = float(text) if text is not None else math.nan
        except ValueError:
            v = math.nan
        if math.isfinite(v) and v > 0:
            return v, f"read from the log: line {line}, {facts.printed.get(arg, arg)}"
        return default, f"assumed: the 70B run's ({flag} not given, the log states none)"

    clip, clip_src = stated(clip, "clip_grad", "--clip", LLAMA2_70B_SETTINGS["clip"])
    eps_ref, eps_src = stated(eps_ref, "adam_eps", "--eps-ref", LLAMA2_70B_SETTINGS["eps_ref"])
    check_positive("--clip", clip)
    check_positive("--eps-ref", eps_ref)
    try:
        steps = read_megatron_log(log).steps
    except MegatronLogError as e:
        raise ConfigError(str(e)) from None
    gn = steps["grad_norm"].to_numpy(float)
    gn = gn[np.isfinite(gn)]
    if len(gn) == 0:
        raise ConfigError(f"{log}: no finite 'grad norm' values in the log")
    late = gn[len(gn) // 2:]
    # N of the logged model (--num-params): the clip bound clip / (sqrt(N) eps) and the
    # mean rho both depend on it; without it, the llama2-70b preset's
    if num_params_log:
        N, n_src = int(num_params_log), "given by flag --num-params"
    elif facts.num_params:
        N, n_src = int(facts.num_params), f"read from the log: {facts.num_params_source}"
    else:
        N, n_src = (num_params(preset("llama2-70b")), "assumed: the llama2-70b preset's "
                    "(--num-params not given, the log prints no count)")
    if N < 1:
        raise ConfigError(f"--num-params: must be >= 1, got {num_params_log}")
    with np.errstate(all="ignore"):      # an extreme input is refused just below
        rho_bar_t = np.minimum(late, clip) / (math.sqrt(N) * eps_ref)
        rho_bar = float(np.median(rho_bar_t))
    for v in (float(rho_bar_t.min()), rho_bar, float(rho_bar_t.max())):
        check_rho(f"{log}", v, f"rho_bar = min(grad norm, --clip {clip:g}) / (sqrt(N {N}) "
                  f"--eps-ref {eps_ref:g}): check --eps-ref, --clip and --num-params")
    fit, ext = LD.ladder_70b(ladder_dir, eps=eps_ref, clip=clip)
    a = (1 - fit["ci"]) / 2
    L = int(ext["num_layers"])
    # the one computation of the shipped profile's rho and interval, with the measured level
    rho, lo, hi, (q_lo, q_hi) = rho_from_level(fit, ext, rho_bar, rho_bar_t)
    # the ladder's extrapolation with its level replaced by the measurement: the same
    # sharpness (so the same mechanism model as --profile llama2-70b), the measured mean rho
    lad = _with_law(LD.public(ext), shipped=Path(ladder_dir).resolve()
                    == package_data.ladder_dir("llama2-70b").resolve())
    ladder_rho = float(lad.get("mean_rho", math.nan))
    lad["mean_rho"] = rho_bar
    inputs = profile_inputs(eps_ref=(eps_ref, eps_src), clip=(clip, clip_src), N=(N, n_src),
                            rho_bar=(rho_bar, f"measured: median over the last {len(late)} "
                                     f"logged grad norms of {log}"),
                            rho_bar_interval=([q_lo, q_hi], f"the {100 * a:g}-"
                                              f"{100 * (1 - a):g} % range of those"),
                            ladder_mean_rho=(ladder_rho, "the ladder's extrapolation, replaced "
                                             "by the measured rho_bar"))
    s70 = LLAMA2_70B_SETTINGS
    # --profile llama2-70b's inputs, for the line naming what differs (its rho_bar is the
    # ladder's at this eps_ref and clip, so the levels compare where those agree)
    shipped_inputs = profile_inputs(
        eps_ref=(s70["eps_ref"], "the 70B run's"), clip=(s70["clip"], "the 70B run's"),
        N=(int(num_params(preset("llama2-70b"))), "the llama2-70b preset"),
        rho_bar=(ladder_rho, f"the ladder's extrapolation at eps {eps_ref:g}, clip {clip:g}"),
        rho_bar_interval=(rho_from_level(fit, ext, ladder_rho, ladder_level_draws(ext))[3],
                          "the ladder's bootstrap interval of it"))
    return _llama70b_profile(
        L, eps_ref, clip, rho, lo, hi, rho_bar=rho_bar, rho_bar_interval=[q_lo, q_hi],
        ladder={"fit": LD.public(fit), "llama2_70b": lad}, inputs=inputs,
        shipped_inputs=shipped_inputs,
        num_params_log=N,
        source=(f"measured log {log}: rho_bar = median of min(grad_norm, {clip:g}) / "
                f"(sqrt(N) eps) over its last {len(late)} logged iterations = "
                f"{rho_bar:.3g} ({100 * a:g}-{100 * (1 - a):g} %: {q_lo:.3g}-{q_hi:.3g}), N {N} ("
                + ("--num-params, the logged model" if num_params_log else
                   "the log's printed count" if facts.num_params else
                   "the llama2-70b preset: give --num-params for another model") +
                f"), eps {eps_ref:g}; "
                f"depth shape from the " + _ladder_source(ladder_dir, fit, ext)))


def with_70b_sharpness(profile: dict, ladder: str | None = None) -> None:
    """A llama2-70b profile from a run or a JSON file (80 layers) gets the ladder's 70B
    sharpness (--ladder, else the shipped ladder), with the ladder's level replaced by the
    profile's own mean rho: the mechanism model then answers for it as for --profile
    llama2-70b and --profile-from-log (one predictor whatever the profile source). Other
    profiles, or one that has it already, are left as they are."""
    if profile.get("name") != "llama2-70b" or \
            ((profile.get("ladder") or {}).get("llama2_70b") or {}).get("sharpness"):
        return
    if int(profile.get("num_layers", -1)) != PRESETS["llama2-70b"].num_layers:
        return
    lad_dir = ladder or package_data.ladder_dir("llama2-70b")
    clip = float(profile.get("clip") or LLAMA2_70B_SETTINGS["clip"])
    fit, ext = LD.ladder_70b(lad_dir, eps=float(profile["eps_ref"]), clip=clip)
    numel = profile_numel(profile)
    rho = profile["rho_by_depth"]
    mean = math.sqrt(sum(numel[d] * rho[d] ** 2 for d in rho) / sum(numel[d] for d in rho))
    lad = _with_law(LD.public(ext), shipped=ladder is None or Path(ladder).resolve()
                    == package_data.ladder_dir("llama2-70b").resolve())
    lad["mean_rho"] = mean
    profile["ladder"] = {"fit": LD.public(fit), "llama2_70b": lad}
    profile.setdefault("inputs", profile_inputs(
        eps_ref=(float(profile["eps_ref"]), profile.get("source", "the profile")),
        rho_bar=(mean, "the profile's rho, numel-weighted rms over depths"),
        sharpness=("the ladder's 70B reading", f"{lad_dir}")))


def profile_from_run(path: Path) -> dict:
    run = load_run(path, tables=("layers",), layer_columns=["grad_rms", "grad_mom_cos"])
    if run.layers.empty:
        raise ConfigError(f"{path}: the run has no layers rows (no per-tensor telemetry)")
    optim = run.config.get("optim", {})
    eps = float(optim.get("eps", math.nan))
    if not eps > 0:
        raise ConfigError(f"{path}: run.json config optim.eps must be > 0 to define rho, got {eps}")
    b1 = float(optim.get("b1", 0.9))
    lay = run.layers
    numel_t = lay.groupby("name")["numel"].first().astype(float)
    depth_t = lay.groupby("name")["depth"].first().astype(int)
    # per step and depth: group_rho over the depth's tensors (numel-weighted rms of grad_rms)
    g = lay.groupby(["step", "name"])["grad_rms"].first().unstack("name")
    per_step = pd.DataFrame({d: group_rho(g[names].to_numpy(float), numel_t[names].to_numpy())
                             for d, names in depth_t.groupby(depth_t).groups.items()},
                            index=g.index)
    grad = per_step.median()
    grad_lo, grad_hi = per_step.quantile(0.1), per_step.quantile(0.9)
    numel_d = numel_t.groupby(depth_t).sum()
    cos = lay.groupby("depth")["grad_mom_cos"].median()
    phis = np.linspace(-0.9, 0.99, 190)
    curve = np.array([grad_mom_cos(b1, 1.0, 0.0, p) for p in phis])
    rho, phi = {}, {}
    for d, g in grad.items():
        if not (np.isfinite(g) and g > 0):
            continue
        rho[int(d)] = float(g / eps)
        c = cos.get(d, math.nan)
        phi[int(d)] = float(np.clip(phis[np.argmin(np.abs(curve - c))], 0.0, 0.99)) \
            if np.isfinite(c) else 0.0
    if not rho:
        raise ConfigError(f"{path}: no depth with a positive finite grad_rms")
    model, train = run.config.get("model", {}), run.config.get("train", {})
    num_layers = int(model.get("num_layers") or max(max(rho), 0))
    lo = {d: float(grad_lo[d] / eps) for d in rho}
    hi = {d: float(grad_hi[d] / eps) for d in rho}
    return {"name": str(model.get("preset", path.name)), "num_layers": num_layers, "eps_ref": eps,
            "rho_by_depth": rho, "phi_by_depth": phi, "lr": float(optim.get("lr", 1e-3)),
            "numel_by_depth": {d: int(numel_d[d]) for d in rho},
            "by_depth": _by_depth(num_layers, rho, lo, hi) if all(
                -1 <= d <= num_layers for d in rho) else [],
            "b1": b1, "global_batch_size": int(train.get("global_batch_size", 1)),
            "seq_len": train.get("seq_len"),
            "source": f"measured: median over steps of the numel-weighted rms of grad_rms "
                      f"per depth of run {path}"}


def profile_from_json(path: Path) -> dict:
    data = read_json(path, ConfigError, f"{path}: profile not found")
    for k in ("num_layers", "eps_ref", "rho_by_depth"):
        if k not in data:
            raise ConfigError(f"{path}: profile field {k!r} missing")
    try:
        rho = {int(d): float(v) for d, v in dict(data["rho_by_depth"]).items()}
        phi_in = data.get("phi", 0.0)
        phi = ({int(d): float(v) for d, v in phi_in.items()} if isinstance(phi_in, dict)
               else {d: float(phi_in) for d in rho})
        eps_ref, num_layers = float(data["eps_ref"]), int(data["num_layers"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: malformed profile ({e})") from None
    if not rho or any(not (v > 0 and math.isfinite(v)) for v in rho.values()):
        raise ConfigError(f"{path}: rho_by_depth must hold positive finite numbers")
    check_positive("eps_ref", eps_ref, f"{path}: ")
    if any(not -1 < v < 1 for v in phi.values()):
        raise ConfigError(f"{path}: phi must lie in (-1, 1)")
    name = str(data.get("name", path.stem))
    if "numel_by_depth" in data:
        try:
            numel = {int(d): float(v) for d, v in dict(data["numel_by_depth"]).items()}
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: malformed numel_by_depth ({e})") from None
        if any(d not in numel or not (numel[d] > 0 and math.isfinite(numel[d])) for d in rho):
            raise ConfigError(f"{path}: numel_by_depth must give a positive count for every "
                              "depth of rho_by_depth")
        numel_src = "numel_by_depth of the profile"
    elif name in PRESETS and PRESETS[name].num_layers == num_layers:
        numel, numel_src = preset_numel_by_depth(name), f"preset {name}"
    else:
        numel, numel_src = {d: 1.0 for d in rho}, "none given: equal per depth"
    return {"name": name, "num_layers": num_layers, "eps_ref": eps_ref,
            "rho_by_depth": rho, "phi_by_depth": {d: phi.get(d, 0.0) for d in rho},
            "numel_by_depth": {d: numel[d] for d in rho}, "numel_source": numel_src,
            "lr": check_positive("lr", data.get("lr", 1.5e-4), f"{path}: "),
            "b1": check_beta("b1", data.get("b1", 0.9), f"{path}: "),
            "global_batch_size": int(data.get("global_batch_size", 1024)),
            "seq_len": data.get("seq_len"), "source": f"profile file {path}"}


def load_profile(spec: str, ladder: str | None = None,
                 batch_sharpness: str | None = None) -> dict:
    if batch_sharpness and spec != "llama2-70b":
        raise ConfigError("--batch-sharpness: only with --profile llama2-70b")
    if spec == "llama2-70b":
        if not ladder:            # a fresh install: the ladder shipped with the package
            lad = package_data.ladder_dir("llama2-70b")
            prof = ladder_profile(lad, batch_sharpness)
            rel = str(lad.relative_to(package_data.DATA.parent.parent))   # not this machine's
            prof["source"] = (package_data.describe(package_data.manifest("llama2-70b"))
                              + "; " + prof["source"].replace(str(lad), rel))
            return prof
        if not Path(ladder).is_dir():
            raise ConfigError(f"--ladder {ladder}: not a directory")
        return ladder_profile(ladder, batch_sharpness)
    p = Path(spec)
    if p.is_dir():
        try:
            return profile_from_run(p)
        except RunFormatError as e:
            raise ConfigError(str(e)) from None
    if p.is_file():
        return profile_from_json(p)
    raise ConfigError(f"--profile: {spec!r} is neither 'llama2-70b', a profile JSON nor a run directory")


def shallow_depths(profile: Mapping[str, Any]) -> list[int]:
    """The profile's depths in the embed and shallow groups (adamspike.depth_groups)."""
    shallow = set(group_shallow_depths(int(profile["num_layers"])))
    return [d for d in sorted(profile["rho_by_depth"]) if d in shallow]


# ----------------------------------------------------------------------------- candidates

CANDIDATE_KEYS = ("optim.b1", "optim.b2", "optim.eps", "optim.lr", "train.global_batch_size")


def _profile_defaults(profile: Mapping[str, Any]) -> dict:
    return {"optim.b1": profile["b1"], "optim.lr": profile["lr"],
            "train.global_batch_size": profile["global_batch_size"]}


def default_candidates(profile: Mapping[str, Any]) -> list[dict]:
    """LLaMA2-70B: eps {1e-5 (as run), 1e-6, 1e-8} x b2 {0.95 (as run), 0.99} x lr
    {1.5e-4 (as run), 3e-4} x global batch {1024 (as run), 2048}: 24 settings. Other
    profiles: the seed report's eps (1e-5, 1e-8) x b2 (0.95, 0.99, 0.999), plus the
    run's setting at half the learning rate."""
    base = _profile_defaults(profile)
    if profile.get("name") == "llama2-70b":
        return [{**base, "optim.b2": b2, "optim.eps": eps, "optim.lr": lr,
                 "train.global_batch_size": bs}
                for eps in (1e-5, 1e-6, 1e-8) for b2 in (0.95, 0.99) for lr in (1.5e-4, 3e-4)
                for bs in (1024, 2048)]
    out = [{**base, "optim.b2": b2, "optim.eps": eps}
           for eps in (1e-5, 1e-8) for b2 in (0.95, 0.99, 0.999)]
    out.append({**base, "optim.b2": 0.95, "optim.eps": 1e-5, "optim.lr": base["optim.lr"] / 2})
    return out


def load_candidates(path: str, profile: Mapping[str, Any]) -> list[dict]:
    """[[candidate]] tables of dotted keys (CANDIDATE_KEYS, optional id); optim.b2 and
    optim.eps are required, the others default to the profile's. Values are validated by
    RunConfig.from_dict (ConfigError names the candidate and the key)."""
    data = read_toml(path)
    unknown = sorted(set(data) - {"candidate"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected [[candidate]] tables")
    cands = data.get("candidate", [])
    if not isinstance(cands, list) or not cands:
        raise ConfigError(f"{path}: no [[candidate]] tables")
    out = []
    for i, c in enumerate(cands):
        c = dict(c)
        cid = c.pop("id", None)
        out.append(_candidate(flatten(c), f"candidate[{i}]", profile, cid))
    return out


def baseline(profile: Mapping[str, Any]) -> dict:
    """The profile's own setting (the run it describes): its eps_ref, b1, lr, batch, and
    b2 where the profile states one (else the 70B config's 0.95, `b2_assumed`)."""
    return {**_profile_defaults(profile), "optim.eps": float(profile["eps_ref"]),
            "optim.b2": float(profile.get("b2") or 0.95)}


def _candidate(flat: Mapping[str, Any], where: str, profile: Mapping[str, Any],
               cid: str | None = None, fill_baseline: bool = False) -> dict:
    """One candidate: CANDIDATE_KEYS only, optim.b2 and optim.eps required (fill_baseline:
    the baseline's, named in `assumed`), the rest from the profile, validated by
    RunConfig.from_dict (ConfigError names `where` and the key)."""
    bad = sorted(set(flat) - set(CANDIDATE_KEYS))
    if bad:
        raise ConfigError(f"{where}.{bad[0]}: unknown key (known: id, {', '.join(CANDIDATE_KEYS)})")
    assumed = {}
    for k in ("optim.b2", "optim.eps"):
        if k not in flat:
            if not fill_baseline:
                raise ConfigError(f"{where}.{k}: missing")
            assumed[k] = baseline(profile)[k]
    flat = {**_profile_defaults(profile), **assumed, **flat}
    try:
        cfg = flatten(to_dict(RunConfig.from_dict(flat)))
    except ConfigError as e:
        raise ConfigError(f"{where}.{e}") from None
    if not cfg["optim.eps"] > 0:
        raise ConfigError(f"{where}.optim.eps: must be > 0 (rho = rms(g) / eps)")
    for k in ("optim.b1", "optim.b2"):
        check_beta(k, cfg[k], f"{where}.")
    check_positive("optim.eps", cfg["optim.eps"], f"{where}.")
    scale = float(profile["eps_ref"]) / cfg["optim.eps"]
    rhos = [float(v) * scale for v in profile["rho_by_depth"].values()]
    for v in (min(rhos), max(rhos)):
        check_rho(f"{where}.optim.eps", v, f"at eps {cfg['optim.eps']:g} the profile's depths "
                  f"have rho {min(rhos):.3g} to {max(rhos):.3g} (rho = rho_ref x eps_ref "
                  f"{float(profile['eps_ref']):g} / eps)")
    return {**({"id": cid} if cid else {}), **{k: cfg[k] for k in CANDIDATE_KEYS},
            **({"assumed": assumed} if assumed else {})}


def parse_setting(text: str, profile: Mapping[str, Any]) -> dict:
    """`--setting optim.eps=1e-6,optim.b2=0.95` (or `eps=1e-6,b2=0.95`: README's short
    keys, adamspike.config.parse_setting_text) as a candidate; a key left out is the
    profile's baseline (`assumed` names it)."""
    flat = parse_setting_text(RunConfig, text, allowed=CANDIDATE_KEYS)
    return _candidate(flat, f"--setting {text!r}", profile, fill_baseline=True)


def setting_id(c: Mapping[str, Any]) -> str:
    return c.get("id") or (f"eps{c['optim.eps']:.0e}-b2_{c['optim.b2']:g}-lr{c['optim.lr']:.2g}"
                           f"-b1_{c['optim.b1']:g}-bs{int(c['train.global_batch_size'])}")


# ----------------------------------------------------------------------------- risk

def rate_model(model_path: str | None, sweeps: Sequence[str], n_boot: int = SR.N_BOOT,
               mechanism: bool = True) -> tuple[SR.RateModel, dict]:
    """(model, provenance): the GLM from a model.json, or fitted on the sweep tables
    (adamspike.spike_rate.training_table, as `adamspike spike-rate` builds it), or the one
    shipped with the package: the mechanism model, or (mechanism=False: a profile without
    the ladder's sharpness) the shipped sweep-trained regime model."""
    if model_path:
        m = SR.load_model(model_path)
        return m, {"model_file": str(model_path),
                   "model_sha256": hashlib.sha256(Path(model_path).read_bytes()).hexdigest()}
    if not sweeps:                # a fresh install: the model shipped with the package
        path = package_data.rate_model_path("llama2-70b", mechanism=mechanism)
        m = SR.load_model(path)
        rel = path.relative_to(package_data.DATA.parent.parent)
        return m, {"model_file": f"package data {rel}",
                   "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                   "shipped": package_data.describe(package_data.manifest("llama2-70b"))}
    rows, _ = SR.training_table(sweeps)
    m = SR.fit(rows, n_boot=n_boot)
    prov = {"fitted_on": [Path(sw).name for sw in sweeps]}
    try:
        v = SR.validate(rows, n_boot=min(n_boot, 50))
        prov["validation"] = {k: v[k] for k in ("split", "n_train", "n_heldout", "heldout_spikes",
                                                "all_heldout_zero", "model", "baseline",
                                                "baseline_rate_per_1k")}
    except SR.SpikeRateError as e:
        prov["validation"] = {"skipped": str(e)}
    return m, prov


def profile_numel(profile: Mapping[str, Any]) -> dict[int, float]:
    """Parameters per depth of the profile (numel_by_depth; equal per depth when absent)."""
    n = profile.get("numel_by_depth") or {}
    return {d: float(n.get(d, n.get(str(d), 1.0)) if n else 1.0) for d in profile["rho_by_depth"]}


# the mechanism features' phases: the median lr of each, as a fraction of the peak (linear
# warmup from 0: 1/2; cosine from the peak to peak/10 afterwards: 0.55), the medians the
# phase map's rows take over their own warmup and cosine (analysis.spike_rate.map_rows)
PHASE_LR = {"warmup": 0.5, "after": 0.55}
MECHANISM_FEATURES = {"log10_stability", "log10_rho_min", "warmup"}


def mechanism_inputs(profile: Mapping[str, Any], cand: Mapping[str, Any], phase: str,
                     which: str = "mid") -> dict:
    """The mechanism features' inputs of a candidate in a phase (PHASE_LR): rho_min, the
    smallest depth's rho at the candidate's eps, and Adam's stability number there,

        S = lr_phase lambda_max(H) c / (2 (sqrt(v_hat) + eps)),  sqrt(v_hat) ~ rho_min eps,
          = (lr_phase / eps) lambda_max(H) / (38 (1 + rho_min))     (c = (1-b1)/(1+b1))

    (the largest preconditioner entry: the group furthest into its eps band; in the band it
    is Pi_eps / 38, out of it Adam's own edge lr lambda / (38 rms), independent of eps), with
    lambda_max(H) from the full-data reading when the profile has one (`full_data`,
    simulate.ladder.full_data_sharpness: the evaluation batches' limit carried to the 70B;
    lo / hi its leave-one-rung-out range; with the law's lr term, at the candidate's peak lr); else from the ladder's minibatch sharpness fit:
    its point, its lo, and for hi the upper end of the reading without the fall beyond the
    ladder's batches (`at_ladder_tokens`, simulate.ladder.sharpness_70b). Without a
    sharpness fit in the profile S is None (the mechanism model then refuses the profile)."""
    eps = float(cand["optim.eps"])
    scale = profile["eps_ref"] / eps
    bd = {int(r["depth"]): r for r in profile.get("by_depth", [])}
    key = {"mid": "rho", "lo": "rho_lo", "hi": "rho_hi"}[which]
    rho_min = min((bd[d][key] if d in bd and key in bd[d] else v) * scale
                  for d, v in profile["rho_by_depth"].items())
    sh = ((profile.get("ladder") or {}).get("llama2_70b") or {}).get("sharpness")
    S = None
    if sh:
        pick = {"mid": "lambda_max", "lo": "lambda_max_lo", "hi": "lambda_max_hi"}[which]
        if "law" in sh:             # the plan-QC law at the candidate's lr, its prediction interval
            law = sh["law"]
            lam = dict(zip(("mid", "lo", "hi"), law_at(law, law["target"]["dim"],
                                                         law["target"]["layers"],
                                                         float(cand["optim.lr"]))))[which]
        elif "full_data" in sh:     # the measured end of the batch fall (batch-sharpness)
            fd = sh["full_data"]
            lam = fd[pick]
            if fd.get("lr_exponent") is not None:   # the law's lr term, at this lr
                lam *= (float(cand["optim.lr"]) / fd["lr_ref"]) ** fd["lr_exponent"]
        elif which == "hi" and "at_ladder_tokens" in sh:
            lam = sh["at_ladder_tokens"]["lambda_max_hi"]
        else:
            lam = sh[pick]
        lr = float(cand["optim.lr"]) * PHASE_LR[phase]
        S = lr / eps * lam / (LD.PI_THRESHOLD * (1 + rho_min))
    return {"rho_min": rho_min, "stability": S, "warmup": float(phase == "warmup")}


def mechanism(S: float | None, rho_min: float, S_hi: float | None = None,
              S_lo: float | None = None) -> str:
    """Which mechanism a setting is exposed to, in the plan's labels
    (adamspike.sharpness_law.label, docs/plan/science4_v*.toml [labels]): "A" when the
    lower end of S's interval reaches the edge (S_lo >= 1), "below the edge" when its
    upper end does not (S_hi < 1), "undetermined (A)" when the interval straddles it;
    " + B" when a group is dormant (rho_min < 0.1). Where A applies it says whether in the
    eps band (rho_min < 1) or at Adam's own edge. Without a sharpness reading (S None):
    only B can be said."""
    if S is None:
        return ("B (dormant group: rho_min < 0.1); A unknown (no sharpness fit)"
                if rho_min < RHO_FROZEN else "B not indicated; A unknown (no sharpness fit)")
    lo = S if S_lo is None else S_lo
    hi = S if S_hi is None else S_hi
    tag = law_label(S, lo, hi, rho_min, dormant_rho=RHO_FROZEN)
    if not tag.startswith("below"):
        where = "eps-band edge of stability" if rho_min < 1 else "Adam's edge, out of the eps band"
        tag += f" (S {S:.2g} [{lo:.2g}, {hi:.2g}]: {where})"
    else:
        tag += f" (S {S:.2g} [{lo:.2g}, {hi:.2g}])"
    return tag


def candidate_features(profile: Mapping[str, Any], cand: Mapping[str, Any],
                       phase: str | None = None) -> dict:
    """Features (adamspike.spike_rate) of a candidate at the profile's central rho and at
    its per-depth interval: {"mid", "lo", "hi"} plus the rho_bar check; with a phase
    ("warmup", "after") also the mechanism features (`mechanism_inputs`)."""
    eps = float(cand["optim.eps"])
    scale = profile["eps_ref"] / eps
    sh = set(shallow_depths(profile))
    depths = sorted(profile["rho_by_depth"])
    numel = profile_numel(profile)
    bd = {int(r["depth"]): r for r in profile.get("by_depth", [])}
    seq = profile.get("seq_len")
    tokens = float(cand["train.global_batch_size"]) * float(seq) if seq else None
    out = {}
    for which, key in (("mid", "rho"), ("lo", "rho_lo"), ("hi", "rho_hi")):
        rho = {d: (bd[d][key] if d in bd and key in bd[d] else profile["rho_by_depth"][d]) * scale
               for d in depths}
        side = {}
        for k, ds in (("s", [d for d in depths if d in sh]), ("d", [d for d in depths if d not in sh])):
            side[k] = float(group_rho([rho[d] for d in ds], [numel[d] for d in ds])) if ds else None
        out[which] = SR.setting_features(
            rho_shallow=side["s"], rho_deep=side["d"],
            b2=float(cand["optim.b2"]), lr=float(cand["optim.lr"]), eps=eps,
            tokens_per_step=tokens,
            **(mechanism_inputs(profile, cand, phase, which) if phase else {}))
    ext = (profile.get("ladder") or {}).get("llama2_70b") or {}
    if ext.get("mean_rho") is not None and profile.get("num_params"):
        rho_bar = float(ext["mean_rho"]) * scale
        bound = float(profile.get("clip", 1.0)) / (math.sqrt(profile["num_params"]) * eps)
        if rho_bar > bound * (1 + 1e-6):
            raise ConfigError(f"profile: mean rho {rho_bar:.3g} at eps {eps:g} exceeds the clip "
                              f"bound {bound:.3g}")
        out["rho_bar"], out["rho_bar_bound"] = rho_bar, bound
    return out


_RISK_CACHE: dict = {}
RHO_QUANTUM_DECADES = 0.05   # closed forms are evaluated on a 1/20-decade rho grid (cached)
PHI_QUANTUM = 0.05


def _layer_risk(rho: float, phi: float, b1: float, b2: float, eps: float) -> dict:
    """theory.risk.layer_risk for one depth at rho, phi rounded to the quanta above (the
    fields used here do not depend on lr); regime is that of the exact rho."""
    rq = 10 ** (round(math.log10(rho) / RHO_QUANTUM_DECADES) * RHO_QUANTUM_DECADES)
    pq = round(phi / PHI_QUANTUM) * PHI_QUANTUM
    key = (rq, pq, b1, b2, eps)
    if key not in _RISK_CACHE:
        _RISK_CACHE[key] = layer_risk([rq], [pq], b1, b2, eps, 1.0)[0]
    return {**_RISK_CACHE[key], "rho": rho, "phi": phi, "regime": regime(rho)}


def assess(profile: Mapping[str, Any], cand: Mapping[str, Any], model: SR.RateModel,
           horizon: int = DEFAULT_HORIZON_STEPS) -> dict:
    """One setting of predictions.json: the GLM's rate with its interval, P(>= 1 spike in
    `horizon` steps), the features and their extrapolation flags, the per-depth theory."""
    depths = sorted(profile["rho_by_depth"])
    b1, b2, eps = cand["optim.b1"], cand["optim.b2"], cand["optim.eps"]
    scale = profile["eps_ref"] / eps
    rhos = [profile["rho_by_depth"][d] * scale for d in depths]
    phis = [profile["phi_by_depth"].get(d, 0.0) for d in depths]
    rows = [_layer_risk(r, p, b1, b2, eps) for r, p in zip(rhos, phis)]
    # a model with the mechanism features predicts each phase (warmup, after) on its own;
    # the setting's rate (its rank) is the after-warmup one
    phased = bool(MECHANISM_FEATURES & set(model.features))
    per: dict = {}
    for phase in (("warmup", "after") if phased else (None,)):
        feats = candidate_features(profile, cand, phase)
        try:
            X = model.matrix([feats["mid"], feats["lo"], feats["hi"]])
        except SR.SpikeRateError as e:
            raise ConfigError(f"candidate {setting_id(cand)}: {e} (profile {profile['name']})"
                              + ("; the mechanism features need the ladder's sharpness fit"
                                 if phased else "")) from None
        iv = model.rate_interval(X)
        extrap = model.extrapolation(feats["mid"])
        sup = model.support(feats["mid"])
        outside = [f"{f} {v}" for f, v in extrap.items() if v != "inside"]
        if sup.get("outside_joint_support"):
            outside.append(f"the joint feature point (distance {sup['nearest_run_distance']:.2f} "
                           f"to the nearest training run > {sup['nn_distance_max']:.2f}, the "
                           "data's largest gap)")
        # a group the model ignores but that differs from its training data: the prediction
        # assumes it has no effect, which the data cannot check
        outside += [f"{k} {v}" for k, v in sup["unmodelled"].items() if not v.startswith("inside")]
        per[phase] = {"feats": feats, "iv": iv, "extrap": extrap, "sup": sup, "outside": outside,
                      "rate": float(iv["rate"][0]), "lo": float(np.min(iv["lo"])),
                      "hi": float(np.max(iv["hi"]))}
    last = per[list(per)[-1]]
    feats, iv, extrap, sup = last["feats"], last["iv"], last["extrap"], last["sup"]
    # the phases' reasons, once each (the joint-support line: the last phase's distance)
    outside = list(dict.fromkeys(o for v in per.values() for o in v["outside"]
                                 if not o.startswith("the joint") or v is last))
    rate, lo, hi = last["rate"], last["lo"], last["hi"]
    p = float(SR.p_spike(rate, horizon))
    p_lo, p_hi = float(SR.p_spike(lo, horizon)), float(SR.p_spike(hi, horizon))
    label = "low" if p < 1 / 3 else "medium" if p < 2 / 3 else "high"
    sh = set(shallow_depths(profile))
    sh_rows = [r for d, r in zip(depths, rows) if d in sh]
    frozen = sum(r["regime"] == "frozen" for r in sh_rows)
    trans = sum(r["regime"] == "transition" for r in sh_rows)
    per_depth = [{"depth": d, **{k: r[k] for k in ("rho", "phi", "regime", "update_rms", "bc",
                                                    "sat_frac", "rms_t_bound", "const_peak",
                                                    "frozen_risk")}}
                 for d, r in zip(depths, rows)]
    fm = feats["mid"]
    rationale = (f"GLM: {rate:.3g} spikes / 1k steps [{lo:.3g}, {hi:.3g}] at shallow rho "
                 f"{10 ** fm['log10_rho_shallow']:.3g}, 1-b2 {1 - b2:g}, lr/eps "
                 f"{10 ** fm['log10_lr_over_eps']:.3g}; "
                 + (f"extrapolated ({', '.join(outside)}); " if outside
                    else "inside the training range; ")

                 + f"theory: {frozen} frozen + {trans} transition of {len(sh_rows)} shallow "
                   f"depths; rms_t <= {rows[0]['rms_t_bound']:.1f} after dormancy at b2={b2:g}")
    out = {"id": setting_id(cand), "overrides": {k: cand[k] for k in CANDIDATE_KEYS},
           "rate_per_1k": rate, "rate_ci": [lo, hi],
           "rate_ci_fisher": [float(iv["fisher"][0][0]), float(iv["fisher"][1][0])],
           "rate_ci_boot": [float(iv["boot"][0][0]), float(iv["boot"][1][0])],
           "horizon_steps": int(horizon), "p_spike": p, "p_spike_ci": [p_lo, p_hi],
           "features": json_clean(fm), "features_lo": json_clean(feats["lo"]),
           "features_hi": json_clean(feats["hi"]), "model_features": list(model.features),
           "extrapolation": extrap, "support": sup, "extrapolated": bool(outside),
           "extrapolation_reasons": outside,
           "risk": p, "risk_label": label, "rationale": rationale, "per_depth": per_depth}
    if cand.get("assumed"):
        out["assumed"] = dict(cand["assumed"])      # keys the setting left to the baseline
    if "rho_bar" in feats:
        out["rho_bar"], out["rho_bar_bound"] = feats["rho_bar"], feats["rho_bar_bound"]
    if phased:
        out["phases"] = {}
        for phase, v in per.items():
            m, lo_, hi_ = (mechanism_inputs(profile, cand, phase, w) for w in ("mid", "lo", "hi"))
            out["phases"][phase] = {
                "lr_median": float(cand["optim.lr"]) * PHASE_LR[phase],
                "rate_per_1k": v["rate"], "rate_ci": [v["lo"], v["hi"]],
                "stability": m["stability"],
                "stability_range": [lo_["stability"], hi_["stability"]],
                "rho_min": m["rho_min"],
                "mechanism": mechanism(m["stability"], m["rho_min"], hi_["stability"],
                                       lo_["stability"]),
                "extrapolation_reasons": v["outside"], "features": json_clean(v["feats"]["mid"])}
        S_max = max((v["stability"] for v in out["phases"].values() if v["stability"] is not None),
                    default=None)
        S_hi = max((v["stability_range"][1] for v in out["phases"].values()
                    if v["stability_range"][1] is not None), default=None)
        S_lo = max((v["stability_range"][0] for v in out["phases"].values()
                    if v["stability_range"][0] is not None), default=None)
        out["mechanism"] = mechanism(S_max, out["phases"]["after"]["rho_min"], S_hi, S_lo)
        out["rationale"] = (f"mechanism {out['mechanism']}; warmup {per['warmup']['rate']:.3g} "
                            f"[{per['warmup']['lo']:.3g}, {per['warmup']['hi']:.3g}], after "
                            f"{rate:.3g} [{lo:.3g}, {hi:.3g}] spikes / 1k steps; " + rationale)
    return out


# ----------------------------------------------------------------------------- alarm rules

def youden_threshold(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float, float]:
    """Threshold t maximising TPR - FPR for the rule value > t; -> (t, tpr, fpr)."""
    vals = np.unique(np.concatenate([pos, neg]))
    cands = (vals[:-1] + vals[1:]) / 2 if len(vals) > 1 else vals
    best = (-np.inf, math.nan, math.nan, math.nan)
    for t in cands:
        tpr, fpr = float(np.mean(pos > t)), float(np.mean(neg > t))
        if tpr - fpr > best[0]:
            best = (tpr - fpr, float(t), tpr, fpr)
    return best[1], best[2], best[3]


def alarm_rules(profile: Mapping[str, Any], table: pd.DataFrame | None, table_name: str,
                b1: float, b2: float) -> list[AlarmRule]:
    sh = shallow_depths(profile)
    depths = [min(sh), max(sh)]
    rules = []
    for m in ("rms_t", "sat_frac", "grad_mom_cos"):
        thr, lead, src, weak = math.nan, None, "", ""
        if table is not None and f"pre_{m}" in table and f"max_{m}" in table:
            spiked = table["num_spikes"] > 0
            pos = table.loc[spiked, f"pre_{m}"].dropna().to_numpy(float)
            neg = table.loc[~spiked & ~table["diverged"].astype(bool), f"max_{m}"].dropna().to_numpy(float)
            if len(pos) >= MIN_CLASS_RUNS and len(neg) >= MIN_CLASS_RUNS:
                thr, tpr, fpr = youden_threshold(pos, neg)
            if math.isfinite(thr) and tpr - fpr < MIN_YOUDEN_J:
                weak = (f"sweep {table_name}: {m} does not separate spiking from calm runs "
                        f"(best TPR {tpr:.2f}, FPR {fpr:.2f}); ")
                thr = math.nan
            if math.isfinite(thr):
                leads = table.loc[spiked, f"lead_{m}"].dropna().to_numpy(float)
                if len(leads):
                    lead = [max(1, int(math.floor(np.quantile(leads, 0.1)))),
                            max(1, int(math.ceil(np.quantile(leads, 0.9))))]
                src = (f"sweep {table_name}: Youden-optimal split of pre-spike maxima of {m} "
                       f"({len(pos)} spiking runs) vs run maxima ({len(neg)} runs without spikes): "
                       f"TPR {tpr:.2f}, FPR {fpr:.2f}")
        if not math.isfinite(thr):
            src = weak
            if m == "rms_t":
                thr, lead = 2.0, [1, 8]
                src += "literature: StableAdamW (Wortsman 2023a), rms_t exceeds ~2-5 1-8 steps before spikes"
            elif m == "grad_mom_cos":
                snr = snr_bc_crossing(b1, b2)
                norm = math.sqrt(1 + snr * snr)
                thr = grad_mom_cos(b1, 1 / norm, snr / norm)
                src += (f"theory: grad_mom_cos at the SNR {snr:.3f} where r turns bimodal "
                       "(theory.bimodality.snr_bc_crossing, theory.adam_moments.grad_mom_cos)")
            else:
                continue
        rules.append(AlarmRule(id=f"{m}_shallow", metric=m, op=">", threshold=float(thr),
                               depths=tuple(depths), reduce="max", consecutive=1,
                               expected_lead_steps=tuple(lead) if lead else None, source=src))
    rules.append(AlarmRule(id="bimodality_shallow", metric="bimodality", op=">",
                           threshold=float(BC_THRESHOLD), depths=tuple(depths), reduce="median",
                           source="theory: Sarle's bimodality threshold 5/9 "
                                  "(theory.bimodality.BC_THRESHOLD), most shallow tensors"))
    rules.append(AlarmRule(id="rho_shallow_frozen", metric="rho", op="<", threshold=float(RHO_FROZEN),
                           depths=tuple(depths), reduce="group_rho", consecutive=5,
                           source="theory: frozen band rho < 0.1 (theory.eps_regime.RHO_FROZEN); "
                                  "rho of the shallow side = group_rho over its tensors "
                                  "(adamspike.depth_groups), the GLM's statistic"))
    return rules


# ----------------------------------------------------------------------------- build

def _model_summary(model: SR.RateModel, prov: Mapping[str, Any], horizon: int,
                   settings: Sequence[Mapping[str, Any]]) -> dict:
    ext = [s["id"] for s in settings if s["extrapolated"]]
    unm = sorted({f"{k} ({v})" for s in settings for k, v in s["support"]["unmodelled"].items()
                  if not v.startswith("inside")})
    d = model.to_json()
    summary = {k: d[k] for k in ("features", "coefficients", "ridge", "dispersion", "ci",
                                 "n_runs", "n_spikes", "total_steps", "baseline_rate_per_1k",
                                 "train_range", "data_range", "sources")}
    if "validation" in d:
        summary["validation"] = {k: v for k, v in d["validation"].items()
                                 if k not in ("calibration", "coefficients")}
    summary.update(prov)
    record = package_data.public_record("llama2-70b")
    if record and record.get("model_sha256") == summary.get("model_sha256"):
        summary["public_record"] = record      # this very model's record (science4)
    summary["horizon_steps"] = int(horizon)
    summary["extrapolation_note"] = (
        (f"{len(ext)} of {len(settings)} settings are extrapolations: outside a model "
         "feature's training range, outside the joint support of the training runs, or with a "
         "group the model does not use that differs from its training data (each setting's "
         "`extrapolation_reasons`)" if ext else
         f"all {len(settings)} settings lie inside every model feature's training range and "
         "the joint support")
        + (f"; groups the model does not use that differ from the training data: "
           f"{', '.join(unm)} (the prediction assumes they have no effect)" if unm else "")
        + f". The training runs are toy problems ({', '.join(model.sources)}); a prediction "
          "for another model (profile: see `profile`) transfers the dimensionless groups only "
          "and is an extrapolation in model class and scale: a pre-registered hypothesis, "
          "not an interpolation")
    return summary


def predict(profile: dict, candidates: Sequence[Mapping[str, Any]], table: pd.DataFrame | None,
            table_name: str = "", model: SR.RateModel | None = None,
            provenance: Mapping[str, Any] | None = None,
            horizon: int = DEFAULT_HORIZON_STEPS) -> Predictions:
    """predictions.json: the GLM's rate per candidate (`assess`), ranked; alarm rules from
    the sweep table (or theory / literature)."""
    if model is None:
        raise ConfigError("no spike-rate model (--rate-model or --sweep)")
    settings = [assess(profile, c, model, horizon) for c in candidates]
    ids = [s["id"] for s in settings]
    if len(set(ids)) != len(ids):
        raise ConfigError("candidates: two candidates have the same id/setting")
    settings.sort(key=lambda s: (s["rate_per_1k"], -s["overrides"]["optim.lr"], s["id"]))
    for i, s in enumerate(settings, 1):
        s["rank"] = i
    # settings the model cannot tell apart (same model features: the same rate): each names
    # the others, and `validate` takes one of each (the lowest rate first)
    for ids in indistinguishable(settings):
        for s in settings:
            if s["id"] in ids:
                s["same_prediction_as"] = [i for i in ids if i != s["id"]]
    validate, seen = [], set()
    for s in settings:
        key = model_key(s)
        if key is None or key not in seen:
            validate.append(s["id"])
            seen.add(key)
        if len(validate) == NUM_VALIDATE:
            break
    base = candidates[0]
    rules = alarm_rules(profile, table, table_name, base["optim.b1"], base["optim.b2"])
    prof = {"name": profile["name"], "num_layers": int(profile["num_layers"]),
            "rho_by_depth": {str(d): float(v) for d, v in sorted(profile["rho_by_depth"].items())},
            "phi": float(np.median(list(profile["phi_by_depth"].values()))),
            "phi_by_depth": {str(d): float(v) for d, v in sorted(profile["phi_by_depth"].items())},
            "eps_ref": profile["eps_ref"], "shallow_depths": shallow_depths(profile),
            "numel_by_depth": {str(d): int(v) for d, v in sorted(profile_numel(profile).items())},
            "source": profile["source"]}
    if profile.get("numel_source"):
        prof["numel_source"] = profile["numel_source"]
    for k in ("by_depth", "ladder", "rho_bar", "rho_bar_interval", "seq_len", "clip",
              "num_params", "num_params_log", "inputs", "shipped_inputs", "lr", "b1", "b2",
              "global_batch_size"):
        if k in profile and profile[k] is not None:
            prof[k] = profile[k]
    src = {"sweep": table_name or None, "sweep_runs": 0 if table is None else int(len(table)),
           "method": "rate per 1000 steps from the Poisson GLM of adamspike.spike_rate "
                     "(rate_model); risk = P(>= 1 spike in horizon_steps); see "
                     "simulate/predict.py"}
    return Predictions(settings=settings, alarm_rules=rules,
                       validate=validate, profile=prof,
                       source=src, rate_model=_model_summary(model, provenance or {}, horizon,
                                                             settings))


def _count(text: str) -> int:
    """A whole number given as digits or in scientific notation (176e9)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v) or v < 1:
        raise argparse.ArgumentTypeError(f"not a whole number >= 1: {text!r}")
    return int(v)


def settings_text(pred: Predictions) -> str:
    """The settings' rates as text (`--setting` without --out: not pre-registered): the
    model and its version, the profile's baseline setting, each input with its source,
    the inputs that differ from the shipped llama2-70b profile, the keys not in the
    model; per setting its rate, marked where it is the baseline, where a key was left to
    the baseline, and where it differs from the baseline only in keys the model cannot see."""
    prof = pred.profile
    base = baseline(prof)
    blind = not_in_model(pred.rate_model.get("features") or [])
    L = [f"model: {model_label(pred.rate_model)}",
         *([record_text(pred.rate_model["public_record"])]
           if pred.rate_model.get("public_record") else []),
         f"profile: {prof['name']} ({prof['source'][:160]}...)",
         "baseline setting: " + ", ".join(f"{k} {base[k]:g}" for k in CANDIDATE_KEYS)
         + (" (optim.b2 assumed: the profile states none)" if not prof.get("b2") else "")]
    inputs = prof.get("inputs") or {}
    if inputs:
        L.append("inputs: " + "; ".join(f"{k} {_g(v['value'])} ({v['source']})"
                                        for k, v in inputs.items() if k != "ladder_mean_rho"))
    ref = prof.get("shipped_inputs") or {}
    if ref:
        diff = [f"{k} {_g(inputs[k]['value'])} here vs {_g(v['value'])} ({v['source']})"
                for k, v in ref.items() if k in inputs and not _same(inputs[k]["value"], v["value"])]
        L.append("inputs that differ from --profile llama2-70b (the same model and the same "
                 "computation): " + ("; ".join(diff) if diff else
                                     "none, so the same numbers"))
    if blind:
        L.append(f"not in the model: {', '.join(blind)} (the model gives the same number at any "
                 "value of them: not a measurement of no effect)")
    for s in pred.settings:
        ov = s["overrides"]
        moved = [k for k in CANDIDATE_KEYS if not _same(ov[k], base[k])]
        tag = (" [baseline]" if not moved else
               f" [differs from the baseline only in {', '.join(moved)}: not in the model, so "
               "this is the baseline's number]" if set(moved) <= set(blind) else "")
        L.append(f"{s['id']}{tag}: {s['rate_per_1k']:.3g} spikes / 1k steps "
                 f"[{s['rate_ci'][0]:.3g}, {s['rate_ci'][1]:.3g}], P(>= 1 in "
                 f"{s['horizon_steps']} steps) {s['p_spike']:.3g}"
                 + ("; assumed (left to the baseline): " + ", ".join(
                     f"{k} {v:g}" for k, v in s["assumed"].items()) if s.get("assumed") else "")
                 + ("; extrapolated: " + "; ".join(s.get("extrapolation_reasons") or [])
                    if s["extrapolated"] else "")
                 + (f"; the model predicts the same for {', '.join(s['same_prediction_as'])}"
                    if s.get("same_prediction_as") else ""))
        if s.get("mechanism"):
            L.append(f"  mechanism after the warmup: {s['mechanism']}")
    L.append("(not pre-registered: give --out FILE to write predictions.json)")
    return "\n".join(L)


def record_text(rec: Mapping[str, Any]) -> str:
    """One line: this rate model's record on the public runs with a spike count
    (study.science4.record_summary), so its rates are read beside it."""
    ll = rec.get("loglik") or {}
    tag = rec.get("reading", "v4")
    L = (f"record on public runs (adamspike science4, {rec['runs_counted']} runs with a count, "
         f"{rec['spikes_reported']:g} visible spikes reported in {rec['steps']:,.0f} steps): "
         f"log-likelihood {ll.get(tag, float('nan')):.1f} for this model"
         + (" with the shipped sharpness law" if tag == "qc" else "") + " vs "
         f"{ll.get('const', float('nan')):.1f} for a constant "
         f"{rec['const_rate_per_1k']:.2g} spikes / 1k steps")
    meta = rec.get("meta_llama2_70b")
    if meta:
        lo, hi = meta["expected_interval"]
        L += (f"; it expects {meta['expected']:.0f} [{lo:.0f}, {hi:.0f}] over Meta's LLaMA2-70B "
              f"run (~{meta['horizon_steps']:,.0f} steps, the same recipe), "
              f"{meta['reported']:g} reported")
    return L + ". Its rates count the toys' k = 4 / >= 10 % jumps, not visible spikes."


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    except (TypeError, ValueError):
        return a == b


def _g(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_g(x) for x in v) + "]"
    return f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike predict", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--profile", help="llama2-70b (--ladder, else the shipped ladder) | "
                                         "PROFILE.json | RUN_DIR")
    which.add_argument("--profile-from-log", metavar="LOG",
                       help="Megatron training log of the 70B (rho_bar from its grad norms; "
                            "depth shape from --ladder)")
    which.add_argument("--profile-from-run", metavar="RUN",
                       help="telemetry run directory (measured per-depth rho)")
    ap.add_argument("--ladder", help="ladder directory (adamspike simulate ladder)")
    ap.add_argument("--batch-sharpness", metavar="DIR",
                    help="--profile llama2-70b: a batch-sharpness folder (adamspike simulate "
                         "batch-sharpness; default: batch_sharpness.json in the ladder folder): "
                         "the full-data sharpness reading")
    ap.add_argument("--clip", type=float, help="--profile-from-log: grad clip (default: the "
                    "log's clip_grad / gradient_clipping, else the 70B run's 1.0, said as "
                    "assumed)")
    ap.add_argument("--eps-ref", type=float, help="--profile-from-log: the run's eps (default: "
                    "the log's adam_eps / optimizer eps, else the 70B run's 1e-5, said as "
                    "assumed)")
    ap.add_argument("--num-params", type=_count, metavar="N",
                    help="--profile-from-log: parameters of the logged model (176e9 accepted; "
                         "default: the count the log prints, else the llama2-70b preset's)")
    ap.add_argument("--sweep", action="append", default=[],
                    help="sweep table (runs.parquet / .csv or a sweep directory; repeatable): "
                         "the alarm thresholds, and the GLM's data without --rate-model")
    ap.add_argument("--rate-model", metavar="MODEL.json",
                    help="spike-rate GLM from `adamspike spike-rate` (else fitted on --sweep)")
    ap.add_argument("--horizon-steps", type=int, default=DEFAULT_HORIZON_STEPS,
                    help="N of P(>= 1 spike in N steps)")
    ap.add_argument("--candidates", help="TOML with [[candidate]] tables of dotted keys "
                    "(optim.b1, optim.b2, optim.eps, optim.lr, train.global_batch_size)")
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=V,...",
                    help="a candidate as dotted keys, e.g. optim.eps=1e-6,optim.b2=0.95 "
                         "(repeatable; replaces the default candidates; without --out the "
                         "rates are printed, nothing is written)")
    ap.add_argument("--out", help="predictions.json to write (must not exist: a pre-registered "
                    "file is never overwritten); required unless --setting is given")
    return cli_main(ap, argv, _main, "adamspike predict",
                    (ConfigError, PredictionsError, SR.SpikeRateError, ValueError))


def _main(args) -> int:
    if not args.out and not args.setting:
        raise ConfigError("--out: required (or --setting KEY=V,... to print the rates)")
    if args.setting and args.candidates:
        raise ConfigError("--setting and --candidates: give one of them")
    if args.out and Path(args.out).exists():
        raise ConfigError(f"{args.out}: exists (a pre-registered predictions file is never "
                          "overwritten); choose a new --out")
    if args.out:
        check_out(args.out, kind="file")   # a read-only or unwritable place, before computing
    if args.horizon_steps < 1:
        raise ConfigError(f"--horizon-steps: must be >= 1, got {args.horizon_steps}")
    if args.profile_from_log:
        profile = profile_from_log(args.profile_from_log,
                                   args.ladder or package_data.ladder_dir("llama2-70b"),
                                   args.clip, args.eps_ref, args.num_params)
    elif args.profile_from_run:
        if not Path(args.profile_from_run).is_dir():
            raise ConfigError(f"--profile-from-run {args.profile_from_run}: not a directory")
        profile = load_profile(args.profile_from_run)
    else:
        profile = load_profile(args.profile, args.ladder, args.batch_sharpness)
    with_70b_sharpness(profile, args.ladder)
    tables = [SR.read_sweep_table(sw) for sw in args.sweep]
    for sw, t in zip(args.sweep, tables):
        need = {"optim.b2", "num_spikes", "diverged"}
        if not need <= set(t.columns):
            raise ConfigError(f"{sw}: not a sweep table (missing {sorted(need - set(t.columns))})")
    table = pd.concat(tables, ignore_index=True) if tables else None
    cands = (load_candidates(args.candidates, profile) if args.candidates
             else [parse_setting(t, profile) for t in args.setting] if args.setting
             else default_candidates(profile))
    has_sharpness = bool(((profile.get("ladder") or {}).get("llama2_70b") or {}).get("sharpness"))
    model, prov = rate_model(args.rate_model, args.sweep, mechanism=has_sharpness)
    pred = predict(profile, cands, table, ", ".join(args.sweep), model=model,
                   provenance=prov, horizon=args.horizon_steps)
    if not args.out:
        print(settings_text(pred))
        return 0
    data = save_predictions(pred, args.out)
    best, worst = pred.settings[0], pred.settings[-1]
    print(f"{len(pred.settings)} settings, {len(pred.alarm_rules)} alarm rules -> {args.out} "
          f"(pre-registered {data['created']}, sha256 {data['content_sha256'][:12]}); rates "
          f"{best['rate_per_1k']:.3g} ({best['id']}) .. {worst['rate_per_1k']:.3g} spikes / 1k "
          f"steps ({worst['id']}); {sum(s['extrapolated'] for s in pred.settings)} extrapolated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
