"""`adamspike simulate <problem> ...`: run one simulated problem, write a run directory.

    adamspike simulate quadratic --optim.eps 1e-4 --steps 30000 --out RUN [--dim 8 --lam-min 0.01 ...]
    adamspike simulate mlp --kind sin|deep --steps 20000 --out RUN [--optim.lr ... --train.loss_scale ...]
    adamspike simulate streams --b2 0.95 --phi 0.9 --steps 200 [--out stats.json]
    adamspike simulate llama --config configs/tiny.toml --out RUN [--key value overrides]
    adamspike simulate ladder --out DIR [--rungs ...]   (width/depth ladder, 70B profile fit)
    adamspike simulate batch-sharpness --out DIR [--rungs ...]   (lambda_max(H) vs the evaluation batch)
    adamspike simulate matched --runs RUN... --predictions P --out DIR   (rho-matched toy report)

Exit status: 0 ok, 2 bad input (the message names the parameter; nothing existing is
overwritten).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from adamspike import mitigations
from adamspike.config import (check_finite_args, flatten, from_dict, merge, nest, parse_overrides,
                              to_dict)
from adamspike.rundir import atomic_write_bytes
from simulate import ladder, matched   # numpy / pandas only: the ladder fit and the report run without jax
from theory.adam_moments import update_stats

PROBLEMS = ("quadratic", "mlp", "streams", "llama", "ladder", "batch-sharpness", "matched")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so simulate_main returns 2."""

    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        check_finite_args(ns)   # NaN / inf in any float flag: exit 2 naming it
        return ns


class _UsageError(Exception):
    pass


def _flag_name(msg: str) -> str:
    """'grad_clip: must be ...' -> '--grad-clip: must be ...'."""
    m = re.match(r"^([a-z0-9_]+):", msg)
    return f"--{m.group(1).replace('_', '-')}{msg[m.end() - 1:]}" if m else msg


def _run_parser(prog: str, description: str, steps: int) -> _Parser:
    """The options of a subcommand that writes a run directory (quadratic, mlp)."""
    p = _Parser(prog=f"adamspike simulate {prog}", description=description)
    p.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers-every", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def _check_run(a) -> None:
    """--steps, --layers-every in range; --out new or empty."""
    for k in ("steps", "layers_every"):
        if getattr(a, k) < 1:
            raise ValueError(f"{k}: must be >= 1, got {getattr(a, k)}")
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):
        raise ValueError(f"out: {a.out} exists and is not an empty directory (nothing was overwritten)")


# ----------------------------------------------------------------------------- quadratic

def _quadratic(argv) -> int:
    p = _run_parser("quadratic", "Adam on a 1-D / N-D quadratic (Bai et al.); see "
                    "simulate.quadratic", 30_000)
    p.add_argument("--dim", type=int, default=1)
    p.add_argument("--lam-min", type=float, default=None, help="default: lam-max")
    p.add_argument("--lam-max", type=float, default=1.0)
    p.add_argument("--rotate", action="store_true", help="random orthogonal eigenbasis")
    p.add_argument("--no-rescale", action="store_true",
                   help="plain floating point (theta may underflow; see simulate.quadratic)")
    p.add_argument("--dtype", default="float64")
    p.epilog = ("Adam and problem settings: dotted config keys, e.g. --optim.lr 1e-2 "
                "--optim.eps 1e-4 --optim.b2 0.95 --quadratic.noise 1e-9 --quadratic.theta0 1 "
                "(a unique last part may stand alone: --eps 1e-4).")
    a, rest = p.parse_known_args(argv)
    # lazy: jax (these modules import it at their top), only this subcommand needs it
    from simulate.quadratic import QuadraticSpec, count_spikes, eps_star, run_quadratic
    from simulate.runner import quadratic_traces, write_run
    from simulate.sweep_problems import QUADRATIC, QuadraticConfig
    over = parse_overrides(QuadraticConfig, rest)
    shape = sorted(k for k in flatten(over) if k.startswith(("train.", "quadratic."))
                   and k not in ("quadratic.noise", "quadratic.theta0"))
    if shape:
        raise ValueError(f"{shape[0]}: set it with this command's own flag (--steps, --dim, "
                         "--lam-min, --lam-max, --rotate)")
    settings = from_dict(QuadraticConfig, merge(nest(QUADRATIC.base), over))
    o, q = settings.optim, settings.quadratic
    _check_run(a)
    spec = QuadraticSpec(num_steps=a.steps, dim=a.dim, lam_min=a.lam_max if a.lam_min is None
                         else a.lam_min, lam_max=a.lam_max, rotate=a.rotate,
                         rescale=not a.no_rescale, dtype=a.dtype)
    hp = {"lr": o.lr, "eps": o.eps, "b1": o.b1, "b2": o.b2, "noise": q.noise,
          "theta0": q.theta0, "seed": a.seed}
    t0 = time.perf_counter()
    out = run_quadratic(hp, spec)
    wall = time.perf_counter() - t0
    es = eps_star(o.lr, spec.lam_max, o.b1)
    problem = {"kind": "quadratic", **hp, "dim": spec.dim, "lam_min": spec.lam_min,
               "lam_max": spec.lam_max, "rotate": spec.rotate, "rescale": spec.rescale,
               "dtype": spec.dtype, "eps_star": es}
    config = {"problem": problem, "num_steps": a.steps,
              "optim": {"lr": o.lr, "eps": o.eps, "b1": o.b1, "b2": o.b2},
              "train": {"num_steps": a.steps}}
    write_run(a.out, quadratic_traces(out, spec, hp, wall), config=config, problem=problem,
              layers_every=a.layers_every, progress=not a.no_progress)
    spikes = count_spikes(out["log10_loss"])
    print(json.dumps({"out": str(a.out), "eps_star": es, "num_spikes": int(len(spikes)),
                      "first_spike": int(spikes.start.min()) if len(spikes) else None,
                      "final_log10_loss": float(out["log10_loss"][-1])}))
    return 0


