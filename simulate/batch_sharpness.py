"""Sharpness against the evaluation batch: where the minibatch lambda_max(H) stops falling.

    adamspike simulate batch-sharpness --out DIR [--rungs DxL ...] [--seeds N]
                                       [--eval-tokens N ...] [--num-steps N]
                                       [--cells-from STORE]
                                       (one cell per rung and seed)

The sharpness ladder (simulate.ladder) measures lambda_max(H) of the training minibatch
(16 x 32 tokens) and finds it falls with the batch as tokens^-1.18. Carried to the 70B's 4M
tokens per step, that fall puts the 70B's Pi_eps far below the eps band's edge; stopped at
the ladder's largest batch, far above (docs/results/science3_2026-12-05.md). The minibatch
Hessian is H_B = H + (a zero-mean term whose size falls with B), so lambda_max(H_B) falls
toward the full-data lambda_max(H) and stops there. This measures where, at the trained
parameters of a few ladder rungs:

1. Train seed s of rung (dim, layers) with the ladder's recipe (simulate.ladder.run_config:
   its lr rule, schedule, data and batch 16 x 32, `spec.num_steps` steps) through
   simulate.program's step (`Program.step_fn`, the trainer's).
2. At the final parameters, lambda_max(H) of the mean loss over n tokens for n in
   `eval_tokens` (nested samples of the same data set: each larger batch contains the
   smaller; sample seed 1000 + s, apart from the training order), by `Program.stability`
   (precondition=False) on chunks of CHUNK_SEQS sequences: COLD_ITERS products from a
   random vector at the smallest n, then WARM_ITERS more at each larger n from the previous
   n's vector. `change` is the last product's relative change of the Rayleigh quotient
   (convergence).
3. Per (rung, seed) the fit lambda(n) = lambda_inf + a / n (least squares on the measured
   n: the noise term of H_B falls as 1 / B); `noise_share` = 1 - lambda_inf / lambda(n_max).
   Across rungs, log10 lambda_inf = c0 + c_d log10 dim + c_L log10 layers [+ c_lr log10 lr
   when the rungs' lr varies apart from their width: `--lr-scaling both` runs the ladder's
   two lr rules], carried to the 70B (dim 8192, 80 layers, LLaMA2's lr 1.5e-4; a full-data
   value, so no tokens term) with leave-one-rung-out fits for its range, and Pi_eps =
   (lr / eps) lambda_inf at lr 1.5e-4 and eps 1e-5 against the eps band's threshold 38
   (simulate.ladder.PI_THRESHOLD). Measured: under the inverse-width rule alone the width
   exponent (0.48) is the lr's (at constant lr it is 0.03; with both, lr^-0.45).

Limits, stated in the summary: the rungs train at the ladder's lr (3e-3 x 64 / dim), not at
LLaMA2's, and far below their edge (S 0.004-0.04), so lambda is not pinned at 2 / lr;
150 steps (the full ladder's) is early training; 5 rungs over 1.6 decades of width would
be needed for more than a rough exponent, and the full size has dims 32-128.

Storage (DIR): cells/batch_sharpness/ (the one cell store, adamspike.cells: one cell per
rung, lr and seed, keyed by the ladder spec, rung, seed and evaluation sizes, so a killed run
resumes there and a changed setting recomputes only its cells), then batch_sharpness.csv
(one row per rung, seed, n), summary.json and batch_sharpness.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from adamspike.cells import Cell, CellStore, run_cells
from adamspike.config import ConfigError, cli_main
from adamspike.rundir import atomic_write_bytes, check_out
from adamspike.synthdata import SyntheticTokens
from adamspike.tables import md_table
from simulate import ladder as LD

CHUNK_SEQS = 256          # sequences per chunk of a large evaluation batch (memory bound)
COLD_ITERS = 20
WARM_ITERS = 10
EPS_70B = 1e-5
KIND = "batch_sharpness"
CODE = "power-1"          # bump when `measure` changes meaning
# the full study's sizes; smaller ones are explicit (run's arguments, the CLI's flags), e.g.
# --rungs 32x2 --seeds 1 --eval-tokens 512 2048 8192 --num-steps 60 --warmup-steps 6
SIZES = {"rungs": [(32, 4), (64, 4), (128, 4), (64, 2), (64, 8)], "seeds": 2,
         "eval_tokens": [512, 2048, 8192, 32768]}


def eval_batches(spec: LD.LadderSpec, seed: int, eval_tokens: Sequence[int]) -> list[np.ndarray]:
    """Nested evaluation batches, one (k, B, T+1) int32 array per n in eval_tokens (k chunks
    of B <= CHUNK_SEQS sequences); sample seed 1000 + seed."""
    data = SyntheticTokens("markov", spec.vocab_size, spec.seq_len, 1 << 20, LD.DATA_SEED, 0.1)
    num_seqs = [int(n) // spec.seq_len for n in eval_tokens]
    if any(n < 1 for n in num_seqs) or sorted(num_seqs) != num_seqs:
        raise ConfigError(f"eval_tokens {list(eval_tokens)}: increasing, each >= seq_len {spec.seq_len}")
    rng = np.random.default_rng(1000 + int(seed))
    idx = np.sort(rng.choice(data.num_samples, num_seqs[-1], replace=False))
    idx = rng.permutation(idx)
    out = []
    for n in num_seqs:
        b = min(n, CHUNK_SEQS)
        if n % b:
            raise ConfigError(f"eval_tokens: {n} sequences is not a multiple of {b}")
        out.append(data.batch(idx[:n]).reshape(n // b, b, spec.seq_len + 1).astype(np.int32))
    return out


def measure(rung: tuple[int, int], seed: int, spec: LD.LadderSpec,
            eval_tokens: Sequence[int]) -> dict:
    """Train one seed of the rung, then lambda_max(H) at each evaluation size (module doc)."""
    import jax   # jax: only when rungs run
    import jax.numpy as jnp
    from simulate.program import program

    dim, layers = rung
    t0 = time.perf_counter()
    cfg = LD.llama_config(dim, layers, spec)
    batch = 16
    rc = LD.run_config(cfg, spec, batch)
    prog = program(rc)
    tokens = LD.batches(spec, batch, [seed])[:, 0]
    ctl = prog.controls(rc, range(1, spec.num_steps + 1))
    params, state = prog.init(seed)
    losses = []
    for s in range(spec.num_steps):
        params, state, out = prog.step_fn(params, state, jnp.asarray(tokens[s]), ctl.at(s))
        losses.append(float(out["loss"]))
    # the number of products traced: the cold / warm run and the one-product change check
    # at each batch size are one compiled program (a while loop), not two
    stab = jax.jit(prog.stability, static_argnames=("precondition",))
    c = ctl.at(spec.num_steps - 1)
    leaves = jax.tree.leaves(params)
    keys = jax.random.split(jax.random.PRNGKey(7_000 + seed), len(leaves))
    u = prog.tree([jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])
    rows = []
    for i, (n, b) in enumerate(zip(eval_tokens, eval_batches(spec, seed, eval_tokens))):
        iters = COLD_ITERS if i == 0 else WARM_ITERS
        lam, u = stab(params, state, jnp.asarray(b), c, u, num_iters=np.int32(iters - 1),
                      precondition=False)
        lam2, u = stab(params, state, jnp.asarray(b), c, u, num_iters=np.int32(1),
                       precondition=False)
        lam, lam2 = float(lam), float(lam2)
        rows.append({"tokens": int(n), "lambda": lam2,
                     "change": abs(lam2 - lam) / abs(lam2) if lam2 else math.nan})
    return {"dim": dim, "layers": layers, "seed": int(seed), "lr": float(rc.optim.lr),
            "num_steps": spec.num_steps, "train_tokens": batch * spec.seq_len,
            "final_loss": float(np.mean(losses[-10:])), "eval": rows,
            "seconds": time.perf_counter() - t0}


def cell(rung: Sequence[int], seed: int, spec: LD.LadderSpec, eval_tokens: Sequence[int]) -> Cell:
    """One rung and seed as a cell of the one store (the spec without its rung list)."""
    shared = {k: v for k, v in spec.to_json().items() if k not in ("rungs", "seeds")}
    return Cell(KIND, CODE, {"rung": [int(x) for x in rung], "seed": int(seed),
                             "spec": shared, "eval_tokens": [int(n) for n in eval_tokens]},
                "simulate.batch_sharpness:compute")


def compute(config: dict) -> dict:
    """The cell's computation (`cell`): `measure` on its resolved input."""
    spec = LD.spec_from_json({**config["spec"], "rungs": [], "seeds": 1})
    return measure(tuple(config["rung"]), config["seed"], spec, config["eval_tokens"])


