"""``adamspike theory`` / ``python -m theory``: closed-form numbers, tables or JSON.

    galton     --n 20 --icc 0.4 [--p 0.5] [--persist 0.5]
    update     --b1 0.9 --b2 0.95 --eps 0 --sigma 1 --mu 0 --phi 0 [--t inf] [--method exact]
    eps-regime --rho 100 10 1 0.1 0.01 [--b1 --b2 --phi --snr]
    transient  --b1 0.9 --b2 0.95 --k 10 --steps 30 [--phi 0 --eps 0]
    quadratic  --lr 1e-2 --lam 1 --b1 0.9 --eps 1e-8 [--v 1e-8]
    all        (every section at its defaults)
--json prints one JSON object (non-finite numbers as null).  Bad values: a message naming
the parameter on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from . import adam_moments, bimodality, eps_regime, galton, quadratic, transients


def _clean(x):
    # A copy of adamspike.rundir.json_clean: theory imports nothing of the project (it is
    # the bottom layer, numpy + scipy only), so `python -m theory --json` keeps its own.
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


def _float_or_inf(s: str) -> float:
    return math.inf if s.strip().lower() in ("inf", "infinity") else float(s)


def galton_section(n=20, icc=0.4, p=0.5, persist=0.5) -> dict:
    bb = galton.betabinom_pmf(n, icc, p)
    mom = galton.betabinom_moments(n, icc, p)
    mk = galton.markov_pmf(n, persist, p)
    mkm = galton.pmf_moments(mk)
    return {
        "n": n, "icc": icc, "p": p, "persist": persist,
        "independent": {"pmf": galton.binomial_pmf(n, p), "mean": n * p, "var": n * p * (1 - p),
                        "kolmogorov_distance": galton.kolmogorov_distance(n, p),
                        "berry_esseen_bound": galton.berry_esseen_bound(n, p)},
        "exchangeable": {"pmf": bb, **mom,
                         "bc": bimodality.bc_population(mom["skew"], mom["kurt_excess"]),
                         "u_shaped": bimodality.is_u_shaped(bb),
                         "icc_u_threshold": bimodality.betabinom_u_threshold(n, p) if n >= 2 else None,
                         "icc_bc_crossing": bimodality.betabinom_bc_crossing(n, p) if n >= 2 else None},
        "markov": {"pmf": mk, **galton.markov_moments(n, persist, p),
                   "skew": mkm["skew"], "kurt_excess": mkm["kurt_excess"],
                   "bc": bimodality.bc_population(mkm["skew"], mkm["kurt_excess"]),
                   "persist_bc_crossing": bimodality.markov_bc_crossing(n, p) if n >= 2 else None},
        "bc_threshold": bimodality.BC_THRESHOLD,
    }


def update_section(b1=0.9, b2=0.95, eps=0.0, sigma=1.0, mu=0.0, phi=0.0, t=math.inf,
                   method="exact") -> dict:
    st = adam_moments.update_stats(b1, b2, eps, sigma, mu, phi, t, method)
    so = adam_moments.update_stats(b1, b2, eps, sigma, mu, phi, t, "second_order")
    bim = bimodality.r_bimodality(b1, b2, eps, abs(mu) / sigma, phi, sigma, t)
    return {"params": {"b1": b1, "b2": b2, "eps": eps, "sigma": sigma, "mu": mu, "phi": phi, "t": t},
            **st, "second_order": {k: so[k] for k in ("r_mean", "r_rms", "r_abs", "rms_t")},
            "bimodality_random_sign": {k: bim[k] for k in ("bc", "bimodal", "sat_frac", "r_m2", "r_m4")}}


def eps_section(rho=(100.0, 10.0, 1.0, 0.1, 0.01), b1=0.9, b2=0.95, phi=0.0, snr=0.0) -> dict:
    rho = list(rho)
    return {"params": {"b1": b1, "b2": b2, "phi": phi, "snr": snr}, "rho": rho,
            "update_rms": eps_regime.update_rms_curve(rho, b1, b2, phi, snr),
            "frozen_limit": eps_regime.frozen_limit(rho, b1, phi, snr),
            "scale_invariant_limit": eps_regime.scale_invariant_limit(b1, b2, phi, snr),
            "regime": [eps_regime.regime(r) for r in rho]}


def transient_section(b1=0.9, b2=0.95, k=10.0, steps=30, phi=0.0, eps=0.0) -> dict:
    o = transients.step_up(b1, b2, k, steps, phi=phi, eps=eps)
    peaks = {str(b): dict(zip(("step", "value"), transients.constant_after_dormancy_peak(b1, b)))
             for b in (0.95, 0.99, 0.999)}
    return {"params": {"b1": b1, "b2": b2, "kappa": k, "steps": steps, "phi": phi, "eps": eps},
            **o, "const_peaks_by_b2": peaks,
            "bounds_by_b2": {str(b): transients.dormant_rms_t_bound(b) for b in (0.95, 0.99, 0.999)}}


def quadratic_section(lr=1e-2, lam=1.0, b1=0.9, eps=1e-8, v=None) -> dict:
    es = quadratic.critical_eps(lr, lam, b1)
    out = {"params": {"lr": lr, "lam": lam, "b1": b1, "eps": eps, "v": v},
           "eps_star": es, "threshold": quadratic.stability_threshold(lr),
           "critical_v": quadratic.critical_v(lr, lam, b1, eps), "safe": eps >= es}
    if v is not None:
        out["effective_lr"] = quadratic.effective_lr(lr, v, eps)
        out["lam_hat"] = quadratic.preconditioned_curvature(lam, b1, v, eps)
        out["unstable"] = quadratic.is_unstable(lr, lam, b1, eps, v)
    return out


def _table(obj, indent=0) -> str:
    lines = []
    pad = "  " * indent
    for k, v in obj.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines.append(_table(v, indent + 1))
        elif isinstance(v, (list, tuple, np.ndarray)):
            arr = list(np.asarray(v).ravel()) if not (len(v) and isinstance(v[0], str)) else list(v)
            if len(arr) > 12:
                head = ", ".join(_fmt(a) for a in arr[:12])
                lines.append(f"{pad}{k:<24} [{head}, ...] ({len(arr)})")
            else:
                lines.append(f"{pad}{k:<24} [{', '.join(_fmt(a) for a in arr)}]")
        else:
            lines.append(f"{pad}{k:<24} {_fmt(v)}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(v)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adamspike theory", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd")

    def add(name, help_):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    p = add("galton", "Galton boards: independent, exchangeable, Markov")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--icc", type=float, default=0.4)
    p.add_argument("--p", type=float, default=0.5)
    p.add_argument("--persist", type=float, default=0.5)
    p = add("update", "m, v, r statistics of an AR(1) stream")
    for k, d in (("b1", 0.9), ("b2", 0.95), ("eps", 0.0), ("sigma", 1.0), ("mu", 0.0), ("phi", 0.0)):
        p.add_argument(f"--{k}", type=float, default=d)
    p.add_argument("--t", type=_float_or_inf, default=math.inf)
    p.add_argument("--method", default="exact", choices=("exact", "second_order"))
    p = add("eps-regime", "update_rms vs rho = rms(g)/eps")
    p.add_argument("--rho", type=float, nargs="+", default=[100.0, 10.0, 1.0, 0.1, 0.01])
    for k, d in (("b1", 0.9), ("b2", 0.95), ("phi", 0.0), ("snr", 0.0)):
        p.add_argument(f"--{k}", type=float, default=d)
    p = add("transient", "rms_t and r after a step up of the gradient scale by k")
    for k, d in (("b1", 0.9), ("b2", 0.95), ("k", 10.0), ("phi", 0.0), ("eps", 0.0)):
        p.add_argument(f"--{k}", type=float, default=d)
    p.add_argument("--steps", type=int, default=30)
    p = add("quadratic", "Bai et al. stability: eps*, lam_hat vs 2/lr")
    for k, d in (("lr", 1e-2), ("lam", 1.0), ("b1", 0.9), ("eps", 1e-8)):
        p.add_argument(f"--{k}", type=float, default=d)
    p.add_argument("--v", type=float, default=None, help="v_hat for lam_hat (optional)")
    add("all", "every section at its defaults")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.cmd or "all"
    as_json = getattr(args, "json", False)
    try:
        if cmd == "galton":
            out = galton_section(args.n, args.icc, args.p, args.persist)
        elif cmd == "update":
            out = update_section(args.b1, args.b2, args.eps, args.sigma, args.mu, args.phi, args.t,
                                 args.method)
        elif cmd == "eps-regime":
            out = eps_section(args.rho, args.b1, args.b2, args.phi, args.snr)
        elif cmd == "transient":
            out = transient_section(args.b1, args.b2, args.k, args.steps, args.phi, args.eps)
        elif cmd == "quadratic":
            out = quadratic_section(args.lr, args.lam, args.b1, args.eps, args.v)
        else:
            out = {"galton": galton_section(), "update": update_section(), "eps_regime": eps_section(),
                   "transient": transient_section(), "quadratic": quadratic_section()}
    except ValueError as e:
        print(f"adamspike theory {cmd}: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(_clean(out)))
    else:
        print(_table(out))
    return 0
