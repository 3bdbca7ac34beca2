"""`adamspike simulate <problem> ...`: run one simulated problem, write a run directory.

    adamspike simulate quadratic --optim.eps 1e-4 --steps 20000 --out RUN [--dim 8 --lam-min 0.01 ...]
    adamspike simulate mlp --kind sin|deep --steps 5000 --out RUN [--optim.lr ... --train.loss_scale ...]
      (the quadratic and the MLP: the sweep's config and defaults, simulate.sweep_problems;
      every flag is a dotted key of it, --steps = --train.num_steps; `--help` lists them)
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

from adamspike.config import check_finite_args, flatten, parse_overrides, to_dict
from adamspike.rundir import atomic_write_bytes, check_out
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
    """'grad_clip: must be ...' -> '--grad-clip: must be ...'; a toy's dotted key gets the
    flag it was given by: 'train.num_steps (--steps): ...', 'quadratic.lam_min (--lam-min)'."""
    m = re.match(r"^([a-z0-9_]+):", msg)
    if m:
        return f"--{m.group(1).replace('_', '-')}{msg[m.end() - 1:]}"
    m = re.match(r"^((?:quadratic|mlp|train|telemetry)\.([a-z0-9_]+)):", msg)
    if m:
        flag = _FLAG_OF_KEY.get(m.group(1), "--" + m.group(2).replace("_", "-"))
        return f"{m.group(1)} ({flag}){msg[m.end() - 1:]}"
    return msg


# The toys' own flags, as the dotted keys of the one config each toy has
# (simulate.sweep_problems.QuadraticConfig / MLPConfig, the sweep's): a flag not listed
# here is a key itself or the unique last part of one (--eps, --dim, --lam-min, --seed,
# --kind, --width, --hist-every, ...). A switch (no value) sets the value given here.
TOY_FLAGS = {
    "quadratic": {"--steps": "train.num_steps", "--layers-every": "telemetry.every",
                  "--rotate": ("quadratic.rotate", "true"),
                  "--no-rescale": ("quadratic.rescale", "false")},
    "mlp": {"--steps": "train.num_steps", "--layers-every": "telemetry.every",
            "--batch-size": "mlp.batch", "--curvature": ("mlp.curvature", "true")},
}
_FLAG_OF_KEY: dict[str, str] = {}


def _dotted(argv: list[str], flags: dict) -> list[str]:
    """The toy's own flags rewritten as the dotted keys they set (TOY_FLAGS)."""
    out = []
    for tok in argv:
        name, eq, val = tok.partition("=")
        key = flags.get(name)
        if key is None:
            out.append(tok)
        elif isinstance(key, tuple):
            if eq:
                raise ValueError(f"{key[0]} ({name}): a switch, takes no value")
            out += [f"--{key[0]}", key[1]]
        else:
            out.append(f"--{key}{eq}{val}")
    return out


def _keys_help(problem) -> str:
    """Every key of the toy's config with its default (the problem's base over the schema)."""
    flat = flatten(to_dict(problem.config({})))
    rev = {v if isinstance(v, str) else v[0]: k for k, v in TOY_FLAGS[problem.name].items()}
    keys = [k for k in flat if k.split(".")[0] in ("optim", problem.name, "telemetry")
            and k not in ("telemetry.flush_every_s", "telemetry.tensorboard",
                          "telemetry.enabled", "telemetry.precision", "telemetry.compile",
                          "telemetry.curvature_every", "telemetry.curvature_iters")]
    keys += ["train.num_steps", "train.seed", "train.loss_scale"]
    return "; ".join(f"{k} {flat[k]!r}" + (f" ({rev[k]})" if k in rev else "") for k in keys)


def _toy(name: str, argv: list[str]) -> int:
    """`simulate quadratic|mlp`: the toy's one config (its sweep problem's schema and base,
    simulate.sweep_problems) from dotted flags, written by the problem's one run writer."""
    from simulate import sweep_problems as SP   # lazy: jax (imported at its top)
    problem = SP.PROBLEMS[name]
    p = _Parser(prog=f"adamspike simulate {name}", allow_abbrev=False,
                description={"quadratic": "Adam on a 1-D / N-D quadratic (Bai et al.); see "
                                          "simulate.quadratic",
                             "mlp": "2-layer FNN on sin x + sin 4x (mlp.kind sin) or a deep "
                                    "tanh MLP (deep); see simulate.mlp"}[name])
    p.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    p.add_argument("--no-progress", action="store_true")
    p.epilog = ("Settings are the dotted keys of the config the sweep uses (a unique last part "
                "may stand alone, e.g. --eps 1e-4); keys and defaults: " + _keys_help(problem))
    a, rest = p.parse_known_args(argv)
    flags = TOY_FLAGS[name]
    _FLAG_OF_KEY.clear()
    _FLAG_OF_KEY.update({v if isinstance(v, str) else v[0]: k for k, v in flags.items()})
    over = flatten(parse_overrides(problem.schema, _dotted(rest, flags)))
    cfg = problem.config(over)          # validated: ConfigError names the key
    check_out(a.out)      # new or empty, on a writable file system: before computing
    save = {"quadratic": SP.save_quadratic, "mlp": SP.save_mlp}[name]
    out = save(flatten(to_dict(cfg)), cfg.train.seed, a.out, progress=not a.no_progress)
    if name == "quadratic":
        from simulate.quadratic import count_spikes, eps_star   # jax, as above
        spikes = count_spikes(out["log10_loss"])
        summary = {"eps_star": eps_star(cfg.optim.lr, cfg.quadratic.lam_max, cfg.optim.b1),
                   "num_spikes": int(len(spikes)),
                   "first_spike": int(spikes.start.min()) if len(spikes) else None,
                   "final_log10_loss": float(out["log10_loss"][-1])}
    else:
        summary = {"final_loss": float(out["loss"][-1]), "min_loss": float(out["loss"].min())}
    print(json.dumps({"out": str(a.out), **summary}))
    return 0


def _quadratic(argv) -> int:
    return _toy("quadratic", argv)


def _mlp(argv) -> int:
    return _toy("mlp", argv)


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
    if a.out is not None:
        check_out(a.out, kind="file")
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