def fit_noise(tokens: np.ndarray, lam: np.ndarray) -> tuple[float, float]:
    """lambda(n) = lambda_inf + a / n by least squares: (lambda_inf, a)."""
    X = np.stack([np.ones_like(tokens, dtype=float), 1.0 / np.asarray(tokens, float)], 1)
    coef = np.linalg.lstsq(X, np.asarray(lam, float), rcond=None)[0]
    return float(coef[0]), float(coef[1])


def summarize(cells: list[dict]) -> tuple[pd.DataFrame, dict]:
    """The long table and the summary (per rung and seed: lambda at each n, the 1/n fit;
    across rungs: the power law of lambda_inf and the 70B's Pi_eps)."""
    long = pd.DataFrame([{k: c[k] for k in ("dim", "layers", "seed", "lr", "final_loss")}
                         | {k: r[k] for k in ("tokens", "lambda", "change")}
                         for c in cells for r in c["eval"]])      # the columns in this order
    per = []
    for (dim, layers, lr, seed), d in long.groupby(["dim", "layers", "lr", "seed"], sort=True):
        d = d.sort_values("tokens")
        lam_inf, a = fit_noise(d["tokens"].to_numpy(), d["lambda"].to_numpy())
        last = float(d["lambda"].iloc[-1])
        per.append({"dim": int(dim), "layers": int(layers), "lr": float(lr), "seed": int(seed),
                    "lambda_first": float(d["lambda"].iloc[0]), "lambda_last": last,
                    "fall_first_to_last": float(d["lambda"].iloc[0] / last) if last else math.nan,
                    "lambda_inf": lam_inf, "noise_a": a,
                    "noise_share": 1 - lam_inf / last if last else math.nan,
                    "max_change": float(d["change"].max())})
    per = pd.DataFrame(per)
    summary = {"eval_tokens": sorted(long["tokens"].unique().tolist()),
               "rungs": per.to_dict("records"), "law": None, "llama2_70b": None,
               "limits": f"rungs at lr {', '.join(f'{v:.3g}' for v in sorted({c['lr'] for c in cells}))}"
                         " (the ladder's rule, not LLaMA2's lr / eps), far below their edge; "
                         f"{max(c.get('num_steps', 0) for c in cells)} steps of training (early); "
                         f"{len({(c['dim'], c['layers']) for c in cells})} rungs, dims "
                         f"{sorted({c['dim'] for c in cells})}"}
    rung = per.groupby(["dim", "layers", "lr"], as_index=False)["lambda_inf"].median()
    rung = rung[rung["lambda_inf"] > 0]
    if rung["dim"].nunique() >= 2 and rung["layers"].nunique() >= 2 and len(rung) >= 4:
        cols = [np.ones(len(rung)), np.log10(rung["dim"]), np.log10(rung["layers"])]
        x70 = [1.0, math.log10(LD.TARGET_70B["dim"]), math.log10(LD.TARGET_70B["num_layers"])]
        with_lr = np.linalg.matrix_rank(np.stack(cols + [np.log10(rung["lr"])], 1)) == 4 \
            and len(rung) >= 5
        if with_lr:   # lr and width vary apart: the law carries the lr, read at LLaMA2's
            cols.append(np.log10(rung["lr"]))
            x70.append(math.log10(LD.LR_70B))
        X, x70 = np.stack(cols, 1), np.array(x70)
        y = np.log10(rung["lambda_inf"].to_numpy())
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        loo = []
        for i in range(len(rung)):
            keep = np.arange(len(rung)) != i
            if np.linalg.matrix_rank(X[keep]) == X.shape[1]:
                loo.append(float(x70 @ np.linalg.lstsq(X[keep], y[keep], rcond=None)[0]))
        lam70 = 10 ** float(x70 @ coef)
        pi = LD.LR_70B / EPS_70B
        summary["law"] = {"c0": float(coef[0]), "dim": float(coef[1]), "layers": float(coef[2]),
                          "lr": float(coef[3]) if with_lr else None,
                          "num_rungs": int(len(rung)),
                          "resid_sd": float(np.std(y - X @ coef, ddof=0))}
        summary["llama2_70b"] = {
            "lambda_inf": lam70,
            "lambda_inf_leave_one_out": [10 ** min(loo), 10 ** max(loo)] if loo else None,
            "lr": LD.LR_70B, "eps": EPS_70B, "pi_eps": pi * lam70,
            "pi_eps_leave_one_out": [pi * 10 ** min(loo), pi * 10 ** max(loo)] if loo else None,
            "threshold": LD.PI_THRESHOLD, "over_threshold": pi * lam70 / LD.PI_THRESHOLD}
    return long, summary


