"""`adamspike figures`: regenerate every figure of the study.

    adamspike figures [RUN...] [--analysis DIR] [--from-study DIR] [--sweep TABLE]
                      [--replication DIR] [--out DIR] [--formats png pdf]
                      [--set FIGURE.KEY=VALUE ...]

Run figures (one set per run directory, in OUT/<run name>/), theory figures (OUT/theory/)
and sweep figures (OUT/sweep/, when a sweep table is given or found in the study folder).
Only what is asked: RUN... / --analysis draw the run figures (and the inputs named), not
the theory figures (--theory adds them) or the study-wide figure (--from-study draws all).
`adamspike analyze` draws the run figures itself (draw_run_figures).
Spikes, precursors, fits and regime cards are not computed here: the figures read the
tables `adamspike analyze --out DIR` wrote (--analysis DIR; a study's analysis/), and a
figure drawn from them is skipped for a run without an analysis. With --analysis, each
run's DIR/<run>/report.html is rewritten with its run figures inline (one self-contained
file, adamspike.report_html). Library warnings of a figure are counted in its outcome line,
not printed.
The figure scripts are listed in REGISTRY and called through their `main(argv)`; a script
that is not there is reported as missing, one whose input is absent as skipped, one that
fails as failed with its error; nothing is faked. `generate` returns the files written.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from adamspike.parallel import process_map
from adamspike.report_html import markdown_to_html
from adamspike.rundir import (OutputPathError, RunFormatError, atomic_write_bytes, check_out,
                              claim_out, find_runs, load_run, run_names)
from figures import style
from figures._common import run_analysis

# (module, kind): kind "run" figures take RUN... --out [--tables DIR] (prepare(run,
# tables), figures._common); "theory" take --out [--set KEY=VALUE ...]
# (figures.style.computed_figure_main);
# "sweep" take --table SWEEP --out; "replication" take --table REPLICATION (or the sweep
# folder, next to which a study keeps replication/) --out; "study" take --tables DIR --out
# [--predictions-70b FILE] (all analysed runs in one figure, OUT/study/); "ladder" take
# --ladder DIR --out;
# "spike_rate" take --spike-rate DIR --out (adamspike spike-rate's output);
# "phase_map" take --map DIR --out (adamspike phase-map's output);
# "batch_sharpness" take --batch-sharpness DIR --out (adamspike simulate batch-sharpness's).
REGISTRY: list[tuple[str, str]] = [
    ("figures.fig_loss_spikes", "run"),
    ("figures.fig_grad_norm", "run"),
    ("figures.fig_layer_grad_rms", "run"),
    ("figures.fig_r_heatmap", "run"),
    ("figures.fig_precursors", "run"),
    ("figures.fig_theory_fit", "run"),
    ("figures.fig_galton", "theory"),
    ("figures.fig_r_hist_bimodal", "theory"),
    ("figures.fig_update_rms_vs_rho", "theory"),
    ("figures.fig_rms_t_transient", "theory"),
    ("figures.fig_phase_diagram", "sweep"),
    ("figures.fig_replication", "replication"),
    ("figures.fig_regime_map", "study"),
    ("figures.fig_ladder", "ladder"),
    ("figures.fig_calibration", "spike_rate"),
    ("figures.fig_phase_map", "phase_map"),
    ("figures.fig_batch_sharpness", "batch_sharpness"),
]


@dataclass
class Outcome:
    module: str
    target: str
    status: str            # ok | missing | skipped | failed
    detail: str = ""
    files: list[Path] = field(default_factory=list)
    seconds: float = 0.0   # wall time since the previous outcome (the figure's own cost)


class _Timed(list):
    """Outcomes, each stamped on append with the seconds since the previous one."""

    def __init__(self):
        super().__init__()
        self.last = time.perf_counter()

    def append(self, o: Outcome) -> None:
        now = time.perf_counter()
        o.seconds, self.last = now - self.last, now
        super().append(o)

    def extend_timed(self, done: list[Outcome]) -> None:
        """Outcomes timed elsewhere (a worker process): their seconds are kept."""
        super().extend(done)
        self.last = time.perf_counter()


def _snapshot(d: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()} if d.exists() else {}


def _written(d: Path, before: dict[Path, float]) -> list[Path]:
    return sorted(p for p, t in _snapshot(d).items() if before.get(p) != t)


def _call_main(mod, argv: list[str], out: Path, target: str) -> Outcome:
    before = _snapshot(out)
    buf_err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(buf_err):
            rc = mod.main(argv)
    except SystemExit as e:  # argparse inside the figure
        rc = e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001 - a failing figure is reported, not fatal
        return Outcome(mod.__name__, target, "failed", f"{type(e).__name__}: {e}",
                       _written(out, before))
    files = _written(out, before)
    if rc not in (0, None):
        err = buf_err.getvalue().strip().splitlines()
        return Outcome(mod.__name__, target, "failed" if not files else "partial",
                       f"exit {rc}: {err[-1] if err else ''}", files)
    return Outcome(mod.__name__, target, "ok", "", files)


def _run_figures(item: tuple) -> list[Outcome]:
    """The run figures (module names) of one run directory into its own folder; one
    Outcome each, timed. A picklable unit of work: `generate(..., jobs=N)` hands runs to N
    processes."""
    path, d, module_names, formats, analysis, name = item
    path, d = Path(path), Path(d)
    mods = [importlib.import_module(n) for n in module_names]
    t0 = time.perf_counter()
    try:
        run = load_run(path)
        tables = run_analysis(analysis, path, name)
    except (RunFormatError, ValueError) as e:
        return [Outcome(m.__name__, str(path), "failed", str(e)) for m in mods]
    res: list[Outcome] = []
    with style.only_formats(*formats):
        for m in mods:
            before = _snapshot(d)
            # library warnings (matplotlib, numpy on empty data) are the figure's outcome,
            # not console noise: counted in its detail line
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    m.plot(m.prepare(run, tables), d)
                    o = Outcome(m.__name__, str(path), "ok", "", _written(d, before))
                except ValueError as e:  # the run lacks this figure's input
                    o = Outcome(m.__name__, str(path), "skipped", str(e))
                except Exception as e:  # noqa: BLE001
                    o = Outcome(m.__name__, str(path), "failed", f"{type(e).__name__}: {e}")
            if caught:
                first = str(caught[0].message).splitlines()[0][:120]
                o.detail = "; ".join(x for x in (o.detail, f"{len(caught)} library warning(s), "
                                                 f"first: {first}") if x)
            now = time.perf_counter()
            o.seconds, t0 = now - t0, now
            res.append(o)
    if tables is not None and (tables.path / "report.md").is_file():
        failed = _report_html(tables.path, run, sorted(
            f for o in res for f in o.files if f.suffix == ".png"))
        res += [failed] if failed else []
    return res


def _report_html(analysis_dir: Path, run, pngs: list[Path]) -> Outcome | None:
    """The run's report.html in its analysis folder (analysis.report wrote it without
    figures), rewritten with the figures just drawn inline (adamspike.report_html: one
    self-contained file); an Outcome only when that fails."""
    try:
        md = (analysis_dir / "report.md").read_text(encoding="utf-8")
        atomic_write_bytes(analysis_dir / "report.html", markdown_to_html(
            md, analysis_dir, f"Run {Path(run.path).name}", figures=pngs).encode())
    except OSError as e:
        return Outcome("report.html", str(run.path), "failed", str(e))
    return None


def draw_run_figures(runs: Iterable[str | Path], names: Iterable[str], analysis: str | Path,
                     jobs: int = 1) -> str:
    """The run figures of analysed runs into ANALYSIS/<name>/figures (where the run report
    links them, analysis.report.FIGURE_DIRS), read from the analysis tables; PNG only.
    Returns a one-line summary of the figures that failed ('' when none did)."""
    run_modules = [n for n, k in REGISTRY if k == "run"]
    items = [(str(p), str(Path(analysis) / n / "figures"), run_modules, ("png",),
              str(analysis), n) for p, n in zip(runs, names)]
    bad = [o for done in process_map(_run_figures, items, jobs) for o in done
           if o.status == "failed"]
    return "; ".join(f"figure {o.module} [{Path(o.target).name}] failed: {o.detail}"
                     for o in bad[:5])


def generate(runs: Iterable[str | Path] = (), out: str | Path = "figures_out", *,
             sweep: str | Path | None = None, replication: str | Path | None = None,
             sets: Sequence[str] = (),
             theory: bool = True, registry=None, study: str | Path | None = None,
             ladder: str | Path | None = None,
             spike_rate: str | Path | None = None, analysis: str | Path | None = None,
             phase_map: str | Path | None = None, batch_sharpness: str | Path | None = None,
             jobs: int = 1, study_figures: bool = True) -> tuple[list[Path], list[Outcome]]:
    """Regenerate all figures; returns (files written, one Outcome per module x target).
    analysis: the `adamspike analyze --out` folder the run and study figures read (None:
    those figures are skipped). jobs > 1: the run figures of different runs are drawn in
    that many processes."""

    out = Path(out)
    runs = [Path(r) for r in runs]
    outcomes: list[Outcome] = _Timed()
    mods = {}
    for name, kind in registry or REGISTRY:
        try:
            mods[name] = (importlib.import_module(name), kind)
        except ModuleNotFoundError as e:
            if e.name != name:
                outcomes.append(Outcome(name, "", "failed", f"import error: {e}"))
            else:
                outcomes.append(Outcome(name, "", "missing", "module not in this checkout"))
    run_modules = [m.__name__ for m, k in mods.values() if k == "run"]
    items = [(str(p), str(out / n), run_modules, style.FORMATS,
              None if analysis is None else str(analysis), n)
             for p, n in zip(runs, run_names(runs))]
    # runs are independent and matplotlib is single-threaded: one process per run
    for done in process_map(_run_figures, items, jobs):
        outcomes.extend_timed(done)
    # kind -> (its input, the figure's option for it, why it is skipped when not given)
    inputs = {"sweep": (sweep, "--table", "no sweep table"),
              "replication": (replication or sweep, "--table", "no replication table"),
              "ladder": (ladder, "--ladder", "no ladder"),
              "spike_rate": (spike_rate, "--spike-rate", "no spike-rate directory"),
              "phase_map": (phase_map, "--map", "no phase-map directory"),
              "batch_sharpness": (batch_sharpness, "--batch-sharpness",
                                  "no batch-sharpness directory")}
    for m, kind in mods.values():
        if kind == "theory" and theory:
            d = out / "theory"
            short = m.__name__.rsplit(".", 1)[-1]
            argv = ["--out", str(d)] + [a for t in sets if t.startswith(short + ".")
                                        for a in ("--set", t[len(short) + 1:])]
            outcomes.append(_call_main(m, argv, d, "theory"))
        elif kind == "study":
            if not study_figures:
                continue                       # not asked for (figures RUN... --analysis)
            if analysis is None or not Path(analysis).is_dir():
                outcomes.append(Outcome(m.__name__, str(analysis or ""), "skipped",
                                        "no analysis folder (`adamspike analyze` first)"))
                continue
            d = out / "study"
            pred = Path(study) / "predictions_70b.json" if study else None
            argv = ["--tables", str(analysis), "--out", str(d)]
            if pred is not None and pred.is_file():
                argv += ["--predictions-70b", str(pred)]
            outcomes.append(_call_main(m, argv, d, "study"))
        elif kind in inputs:
            src, flag, none = inputs[kind]
            if src is None and not study_figures:
                continue                       # not asked for: not even a "skipped" line
            if src is None or not Path(src).exists():
                outcomes.append(Outcome(m.__name__, str(src or ""), "skipped",
                                        none if src is None else f"{src} does not exist"))
                continue
            d = out / kind
            outcomes.append(_call_main(m, [flag, str(src), "--out", str(d)], d, str(src)))
    files = sorted({f for o in outcomes for f in o.files})
    return files, outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike figures", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", metavar="RUN", help="run directories")
    ap.add_argument("--from-study", metavar="DIR",
                    help="a `adamspike reproduce` output folder: its runs/, analysis/, sweep/")
    ap.add_argument("--analysis", metavar="DIR",
                    help="`adamspike analyze --out` folder of the runs: its tables (spikes, "
                         "precursors, fits, regime cards) are what the run figures draw")
    ap.add_argument("--sweep", metavar="TABLE", help="sweep directory or table")
    ap.add_argument("--replication", metavar="DIR", help="replication directory or csv")
    ap.add_argument("--ladder", metavar="DIR", help="ladder directory (adamspike simulate ladder)")
    ap.add_argument("--spike-rate", metavar="DIR", help="adamspike spike-rate output directory")
    ap.add_argument("--phase-map", metavar="DIR", help="adamspike phase-map output directory")
    ap.add_argument("--batch-sharpness", metavar="DIR",
                    help="adamspike simulate batch-sharpness output directory")
    ap.add_argument("--out", default="figures_out", help="output directory")
    ap.add_argument("--formats", nargs="+", choices=("png", "pdf"), default=["png", "pdf"],
                    help="the files each figure writes (default: png pdf)")
    ap.add_argument("--set", action="append", default=[], metavar="FIGURE.KEY=VALUE",
                    help="a theory figure's Monte-Carlo size (repeatable), e.g. "
                         "--set fig_galton.draws=20000")
    ap.add_argument("--no-theory", action="store_true", help="skip the theory figures")
    ap.add_argument("--theory", action="store_true",
                    help="also the theory figures when RUN... or --analysis is given (drawn by "
                         "default only with --from-study or when nothing else is asked for)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes drawing the run figures (one run each; default 1)")
    ap.add_argument("--only-theory", action="store_true",
                    help="only the theory figures (they read no runs: the study draws them "
                         "early, beside the training stages)")
    args = ap.parse_args(argv)
    with style.only_formats(*args.formats):
        return _main(args)


def _claim_out(out: str) -> bool:
    """--out new, empty or figures' own (it rewrites its files there; the study's two figure
    stages share OUT/figures), writable; claimed before drawing. False: said in one line."""
    try:
        claim_out(check_out(out, owner="figures"), "figures")
    except (OutputPathError, OSError) as e:
        print(f"adamspike figures: {e}", file=sys.stderr)
        return False
    return True


def _main(args: argparse.Namespace) -> int:
    if args.only_theory:
        if args.no_theory:
            print("adamspike figures: --only-theory and --no-theory exclude each other",
                  file=sys.stderr)
            return 2
        if not _claim_out(args.out):
            return 2
        _, outcomes = generate([], args.out, sets=args.set,
                               registry=[(n, k) for n, k in REGISTRY if k == "theory"])
        return _print_outcomes(outcomes)
    runs = [Path(r) for r in args.runs]
    sweep, replication = args.sweep, args.replication
    if args.from_study:
        study = Path(args.from_study)
        if not study.is_dir():
            print(f"adamspike figures: {study}: study folder does not exist", file=sys.stderr)
            return 2
        runs += find_runs(study / "runs" if (study / "runs").is_dir() else study)
        if sweep is None and (study / "sweep").exists():
            sweep = study / "sweep"
        if replication is None and (study / "replication").exists():
            replication = study / "replication"
        if args.ladder is None and (study / "ladder" / "fit.json").exists():
            args.ladder = study / "ladder"
        if args.spike_rate is None and (study / "spike_rate" / "model.json").exists():
            args.spike_rate = study / "spike_rate"
        if args.phase_map is None and (study / "phase_map" / "phase_map.csv").exists():
            args.phase_map = study / "phase_map"
        if args.batch_sharpness is None and (study / "batch_sharpness" / "summary.json").exists():
            args.batch_sharpness = study / "batch_sharpness"
        if args.analysis is None and (study / "analysis").is_dir():
            args.analysis = study / "analysis"
    for r in runs:
        if not (r / "run.json").is_file():
            print(f"adamspike figures: {r}: not a run directory (no run.json)", file=sys.stderr)
            return 2
    # only what is asked: RUN... / --analysis draw the run figures (and whatever input is
    # named), not the theory figures or the all-runs study figure
    asked_runs = bool(args.runs or args.analysis) and not args.from_study
    if not _claim_out(args.out):
        return 2
    theory = not args.no_theory and (args.theory or not asked_runs)
    _, outcomes = generate(runs, args.out, sweep=sweep, replication=replication,
                           sets=args.set, theory=theory, study=args.from_study,
                           study_figures=not asked_runs,
                           ladder=args.ladder, spike_rate=args.spike_rate,
                           analysis=args.analysis, phase_map=args.phase_map,
                           batch_sharpness=args.batch_sharpness, jobs=max(1, args.jobs))
    return _print_outcomes(outcomes)


def _print_outcomes(outcomes: list[Outcome]) -> int:
    """One line per outcome (stderr), the files written (stdout); 1 if a figure failed."""
    for o in outcomes:
        tgt = f" [{o.target}]" if o.target else ""
        msg = f" ({o.detail})" if o.detail else ""
        print(f"{o.status:8s} {o.module}{tgt}: {len(o.files)} file(s), {o.seconds:.1f} s{msg}",
              file=sys.stderr)
    for f in sorted({f for o in outcomes for f in o.files}):
        print(f)
    return 1 if any(o.status == "failed" for o in outcomes) else 0
