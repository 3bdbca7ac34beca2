"""What the run figures share: their `main(argv)` and the reading of `adamspike analyze`'s
tables (figures import no analysis code: spike detection and fits run once, in the
analysis, and the figures read the files it wrote).

The analysis of a run is the folder `adamspike analyze --out A` wrote for it, A/<run name>/
(summary.json, spikes.csv, grad_norm_spikes.csv, precursor_*.csv, update_rms_fit_rows.csv,
regime_trajectory.csv, ...). `run_analysis(A, run)` finds it: A itself when it is one run's
folder, else the subfolder whose summary.json names the run's path, else A/<run name>.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from adamspike.rundir import RunFormatError, load_run, run_names


class RunTables:
    """One run's analysis folder: summary.json and its CSV tables."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.summary = json.loads((self.path / "summary.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: not an analysis folder (summary.json: {e})") from None

    def table(self, name: str, required: bool = True) -> pd.DataFrame | None:
        """<name>.csv; missing: ValueError (required) or None. An empty file: no rows."""
        p = self.path / f"{name}.csv"
        if not p.is_file():
            if required:
                why = (self.summary.get("notes") or {}).get(name.split("_")[0], "")
                raise ValueError(f"{self.path}: no {name}.csv" + (f" ({why})" if why else ""))
            return None
        try:
            return pd.read_csv(p)
        except pd.errors.EmptyDataError:
            return pd.DataFrame()


def _same(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def run_analysis(root: str | Path | None, run_path: str | Path,
                 name: str | None = None) -> RunTables | None:
    """The analysis folder of the run at run_path under `root` (see the module doc); None
    when root is None or holds none for this run."""
    if root is None:
        return None
    root = Path(root)
    if (root / "summary.json").is_file():
        return RunTables(root)
    for s in sorted(root.glob("*/summary.json")):
        try:
            if _same(json.loads(s.read_text()).get("path", ""), run_path):
                return RunTables(s.parent)
        except (OSError, ValueError):
            continue
    cand = root / (name or Path(run_path).name)
    return RunTables(cand) if (cand / "summary.json").is_file() else None


def need_tables(tables: RunTables | None, run_path) -> RunTables:
    """tables, or the ValueError that skips a figure drawn from the analysis."""
    if tables is None:
        raise ValueError(f"{run_path}: no analysis of this run (`adamspike analyze` first; "
                         "`adamspike figures --analysis DIR`; a figure script: --tables DIR)")
    return tables


def run_figure_main(argv, doc: str, prepare: Callable, plot: Callable, *, tables=("steps",),
                    layer_columns=None, extra_args=()) -> int:
    """The `main(argv)` of a run figure: RUN... --out DIR [--tables DIR] (the folder of
    `adamspike analyze --out`); prepare(run, tables, **extra) gets the run's analysis
    folder (RunTables) or None; exit 2 on bad input."""

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tables", metavar="DIR",
                    help="`adamspike analyze --out` folder of these runs (its tables)")
    for flag, dest in extra_args:
        ap.add_argument(flag, dest=dest, default=None)
    args = ap.parse_args(argv)
    names = run_names(args.runs)
    rc = 0
    for path, name in zip(args.runs, names):
        out = Path(args.out) if len(args.runs) == 1 else Path(args.out) / name
        try:
            run = load_run(path, tables=tables, layer_columns=layer_columns)
            kw = {d: getattr(args, d) for _, d in extra_args if getattr(args, d) is not None}
            files = plot(prepare(run, run_analysis(args.tables, path, name), **kw), out)
        except (RunFormatError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 2
            continue
        for f in files:
            print(f)
    return rc


def break_gaps(step, *series, factor: float = 2.0):
    """(step, *series) with a NaN point inserted in every gap of the step axis (a jump of
    more than `factor` x the median step difference: the log's excerpt boundaries, a
    restart, missing lines), so a line plot is broken there instead of drawn across it.
    NaN values already break a line; this covers the steps that have no row at all."""
    x = np.asarray(step, dtype=float)
    ys = [np.asarray(y, dtype=float) for y in series]
    if len(x) < 3:
        return (x, *ys)
    d = np.diff(x)
    pos = d[d > 0]
    if not len(pos):
        return (x, *ys)
    gaps = np.flatnonzero(d > factor * np.median(pos)) + 1
    if not len(gaps):
        return (x, *ys)
    xs = np.insert(x, gaps, (x[gaps - 1] + x[gaps]) / 2)
    return (xs, *(np.insert(y, gaps, np.nan) for y in ys))
