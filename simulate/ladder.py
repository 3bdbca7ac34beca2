"""Width/depth ladder of tiny LLaMAs: how per-depth-group gradient RMS scales, and the 70B.

    adamspike simulate ladder --out DIR [--rungs DxLxB ...] [--seeds N] [--num-steps N]
                              [--warmup-steps N] [--curvature-every K] [--curvature-iters N]
                              (cells in the store DIR/cells, resumable; the flags replace the
                              full ladder's values, e.g. a CI-sized one)
                              [--cells-from LADDER_DIR]   (reuse that ladder's measured cells)

The ladder trains the JAX LLaMA through simulate.program's one step (the trainer's: same
parameter specs, init, loss and AdamW chain; the rung as a RunConfig, `run_config`) on one fixed
synthetic data set (adamspike.synthdata Markov task, data seed 0) at every rung:

    full   dim in {32, 64, 128, 256} x layers in {2, 4, 8} at batch 16 x 32 tokens, without
           (256, 8) (alone ~30 % of the ladder's CPU time; left out for the reproduce budget),
           plus batch {4, 32} x 32 tokens at dim 64, 4 layers (the tokens-per-step axis;
           {4, 64} with the constant lr), 3 seeds, 150 steps
    and the sharpness ladder: lambda_max(H) and Adam's S every 15 steps with 5 warm-started
    Hessian-vector products each. A smaller ladder is the same with explicit values, e.g.
    --rungs 32x2x16 64x2x16 32x4x16 32x2x4 --seeds 2 --num-steps 60 --warmup-steps 6
    --curvature-every 20 --curvature-iters 3 (two values per axis around one corner)

Learning rate per rung (`lr_scaling`): "inverse_width" (default) lr = 3e-3 * 64 / dim, the
muP rule for Adam's hidden layers (LLaMA's own lrs fall with width: 3e-4 at 7B, 1.5e-4 at
70B); "constant" keeps 3e-3 on every rung, which puts the wide rungs in another regime
(their block gradients fall by ~1 decade at dim 256 and the power law stops fitting).

Seeds are one vmapped program per cell (`jax.vmap` over the seed's init key and its batch
order; the data are the same for every cell: batch s of seed k is
adamspike.order.sample_indices(s, B, num_samples, k), so rungs are paired by seed), and the
steps one `jax.lax.scan`. Every LOG_EVERY steps the gradient of the unscaled loss, before
clipping, is reduced per depth (-1 embedding, 0..L-1 blocks, L final norm + head) to its sum
of squares; groups follow adamspike.depth_groups (embed, shallow, deep, head).

Storage (DIR), as simulate.sweep: ladder.json (the resolved ladder; a restart with another is
refused), cells/, the one cell store (adamspike.cells): a `ladder_rung` cell per rung (the
spec's shared settings, seeds and the rung), its table one row per seed x logged step x
depth, so an interrupted ladder resumes at the first missing cell;
then fit.json, responses.csv, band.csv, depth_rms.csv (`write_outputs`, read by
figures/fig_ladder.py and `adamspike predict --ladder`).

Fit (`fit_ladder`). Per (cell, seed, group) the response is y = log10 of the group's gradient
RMS, sqrt(sum g^2 / numel), taken as the median over the logged steps of the second half of
training. Per group an ordinary least-squares power law

    log10 rms_group = c0 + c_d log10 dim + c_L log10 layers + c_B log10 tokens_per_step

(the 3 exponents are not pinned: the ladder measures them). The separable form is an
assumption (the tokens-per-step exponent comes from one (dim, layers) rung); the fit reports
R^2 in log space, the residual scatter, and a held-out check: refit without the widest rung
and the mean log10 error predicting it. Bootstrap (`n_boot` resamples of the (cell, seed)
rows, the same rows for all groups so their correlation is kept): coefficient percentile
intervals and, at a target (dim, layers, tokens), a prediction interval = refit prediction +
a resampled residual of that group.

70B profile (`extrapolate_70b`): the predicted raw group RMS at dim 8192, 80 layers,
1024 x 4096 tokens gives a predicted global norm gn = sqrt(sum_g N_g rms_g^2) (N_g from
adamspike.llama.param_specs of the llama2-70b preset). Adam consumes the clipped gradient:
every rms is multiplied by min(1, clip / gn), so sum_g N_g rms_g^2 = min(gn, clip)^2 and the
mean rho = ||g_clipped|| / (sqrt(N) eps) <= clip / (sqrt(N) eps) (0.381 at N = 6.9e10,
eps = 1e-5, clip 1). rho per depth = rms of its group / eps, with the interval of each group
from the bootstrap replicates (each replicate clipped on its own).

Known limits (stated in the fit's JSON too): the ladder's vocab (256) is the same on every
rung, so the embed and head groups extrapolate without a vocab term (the 70B's is 32000);
200 steps of training is early training; extrapolating 1.5 decades in width, 1 in depth
and 3.6 in tokens per step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from adamspike.config import ConfigError, cli_main
from adamspike.depth_groups import GROUPS, depth_group
from adamspike.llama import LlamaConfig, ffn_dim_for, param_specs, preset
from adamspike.order import sample_indices
from adamspike.cells import Cell, CellStore, CorruptCell, run_cells
from adamspike.rundir import atomic_write_bytes
from adamspike.rundir import check_out
from adamspike.synthdata import SyntheticTokens
from adamspike.tables import md_table

LOG_EVERY = 5
DATA_SEED = 0
VOCAB = 256
LR_BASE_DIM = 64
TARGET_70B = {"dim": 8192, "num_layers": 80, "tokens_per_step": 1024 * 4096}
LR_70B = 1.5e-4            # LLaMA2-70B's peak lr (Touvron et al. 2023; configs/llama2-70b.toml)
PI_THRESHOLD = 38.0   # 2 (1+b1) / (1-b1) at b1 0.9: the eps band's edge, S = 1 (Cohen et al. 2022)


@dataclass
class LadderSpec:
    """The rungs of a ladder: (dim, num_layers, batch) triples at one seq_len, seeds, steps."""
    rungs: list[tuple[int, int, int]]
    seq_len: int = 32
    seeds: int = 3
    num_steps: int = 200
    vocab_size: int = VOCAB
    lr: float = 3e-3
    warmup_steps: int = 20
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    # "constant": every rung at lr; "inverse_width": lr * LR_BASE_DIM / dim (the muP rule
    # for Adam's hidden-layer lr: the update size per unit of width stays put)
    lr_scaling: str = "constant"
    # the sharpness ladder: lambda_max(H) and Adam's stability number S every K steps
    # (Program.run's curvature, `curvature_iters` warm-started products each); 0 = off
    curvature_every: int = 0
    curvature_iters: int = 5

    def lr_for(self, dim: int) -> float:
        if self.lr_scaling == "constant":
            return self.lr
        if self.lr_scaling == "inverse_width":
            return self.lr * LR_BASE_DIM / dim
        raise ConfigError(f"lr_scaling: unknown {self.lr_scaling!r} (constant, inverse_width)")

    def to_json(self) -> dict:
        d = asdict(self)
        d["rungs"] = [list(r) for r in self.rungs]
        return d


def full_spec(lr_scaling: str = "inverse_width") -> LadderSpec:
    rungs = [(d, L, 16) for d in (32, 64, 128, 256) for L in (2, 4, 8) if (d, L) != (256, 8)]
    rungs += [(64, 4, 4), (64, 4, 64) if lr_scaling == "constant" else (64, 4, 32)]
    return LadderSpec(rungs=rungs, num_steps=150, lr_scaling=lr_scaling, curvature_every=15)


def sized_spec(lr_scaling: str = "inverse_width", **sizes: Any) -> LadderSpec:
    """The full ladder with explicit sizes replacing its own (rungs, seeds, num_steps,
    warmup_steps, curvature_every, curvature_iters; None: the full ladder's)."""
    spec = full_spec(lr_scaling)
    given = {k: v for k, v in sizes.items() if v is not None}
    if "rungs" in given:
        given["rungs"] = [tuple(int(x) for x in r) for r in given["rungs"]]
    return replace_spec(spec, **given)


def replace_spec(spec: LadderSpec, **changes: Any) -> LadderSpec:
    return spec_from_json({**spec.to_json(), **changes})


def llama_config(dim: int, num_layers: int, spec: LadderSpec):
    """The rung's architecture: head dim 16 (at least 2 heads), 2 kv heads where they divide,
    Meta's SwiGLU width rule (multiple of 32), init std 0.02."""
    heads = max(2, dim // 16)
    kv = 2 if heads % 2 == 0 else 1
    cfg = LlamaConfig(vocab_size=spec.vocab_size, dim=dim, num_layers=num_layers,
                      num_heads=heads, num_kv_heads=kv, ffn_dim=ffn_dim_for(dim, 32),
                      max_seq_len=spec.seq_len, init_std=0.02)
    cfg.check()
    return cfg


def cell_id(spec: LadderSpec, rung: Sequence[int]) -> str:
    """Stable id of a rung under the spec's shared settings (seed count excluded)."""
    shared = {k: v for k, v in spec.to_json().items() if k not in ("rungs", "seeds")}
    if shared.get("lr_scaling") == "constant":   # ids of ladders from before the knob
        del shared["lr_scaling"]
    if not shared.get("curvature_every"):         # ... and from before the sharpness ladder
        shared.pop("curvature_every", None)
        shared.pop("curvature_iters", None)
    blob = json.dumps({"rung": list(rung), **shared}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


KIND = "ladder_rung"
CODE = "program-run-1"    # bump when train_seeds / cell_table change meaning


def store_cell(spec: LadderSpec, rung: Sequence[int]) -> Cell:
    """A rung of `spec` as a cell of the one store: every setting of the spec but its rung
    list, and the rung."""
    return Cell(KIND, CODE, {"spec": {k: v for k, v in spec.to_json().items() if k != "rungs"},
                             "rung": [int(x) for x in rung]}, "simulate.ladder:compute_cell")


def compute_cell(config: Mapping[str, Any]) -> dict:
    """Train a rung's seeds (one vmapped program) and tabulate them (`cell_table`)."""
    spec = spec_from_json({**config["spec"], "rungs": [config["rung"]]})
    dim, L, B = rung = tuple(config["rung"])
    seeds = list(range(spec.seeds))
    tokens = batches(spec, B, seeds)
    t0 = time.perf_counter()
    res = train_seeds(llama_config(dim, L, spec), spec, tokens, seeds)
    return {"rows": cell_table(rung, spec, seeds, res, cell_id(spec, rung),
                               time.perf_counter() - t0)}


# ----------------------------------------------------------------------------- data

def batches(spec: LadderSpec, batch: int, seeds: Sequence[int]) -> np.ndarray:
    """Tokens (num_steps, num_seeds, batch, seq_len + 1) int32: step s of seed k reads
    sample_indices(s, batch, num_samples, k) of the one data set (seed DATA_SEED)."""
    data = SyntheticTokens("markov", spec.vocab_size, spec.seq_len, 1 << 20, DATA_SEED, 0.1)
    out = np.empty((spec.num_steps, len(seeds), batch, spec.seq_len + 1), np.int32)
    for s in range(spec.num_steps):
        for j, k in enumerate(seeds):
            out[s, j] = data.batch(sample_indices(s + 1, batch, data.num_samples, int(k)))
    return out


# ----------------------------------------------------------------------------- training

def run_config(cfg: LlamaConfig, spec: LadderSpec, batch: int):
    """The rung as a RunConfig of simulate.program: its architecture, AdamW with the
    ladder's lr (lr_for(dim)), warmup, cosine decay, b2, eps, clip and weight decay; fp32,
    loss scale 1, no z-loss."""
    from adamspike.train_config import RunConfig   # lazy, as the program below
    fields = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim",
              "max_seq_len", "norm_eps", "rope_theta", "init_std")
    return RunConfig.from_dict({
        **{f"model.{f}": getattr(cfg, f) for f in fields}, "model.preset": "tiny",
        "optim.lr": spec.lr_for(cfg.dim), "optim.warmup_steps": spec.warmup_steps,
        "optim.schedule": "cosine", "optim.b1": 0.9, "optim.b2": spec.b2, "optim.eps": spec.eps,
        "optim.grad_clip": spec.grad_clip, "optim.weight_decay": spec.weight_decay,
        "train.num_steps": spec.num_steps, "train.global_batch_size": batch,
        "train.seq_len": spec.seq_len})


def train_seeds(cfg, spec: LadderSpec, tokens: np.ndarray, seeds: Sequence[int],
                vmapped: bool = True) -> dict[str, np.ndarray]:
    """Train len(seeds) models of architecture cfg, one per seed (init key PRNGKey(seed)),
    on tokens (num_steps, num_seeds, B, T+1) through simulate.program's one step (its
    vmapped lax.scan form); vmapped=True runs the seeds as one program, False one lane per
    call (the bench compares the two).

    Returns numpy arrays: loss, grad_norm (num_seeds, num_steps); depth_sumsq
    (num_seeds, num_logged, num_depths) of the raw (pre-clip) gradient on steps
    log_steps (1-based, every LOG_EVERY); depths, depth_numel (num_depths,); with
    spec.curvature_every = K also sharpness and stability (num_seeds, num_steps // K) after
    steps K, 2K, ... (Program.run)."""
    # lazy: jax (simulate.program imports it), so that the fit and the 70B profile
    # (`adamspike predict --ladder`) work without it
    from simulate.program import program

    rc = run_config(cfg, spec, tokens.shape[2])
    prog = program(rc)
    specs = {s.name: s for s in param_specs(cfg)}
    depths = sorted({s.depth for s in specs.values()})
    numel = np.array([sum(s.numel for s in specs.values() if s.depth == d) for d in depths],
                     np.int64)
    member = np.array([[specs[n].depth == d for d in depths] for n in prog.names], np.float64)
    K = spec.curvature_every
    outs = prog.run(seeds, np.swapaxes(tokens, 0, 1),   # (seeds, steps, B, T+1)
                    prog.controls(rc, range(1, spec.num_steps + 1)), vmapped=vmapped,
                    curvature_every=K, sharpness=bool(K), curvature_iters=spec.curvature_iters)
    sumsq = outs["tensor_sumsq"][:, LOG_EVERY - 1::LOG_EVERY] @ member
    return {"loss": outs["loss"], "grad_norm": outs["grad_norm"], "depth_sumsq": sumsq,
            "depths": np.array(depths), "depth_numel": numel,
            "log_steps": np.arange(LOG_EVERY, spec.num_steps + 1, LOG_EVERY),
            **({k: outs[k] for k in ("sharpness", "stability")} if K else {})}


def cell_table(rung: Sequence[int], spec: LadderSpec, seeds: Sequence[int],
               res: Mapping[str, np.ndarray], cid: str, seconds: float) -> pd.DataFrame:
    """Long table: one row per seed x logged step x depth; with curvature, `sharpness` and
    `stability` on the rows of the steps where they were taken (NaN elsewhere)."""
    dim, L, B = (int(x) for x in rung)
    K = spec.curvature_every
    rows = []
    steps = res["log_steps"]
    for j, seed in enumerate(seeds):
        for i, s in enumerate(steps):
            curv = ((float(res["sharpness"][j, s // K - 1]), float(res["stability"][j, s // K - 1]))
                    if K and s % K == 0 else (math.nan, math.nan))
            for k, d in enumerate(res["depths"]):
                rows.append((cid, dim, L, B, B * spec.seq_len, int(seed), int(s), int(d),
                             depth_group(int(d), L), int(res["depth_numel"][k]),
                             float(res["depth_sumsq"][j, i, k]), float(res["loss"][j, s - 1]),
                             float(res["grad_norm"][j, s - 1]), *curv))
    df = pd.DataFrame(rows, columns=["cell_id", "dim", "num_layers", "batch", "tokens_per_step",
                                     "seed", "step", "depth", "group", "numel", "grad_sumsq",
                                     "loss", "grad_norm", "sharpness", "stability"])
    df["seconds"] = seconds
    return df


def run_ladder(spec: LadderSpec, out: str | Path, progress: bool = True) -> pd.DataFrame:
    """Run every rung not yet in the store out/cells; return all cells' rows."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "ladder.json"
    if not _refuse_another(out, spec):
        atomic_write_bytes(meta, json.dumps({"ladder": spec.to_json()}, indent=2).encode())
    if spec.curvature_every and (spec.curvature_every % LOG_EVERY
                                 or spec.num_steps % spec.curvature_every):
        raise ConfigError(f"curvature_every {spec.curvature_every}: must be a multiple of "
                          f"{LOG_EVERY} that divides num_steps {spec.num_steps}")
    run_cells(CellStore(out / "cells"), [store_cell(spec, r) for r in spec.rungs],
              progress=progress, desc="ladder")
    return read_ladder(out, spec)


def seed_cells(spec: LadderSpec, out: str | Path, source: str | Path) -> int:
    """Copy into out/cells the cells of `spec` that the ladder directory `source` has
    measured and `out` lacks (the study's standard scale reads the ladder shipped with the
    package this way: the fit is recomputed, the hours of training are not), and its
    batch-sharpness summary (BATCH_SHARPNESS_FILE) when `out` has none. `source` must hold
    the same ladder (its ladder.json), else nothing is copied. Returns the cells copied."""
    source, out = Path(source), Path(out)
    _refuse_another(out, spec)
    theirs, mine = stored_spec(source, "--cells-from ").to_json(), spec.to_json()
    if theirs != mine:
        diff = sorted(k for k in theirs if theirs[k] != mine.get(k))
        raise ConfigError(f"--cells-from {source}: another ladder (differs in {', '.join(diff)}); "
                          "nothing copied")
    # the source is read only (it may be the package's data): its cells through `sources`
    theirs_cells = source / "cells"
    store = CellStore(out / "cells", sources=[theirs_cells] if theirs_cells.is_dir() else [])
    for r in spec.rungs:
        store.get(store_cell(spec, r))
    copied = store.copied
    bs = source / BATCH_SHARPNESS_FILE
    if bs.is_file() and not (out / BATCH_SHARPNESS_FILE).exists():
        atomic_write_bytes(out / BATCH_SHARPNESS_FILE, bs.read_bytes())
    return copied


def stored_spec(out: Path, what: str = "") -> LadderSpec:
    """The ladder a ladder directory was run with (its ladder.json); `what` prefixes the
    error's name of the directory (e.g. the option that named it)."""
    meta = Path(out) / "ladder.json"
    if not meta.is_file():
        raise ConfigError(f"{what}{out}: not a ladder directory (no ladder.json)")
    return spec_from_json(json.loads(meta.read_text()).get("ladder", {}))


def _refuse_another(out: Path, spec: LadderSpec) -> bool:
    """Whether `out` already holds a ladder; an error when it is another than `spec`."""
    if not (out / "ladder.json").is_file():
        return False
    if stored_spec(out).to_json() != spec.to_json():
        raise ConfigError(f"{out}: holds another ladder (ladder.json differs); use a new --out")
    return True


def read_ladder(out: str | Path, spec: LadderSpec | None = None) -> pd.DataFrame:
    """All cached cells of a ladder directory (those of `spec` only, when given)."""
    out = Path(out)
    if not (out / "ladder.json").is_file():
        raise ConfigError(f"{out}: not a ladder directory (no ladder.json)")
    spec = stored_spec(out) if spec is None else spec
    store = CellStore(out / "cells")
    cells = [store_cell(spec, r) for r in spec.rungs]
    try:
        frames = [store.read(c.kind, c.key)["rows"] for c in cells if store.has(c.kind, c.key)]
    except CorruptCell as e:
        raise ConfigError(f"{e}: `adamspike simulate ladder` on {out} recomputes it") from None
    if not frames:
        raise ConfigError(f"{out}: no finished ladder cells")
    return pd.concat(frames, ignore_index=True)


def spec_from_json(d: Mapping[str, Any]) -> LadderSpec:
    d = dict(d)
    d["rungs"] = [tuple(int(x) for x in r) for r in d["rungs"]]
    return LadderSpec(**d)


# ----------------------------------------------------------------------------- fit

FEATURES = ("dim", "num_layers", "tokens_per_step")


def responses(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, seed): dim, num_layers, tokens_per_step and, per group, log10 of
    the group's gradient RMS (median over logged steps in the second half of training)."""
    last = df["step"].max()
    late = df[df["step"] > last / 2]
    g = late.groupby(["cell_id", "seed", "step", "group"], as_index=False).agg(
        grad_sumsq=("grad_sumsq", "sum"), numel=("numel", "sum"),
        dim=("dim", "first"), num_layers=("num_layers", "first"),
        tokens_per_step=("tokens_per_step", "first"))
    g["log10_rms"] = 0.5 * np.log10(g["grad_sumsq"] / g["numel"])
    r = g.groupby(["cell_id", "seed", "group"], as_index=False).agg(
        log10_rms=("log10_rms", "median"), dim=("dim", "first"),
        num_layers=("num_layers", "first"), tokens_per_step=("tokens_per_step", "first"))
    wide = r.pivot_table(index=["cell_id", "seed", *FEATURES], columns="group",
                         values="log10_rms").reset_index()
    wide.columns.name = None
    if "sharpness" in late and late["sharpness"].notna().any():
        # the sharpness ladder: per (cell, seed) the median over the late evaluations of
        # lambda_max(H) (log10; a median <= 0 has no log: NaN, left out of the fit) and of S
        c = late.dropna(subset=["sharpness"]).drop_duplicates(["cell_id", "seed", "step"])
        c = c.groupby(["cell_id", "seed"], as_index=False).agg(
            sharpness=("sharpness", "median"), stability=("stability", "median"))
        c["log10_sharpness"] = np.log10(c["sharpness"].where(c["sharpness"] > 0))
        wide = wide.merge(c, on=["cell_id", "seed"], how="left")
    return wide


def design(x: pd.DataFrame | Mapping[str, Any]) -> np.ndarray:
    """[1, log10 dim, log10 layers, log10 tokens_per_step] rows."""
    cols = [np.atleast_1d(np.asarray(x[f], float)) for f in FEATURES]
    return np.column_stack([np.ones_like(cols[0]), *(np.log10(c) for c in cols)])


@dataclass
class GroupFit:
    coef: np.ndarray                 # c0, c_d, c_L, c_B
    coef_lo: np.ndarray
    coef_hi: np.ndarray
    r2_log: float
    resid_sd: float                  # log10 units
    resid: np.ndarray
    boot_coef: np.ndarray = field(repr=False)   # (n_boot, 4)
    n: int = 0


def _lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(X, y, rcond=None)[0]


def fit_power_law(X: np.ndarray, Y: np.ndarray, n_boot: int = 1000, seed: int = 0,
                  ci: float = 0.9) -> list[GroupFit]:
    """Least-squares fits of each column of Y (n, k) on X (n, p) with a case bootstrap
    shared by the columns (the same resampled rows for every column)."""
    X, Y = np.asarray(X, float), np.asarray(Y, float)
    n = len(X)
    if n <= X.shape[1]:
        raise ValueError(f"ladder fit: {n} rows for {X.shape[1]} coefficients")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    a = (1 - ci) / 2
    out = []
    for k in range(Y.shape[1]):
        y = Y[:, k]
        ok = np.isfinite(y)
        coef = _lstsq(X[ok], y[ok])
        resid = y[ok] - X[ok] @ coef
        ss_tot = float(np.sum((y[ok] - y[ok].mean()) ** 2))
        r2 = 1 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else math.nan
        boot = []
        for rows in idx:
            rows = rows[ok[rows]]
            Xb = X[rows]
            if np.linalg.matrix_rank(Xb) < X.shape[1]:
                continue
            boot.append(_lstsq(Xb, y[rows]))
        boot = np.array(boot)
        dof = max(1, ok.sum() - X.shape[1])
        out.append(GroupFit(coef=coef, coef_lo=np.quantile(boot, a, axis=0),
                            coef_hi=np.quantile(boot, 1 - a, axis=0), r2_log=r2,
                            resid_sd=float(np.sqrt(np.sum(resid ** 2) / dof)), resid=resid,
                            boot_coef=boot, n=int(ok.sum())))
    return out


def predict_interval(fit: GroupFit, x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Bootstrap prediction draws (n_boot,) of y at design row x: each replicate's
    prediction plus a resampled residual."""
    rng = np.random.default_rng(seed + 1)
    pred = fit.boot_coef @ np.asarray(x, float)
    return pred + rng.choice(fit.resid, size=len(pred))


def fit_ladder(df: pd.DataFrame, n_boot: int = 1000, ci: float = 0.9) -> dict:
    """The per-group power-law fit of the module docstring, as a JSON-able dict, plus the
    held-out check on the widest rung (fit without it, predict it)."""
    wide = responses(df)
    groups = [g for g in GROUPS if g in wide]
    X, Y = design(wide), wide[groups].to_numpy(float)
    fits = fit_power_law(X, Y, n_boot=n_boot, ci=ci)
    widest = wide["dim"].max()
    train = (wide["dim"] < widest).to_numpy()
    # the narrower rungs must still identify the width and depth exponents
    identifiable = (len(np.unique(wide.loc[train, "dim"])) >= 2
                    and len(np.unique(wide.loc[train, "num_layers"])) >= 2)
    held = ({g: _heldout_error(X, Y[:, k], train) for k, g in enumerate(groups)}
            if identifiable else {})
    sharp = (_fit_sharpness(wide, X, train if identifiable else None, n_boot, ci)
             if "log10_sharpness" in wide else None)
    return {
        **({"sharpness": public(sharp), "_sharp_fit": sharp["_fit"]} if sharp else {}),
        "form": "log10 rms_group = c0 + c_d log10 dim + c_L log10 layers + c_B log10 tokens_per_step",
        "response": "log10 gradient RMS of the group (raw, pre-clip), median over the logged "
                    "steps of the second half of training, one row per (rung, seed)",
        "ci": ci, "n_boot": n_boot, "num_rows": int(len(wide)),
        "rungs": sorted({(int(a), int(b), int(c)) for a, b, c in
                         wide[list(FEATURES)].itertuples(index=False)}),
        "groups": {g: {"coef": f.coef.tolist(), "coef_lo": f.coef_lo.tolist(),
                       "coef_hi": f.coef_hi.tolist(), "r2_log": f.r2_log,
                       "resid_sd_log10": f.resid_sd, "n": f.n,
                       "heldout_widest": held.get(g)} for g, f in zip(groups, fits)},
        "heldout_dim": int(widest),
        "_fits": dict(zip(groups, fits)),
        "_responses": wide,
    }


def _heldout_error(X: np.ndarray, y: np.ndarray, train: np.ndarray) -> dict | None:
    """Fit on the `train` rows, predict the others: their mean and rms log10 error (rows
    with a non-finite y left out; None when too few rows remain on either side)."""
    ok = np.isfinite(y)
    fit_rows, test = train & ok, ~train & ok
    if fit_rows.sum() <= X.shape[1] or not test.any():
        return None
    err = y[test] - X[test] @ _lstsq(X[fit_rows], y[fit_rows])
    return {"mean_log10_error": float(np.mean(err)),
            "rms_log10_error": float(np.sqrt(np.mean(err ** 2)))}


def _fit_sharpness(wide: pd.DataFrame, X: np.ndarray, train: np.ndarray | None, n_boot: int,
                   ci: float) -> dict:
    """The sharpness ladder's fit: log10 lambda_max(H) on the same design and bootstrap as
    the groups' RMS, its held-out check on the widest rung (train: the other rows; None
    when they do not identify the exponents), and per rung the median S."""
    y = wide[["log10_sharpness"]].to_numpy(float)
    f = fit_power_law(X, y, n_boot=n_boot, ci=ci)[0]
    ok = np.isfinite(y[:, 0])
    held = None if train is None else _heldout_error(X, y[:, 0], train)
    by_rung = wide.groupby(list(FEATURES), as_index=False).agg(
        sharpness=("sharpness", "median"), stability=("stability", "median"),
        stability_min=("stability", "min"), stability_max=("stability", "max"))
    return {"form": "log10 lambda_max(H) = c0 + c_d log10 dim + c_L log10 layers "
                    "+ c_B log10 tokens_per_step",
            "response": "lambda_max of the Hessian of the unscaled minibatch loss (power "
                        "iteration, warm-started), median over the evaluations of the second "
                        "half of training, one row per (rung, seed); S = lr lambda_max(P H) / 2 "
                        "beside it",
            "coef": f.coef.tolist(), "coef_lo": f.coef_lo.tolist(), "coef_hi": f.coef_hi.tolist(),
            "r2_log": f.r2_log, "resid_sd_log10": f.resid_sd, "n": f.n,
            "num_nonpositive": int((~ok).sum()), "heldout_widest": held,
            "by_rung": by_rung.to_dict("records"), "_fit": f}


# ----------------------------------------------------------------------------- 70B

def group_numel(cfg) -> dict[str, int]:
    """Parameters per depth group of a LlamaConfig."""
    out = {g: 0 for g in GROUPS}
    for s in param_specs(cfg):
        out[depth_group(s.depth, cfg.num_layers)] += s.numel
    return out


def extrapolate(fit: Mapping[str, Any], cfg, tokens_per_step: int, eps: float,
                clip: float = 1.0) -> dict:
    """The clipped profile at (cfg.dim, cfg.num_layers, tokens_per_step): per group the
    point prediction and the bootstrap interval of rho = rms_consumed / eps, where
    rms_consumed = rms_raw * min(1, clip / gn), gn = sqrt(sum_g N_g rms_raw_g^2) per
    replicate. Also the predicted raw global norm, the clip factor and the bound
    clip / (sqrt(N) eps) on the mean rho."""
    fits: dict[str, GroupFit] = fit["_fits"]
    numel = group_numel(cfg)
    groups = [g for g in GROUPS if g in fits and numel[g] > 0]
    x = design({"dim": cfg.dim, "num_layers": cfg.num_layers, "tokens_per_step": tokens_per_step})[0]
    point = {g: 10 ** float(fits[g].coef @ x) for g in groups}
    draws = np.column_stack([10 ** predict_interval(fits[g], x, seed=k)
                             for k, g in enumerate(groups)])
    m = min(len(fits[g].boot_coef) for g in groups)
    draws = draws[:m]
    N = np.array([numel[g] for g in groups], float)
    ntot = float(sum(numel.values()))

    def clipped(rms):  # rms (..., groups)
        gn = np.sqrt(np.sum(N * rms ** 2, axis=-1, keepdims=True))
        return rms * np.minimum(1.0, clip / gn), gn[..., 0]

    p_rms = np.array([point[g] for g in groups])
    p_cons, p_gn = clipped(p_rms)
    d_cons, d_gn = clipped(draws)
    a = (1 - fit["ci"]) / 2
    rho = p_cons / eps
    lo, hi = np.quantile(d_cons / eps, a, axis=0), np.quantile(d_cons / eps, 1 - a, axis=0)
    mean_rho = float(np.sqrt(np.sum(N * rho ** 2) / ntot))
    mean_rho_draws = np.sqrt(np.sum(N * (d_cons / eps) ** 2, axis=1) / ntot)
    return {
        "dim": cfg.dim, "num_layers": cfg.num_layers, "tokens_per_step": int(tokens_per_step),
        "eps": eps, "clip": clip, "num_params": int(ntot),
        "group_numel": {g: int(numel[g]) for g in groups},
        "raw_rms": {g: float(v) for g, v in zip(groups, p_rms)},
        "raw_grad_norm": float(p_gn), "raw_grad_norm_lo": float(np.quantile(d_gn, a)),
        "raw_grad_norm_hi": float(np.quantile(d_gn, 1 - a)),
        "clip_factor": float(min(1.0, clip / p_gn)),
        "clipped_frac_of_draws": float(np.mean(d_gn > clip)),
        "rho": {g: float(v) for g, v in zip(groups, rho)},
        "rho_lo": {g: float(v) for g, v in zip(groups, lo)},
        "rho_hi": {g: float(v) for g, v in zip(groups, hi)},
        "mean_rho": mean_rho, "mean_rho_hi": float(np.quantile(mean_rho_draws, 1 - a)),
        "mean_rho_bound": clip / (math.sqrt(ntot) * eps),
        **({"sharpness": sharpness_70b(
            fit["_sharp_fit"], x, eps, fit["ci"],
            x_floor=design({"dim": cfg.dim, "num_layers": cfg.num_layers,
                            "tokens_per_step": max(r[2] for r in fit["rungs"])})[0])}
           if "_sharp_fit" in fit else {}),
        "_draws_rho": d_cons / eps, "_groups": groups,
    }


def pi_readings(lam: float, lo: float, hi: float, eps: float, lr: float = LR_70B) -> dict:
    """Pi_eps = (lr / eps) lambda_max(H) with its interval and its ratio to the threshold, at
    the peak lr and at half of it (step 1000 of LLaMA2's 2000-step linear warmup)."""
    return {name: {"lr": l, "pi_eps": l / eps * lam, "pi_eps_lo": l / eps * lo,
                   "pi_eps_hi": l / eps * hi, "over_threshold": l / eps * lam / PI_THRESHOLD}
            for name, l in (("peak", lr), ("warmup_step_1000", lr / 2))}


def sharpness_70b(f: GroupFit, x: np.ndarray, eps: float, ci: float, lr: float = LR_70B,
                  x_floor: np.ndarray | None = None) -> dict:
    """lambda_max(H) at design row x (point, bootstrap prediction interval) and the eps
    band's stability number there, Pi_eps = (lr / eps) lambda_max(H) against its threshold
    2 (1+b1) / (1-b1) = 38, at the peak lr and at half of it (step 1000 of LLaMA2's
    2000-step linear warmup). Pi_eps / 38 is Adam's S for a coordinate deep in the band
    (sqrt(v_hat) << eps); a group with rho ~ 1 has its P halved, so S is at most this.

    The minibatch Hessian's top eigenvalue falls with the batch while its noise part
    dominates and stops at the full-batch value, which the ladder's batches may not reach:
    x_floor (the 70B's width and depth at the ladder's largest tokens per step) gives the
    other end, `at_ladder_tokens`: no further fall beyond the ladder's batches."""
    a = (1 - ci) / 2

    def at(row, seed):
        draws = 10 ** predict_interval(f, row, seed=seed)
        return 10 ** float(f.coef @ row), float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))

    lam, lo, hi = at(x, 99)
    out = {"lambda_max": lam, "lambda_max_lo": lo, "lambda_max_hi": hi, "eps": eps,
           "threshold": PI_THRESHOLD, "pi": pi_readings(lam, lo, hi, eps, lr),
           "lambda_crossing_at_peak": PI_THRESHOLD * eps / lr}
    if x_floor is not None:
        fl = at(x_floor, 98)
        out["at_ladder_tokens"] = {"tokens_per_step": float(10 ** x_floor[3]),
                                   "lambda_max": fl[0], "lambda_max_lo": fl[1],
                                   "lambda_max_hi": fl[2], "pi": pi_readings(*fl, eps, lr)}
    return out


def profile_by_depth(ext: Mapping[str, Any]) -> list[dict]:
    """Per depth (-1 .. L): depth, group, rho, rho_lo, rho_hi (the group's values)."""
    L = int(ext["num_layers"])
    rows = []
    for d in range(-1, L + 1):
        g = depth_group(d, L)
        rows.append({"depth": d, "group": g, "rho": ext["rho"][g], "rho_lo": ext["rho_lo"][g],
                     "rho_hi": ext["rho_hi"][g]})
    return rows


def public(d: Mapping[str, Any]) -> dict:
    """Drop the private (underscore) entries of a fit / extrapolation dict."""
    return {k: v for k, v in d.items() if not k.startswith("_")}


BATCH_SHARPNESS_FILE = "batch_sharpness.json"


def full_data_sharpness(summary: Mapping[str, Any], eps: float, lr: float = LR_70B) -> dict | None:
    """The 70B's full-data reading from a batch-sharpness summary (simulate.batch_sharpness:
    lambda_inf of the rungs' evaluation-batch fits, its law across rungs carried to the
    70B; the range: leave one rung out), in sharpness_70b's shape; None without a law."""
    t = summary.get("llama2_70b")
    if not t or not t.get("lambda_inf_leave_one_out"):
        return None
    lam = float(t["lambda_inf"])
    lo, hi = (float(v) for v in t["lambda_inf_leave_one_out"])
    lo, hi = min(lo, lam), max(hi, lam)
    law = summary.get("law") or {}
    return {"lambda_max": lam, "lambda_max_lo": lo, "lambda_max_hi": hi,
            # with an lr term, lambda at another lr: lambda (lr / lr_ref)^lr_exponent
            "lr_ref": float(t.get("lr", lr)), "lr_exponent": law.get("lr"),
            "law": summary.get("law"), "eval_tokens": summary.get("eval_tokens"),
            "pi": pi_readings(lam, lo, hi, eps, lr)}


def ladder_70b(ladder_dir: str | Path, eps: float = 1e-5, clip: float = 1.0,
               n_boot: int = 1000, batch_sharpness: str | Path | None = None) -> tuple[dict, dict]:
    """(fit, extrapolation) of a ladder directory at LLaMA2-70B (TARGET_70B). With a
    batch-sharpness summary (`batch_sharpness`, or BATCH_SHARPNESS_FILE in the ladder
    directory) the sharpness gets its full-data reading `full_data` (full_data_sharpness):
    the minibatch fall with the batch stops where the evaluation batches say it does."""
    fit = fit_ladder(read_ladder(ladder_dir), n_boot=n_boot)
    fit["ladder_spec"] = json.loads((Path(ladder_dir) / "ladder.json").read_text())["ladder"]
    cfg = preset("llama2-70b")
    ext = extrapolate(fit, cfg, TARGET_70B["tokens_per_step"], eps, clip)
    path = Path(batch_sharpness) if batch_sharpness else Path(ladder_dir) / BATCH_SHARPNESS_FILE
    if path.is_dir():
        path = path / "summary.json"
    if ext.get("sharpness") and path.is_file():
        full = full_data_sharpness(json.loads(path.read_text()), eps)
        if full is not None:
            ext["sharpness"]["full_data"] = full
    elif batch_sharpness:
        raise ConfigError(f"--batch-sharpness {batch_sharpness}: no summary.json there"
                          if not path.is_file() else
                          f"{ladder_dir}: no sharpness fit, so no full-data reading to add")
    return fit, ext


def extrapolation_band(fit: Mapping[str, Any], num_layers: int, tokens_per_step: int,
                       dims: Sequence[float]) -> pd.DataFrame:
    """Raw (unclipped) group RMS along width at fixed layers and tokens per step: point
    prediction and the bootstrap prediction interval, one row per (group, dim)."""
    a = (1 - fit["ci"]) / 2
    rows = []
    for k, (g, f) in enumerate(fit["_fits"].items()):
        for d in dims:
            x = design({"dim": d, "num_layers": num_layers, "tokens_per_step": tokens_per_step})[0]
            draws = predict_interval(f, x, seed=k)
            rows.append({"group": g, "dim": float(d), "num_layers": num_layers,
                         "tokens_per_step": tokens_per_step, "rms": 10 ** float(f.coef @ x),
                         "rms_lo": 10 ** float(np.quantile(draws, a)),
                         "rms_hi": 10 ** float(np.quantile(draws, 1 - a))})
    return pd.DataFrame(rows)


def write_outputs(out: Path, df: pd.DataFrame, fit: Mapping[str, Any], ext: Mapping[str, Any],
                  seconds: float) -> dict:
    """fit.json (fit, 70B extrapolation, profile by depth, timings), responses.csv (the fitted
    rows), band.csv (extrapolation_band at the 70B's depth and tokens), depth_rms.csv (per
    depth RMS per rung, median over seeds and late steps): the figure reads these."""
    summary = {"fit": public(fit), "llama2_70b": public(ext), "profile_by_depth": profile_by_depth(ext),
               "cell_seconds": {c: float(s) for c, s in df.groupby("cell_id")["seconds"].first().items()},
               "seconds": seconds}
    atomic_write_bytes(out / "fit.json", json.dumps(summary, indent=2).encode())
    atomic_write_bytes(out / "responses.csv", fit["_responses"].to_csv(index=False).encode())
    band = extrapolation_band(fit, ext["num_layers"], ext["tokens_per_step"],
                              np.geomspace(16, 16384, 41))
    atomic_write_bytes(out / "band.csv", band.to_csv(index=False).encode())
    late = df[df["step"] > df["step"].max() / 2]
    dr = late.assign(rms=np.sqrt(late["grad_sumsq"] / late["numel"])).groupby(
        ["dim", "num_layers", "batch", "depth", "group"], as_index=False)["rms"].median()
    atomic_write_bytes(out / "depth_rms.csv", dr.to_csv(index=False).encode())
    atomic_write_bytes(out / "report.md", report_md(summary, out).encode())
    return summary


def report_md(summary: Mapping[str, Any], out: Path) -> str:
    """The ladder's section of STUDY.md: the fit, its quality and the 70B profile."""
    fit, ext = summary["fit"], summary["llama2_70b"]
    pct = int(round(100 * fit["ci"]))
    lines = [f"Ladder `{out}`: {len(fit['rungs'])} rungs (dim, layers, tokens per step) "
             f"{', '.join(str(tuple(r)) for r in fit['rungs'])}; {fit['num_rows']} rung x seed "
             f"rows; {fit.get('ladder_spec', {}).get('num_steps', '?')} steps, lr "
             f"{fit.get('ladder_spec', {}).get('lr', '?')} ({fit.get('ladder_spec', {}).get('lr_scaling', 'constant')}"
             f" over width), b2 {fit.get('ladder_spec', {}).get('b2', '?')}, clip 1, wd 0.1; wall time "
             f"{summary['seconds']:.0f} s (cells cached: a resumed ladder only runs missing cells).", "",
             f"Fit: `{fit['form']}` per group; response: {fit['response']}. "
             f"Intervals: {pct} % case bootstrap (n_boot {fit['n_boot']}).", "",
             md_table(([g, *(f"{v['coef'][k]:+.3f} [{v['coef_lo'][k]:+.3f}, {v['coef_hi'][k]:+.3f}]"
                             for k in (1, 2, 3)), f"{v['r2_log']:.3f}", f"{v['resid_sd_log10']:.3f}",
                        f"{v['heldout_widest']['mean_log10_error']:+.3f}" if v.get("heldout_widest") else "n/a"]
                       for g, v in fit["groups"].items()),
                      headers=["group", "c_d (width)", "c_L (layers)", "c_B (tokens/step)", "R^2 (log)",
                               "resid sd (log10)", f"held-out dim {fit['heldout_dim']}: mean log10 error"],
                      max_rows=None)]
    k = ext["eps"] / 1e-8
    lines += ["", f"LLaMA2-70B (dim {ext['dim']}, {ext['num_layers']} layers, "
              f"{ext['tokens_per_step']:,} tokens/step, N = {ext['num_params']:,}): predicted raw "
              f"global grad norm {ext['raw_grad_norm']:.3g} [{ext['raw_grad_norm_lo']:.3g}, "
              f"{ext['raw_grad_norm_hi']:.3g}] ({100 * ext['clipped_frac_of_draws']:.0f} % of the "
              f"bootstrap draws above the clip {ext['clip']:g}), so Adam consumes the gradient "
              f"times {ext['clip_factor']:.3g}; mean rho {ext['mean_rho']:.4f} at eps "
              f"{ext['eps']:g}, bound clip/(sqrt(N) eps) = {ext['mean_rho_bound']:.4f}.", "",
              md_table(([g, f"{ext['group_numel'][g]:,}", f"{ext['raw_rms'][g]:.3g}",
                         f"{ext['rho'][g]:.3g} [{ext['rho_lo'][g]:.3g}, {ext['rho_hi'][g]:.3g}]",
                         f"{ext['rho'][g] * k:.3g} [{ext['rho_lo'][g] * k:.3g}, {ext['rho_hi'][g] * k:.3g}]"]
                        for g in ext["rho"]),
                       headers=["group", "N", "raw rms", f"rho at eps {ext['eps']:g} [{pct} % PI]",
                                "rho at eps 1e-8"], max_rows=None)]
    if "sharpness" in fit and "sharpness" in ext:
        lines += [""] + sharpness_md(fit["sharpness"], ext["sharpness"], pct,
                                     fit.get("ladder_spec", {}))
    lines += ["", "Limits: the ladder's vocab (256) is fixed, so embed and head extrapolate "
              "without a vocab term (the 70B has 32000); the response is early training (the "
              "late half of a short run); the tokens-per-step exponent comes from one (dim, "
              "layers) rung and extrapolates 3.6 decades (a gradient-noise floor would stop the "
              "1/sqrt(B)-like fall); width 1.5 decades, depth 1 decade beyond the ladder. The "
              "interval is statistical (rows and residuals resampled), not a model-form error."]
    return "\n".join(lines) + "\n"


def sharpness_md(sf: Mapping[str, Any], s70: Mapping[str, Any], pct: int,
                 spec: Mapping[str, Any]) -> list[str]:
    """The sharpness ladder's lines of the report: the fit, S per rung, the 70B's Pi_eps."""
    c, lo, hi = sf["coef"], sf["coef_lo"], sf["coef_hi"]
    held = sf.get("heldout_widest")
    out = [f"Sharpness ladder: {sf['response']}; every {spec.get('curvature_every', '?')} steps, "
           f"{spec.get('curvature_iters', '?')} products per evaluation. Fit `{sf['form']}`: "
           f"c_d {c[1]:+.3f} [{lo[1]:+.3f}, {hi[1]:+.3f}], c_L {c[2]:+.3f} [{lo[2]:+.3f}, "
           f"{hi[2]:+.3f}], c_B {c[3]:+.3f} [{lo[3]:+.3f}, {hi[3]:+.3f}]; R^2 (log) "
           f"{sf['r2_log']:.3f}, resid sd {sf['resid_sd_log10']:.3f} (log10); held-out widest "
           + (f"mean log10 error {held['mean_log10_error']:+.3f}" if held else "n/a")
           + (f"; {sf['num_nonpositive']} row(s) with a non-positive median left out"
              if sf.get("num_nonpositive") else "") + ".", "",
           md_table(([int(r["dim"]), int(r["num_layers"]), int(r["tokens_per_step"]),
                      f"{r['sharpness']:.3g}", f"{r['stability']:.3g}",
                      f"[{r['stability_min']:.3g}, {r['stability_max']:.3g}]"]
                     for r in sf["by_rung"]),
                    headers=["dim", "layers", "tokens/step", "lambda_max(H) (median)",
                             "S (median over seeds)", "S range over seeds"], max_rows=None), ""]
    pk, wu = s70["pi"]["peak"], s70["pi"]["warmup_step_1000"]
    out.append(
        f"LLaMA2-70B: lambda_max(H) {s70['lambda_max']:.3g} [{s70['lambda_max_lo']:.3g}, "
        f"{s70['lambda_max_hi']:.3g}] ({pct} % PI); at eps {s70['eps']:g} the eps band's "
        f"stability number Pi_eps = (lr/eps) lambda_max(H) is {pk['pi_eps']:.3g} "
        f"[{pk['pi_eps_lo']:.3g}, {pk['pi_eps_hi']:.3g}] at the peak lr {pk['lr']:g} "
        f"({pk['over_threshold']:.3g}x the threshold {s70['threshold']:g}) and "
        f"{wu['pi_eps']:.3g} [{wu['pi_eps_lo']:.3g}, {wu['pi_eps_hi']:.3g}] at step 1000 of "
        f"the warmup; it crosses 38 at the peak lr once lambda_max(H) > "
        f"{s70['lambda_crossing_at_peak']:.3g}. "
        + (lambda fl: f"Without the fall with the batch beyond the ladder's "
           f"{fl['tokens_per_step']:,.0f} tokens per step (a minibatch Hessian stops at its "
           f"full-batch value): lambda_max(H) {fl['lambda_max']:.3g} [{fl['lambda_max_lo']:.3g}, "
           f"{fl['lambda_max_hi']:.3g}], Pi_eps {fl['pi']['peak']['pi_eps']:.3g} at the peak lr "
           f"({fl['pi']['peak']['over_threshold']:.3g}x the threshold). The two readings "
           f"bracket the 70B. ")(s70["at_ladder_tokens"]) * ("at_ladder_tokens" in s70)
        + f"The ladder trains at its own lr per rung "
        f"(lr_scaling {spec.get('lr_scaling', '?')}), not the 70B's: where sharpness "
        f"self-stabilises at an edge, lambda_max scales with 1/lr, and this extrapolation "
        f"carries the ladder's lr, not LLaMA2's.")
    return out


# ----------------------------------------------------------------------------- CLI

def rung_arg(text: str) -> tuple[int, ...]:
    """'64x4x16' (dim x layers x batch; batch_sharpness: dim x layers) as integers."""
    try:
        vals = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        vals = ()
    if len(vals) not in (2, 3) or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DIMxLAYERS[xBATCH], e.g. 64x4x16")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike simulate ladder",
                                 description="Width/depth ladder of tiny LLaMAs (simulate.ladder)")
    ap.add_argument("--out", type=Path, required=True, help="ladder directory (resumable)")
    ap.add_argument("--rungs", nargs="+", type=rung_arg, metavar="DxLxB",
                    help="the rungs (dim x layers x batch; default: the full ladder's 13)")
    ap.add_argument("--seeds", type=int, help="seeds per rung (default 3)")
    ap.add_argument("--num-steps", type=int, help="training steps (default 150)")
    ap.add_argument("--warmup-steps", type=int, help="lr warmup steps (default 20)")
    ap.add_argument("--curvature-every", type=int,
                    help="the sharpness ladder's interval (default 15; 0: off)")
    ap.add_argument("--curvature-iters", type=int,
                    help="warm-started products per evaluation (default 5)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--eps", type=float, default=1e-5, help="eps of the 70B profile written")
    ap.add_argument("--lr-scaling", choices=("constant", "inverse_width"), default="inverse_width",
                    help="lr per rung: lr * 64 / dim (muP-style, default) or the same lr")
    ap.add_argument("--cells-from", type=Path, metavar="LADDER_DIR",
                    help="copy the cells this ladder lacks from that ladder directory (the same "
                         "spec; e.g. the one shipped in adamspike/data/llama2_70b/ladder) and its "
                         f"{BATCH_SHARPNESS_FILE}; only missing cells are then trained")
    return cli_main(ap, argv, _main, "adamspike simulate ladder: error")


def _main(args) -> int:
    # resumable: a ladder folder (its ladder.json or cells/: --cells-from copies cells
    # first) is kept, any other non-empty one refused
    check_out(args.out, keep_existing=(args.out / "ladder.json").is_file()
              or (args.out / "cells").is_dir())
    spec = sized_spec(args.lr_scaling, rungs=args.rungs, seeds=args.seeds,
                      num_steps=args.num_steps, warmup_steps=args.warmup_steps,
                      curvature_every=args.curvature_every, curvature_iters=args.curvature_iters)
    t0 = time.perf_counter()
    if args.cells_from:
        n = seed_cells(spec, args.out, args.cells_from)
        print(f"ladder: {n} of {len(spec.rungs)} cells copied from {args.cells_from}")
    df = run_ladder(spec, args.out, progress=not args.no_progress)
    fit, ext = ladder_70b(args.out, eps=args.eps)
    write_outputs(args.out, df, fit, ext, time.perf_counter() - t0)
    g = fit["groups"]
    print(f"ladder: {df['cell_id'].nunique()} cells; R^2(log) "
          + ", ".join(f"{k} {v['r2_log']:.2f}" for k, v in g.items())
          + f"; 70B mean rho {ext['mean_rho']:.3g} (bound {ext['mean_rho_bound']:.3g}) "
          f"-> {args.out / 'fit.json'}")
    if "sharpness" in ext:
        sh = ext["sharpness"]
        print(f"ladder: 70B lambda_max(H) {sh['lambda_max']:.3g} [{sh['lambda_max_lo']:.3g}, "
              f"{sh['lambda_max_hi']:.3g}]; Pi_eps at the peak lr {sh['pi']['peak']['pi_eps']:.3g} "
              f"(threshold {sh['threshold']:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