# ----------------------------------------------------------------------------- mlp

def _mlp(argv) -> int:
    p = _run_parser("mlp", "2-layer FNN on sin x + sin 4x ('sin') or a deep tanh MLP ('deep')",
                    20_000)
    p.add_argument("--kind", default="sin", help="sin | deep")
    p.add_argument("--width", type=int, default=None, help="default 256 (sin) / 64 (deep)")
    p.add_argument("--depth", type=int, default=None, help="hidden layers; default 1 (sin) / 8 (deep)")
    p.add_argument("--num-points", type=int, default=None, help="default 256 (sin) / 1024 (deep)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="0 = full batch; default 0 (sin) / 128 (deep)")
    p.add_argument("--init-gain", type=float, default=1.0)
    p.add_argument("--input-scale", type=float, default=1.0)
    p.add_argument("--hist-every", type=int, default=100, help="0 = no histograms")
    p.add_argument("--curvature", action="store_true",
                   help="log lam_hat_grad (one Hessian-vector product per step) and 2/lr")
    p.epilog = ("Optimizer and mitigation settings: dotted config keys, e.g. --optim.lr 1e-2 "
                "--optim.b2 0.95 --train.loss_scale 1e-3, mitigation.* keys whose hook the MLP has (a "
                "unique last part may stand alone: --lr 1e-2).")
    a, rest = p.parse_known_args(argv)
    # lazy: jax (these modules import it at their top), only this subcommand needs it
    from simulate.mlp import HOOKS, KINDS, MLPSpec, train
    from simulate.runner import write_run
    from simulate.sweep_problems import MLP, MLPConfig
    settings = from_dict(MLPConfig, merge(nest(MLP.base), parse_overrides(MLPConfig, rest)))
    mitigations.require_hooks(settings, HOOKS, "adamspike simulate mlp")
    optim = settings.optim
    if a.kind not in KINDS:
        raise ValueError(f"kind: must be one of {list(KINDS)}, got {a.kind!r}")
    deep = a.kind == "deep"
    spec = MLPSpec(kind=a.kind, width=a.width or (64 if deep else 256),
                   depth=a.depth or (8 if deep else 1),
                   num_points=a.num_points or (1024 if deep else 256),
                   batch_size=(128 if deep else 0) if a.batch_size is None else a.batch_size,
                   init_gain=a.init_gain, input_scale=a.input_scale, seed=a.seed)
    if a.hist_every < 0:
        raise ValueError(f"hist_every: must be >= 0, got {a.hist_every}")
    _check_run(a)
    loss_scale = settings.train.loss_scale
    traces = train(spec, optim, a.steps, loss_scale=loss_scale,
                   plan=mitigations.plan(settings, {}, 1), hist_every=a.hist_every,
                   curvature=a.curvature, progress=not a.no_progress)
    problem = {"kind": f"mlp-{a.kind}", **{k: getattr(spec, k) for k in spec.__dataclass_fields__},
               "loss_scale": loss_scale}
    config = {"problem": problem, "optim": to_dict(optim),
              "mitigation": to_dict(settings.mitigation), "num_steps": a.steps,
              "telemetry": {"every": a.layers_every, "hist_every": a.hist_every}}
    write_run(a.out, traces, config=config, problem=problem, layers_every=a.layers_every,
              progress=not a.no_progress)
    print(json.dumps({"out": str(a.out), "final_loss": float(traces["loss"][-1]),
                      "min_loss": float(traces["loss"].min())}))
    return 0


# ----------------------------------------------------------------------------- streams

def _streams(argv) -> int:
    from simulate import streams   # lazy: jax, only this subcommand needs it
    p = _Parser(prog="adamspike simulate streams",
                description="Monte-Carlo AR(1) gradient streams through Adam (simulate.streams)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--coords", type=int, default=65536, help="coordinates per configuration")
    p.add_argument("--b1", type=float, default=0.9)
    p.add_argument("--b2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=0.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--mu", type=float, default=0.0)
    p.add_argument("--phi", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default="last", help="last | all")
    p.add_argument("--out", type=Path, default=None, help="write the statistics as JSON here")
    a = p.parse_args(argv)
    if a.record not in ("last", "all"):
        raise ValueError(f"record: must be 'last' or 'all', got {a.record!r}")
    if a.out is not None and a.out.exists():
        raise ValueError(f"out: {a.out} exists (nothing was overwritten)")
    cfg = {k: getattr(a, k) for k in ("b1", "b2", "eps", "sigma", "mu", "phi")}
    stats = streams.simulate_streams([cfg], a.steps, a.coords, seed=a.seed, record=a.record)
    res = {"config": cfg, "steps": a.steps, "coords": a.coords, "seed": a.seed,
           "stats": {k: (v[0].tolist() if hasattr(v, "tolist") else v) for k, v in stats.items()}}
    res["theory"] = _theory_check(cfg, a.steps, res["stats"])
    text = json.dumps(res, indent=None if a.out is None else 2, allow_nan=True)
    if a.out is not None:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(a.out, text.encode())
    else:
        print(text)
    return 0


# ----------------------------------------------------------------------------- llama

def _llama(argv) -> int:
    from simulate import llama_train   # lazy: jax, only this subcommand needs it
    return int(llama_train.main(argv))


def _ladder(argv) -> int:
    return int(ladder.main(argv))


def _batch_sharpness(argv) -> int:
    from simulate import batch_sharpness   # jax when rungs run
    return int(batch_sharpness.main(argv))


def _matched(argv) -> int:
    return int(matched.main(argv))


def _theory_check(cfg: dict, steps: int, stats: dict) -> dict:
    """The exact closed forms (theory.adam_moments) at the same step, with z = (MC - theory)/SE."""
    th = update_stats(cfg["b1"], cfg["b2"], cfg["eps"], cfg["sigma"], cfg["mu"], cfg["phi"],
                      t=steps, method="exact")
    out = {}
    for k in ("r_mean", "r_rms", "r_abs"):
        mc, se = stats.get(k), stats.get(k + "_se")
        if isinstance(mc, float) and isinstance(se, float) and se > 0:
            out[k] = {"theory": th[k], "mc": mc, "se": se, "z": (mc - th[k]) / se}
    return out


def simulate_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    problem, rest = argv[0], argv[1:]
    if problem not in PROBLEMS:
        print(f"adamspike simulate: error: problem: unknown {problem!r} (choose from "
              f"{', '.join(PROBLEMS)})", file=sys.stderr)
        return 2
    handler = {"quadratic": _quadratic, "mlp": _mlp, "streams": _streams, "llama": _llama,
               "ladder": _ladder, "batch-sharpness": _batch_sharpness,
               "matched": _matched}[problem]
    try:
        return handler(rest)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except ValueError as e:  # ConfigError, RunFormatError and our checks are ValueErrors
        print(f"adamspike simulate {problem}: error: {_flag_name(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(simulate_main())
