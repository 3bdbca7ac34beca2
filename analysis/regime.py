"""The regime card: the dimensionless numbers that decide what Adam does, per depth group.

For a run directory (either backend) with per-tensor telemetry, and for a Megatron-style
log (global gradient norm only). All quantities refer to the gradient Adam consumed: the
telemetry's grad_rms is computed from the gradient after clipping (torch: p.grad after
clip_grad_norm_; JAX: optim.consumed_grads / clip_info's factor) and at the loss scale s the
run trains with (`train.loss_scale`: Adam sees s x the gradient, and rho = grad_rms / eps is
then the effective rho, s x the unscaled one; there is no fp16 dynamic loss scale to undo in
either trainer). Megatron logs print the grad norm after the fp16 loss-scale is undone and
before clipping, so min(grad_norm, clip) is the norm Adam consumed.

Per tensor l and logged step t (N_l = numel):
    rho_l(t)      = grad_rms_l(t) / eps
    group rho     = sqrt(sum_l N_l grad_rms_l^2 / sum_l N_l) / eps   (the group's whole
                    gradient as one vector: its rms over all its coordinates)
    eps_frac      = fraction of coordinates with sqrt(v_hat) < eps (telemetry, every logged
                    step): the coordinates whose own rms gradient over Adam's b2 window is
                    below eps
    g_below_eps   = fraction of coordinates with |g| < eps on the step (vhists table,
                    histogram steps only; numel-weighted over the group)
    below_1       = fraction of logged steps with rho_l < 1
    dormant       = rho_l < rho_wake (default 1: the update ~ m_hat / eps, eps-dominated);
    dormancy(t)   = logged steps since the tensor was last outside the band (0 when awake)
    wake-up       = the first step with rho_l >= rho_wake after at least `min_dormant`
                    consecutive dormant logged steps (the "state not reached for a long
                    time" of the seed report); recorded with the stretch's length, the
                    median rho over it, and rho / rms_t / update_rms at the wake-up step
    snr           = gradient SNR |mu| / sigma from m_v_ratio^2 = ||m_hat||^2 / ||sqrt v_hat||^2:
                    for a stationary stream with i.i.d. noise, m_v^2 = a + (1 - a) c with
                    c = (1 - b1) / (1 + b1) and a = mu^2 / (mu^2 + sigma^2), so
                    a = (m_v^2 - c) / (1 - c) (clipped to [0, 1)), snr = sqrt(a / (1 - a));
                    time correlation of the noise (phi > 0) also raises m_v and is read as snr
    lr / eps      = the step of the momentum-SGD Adam becomes where rho << 1 (r ~ m_hat / eps)
Curvature (runs that write the `curvature` table: step, group, precond_curvature,
raw_curvature, lr): the top preconditioned curvature against Bai et al.'s 2 / lr, and the
raw curvature against the eps-band threshold of momentum SGD with step lr / eps,
2 (1 + b1) / ((1 - b1) lr / eps) (heavy ball with an EMA momentum of weight 1 - b1); Adam's
stability number S = lr precond / 2 (S = 1 at 2 / lr). Group "update" (the Megatron probe's
online proxy, simulate.program.secant_update: the curvature along the updates, not the top
eigenvector's) reads below the top: its S_estimate = S_median / SECANT_TO_S, the ratio of
the proxy to the power-iteration tracker measured on the toys of the phase map.

Stability numbers over time (the trajectory, per logged step and group): Pi_eps and Pi_adam
at the curvature steps (`stability_numbers`), the warmup progress lr(t) / lr_peak, the
relative update size lr(t) rms(r) / rms(p) (group rms over coordinates), and dormancy in
units of the b2 memory 1/(1-b2) steps (`dormancy_memories`; wake-ups: `dormant_memories`).

For a log: rho_bar(t) = min(grad_norm, clip) / (sqrt(N) eps), N the parameter count. By
the clip, sum_l N_l rms_l^2 = min(gn, clip)^2, so the rms over all N coordinates is
min(gn, clip) / sqrt(N) and rho_bar <= clip / (sqrt(N) eps) (= 0.381 for LLaMA2-70B at eps
1e-5, clip 1). N comes from --num-params / --model (adamspike.llama presets, as
`adamspike model info`) or from the log's printed Megatron arguments (num_layers,
hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, padded_vocab_size /
vocab_size), which also give adam_eps, adam_beta1/2, clip_grad when the command line did
not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from adamspike.depth_groups import GROUPS, depth_group, group_rho
from adamspike.log_facts import NEOX_NAMES, LogFacts, _num, log_arguments, log_facts  # noqa: F401 (re-exported)
from adamspike.llama import PRESETS, LlamaConfig
from adamspike.llama import num_params as llama_num_params
from adamspike.rundir import load_run
from analysis.fits import optim_params
from theory.eps_regime import regimes

RHO_WAKE = 1.0
MIN_DORMANT = 10
LOG_EPS = (1e-5, 1e-8)


# ------------------------------------------------------------------ depth groups

def num_blocks(layers: pd.DataFrame, config: dict | None = None) -> int:
    """L of adamspike.depth_groups: the config's model.num_layers / preset when given, else
    the depth of the output head (kind "output"), else max depth + 1 (no head)."""
    m = (config or {}).get("model") or {}
    if isinstance(m, dict):
        if m.get("num_layers"):
            return int(m["num_layers"])
        if m.get("preset"):
            if m["preset"] in PRESETS:
                return PRESETS[m["preset"]].num_layers
    d = layers["depth"].to_numpy()
    kinds = layers["kind"].astype(str).to_numpy() if "kind" in layers else np.array([])
    if (kinds == "output").any():
        return max(1, int(d[kinds == "output"].max()))
    return max(1, int(d.max()) + 1)


def groups_of(depth, num_layers: int) -> np.ndarray:
    """adamspike.depth_groups.depth_group of each depth."""
    depth = np.asarray(depth)
    uniq = {int(x): depth_group(int(x), num_layers) for x in np.unique(depth)}
    return np.array([uniq[int(x)] for x in depth], dtype=object)


def snr_from_m_v(m_v_ratio, b1: float) -> np.ndarray:
    """|mu| / sigma from m_v_ratio (module doc; i.i.d.-noise stationary inversion)."""
    c = (1.0 - b1) / (1.0 + b1)
    a = np.clip((np.asarray(m_v_ratio, float) ** 2 - c) / (1.0 - c), 0.0, 1.0 - 1e-12)
    return np.sqrt(a / (1.0 - a))


# ------------------------------------------------------------------ the card (runs)

@dataclass
class RegimeCard:
    kind: str                       # "run" or "log"
    eps: float | None
    b1: float | None
    b2: float | None
    lr: float | None                # median lr over the steps table
    num_layers: int | None = None
    groups: pd.DataFrame = field(default_factory=pd.DataFrame)      # one row per group
    trajectory: pd.DataFrame = field(default_factory=pd.DataFrame)  # step, group, rho, ...
    tensors: pd.DataFrame = field(default_factory=pd.DataFrame)     # one row per tensor
    wakeups: pd.DataFrame = field(default_factory=pd.DataFrame)
    curvature: pd.DataFrame | None = None                           # per group
    log: dict | None = None                                         # the log card
    notes: list[str] = field(default_factory=list)

    @property
    def lr_over_eps(self) -> float | None:
        if self.lr is None or not self.eps:
            return None
        return self.lr / self.eps


def _dormancy(rho: np.ndarray, steps: np.ndarray, rho_wake: float, min_dormant: int):
    """Per column of rho (steps x tensors): dormancy at each step (logged steps since the
    tensor last had rho >= rho_wake; NaN rows carry the count on), and the wake-ups
    (row index, stretch length, start row)."""
    n, k = rho.shape
    dorm = np.zeros((n, k), np.int64)
    wakes = []
    run = np.zeros(k, np.int64)
    for i in range(n):
        r = rho[i]
        ok = np.isfinite(r)
        below = ok & (r < rho_wake)
        above = ok & (r >= rho_wake)
        for j in np.flatnonzero(above & (run >= min_dormant)):
            wakes.append((i, j, int(run[j])))
        run = np.where(below, run + 1, np.where(above, 0, run))
        dorm[i] = run
    return dorm, wakes


def run_card(layers: pd.DataFrame, steps: pd.DataFrame | None, config: dict | None, *,
             curvature: pd.DataFrame | None = None, vhists: pd.DataFrame | None = None,
             rho_wake: float = RHO_WAKE, min_dormant: int = MIN_DORMANT) -> RegimeCard:
    """The regime card of a run directory's layers table (module doc); `vhists` (the
    table, with its g_below_eps column) adds the fraction of coordinates with |g| < eps
    per group on histogram steps."""
    need = ["step", "name", "depth", "numel", "grad_rms", "rho"]
    missing = [c for c in need if c not in layers]
    if missing:
        raise ValueError(f"layers table lacks column(s) {missing} for the regime card")
    op = optim_params(config or {})
    lr = None
    if steps is not None and "lr" in steps and np.isfinite(steps["lr"].to_numpy(float)).any():
        lr = float(np.nanmedian(steps["lr"].to_numpy(float)))
    elif op["lr"] is not None:
        lr = op["lr"]
    L = num_blocks(layers, config)
    card = RegimeCard(kind="run", eps=op["eps"], b1=op["b1"], b2=op["b2"], lr=lr, num_layers=L)
    names = layers["name"].astype(str)
    cat = pd.Categorical(names)
    tnames = np.asarray(cat.categories, dtype=object)
    codes = cat.codes
    st = np.unique(layers["step"].to_numpy())
    si = np.searchsorted(st, layers["step"].to_numpy())

    def mat(col):
        m = np.full((len(st), len(tnames)), np.nan)
        m[si, codes] = layers[col].to_numpy(float)
        return m

    rho = mat("rho")
    depth = np.zeros(len(tnames), np.int64)
    depth[codes] = layers["depth"].to_numpy()
    numel = np.zeros(len(tnames), np.float64)
    numel[codes] = layers["numel"].to_numpy(float)
    grp = groups_of(depth, L)
    dorm, wakes = _dormancy(rho, st, rho_wake, min_dormant)
    b1 = op["b1"] if op["b1"] is not None else 0.9
    extra = {c: mat(c) for c in ("eps_frac", "m_v_ratio", "rms_t", "update_rms", "param_rms")
             if c in layers}
    # the schedule at the logged steps: lr(t) and the warmup progress lr(t) / lr_peak
    lr_t = np.full(len(st), np.nan)
    if steps is not None and "lr" in steps and len(steps):
        s_lr = steps[["step", "lr"]].dropna().drop_duplicates("step").set_index("step")["lr"]
        lr_t = s_lr.reindex(st).to_numpy(float)
    elif lr is not None:
        lr_t[:] = lr
    peak = np.nanmax(lr_t) if np.isfinite(lr_t).any() else math.nan
    memory = 1.0 / (1.0 - op["b2"]) if op["b2"] is not None and op["b2"] < 1 else math.nan
    spacing = float(np.median(np.diff(st))) if len(st) > 1 else 1.0   # steps per logged step
    snr = snr_from_m_v(extra["m_v_ratio"], b1) if "m_v_ratio" in extra else None

    # per tensor
    with np.errstate(all="ignore"):
        trows = []
        for j, n in enumerate(tnames):
            r = rho[:, j]
            ok = np.isfinite(r)
            trows.append({
                "name": n, "depth": int(depth[j]), "group": grp[j], "numel": int(numel[j]),
                "rho_median": float(np.median(r[ok])) if ok.any() else math.nan,
                "rho_min": float(r[ok].min()) if ok.any() else math.nan,
                "rho_max": float(r[ok].max()) if ok.any() else math.nan,
                "frac_below_1": float(np.mean(r[ok] < 1.0)) if ok.any() else math.nan,
                "eps_frac_median": float(np.nanmedian(extra["eps_frac"][:, j]))
                if "eps_frac" in extra else math.nan,
                "snr_median": float(np.nanmedian(snr[:, j])) if snr is not None else math.nan,
                "max_dormancy": int(dorm[:, j].max()) if len(st) else 0,
                "final_dormancy": int(dorm[-1, j]) if len(st) else 0,
                "num_wakeups": sum(1 for w in wakes if w[1] == j),
            })
    card.tensors = pd.DataFrame(trows)

    # wake-ups
    wrows = []
    for i, j, length in wakes:
        lo = max(0, i - length)
        wrows.append({"name": tnames[j], "depth": int(depth[j]), "group": grp[j],
                      "step": int(st[i]), "dormant_steps": length,
                      "dormant_since": int(st[lo]),
                      "dormant_memories": (int(st[i]) - int(st[lo])) / memory,
                      "rho_dormant_median": float(np.nanmedian(rho[lo:i, j])),
                      "rho_at_wake": float(rho[i, j]),
                      "rms_t_at_wake": float(extra["rms_t"][i, j]) if "rms_t" in extra
                      else math.nan,
                      "update_rms_at_wake": float(extra["update_rms"][i, j])
                      if "update_rms" in extra else math.nan})
    card.wakeups = pd.DataFrame(wrows, columns=["name", "depth", "group", "step",
                                                "dormant_steps", "dormant_since",
                                                "dormant_memories",
                                                "rho_dormant_median", "rho_at_wake",
                                                "rms_t_at_wake", "update_rms_at_wake"])

    # trajectory: per step and group, the group's rho (adamspike.depth_groups.group_rho)
    present = np.isfinite(rho)
    traj = []
    for g in [x for x in GROUPS if x in set(grp)]:
        cols = grp == g
        w = numel[cols]
        nw = present[:, cols] @ w
        with np.errstate(all="ignore"):
            rho_g = group_rho(rho[:, cols], w)
            ef = (np.where(present[:, cols], np.nan_to_num(extra["eps_frac"][:, cols]), 0.0) @ w
                  / nw) if "eps_frac" in extra else np.full(len(st), np.nan)
            mv = np.nanmedian(snr[:, cols], axis=1) if snr is not None else np.full(len(st), np.nan)
            # relative update size: lr(t) rms(r) / rms(p) over the group's coordinates
            rel = (lr_t * group_rho(extra["update_rms"][:, cols], w)
                   / group_rho(extra["param_rms"][:, cols], w)
                   if {"update_rms", "param_rms"} <= set(extra) else np.full(len(st), np.nan))
        since = dorm[:, cols].max(axis=1) * spacing     # dormant logged steps, in steps
        traj.append(pd.DataFrame({"step": st, "group": g, "rho": rho_g, "eps_frac": ef,
                                  "snr_median": mv,
                                  "frac_tensors_dormant": np.mean(dorm[:, cols] > 0, axis=1),
                                  "max_dormancy": dorm[:, cols].max(axis=1),
                                  "dormancy_memories": since / memory,
                                  "warmup_progress": lr_t / peak, "rel_update": rel}))
    card.trajectory = (pd.concat(traj, ignore_index=True) if traj else
                       pd.DataFrame(columns=["step", "group", "rho", "eps_frac", "snr_median",
                                             "frac_tensors_dormant", "max_dormancy",
                                             "dormancy_memories", "warmup_progress",
                                             "rel_update"]))
    card.trajectory["g_below_eps"] = np.nan
    if vhists is not None and len(vhists) and "g_below_eps" in vhists \
            and vhists["g_below_eps"].notna().any():
        v = vhists[["step", "name", "g_below_eps"]].dropna().copy()
        v["name"] = v["name"].astype(str)
        gmap = dict(zip(tnames, grp))
        nmap = dict(zip(tnames, numel))
        v["group"] = v["name"].map(gmap)
        v["numel"] = v["name"].map(nmap)
        v = v.dropna(subset=["group"])
        agg = v.groupby(["step", "group"]).agg(gb=("g_below_eps", "sum"), n=("numel", "sum"))
        frac = (agg["gb"] / agg["n"]).rename("gbe").reset_index()
        t = card.trajectory.merge(frac, on=["step", "group"], how="left")
        t["g_below_eps"] = t.pop("gbe")
        card.trajectory = t

    # per group
    rows = []
    for g, part in card.trajectory.groupby("group", sort=False):
        tr = card.tensors[card.tensors["group"] == g]
        r = part["rho"].to_numpy(float)
        ok = np.isfinite(r)
        rows.append({
            "group": g, "num_tensors": len(tr), "numel": int(tr["numel"].sum()),
            "rho_median": float(np.median(r[ok])) if ok.any() else math.nan,
            "rho_q10": float(np.quantile(r[ok], 0.1)) if ok.any() else math.nan,
            "rho_q90": float(np.quantile(r[ok], 0.9)) if ok.any() else math.nan,
            "rho_tensor_min": float(tr["rho_median"].min()),
            "rho_tensor_max": float(tr["rho_median"].max()),
            "frac_time_below_1": float(np.mean(r[ok] < 1.0)) if ok.any() else math.nan,
            "eps_frac_median": float(np.nanmedian(part["eps_frac"])) if part["eps_frac"].notna().any() else math.nan,
            "g_below_eps_median": float(np.nanmedian(part["g_below_eps"]))
            if part["g_below_eps"].notna().any() else math.nan,
            "snr_median": float(np.nanmedian(part["snr_median"])) if part["snr_median"].notna().any() else math.nan,
            "max_dormancy": int(tr["max_dormancy"].max()),
            "max_dormancy_memories": float(part["dormancy_memories"].max()),
            "num_wakeups": int(tr["num_wakeups"].sum()),
            "rel_update_median": float(np.nanmedian(part["rel_update"]))
            if part["rel_update"].notna().any() else math.nan,
            "regime": _band(float(np.median(r[ok])) if ok.any() else math.nan),
        })
    card.groups = pd.DataFrame(rows)
    card.groups["pi_eps_median"] = card.groups["pi_adam_median"] = math.nan
    if curvature is not None and len(curvature):
        card.curvature = curvature_card(curvature, op["b1"], op["eps"])
        card.trajectory = card.trajectory.merge(stability_numbers(curvature, op["b1"], op["eps"]),
                                                on=["step", "group"], how="left")
        cc = card.curvature.set_index("group")
        for col in ("pi_eps_median", "pi_adam_median"):
            card.groups[col] = card.groups["group"].map(cc[col])
    elif curvature is not None:
        card.notes.append("the run has a curvature table with no rows")
    return card


def stability_numbers(curv: pd.DataFrame, b1: float | None, eps: float | None) -> pd.DataFrame:
    """Per curvature row (step, group): the eps band's Pi_eps = (lr / eps) lambda_max(H_g)
    against PI_EPS_THRESHOLD = 2 (1+b1)/(1-b1) (38 at b1 0.9) and Adam's Pi_adam = lr
    lambda_max(P_g H_g) against 2 (Bai et al.; S = Pi_adam / 2)."""
    c = curv[["step", "group", "precond_curvature", "raw_curvature", "lr"]].copy()
    c["group"] = c["group"].astype(str)
    lr = c["lr"].to_numpy(float)
    c["pi_adam"] = lr * c["precond_curvature"].to_numpy(float)
    c["pi_eps"] = lr / eps * c["raw_curvature"].to_numpy(float) if eps else math.nan
    c["pi_eps_threshold"] = 2 * (1 + b1) / (1 - b1) if b1 is not None else math.nan
    return c[["step", "group", "pi_eps", "pi_eps_threshold", "pi_adam"]]


def _band(rho: float) -> str:
    if not math.isfinite(rho):
        return "-"
    return str(regimes(rho))


# The online proxy's S (group "update") over the tracker's S on the toys, each lane's median
# over its run: 0.395 (IQR 0.17-0.76, Spearman 0.61 over 80 lanes of 8 width-32 phase-map
# cells; 0.90 over the 60 lanes at lr x1-x256, where the proxy stays below the tracker; at
# lr x1024, past the band, it overshoots 25-50x). Measured 2026-12-05
# (docs/results/science3_2026-12-05.md); `adamspike phase-map` reports it as "secant_lanes".
SECANT_TO_S = 0.395
SECANT_TO_S_IQR = (0.17, 0.76)


def curvature_card(curv: pd.DataFrame, b1: float | None, eps: float | None) -> pd.DataFrame:
    """Per group: the preconditioned curvature against 2 / lr (Bai) and the raw curvature
    against the eps-band threshold 2 (1 + b1) / ((1 - b1) lr / eps) (module doc)."""
    need = ["step", "group", "precond_curvature", "raw_curvature", "lr"]
    missing = [c for c in need if c not in curv]
    if missing:
        raise ValueError(f"curvature table lacks column(s) {missing}")
    c = curv.reset_index(drop=True)   # a fresh index: `numbers` below is read by it
    c["group"] = c["group"].astype(str)
    lr = c["lr"].to_numpy(float)
    c["bai_threshold"] = 2.0 / lr
    if b1 is not None and eps:
        c["eps_band_threshold"] = 2.0 * (1 + b1) / ((1 - b1) * lr / eps)
    else:
        c["eps_band_threshold"] = np.nan
    numbers = stability_numbers(c, b1, eps)
    rows = []
    for g, part in c.groupby("group", sort=False):
        pc, rc = part["precond_curvature"].to_numpy(float), part["raw_curvature"].to_numpy(float)
        pi = numbers.loc[part.index]       # the one definition of Pi_adam and Pi_eps
        with np.errstate(all="ignore"):
            over_bai = pc / part["bai_threshold"].to_numpy(float)
            over_eps = rc / part["eps_band_threshold"].to_numpy(float)
        rows.append({"group": g, "num_rows": len(part),
                     "precond_median": float(np.nanmedian(pc)),
                     "precond_max": float(np.nanmax(pc)),
                     "bai_threshold_median": float(np.nanmedian(part["bai_threshold"])),
                     "frac_above_bai": float(np.nanmean(over_bai > 1)),
                     "max_over_bai": float(np.nanmax(over_bai)),
                     "raw_median": float(np.nanmedian(rc)),
                     "eps_band_threshold_median": float(np.nanmedian(part["eps_band_threshold"])),
                     "frac_raw_above_eps_band": float(np.nanmean(over_eps > 1))
                     if np.isfinite(over_eps).any() else math.nan,
                     "max_raw_over_eps_band": float(np.nanmax(over_eps))
                     if np.isfinite(over_eps).any() else math.nan,
                     "pi_adam_median": float(np.nanmedian(pi["pi_adam"])),
                     "pi_eps_median": float(np.nanmedian(pi["pi_eps"])) if eps else math.nan,
                     "S_median": float(np.nanmedian(over_bai)),
                     "S_estimate": float(np.nanmedian(over_bai)) / SECANT_TO_S
                     if g == "update" else float(np.nanmedian(over_bai))})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ logs

# log_facts / log_arguments / LogFacts (imported above): the one reader of what a log
# states besides its iteration lines lives in the floor (adamspike.log_facts), so that
# simulate's `predict --profile-from-log` reads the same facts


def num_params_from_args(args: dict[str, str]) -> tuple[int | None, str]:
    """LLaMA-style parameter count from Megatron arguments (adamspike.llama.num_params),
    and where it came from; (None, why) when the arguments do not fix it."""
    need = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    vals = {k: _num(args.get(k)) for k in need}
    vocab = _num(args.get("padded_vocab_size")) or _num(args.get("vocab_size"))
    if any(v is None for v in vals.values()) or vocab is None:
        lack = [k for k, v in vals.items() if v is None] + ([] if vocab else ["vocab_size"])
        return None, f"the log's arguments lack {', '.join(lack)}"
    kv = _num(args.get("num_query_groups"))
    if kv is None or str(args.get("group_query_attention", "True")).lower() == "false":
        kv = vals["num_attention_heads"]
    cfg = LlamaConfig(vocab_size=int(vocab), dim=int(vals["hidden_size"]),
                      num_layers=int(vals["num_layers"]),
                      num_heads=int(vals["num_attention_heads"]), num_kv_heads=int(kv),
                      ffn_dim=int(vals["ffn_hidden_size"]))
    n = llama_num_params(cfg)
    if str(args.get("untie_embeddings_and_output_weights", "True")).lower() == "false":
        n -= cfg.vocab_size * cfg.dim
    return n, "the log's model arguments"


def rho_bar(grad_norm, clip: float | None, num_params: int, eps: float) -> np.ndarray:
    """min(grad_norm, clip) / (sqrt(N) eps): the rms rho over all N coordinates of the
    gradient Adam consumed (clip None or <= 0: no clipping)."""
    g = np.asarray(grad_norm, float)
    if clip is not None and clip > 0:
        g = np.minimum(g, clip)
    return g / (math.sqrt(num_params) * eps)


def rho_bar_bound(clip: float, num_params: int, eps: float) -> float:
    """clip / (sqrt(N) eps): no clipped gradient has a larger mean rho."""
    return float(clip) / (math.sqrt(num_params) * eps)


def log_card(steps: pd.DataFrame, config: dict | None, *, num_params: int | None = None,
             num_params_source: str = "", log_path: str | Path | None = None) -> RegimeCard:
    """The regime card of a log (global grad norm only): rho_bar over time (module doc)."""
    op = optim_params(config or {})
    args = log_arguments(log_path) if log_path else {}
    for k, a in (("eps", "adam_eps"), ("b1", "adam_beta1"), ("b2", "adam_beta2"),
                 ("grad_clip", "clip_grad")):
        if op[k] is None and _num(args.get(a)) is not None:
            op[k] = _num(args.get(a))
    notes = []
    if num_params is None and args:
        num_params, num_params_source = num_params_from_args(args)
        if num_params is None:
            notes.append(num_params_source)
    lr = float(np.nanmedian(steps["lr"].to_numpy(float))) if "lr" in steps and \
        steps["lr"].notna().any() else op["lr"]
    card = RegimeCard(kind="log", eps=op["eps"], b1=op["b1"], b2=op["b2"], lr=lr, notes=notes)
    gn = steps["grad_norm"].to_numpy(float)
    ok = np.isfinite(gn)
    info = {"num_params": num_params, "num_params_source": num_params_source or None,
            "clip": op["grad_clip"], "num_steps": int(ok.sum()),
            "grad_norm_median": float(np.median(gn[ok])) if ok.any() else math.nan,
            "frac_clipped": float(np.mean(gn[ok] > op["grad_clip"]))
            if ok.any() and op["grad_clip"] else math.nan}
    if not ok.any():
        card.notes.append("no measured grad norm in the log (none printed, or only the "
                          "placeholders of a framework that did not measure it: 0.000, or "
                          "stale repeats on overflowed steps): no rho_bar, no regime")
        card.log = info
        return card
    if num_params is None:
        card.notes.append("parameter count unknown: pass --num-params N or --model PRESET "
                          "(or a log that prints its model arguments)")
        card.log = info
        return card
    eps_list = sorted({*(e for e in (op["eps"],) if e), *LOG_EPS}, reverse=True)
    rows, traj = [], []
    for eps in eps_list:
        rb = rho_bar(gn[ok], op["grad_clip"], num_params, eps)
        rows.append({"eps": eps, "is_run_eps": bool(op["eps"] and eps == op["eps"]),
                     "rho_bar_median": float(np.median(rb)),
                     "rho_bar_q10": float(np.quantile(rb, 0.1)),
                     "rho_bar_q90": float(np.quantile(rb, 0.9)),
                     "rho_bar_max": float(rb.max()),
                     "bound": rho_bar_bound(op["grad_clip"], num_params, eps)
                     if op["grad_clip"] else math.nan,
                     "frac_time_below_1": float(np.mean(rb < 1.0)),
                     "regime": _band(float(np.median(rb))),
                     "lr_over_eps": lr / eps if lr else math.nan})
        traj.append(pd.DataFrame({"step": steps["step"].to_numpy()[ok], "eps": eps,
                                  "rho_bar": rb}))
    card.groups = pd.DataFrame(rows)
    card.trajectory = pd.concat(traj, ignore_index=True)
    card.log = info
    return card


def card_for_run(run, *, num_params: int | None = None,
                 num_params_source: str = "") -> RegimeCard:
    """run_card for a run with layers telemetry, log_card for a log import (or a run with
    steps only); `run` is adamspike.rundir.Run."""
    curv = getattr(run, "curvature", None)
    if (curv is None or curv.empty) and (Path(run.path) / "curvature").is_dir():
        curv = load_run(run.path, tables=("curvature",)).curvature
    if run.backend == "megatron" or run.layers.empty:
        src = ((run.config.get("source") or {}).get("megatron_log")
               if isinstance(run.config.get("source"), dict) else None)
        log_path = src if src and Path(src).is_file() else None
        imp = run.meta.get("import") or {}
        if num_params is None and imp.get("num_params_printed"):   # the count the log prints
            num_params = int(imp["num_params_printed"])
            num_params_source = imp.get("num_params_printed_source") or "the log"
        card = log_card(run.steps, run.config, num_params=num_params,
                        num_params_source=num_params_source, log_path=log_path)
        if curv is not None and len(curv):    # the Megatron probe's online proxy
            card.curvature = curvature_card(curv, card.b1, card.eps)
        return card
    vh = getattr(run, "vhists", None)
    if (vh is None or vh.empty) and (Path(run.path) / "vhists").is_dir():
        vh = load_run(run.path, tables=("vhists",)).vhists
    return run_card(run.layers, run.steps, run.config,
                    curvature=curv if curv is not None and len(curv) else None,
                    vhists=vh if vh is not None and len(vh) else None)