def report_md(summary: dict) -> str:
    lines = ["# Sharpness against the evaluation batch", "",
             "lambda_max(H) of the mean loss over n tokens at the trained parameters of ladder "
             "rungs (simulate/batch_sharpness.py); the fit lambda(n) = lambda_inf + a / n.", "",
             md_table(pd.DataFrame(summary["rungs"]),
                      ["dim", "layers", "lr", "seed", "lambda_first", "lambda_last", "fall_first_to_last",
                       "lambda_inf", "noise_share", "max_change"]), ""]
    law, t = summary["law"], summary["llama2_70b"]
    if law:
        lr_term = (f" + {law['lr']:.2f} log10 lr" if law.get("lr") is not None
                   else " (no lr term: the rungs' lr is a function of their width, or constant)")
        lines += [f"Across {law['num_rungs']} rungs: log10 lambda_inf = {law['c0']:.2f} + "
                  f"{law['dim']:.2f} log10 dim + {law['layers']:.2f} log10 layers{lr_term} "
                  f"(residual sd {law['resid_sd']:.2f} decades).", "",
                  f"LLaMA2-70B: lambda_inf {t['lambda_inf']:.3g} (leave one rung out: "
                  f"{t['lambda_inf_leave_one_out']}), Pi_eps = (lr/eps) lambda = "
                  f"{t['pi_eps']:.3g} at lr {t['lr']:g}, eps {t['eps']:g}: "
                  f"{t['over_threshold']:.3g} x the threshold {t['threshold']:g}.", ""]
    else:
        lines += ["Too few rungs with a positive lambda_inf for the law across rungs.", ""]
    lines += [f"Limits: {summary['limits']}."]
    return "\n".join(lines) + "\n"


