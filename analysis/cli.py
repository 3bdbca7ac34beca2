"""`adamspike analyze`: spikes, precursors, alarm scores and theory fits for run directories.

    adamspike analyze RUN... [--predictions p.json] [--out DIR] [--from-study DIR]
                      [--log megatron.log [--seq-len 4096] [--clip 1.0] [--b1 .. --b2 .. --eps ..]
                       [--num-params N | --model PRESET]]

Writes DIR/<run>/report.md and report.html (the same page, self-contained: figures inline,
readable offline from any --out; `adamspike analyze` draws the run figures into
DIR/<run>/figures first, from the tables it wrote, unless --no-figures)
(+ CSV tables, summary.json) per run and DIR/report.md / report.html over all runs.
Every report has a numerics-health section (loss-scale changes, overflowed / skipped / NaN
iterations, stale grad norms, placed against the spikes: analysis.numerics); values a log
printed without measuring them (grad norm 0.000, loss scale -1, a line without a loss) are
missing, never data. The tables are what the figures read: `adamspike figures RUN... --analysis DIR`
draws the run figures from them afterwards (spike detection and fits run once, here). `--log` first imports a Megatron / MindSpeed / AscendSpeed training log into
DIR/<log name>.run (a run directory, backend "megatron") and analyses it with the rest;
repeat it for several settings' logs (`--log A --log B --out R`: one report over both;
logs with the same file name get their parent directories in the run name).
Every report carries a regime card (analysis.regime): per depth group rho, dormancy and
wake-ups for telemetry runs; for a log, rho_bar = min(gn, clip) / (sqrt(N) eps) with N from
--num-params, --model or the model arguments the log prints.
With --predictions P (a pre-registered predictions.json, schema 3) the runs are scored
against it (analysis.scoring): each run's observed spike rate against its matched
setting's interval (inside / above / below), the alarm rules' precision, lift and lead
(lead >= 1) pooled over the runs with telemetry; OUT/prediction_scores.{md,json},
OUT/predictions.scored.json (rules with lift <= 1 marked uninformative) and a section in
OUT/report.md. A file whose content hash does not match (edited after pre-registration)
is an error (exit 2); a file without a hash is scored with a warning.
Bad input (a missing or empty run directory, another schema version, a log without
iteration lines, a malformed predictions file) is reported on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Optional   # Optional: runtime types on python 3.8

from tqdm import tqdm

from adamspike.config import ConfigError, check_value
from adamspike.llama import PRESETS
from adamspike.llama import num_params as llama_num_params
from adamspike.parallel import process_map
from adamspike.predictions import PredictionsError, load_predictions
from adamspike.rundir import OutputPathError, RunFormatError, check_out, find_runs, run_names
from adamspike.spikes import SpikeParams, add_spike_flags
from analysis.controls import study_sections
from analysis.megatron_log import MegatronLogError, import_megatron_log
from analysis.report import (AnalysisError, analyze_run, write_index, write_report_page,
                             write_run_report)
from analysis.scoring import score


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adamspike analyze", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("runs", nargs="*", metavar="RUN", help="run directories")
    ap.add_argument("--from-study", metavar="DIR", help="analyse the runs of a reproduce folder")
    ap.add_argument("--predictions", help="predictions.json whose alarm rules are scored")
    ap.add_argument("--out", help="output directory (must be new or empty; default: the "
                                  "first of analysis_out, analysis_out-2, ... that is free)")
    ap.add_argument("--log", action="append", default=[], metavar="LOG",
                    help="a Megatron-style training log to import and analyse (repeatable)")
    ap.add_argument("--seq-len", type=int, help="tokens per sample, for a log's token counts")
    ap.add_argument("--clip", type=float, help="grad-clip threshold the log's run used")
    for b in ("b1", "b2", "eps", "lr"):
        ap.add_argument(f"--{b}", type=float, help=f"optimizer {b} of the log's run")
    ap.add_argument("--num-params", type=count_arg, metavar="N",
                    help="parameter count N of the log's model (regime card rho_bar); an "
                         "integer, also as 176e9 or 1.76e11")
    ap.add_argument("--model", metavar="PRESET",
                    help="the log's model as an adamspike.llama preset (N for rho_bar)")
    add_spike_flags(ap)
    ap.add_argument("--no-figures", action="store_true",
                    help="do not draw the run figures into the reports (they are drawn into "
                         "OUT/<run>/figures and inline in report.html by default)")
    ap.add_argument("--precursor-window", type=int, default=50)
    ap.add_argument("--baseline", type=int, default=200, help="precursor baseline steps")
    ap.add_argument("--horizon", type=int, help="alarm horizon (default: per rule)")
    ap.add_argument("--min-lead", type=int, default=0, help="alarm must precede by >= this")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes analysing runs (one run each; default 1)")
    return ap


def log_run_names(logs: list[str]) -> list[str]:
    """Run-directory names for imported logs: `<log file name>.run`, qualified by the
    parent directories where two logs share a file name (every setting's `node127.log`),
    numbered if that is still not enough."""
    paths = [Path(p).resolve() for p in logs]
    names = [p.name for p in paths]
    depth = 0
    while len(set(names)) < len(names) and depth < 8:
        depth += 1
        names = ["_".join([*p.parent.parts[-depth:], p.name]).lstrip("/_") for p in paths]
    if len(set(names)) < len(names):
        names = [f"{i}_{n}" for i, n in enumerate(names)]
    return [n + ".run" for n in names]


def count_arg(text: str) -> int:
    """An integer count given as digits or in scientific notation (176e9): refused unless
    the value is a whole number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(v)


def _fail(msg: str) -> int:
    print(f"adamspike analyze: {msg}", file=sys.stderr)
    return 2


# a log's run settings given as flags (analyze, assess, watch): the ranges of the config
# fields they stand for (adamspike.train_config.OptimSection / TrainSection), finite; eps > 0
# (rho_bar = min(gn, clip) / (sqrt(N) eps) divides by it; the config's eps may be 0)
LOG_FLAG_LIMITS = {
    "seq_len": (Optional[int], dict(lo=1)),
    "clip": (Optional[float], dict(lo=0.0)),          # optim.grad_clip: 0 = no clipping
    "b1": (Optional[float], dict(lo=0.0, hi=1.0, hi_open=True)),
    "b2": (Optional[float], dict(lo=0.0, hi=1.0, hi_open=True)),
    "eps": (Optional[float], dict(lo=0.0, lo_open=True)),
    "lr": (Optional[float], dict(lo=0.0, lo_open=True)),
    "num_params": (Optional[int], dict(lo=1)),
}
# option -> (type, limits): the shared validation path (adamspike.config.check_value)
LIMITS = {
    "precursor_window": (int, dict(lo=1)),
    "baseline": (int, dict(lo=1)), "jobs": (int, dict(lo=1)), "horizon": (Optional[int], dict(lo=1)),
    "min_lead": (int, dict(lo=0)), **LOG_FLAG_LIMITS,
}


def check_log_flags(args: argparse.Namespace) -> None:
    """The log-setting flags the namespace has (LOG_FLAG_LIMITS), checked like config fields
    (type, finiteness, range); ConfigError naming the flag (`--b2: must be < 1.0, got 1.5`)."""
    for name, (tp, limits) in LOG_FLAG_LIMITS.items():
        if hasattr(args, name):
            check_value("--" + name.replace("_", "-"), getattr(args, name), tp, **limits)


def _check_args(args: argparse.Namespace) -> SpikeParams:
    """Type, finiteness and range of every numeric option (ConfigError naming it); returns
    the spike rule of the flags."""
    params = SpikeParams.from_flags(args)
    for name, (tp, limits) in LIMITS.items():
        check_value("--" + name.replace("_", "-"), getattr(args, name), tp, **limits)
    return params


def _analyze_one(item: tuple):
    """analyze_run + write_run_report of one run (a picklable unit of work for --jobs);
    returns the RunAnalysis, or the error message of bad input."""
    path, name, dest, kw = item
    try:
        ra = analyze_run(path, name=name, **kw)
    except (RunFormatError, AnalysisError) as e:
        return str(e)
    write_run_report(ra, dest)
    return ra


def _free_default_out(base: str = "analysis_out") -> Path:
    """The default output folder: `base`, or base-2, base-3, ... when an earlier analyze
    left it (a second run without --out must not fail; an explicit --out that exists is
    still refused, nothing is overwritten)."""
    out, k = Path(base), 2
    while out.exists() and (not out.is_dir() or any(out.iterdir())):
        out, k = Path(f"{base}-{k}"), k + 1
    return out


def main(argv: list[str] | None = None, draw=None) -> int:
    """`adamspike analyze`. draw(runs, names, out): draws the run figures into
    OUT/<run>/figures from the tables just written (the top CLI passes figures' drawer:
    analysis does not import figures); the reports are then rewritten with them inline.
    --no-figures skips it."""
    args = _parser().parse_args(argv)
    try:
        params = _check_args(args)
    except ConfigError as e:
        return _fail(str(e))
    out = Path(args.out) if args.out else _free_default_out()
    try:
        check_out(out)                # before anything is computed: new or empty, writable
    except OutputPathError as e:
        return _fail(str(e))
    created = not out.exists()
    try:
        rc = _analyze(args, params, out, draw)
    except OSError as e:     # a read-only or full --out, a file vanished under us
        rc = _fail(f"--out {out}: cannot write ({e.strerror or e}"
                   + (f": {e.filename}" if e.filename else "") + ")")
    if rc != 0 and out.is_dir():   # a failed analyze leaves no half-written --out behind
        for child in ([out] if created else list(out.iterdir())):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    return rc


def _analyze(args, params, out: Path, draw=None) -> int:
    runs = [Path(r) for r in args.runs]
    if args.from_study:
        study = Path(args.from_study)
        if not study.is_dir():
            return _fail(f"{study}: study folder does not exist")
        found = find_runs(study / "runs" if (study / "runs").is_dir() else study)
        if not found:
            return _fail(f"{study}: no run directories (run.json) found")
        runs += found
    for r in runs:
        if not r.exists():
            return _fail(f"{r}: run directory does not exist")
        if not (r / "run.json").is_file():
            return _fail(f"{r}: not a run directory (no run.json)")
    preds = None
    if args.predictions:
        try:
            preds = load_predictions(args.predictions)
        except PredictionsError as e:
            return _fail(str(e))
        integ = preds.integrity
        if integ.get("status") == "mismatch":
            return _fail(f"{args.predictions}: content hash mismatch (stored "
                         f"{integ['stored'][:16]}..., computed {integ['computed'][:16]}...): the "
                         "file was edited after it was pre-registered; scoring refused (score "
                         "against the original file)")
        if integ.get("status") == "missing":
            print(f"adamspike analyze: warning: {args.predictions} has no content hash (not "
                  "pre-registered); scored anyway", file=sys.stderr)
    for log, dest_name in zip(args.log, log_run_names(args.log)):
        dest = out / dest_name
        optim = {k: getattr(args, k) for k in ("b1", "b2", "eps", "lr")
                 if getattr(args, k) is not None}
        try:
            st = import_megatron_log(log, dest, seq_len=args.seq_len, clip=args.clip,
                                     optim=optim).stats
        except (MegatronLogError, RunFormatError) as e:
            return _fail(str(e))
        print(f"imported {log}: {st['num_rows']} steps, {st['num_malformed']} malformed "
              f"line(s){' at ' + ', '.join(str(m['line']) for m in st['malformed'][:10]) if st['malformed'] else ''}"
              f" -> {dest}", file=sys.stderr)
        runs.append(dest)
    if not runs:
        return _fail("no runs given (RUN..., --from-study or --log)")
    num_params, num_params_source = args.num_params, "--num-params" if args.num_params else ""
    if args.num_params is not None and args.num_params < 1:
        return _fail("--num-params must be >= 1")
    if args.model:
        if args.model not in PRESETS:
            return _fail(f"--model: unknown preset {args.model!r}; known: {', '.join(PRESETS)}")
        if num_params is None:
            num_params, num_params_source = llama_num_params(PRESETS[args.model]), f"preset {args.model}"
    names = run_names(runs)
    kw = dict(predictions=preds, horizon=args.horizon, min_lead=args.min_lead,
              spike_params=params, window=args.precursor_window, baseline=args.baseline,
              num_params=num_params, num_params_source=num_params_source)
    items = [(path, name, out / name, kw) for path, name in zip(runs, names)]
    analyses = []
    # runs are independent: --jobs analyses them in that many processes
    for res in tqdm(process_map(_analyze_one, items, args.jobs), total=len(items),
                    desc="analyze", unit="run", file=sys.stderr, disable=len(items) < 2):
        if isinstance(res, str):
            return _fail(res)
        analyses.append(res)
    if draw is not None and not args.no_figures:
        failed = draw(runs, names, out)
        for ra, name in zip(analyses, names):
            write_report_page(ra, out / name)        # now linking OUT/<run>/figures
        if failed:
            print(f"adamspike analyze: {failed}", file=sys.stderr)
    index = write_index(analyses, out, names)
    if preds is not None:
        md = score(analyses, preds, json.loads(Path(args.predictions).read_text()),
                   args.predictions, out)
        with open(index, "a") as fh:
            fh.write("\n" + md + "\n")
    if len(runs) > 1:   # precursors against control windows, alarm lift (per problem)
        with open(index, "a") as fh:
            fh.write("\n" + study_sections(runs, predictions=args.predictions) + "\n")
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