def run(out: str | Path, progress: bool = True, lr_scaling: str = "inverse_width", *,
        rungs: Sequence[Sequence[int]] | None = None, seeds: int | None = None,
        eval_tokens: Sequence[int] | None = None, cells_from: Sequence[str | Path] = (),
        **spec_sizes) -> dict:
    """Every rung x seed (SIZES unless given; `spec_sizes`: the ladder recipe's num_steps,
    warmup_steps ... replacing the full ladder's), then the tables and the summary. A cell
    in a `cells_from` store (read only: the cells shipped with the package) is copied, not
    measured."""
    out = Path(out)
    cfg = {"rungs": [tuple(r) for r in (rungs or SIZES["rungs"])],
           "seeds": int(seeds or SIZES["seeds"]),
           "eval_tokens": [int(n) for n in (eval_tokens or SIZES["eval_tokens"])]}
    rules = ("inverse_width", "constant") if lr_scaling == "both" else (lr_scaling,)
    cells, seen = [], set()
    for rule in rules:     # a rung at the same lr under both rules runs once
        spec_r = LD.sized_spec(rule, **spec_sizes)
        for r in cfg["rungs"]:
            for sd in range(cfg["seeds"]):
                c = cell(r, sd, spec_r, cfg["eval_tokens"])
                if (tuple(r), spec_r.lr_for(r[0]), sd) not in seen:
                    seen.add((tuple(r), spec_r.lr_for(r[0]), sd))
                    cells.append(c)
    cells = run_cells(CellStore(out / "cells", sources=cells_from), cells, progress=progress,
                      desc="batch sharpness")
    long, summary = summarize(cells)
    summary["lr_scaling"] = lr_scaling
    summary["size"] = {"rungs": [list(r) for r in cfg["rungs"]], "seeds": cfg["seeds"],
                       "eval_tokens": cfg["eval_tokens"],
                       **{k: v for k, v in spec_sizes.items() if v is not None}}
    atomic_write_bytes(out / "batch_sharpness.csv", long.to_csv(index=False).encode())
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2).encode())
    atomic_write_bytes(out / "batch_sharpness.md", report_md(summary).encode())
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike simulate batch-sharpness",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (resumable)")
    ap.add_argument("--rungs", nargs="+", type=LD.rung_arg, metavar="DxL",
                    help="rungs, dim x layers (default: 32x4 64x4 128x4 64x2 64x8)")
    ap.add_argument("--seeds", type=int, help="seeds per rung (default 2)")
    ap.add_argument("--eval-tokens", type=int, nargs="+", metavar="N",
                    help="evaluation batch sizes in tokens (default 512 2048 8192 32768)")
    ap.add_argument("--num-steps", type=int, help="training steps (default: the ladder's 150)")
    ap.add_argument("--warmup-steps", type=int, help="lr warmup steps (default: the ladder's 20)")
    ap.add_argument("--lr-scaling", choices=("inverse_width", "constant", "both"),
                    default="inverse_width",
                    help="the rungs' lr rule (simulate.ladder: 3e-3 x 64 / dim, or 3e-3 on "
                         "every rung; both: the law gets an lr term, read at LLaMA2's lr)")
    ap.add_argument("--cells-from", action="append", default=[], metavar="STORE",
                    help="a cell store to copy measured rung-seeds from instead of measuring "
                         "them (read only; repeatable)")
    ap.add_argument("--no-progress", action="store_true")

    def body(a) -> int:
        # resumable: its own folder (cells/, summary.json) is kept, any other non-empty one
        # refused
        check_out(a.out, keep_existing=(Path(a.out) / "cells").is_dir())
        if a.rungs and any(len(r) != 2 for r in a.rungs):
            raise ConfigError("--rungs: expected DIMxLAYERS (the batch is 16)")
        print(report_md(run(a.out, progress=not a.no_progress, lr_scaling=a.lr_scaling,
                            rungs=a.rungs, seeds=a.seeds, eval_tokens=a.eval_tokens,
                            num_steps=a.num_steps, warmup_steps=a.warmup_steps,
                            cells_from=a.cells_from)), end="")
        return 0
    return cli_main(ap, None if argv is None else list(argv), body,
                    "adamspike simulate batch-sharpness")
