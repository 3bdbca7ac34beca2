"""`adamspike sweep`: resumable, shardable, vmapped grids over eps x b2 x batch x lr x seed.

    adamspike sweep run --grid configs/sweep_quadratic.toml --out DIR [--shard k/n]
                        [--set SECTION.KEY=VALUE ...]
    adamspike sweep merge DIR... --out TABLE_DIR
    adamspike replicate --out DIR [--seeds 10]           (simulate.claims)

A grid TOML names a problem (simulate.sweep_problems.PROBLEMS) and the values to cross, as
dotted keys of the problem's config schema (RunConfig keys such as optim.eps, plus the
problem's own section, e.g. quadratic.lam_max); TOML reads `optim.eps = [...]` as a nested
table, which is the same thing:

    [sweep]
    problem = "quadratic"        # quadratic | mlp | llama
    seeds = 5                    # a count (0..n-1) or an explicit list
    [fixed]                      # settings shared by every cell
    train.num_steps = 20000
    [grid]                       # one list per axis; cells are the cartesian product
    optim.eps = [1e-8, 1e-6, 1e-4, 3e-4]
    optim.b2 = [0.95, 0.99, 0.999]
    [spikes]                     # adamspike.spikes.SpikeParams fields (optional)
    window = 50

`--set SECTION.KEY=VALUE` replaces one key of [sweep], [fixed], [grid] or [spikes] (a TOML
value): the study's size table (configs/study.toml) gives a smaller grid this way, e.g.
`--set fixed.train.num_steps=3000 --set "grid.optim.b2=[0.95, 0.999]"`.

Cells and runs. A cell is one point of the grid (every problem parameter except the seed);
a run is a cell x seed.  `cell_id` is a hash of the cell's resolved parameters, so it is
stable across invocations, machines and shard counts.

Execution. Cells whose static parameters (array shapes, code paths, step count) agree are
run together: their runs (cells x seeds) are stacked and the problem's batched function is
called once per chunk under `jax.vmap` (scalar hyperparameters and seeds are vmapped).

Storage (DIR):
    sweep.json                    the resolved grid (a restart with another grid is refused)
    cells/sweep_cell/             the one cell store (adamspike.cells): one cell per grid
                                  point (its problem, parameters, seeds and spike settings),
                                  its table one row per seed
    runs.parquet, runs.csv        the tidy table of this invocation's cells (unsharded), or
    runs.shard-K-of-N.parquet     ... of one shard
    runs/<cell_id>-s<seed>/       with --save-runs N: full run directories of the first N
                                  cells at the first seed (simulate.runner / the trainer)
A restarted run skips cells that are stored: no recomputation.  `--shard k/n` (1 <= k <= n)
keeps the cells with int(cell_id, 16) % n == k-1; merging the shards' cells gives the same
table as an unsharded run.

Table columns: problem, cell_id, every knob (dotted key), seed, then per run: num_spikes,
spike_rate (per 1000 steps), max_spike_height (relative, from adamspike.spikes), mean_recovery_steps,
recovered_frac, final_loss, min_loss, diverged (non-finite loss, or final loss >= initial loss),
and for each precursor trace the problem reports (rms_t, sat_frac, bimodality, grad_mom_cos,
rho of its shallow parameters): max_<m> over the run and pre_<m> = max over the PRE_WINDOW (8)
steps before each spike start (maximum over spikes; NaN without spikes), lead_<m> = mean over
spikes of (spike start - step of the maximum over the LEAD_WINDOW (32) steps before it), and
median_rho (median over steps of the rho trace: the shallow group's adamspike.depth_groups.
group_rho, the spike-rate GLM's log10_rho_shallow), and any per-run numbers the problem
reports itself (llama: online_spikes and the spike guard's guard_rollbacks,
guard_skipped_batches, guard_aborted).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm import tqdm

from adamspike.config import (ConfigError, apply_sets, cli_main, flatten, from_dict, merge, nest,
                              read_toml, to_dict)
from adamspike.cells import Cell, CellStore, CorruptCell
from adamspike.rundir import atomic_write_bytes
from adamspike.rundir import check_out
from adamspike.spikes import SpikeParams, detect_spikes

PRE_WINDOW = 8            # Wortsman 2023a: rms_t leads loss spikes by 1-8 steps
LEAD_WINDOW = 32          # the lead is measured in a wider window, so 1-8 is a testable claim
PRECURSORS = ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")


# ----------------------------------------------------------------------------- problems

# run(static settings, {scalar key: float array [N]}, seeds int array [N]) ->
#     {"loss": [N, T], optional precursor traces [N, T] from PRECURSORS,
#      optional "scalars": {column: [N]} per-run numbers added to the table as they are}
BatchFn = Callable[[dict, dict, np.ndarray], dict]


def _detect_default(signal: np.ndarray, **kw) -> pd.DataFrame:
    return detect_spikes(signal, np.arange(1, len(signal) + 1), **kw)


@dataclass(frozen=True)
class Problem:
    """A batched problem over the dotted keys of a config schema (a dataclass of sections,
    adamspike.config; RunConfig for the tiny LLaMA). `knobs` are the keys a grid may set,
    each static (changes shapes or code paths: cells with different values are compiled
    separately) or not (vmapped scalars); `base` the problem's own defaults (dotted keys)
    over the schema's. Every cell is validated by the schema (`config`), so ranges and
    types are declared once, in the schema. `run` may add a "signal" trace [N, T] that
    spikes are detected on (default: the loss); `detect(signal_1d, **spikes)` returns
    adamspike.spikes columns (start, height, duration, recovered); `height_unit` says
    what `height` measures."""
    name: str
    schema: type
    knobs: Mapping[str, bool]                                 # dotted key -> static
    run: BatchFn
    base: Mapping[str, Any] = field(default_factory=dict)
    spikes: Mapping[str, Any] = field(default_factory=dict)   # default detector kwargs
    max_vmap: int = 256                                       # runs per vmapped call
    detect: Callable[..., pd.DataFrame] = _detect_default
    spike_keys: tuple[str, ...] = tuple(f.name for f in fields(SpikeParams))
    height_unit: str = "relative"                             # peak / baseline - 1
    check: Callable[[Any], None] | None = None                # cross-field check of a config
    save: Callable[[dict, int, Path], None] | None = None     # write one run directory

    def config(self, cell: Mapping[str, Any]) -> Any:
        """The validated schema instance of a cell (dotted keys over `base`); ConfigError
        names the key."""
        cfg = from_dict(self.schema, merge(nest(self.base), nest(cell)))
        if self.check is not None:
            self.check(cfg)
        return cfg

    def values(self, cell: Mapping[str, Any]) -> dict[str, Any]:
        """Every knob's value in a cell (defaults filled in, types normalised)."""
        flat = flatten(to_dict(self.config(cell)))
        return {k: flat[k] for k in self.knobs}


def cell_settings(problem: Problem, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Dotted settings (nested tables flattened) restricted to the problem's knobs."""
    flat = flatten(data) if isinstance(data, Mapping) else None
    if flat is None:
        raise ConfigError(f"{where}: expected a table, got {data!r}")
    for k in flat:
        if k not in problem.knobs:
            raise ConfigError(f"unknown grid key: {where}.{k} (problem {problem.name!r} knows: "
                              f"{', '.join(problem.knobs)})")
    return flat


def _checked(problem: Problem, key: str, value: Any, where: str) -> Any:
    """One knob's value, validated and normalised by the schema."""
    try:
        return problem.values({key: value})[key]
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(f"{where}: {msg[len(key) + 2:] if msg.startswith(key + ': ') else msg}") from None


# ----------------------------------------------------------------------------- grid

@dataclass
class Grid:
    problem: Problem
    fixed: dict[str, Any]
    axes: dict[str, list]
    seeds: list[int]
    spikes: dict[str, Any]
    source: str = ""

    def cells(self) -> list[dict]:
        """Every grid point as a full knob dict (problem defaults <- fixed <- axis values)."""
        base = self.problem.values(self.fixed)
        names = list(self.axes)
        return [{**base, **dict(zip(names, vals))}
                for vals in itertools.product(*(self.axes[n] for n in names))]

    def to_json(self) -> dict:
        return {"problem": self.problem.name, "fixed": self.fixed, "axes": self.axes,
                "seeds": self.seeds, "spikes": self.spikes}


GRID_SECTIONS = ("sweep", "fixed", "grid", "spikes")


def load_grid(path: str | Path, problems: Mapping[str, Problem], sets: Sequence[str] = ()) -> Grid:
    """Read and validate a grid TOML with `--set SECTION.KEY=VALUE` applied (module doc);
    every problem raises ConfigError naming the key."""
    return grid_from_dict(apply_sets(read_toml(path), sets, GRID_SECTIONS), problems,
                          source=str(path))


def grid_from_dict(data: Mapping[str, Any], problems: Mapping[str, Problem], source: str = "") -> Grid:
    unknown = sorted(set(data) - set(GRID_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown grid section(s): {', '.join(unknown)} "
                          f"(known: {', '.join(GRID_SECTIONS)})")
    sweep = dict(data.get("sweep", {}))
    bad = sorted(set(sweep) - {"problem", "seeds"})
    if bad:
        raise ConfigError(f"unknown grid key: sweep.{bad[0]} (known: sweep.problem, sweep.seeds)")
    if "problem" not in sweep:
        raise ConfigError(f"sweep.problem: missing (one of {', '.join(problems)})")
    if sweep["problem"] not in problems:
        raise ConfigError(f"sweep.problem: unknown problem {sweep['problem']!r}; known: "
                          f"{', '.join(sorted(problems))}")
    problem = problems[sweep["problem"]]
    seeds = sweep.get("seeds", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise ConfigError(f"sweep.seeds: expected a count or a list of integers, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"sweep.seeds: must be >= 1, got {seeds}")
        seeds = list(range(seeds))
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ConfigError(f"sweep.seeds: expected non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"sweep.seeds: duplicate seeds in {seeds!r}")
    fixed = {k: _checked(problem, k, v, f"fixed.{k}")
             for k, v in cell_settings(problem, data.get("fixed", {}), "fixed").items()}
    axes: dict[str, list] = {}
    for k, vals in cell_settings(problem, data.get("grid", {}), "grid").items():
        if k in fixed:
            raise ConfigError(f"grid.{k}: also set in [fixed]; choose one")
        if not isinstance(vals, list):
            raise ConfigError(f"grid.{k}: expected a list of values, got {vals!r}")
        if not vals:
            raise ConfigError(f"grid.{k}: empty list (the grid would have no cells)")
        checked = [_checked(problem, k, v, f"grid.{k}[{i}]") for i, v in enumerate(vals)]
        if len(set(map(repr, checked))) != len(checked):
            raise ConfigError(f"grid.{k}: duplicate values in {vals!r}")
        axes[k] = checked
    if not axes:
        raise ConfigError("grid: empty (no axis to sweep); add e.g. grid.\"optim.eps\" = [1e-8, 1e-4]")
    spikes = {**problem.spikes}
    for k, v in dict(data.get("spikes", {})).items():
        if k not in problem.spike_keys:
            raise ConfigError(f"unknown grid key: spikes.{k} (known: {', '.join(problem.spike_keys)})")
        spikes[k] = v
    grid = Grid(problem, fixed, axes, list(seeds), spikes, source)
    for cell in grid.cells():
        problem.config(cell)   # cross-field checks of every cell
    return grid


def cell_id(problem: str, params: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit id of a cell: sha1 of its canonical JSON."""
    blob = json.dumps({"problem": problem, **{k: params[k] for k in sorted(params)}},
                      sort_keys=True, default=repr)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """'k/n' with 1 <= k <= n -> (k, n); None -> None."""
    if spec is None:
        return None
    try:
        k_s, n_s = spec.split("/")
        k, n = int(k_s), int(n_s)
    except ValueError:
        raise ConfigError(f"--shard: expected k/n (e.g. 2/8), got {spec!r}") from None
    if n < 1 or not 1 <= k <= n:
        raise ConfigError(f"--shard: need 1 <= k <= n, got {spec!r}")
    return k, n


def in_shard(cid: str, shard: tuple[int, int] | None) -> bool:
    return shard is None or int(cid, 16) % shard[1] == shard[0] - 1


# ----------------------------------------------------------------------------- summaries

def summarize_run(loss: np.ndarray, traces: Mapping[str, np.ndarray], spikes: Mapping[str, Any],
                  signal: np.ndarray | None = None,
                  detect: Callable[..., pd.DataFrame] = _detect_default) -> dict:
    """Per-run numbers from a loss trace and precursor traces (all length T, step = index+1);
    spikes are detected on `signal` (default: the loss) up to the first non-finite loss."""
    loss = np.asarray(loss, dtype=np.float64)
    num_steps = len(loss)
    finite = np.isfinite(loss)
    first_bad = int(np.argmin(finite)) if not finite.all() else num_steps
    good = loss[:first_bad]
    diverged = first_bad < num_steps or (len(good) > 1 and good[-1] >= good[0])
    sig = good if signal is None else np.asarray(signal, dtype=np.float64)[:first_bad]
    sp = detect(sig, **spikes) if len(sig) >= 3 else None
    n = 0 if sp is None else len(sp)
    row = {
        "num_spikes": n,
        "spike_rate": 1000.0 * n / num_steps,
        "max_spike_height": float(sp["height"].max()) if n else 0.0,
        "mean_recovery_steps": float(sp.loc[sp["recovered"].astype(bool), "duration"].mean())
        if n and sp["recovered"].astype(bool).any() else math.nan,
        "recovered_frac": float(sp["recovered"].astype(bool).mean()) if n else math.nan,
        "final_loss": float(loss[-1]) if finite[-1] else math.inf,
        "min_loss": float(np.nanmin(np.where(finite, loss, np.nan))) if finite.any() else math.nan,
        "diverged": bool(diverged),
        "median_rho": math.nan,
    }
    starts = [] if n == 0 else [int(s) for s in sp["start"]]
    for m in PRECURSORS:
        if m not in traces:
            continue
        tr = np.asarray(traces[m], dtype=np.float64)
        row[f"max_{m}"] = float(np.nanmax(tr)) if np.isfinite(tr).any() else math.nan
        pre, leads = [], []
        for s in starts:                       # step s is index s-1; window = steps s-W..s-1
            lo, hi = max(0, s - 1 - PRE_WINDOW), s - 1
            w = tr[lo:hi]
            if w.size and np.isfinite(w).any():
                pre.append(float(np.nanmax(w)))
            lo = max(0, s - 1 - LEAD_WINDOW)
            w = tr[lo:hi]
            if w.size and np.isfinite(w).any():
                leads.append(float(hi - (lo + int(np.nanargmax(w)))))
        row[f"pre_{m}"] = max(pre) if pre else math.nan
        row[f"lead_{m}"] = float(np.mean(leads)) if leads else math.nan
    if "rho" in traces:
        tr = np.asarray(traces["rho"], dtype=np.float64)
        row["median_rho"] = float(np.nanmedian(tr)) if np.isfinite(tr).any() else math.nan
    return row


# ----------------------------------------------------------------------------- execution

def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _static_key(problem: Problem, params: Mapping[str, Any]) -> tuple:
    return tuple((k, _hashable(params[k])) for k, static in problem.knobs.items() if static)


def _chunk_size(n: int, cap: int) -> int:
    """Pad chunks to powers of two (<= cap) so repeated groups reuse compiled code."""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


def run_group(problem: Problem, cells: list[tuple[str, dict]], seeds: list[int],
              spikes: Mapping[str, Any]) -> dict[str, pd.DataFrame]:
    """Run every (cell, seed) of cells sharing static params; -> {cell_id: rows}."""
    jobs = [(cid, p, s) for cid, p in cells for s in seeds]
    static = {k: v for k, v in _static_key(problem, cells[0][1])}
    scalar_names = [k for k, static in problem.knobs.items() if not static]
    size = _chunk_size(len(jobs), problem.max_vmap)
    rows: dict[str, list[dict]] = {cid: [] for cid, _ in cells}
    for lo in range(0, len(jobs), size):
        chunk = jobs[lo:lo + size]
        padded = chunk + [chunk[-1]] * (size - len(chunk))
        scalars = {k: np.asarray([float(p[k]) for _, p, _ in padded]) for k in scalar_names}
        seed_arr = np.asarray([s for _, _, s in padded], dtype=np.int64)
        out = problem.run(static, scalars, seed_arr)
        loss = np.asarray(out["loss"])
        signal = out.get("signal")
        extra = out.get("scalars", {})
        for i, (cid, p, s) in enumerate(chunk):
            traces = {m: np.asarray(out[m][i]) for m in PRECURSORS if m in out}
            row = summarize_run(loss[i], traces, spikes, None if signal is None else signal[i],
                                problem.detect)
            row.update({k: float(np.asarray(v)[i]) for k, v in extra.items()})
            rows[cid].append({"problem": problem.name, "cell_id": cid, **p, "seed": int(s), **row,
                              "spike_height_unit": problem.height_unit})
    return {cid: pd.DataFrame(r) for cid, r in rows.items()}


def _sort_table(df: pd.DataFrame, grid_json: Mapping[str, Any]) -> pd.DataFrame:
    keys = [k for k in grid_json["axes"] if k in df.columns] + ["seed", "cell_id"]
    return df.sort_values(keys, kind="stable").reset_index(drop=True)


def _write_table(df: pd.DataFrame, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / f"{stem}.parquet", df.to_parquet(index=False))
    atomic_write_bytes(out_dir / f"{stem}.csv", df.to_csv(index=False).encode())


def _check_sweep_json(out: Path, grid_json: dict) -> None:
    meta = out / "sweep.json"
    if meta.exists():
        try:
            old = json.loads(meta.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{meta}: invalid JSON ({e})") from None
        if old.get("grid") != grid_json:
            raise ConfigError(f"{out}: holds a sweep of another grid (see {meta}); use a new --out "
                              "(nothing was overwritten)")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(meta, json.dumps({"grid": grid_json}, indent=2).encode())


KIND = "sweep_cell"
CODE = "vmap-1"          # bump when a problem's run or summarize_run changes meaning


def store_cell(problem: Problem, params: Mapping[str, Any], seeds: Sequence[int],
               spikes: Mapping[str, Any]) -> Cell:
    """One grid point x seeds as a cell of the one store (payload `rows`)."""
    return Cell(KIND, CODE, {"problem": problem.name, "params": dict(params),
                             "seeds": [int(s) for s in seeds], "spikes": dict(spikes)},
                "simulate.sweep:compute_cell")


def compute_cell(config: Mapping[str, Any]) -> dict:
    """A cell alone (an executor's worker); run_cells computes the missing cells of one
    static group together, vmapped."""
    from simulate.sweep_problems import PROBLEMS   # it imports this module: a cycle at the top
    params = dict(config["params"])
    problem = PROBLEMS[config["problem"]]
    cid = cell_id(problem.name, params)
    return {"rows": run_group(problem, [(cid, params)], list(config["seeds"]),
                              config["spikes"])[cid]}


def run_cells(problem: Problem, cells: Sequence[Mapping[str, Any]], seeds: Sequence[int], out: str | Path,
              spikes: Mapping[str, Any] | None = None, progress: bool = True,
              desc: str | None = None, cells_from: Sequence[str | Path] = ()) -> pd.DataFrame:
    """Run (or resume) explicit cells (full parameter dicts) x seeds into the cell store
    out/cells (a cell found in a `cells_from` store is copied, not run); returns their
    rows in the given cell order. The missing cells that share static params are vmapped
    together."""
    store = CellStore(Path(out) / "cells", sources=cells_from)
    spikes = dict(problem.spikes if spikes is None else spikes)
    ids = [(cell_id(problem.name, p), dict(p)) for p in cells]
    stored = {c: store.get(store_cell(problem, p, seeds, spikes)) for c, p in dict(ids).items()}
    todo = [(c, p) for c, p in dict(ids).items() if stored[c] is None]
    groups: dict[tuple, list] = {}
    for c, p in todo:
        groups.setdefault(_static_key(problem, p), []).append((c, p))
    per_call = max(1, problem.max_vmap // len(seeds))
    bar = tqdm(total=len(todo) * len(seeds), desc=desc or f"sweep {problem.name}", unit="run",
               disable=not progress, file=sys.stderr)
    for members in groups.values():
        for lo in range(0, len(members), per_call):
            part = members[lo:lo + per_call]
            params = dict(part)
            for c, df in run_group(problem, part, list(seeds), spikes).items():
                stored[c] = store.put(store_cell(problem, params[c], seeds, spikes), {"rows": df})
            bar.update(len(part) * len(seeds))
    bar.close()
    frames = [stored[c]["rows"] for c, _ in ids]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def run_sweep(grid: Grid, out: str | Path, shard: tuple[int, int] | None = None,
              progress: bool = True, save_runs: int = 0) -> pd.DataFrame:
    """Run (or resume) a grid into `out`; returns the table of this shard's runs."""
    out = Path(out)
    if (out / "run.json").exists():   # a run directory (maybe a live one): never written to
        raise ConfigError(f"{out}: is a run directory, not a sweep directory (nothing was changed)")
    grid_json = json.loads(json.dumps(grid.to_json()))
    _check_sweep_json(out, grid_json)
    mine = [p for p in grid.cells() if in_shard(cell_id(grid.problem.name, p), shard)]
    table = run_cells(grid.problem, mine, grid.seeds, out, grid.spikes, progress) if mine \
        else pd.DataFrame()
    if not table.empty:
        table = _sort_table(table, grid_json)
    stem = "runs" if shard is None else f"runs.shard-{shard[0]}-of-{shard[1]}"
    _write_table(table, out, stem)
    if save_runs:
        save_run_dirs(grid, mine[:save_runs], out / "runs", progress)
    return table


def save_run_dirs(grid: Grid, cells: Sequence[Mapping[str, Any]], runs_dir: Path,
                  progress: bool = True) -> list[Path]:
    """Full run directories (adamspike.rundir, via the problem's `save`) for `cells` at the
    grid's first seed: runs_dir/<cell_id>-s<seed>. Existing ones are kept as they are."""
    if grid.problem.save is None:
        raise ConfigError(f"--save-runs: problem {grid.problem.name!r} cannot write run directories")
    seed, paths = grid.seeds[0], []
    for p in tqdm(cells, desc="save runs", disable=not progress, file=sys.stderr):
        path = runs_dir / f"{cell_id(grid.problem.name, p)}-s{seed}"
        if not (path / "run.json").exists():
            runs_dir.mkdir(parents=True, exist_ok=True)
            grid.problem.save(dict(p), seed, path)
        paths.append(path)
    return paths


def read_cells(out: Path) -> pd.DataFrame:
    """Every stored cell of a sweep directory (merge's input), verified: a missing or
    corrupt one is a ConfigError naming it."""
    store = CellStore(Path(out) / "cells")
    try:
        frames = [store.read(KIND, k)["rows"] for k in store.keys(KIND)]
    except CorruptCell as e:
        raise ConfigError(f"{e} (rerun the sweep on the same --out to recompute it)") from None
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def merge_shards(dirs: Sequence[str | Path], out: str | Path, force: bool = False) -> pd.DataFrame:
    """Merge the cells of shard directories (same grid) into out/runs.{parquet,csv}."""
    grids, frames = [], []
    for d in map(Path, dirs):
        meta = d / "sweep.json"
        if not meta.is_file():
            raise ConfigError(f"{d}: not a sweep directory (no sweep.json)")
        try:
            grids.append(json.loads(meta.read_text())["grid"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{meta}: malformed sweep.json ({e})") from None
        frames.append(read_cells(d))
    if any(g != grids[0] for g in grids[1:]):
        raise ConfigError("merge: the directories hold sweeps of different grids")
    out = Path(out)
    if not force and ((out / "runs.parquet").exists() or (out / "runs.csv").exists()):
        raise ConfigError(f"{out}: already holds runs.parquet/runs.csv; choose another --out or "
                          "pass --force (nothing was overwritten)")
    df = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) \
        else pd.DataFrame()
    if df.empty:
        raise ConfigError("merge: no finished cells in " + ", ".join(map(str, dirs)))
    df = df.drop_duplicates(["cell_id", "seed"], keep="first")
    df = _sort_table(df, grids[0])
    _write_table(df, out, "runs")
    missing = _expected_runs(grids[0]) - len(df)
    if missing > 0:
        print(f"merge: {missing} run(s) of the grid are not finished yet", file=sys.stderr)
    return df


def _expected_runs(grid_json: Mapping[str, Any]) -> int:
    return math.prod(len(v) for v in grid_json["axes"].values()) * len(grid_json["seeds"])


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adamspike sweep", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run (or resume) a grid")
    r.add_argument("--grid", required=True, help="grid TOML (configs/sweep_*.toml)")
    r.add_argument("--out", required=True, help="sweep directory (cells/, runs.parquet)")
    r.add_argument("--shard", help="k/n: this process runs the k-th of n deterministic slices")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="replace one grid value (a TOML value; repeatable), e.g. "
                        "--set sweep.seeds=3 (module doc)")
    r.add_argument("--save-runs", type=int, default=0, metavar="N",
                   help="also write full run directories (DIR/runs/) for the first N cells, seed 0")
    r.add_argument("--no-progress", action="store_true")
    m = sub.add_parser("merge", help="merge shard directories into one table")
    m.add_argument("dirs", nargs="+")
    m.add_argument("--out", required=True, help="directory for runs.parquet / runs.csv")
    m.add_argument("--force", action="store_true", help="replace an existing table in --out")
    return ap


def main(argv: list[str] | None, problems: Mapping[str, Problem]) -> int:
    """`adamspike sweep run|merge` over `problems` (simulate.sweep_problems.PROBLEMS; the
    top CLI passes them, so this engine imports no problem)."""
    return cli_main(_parser(), argv, lambda args: _main(args, problems), "adamspike sweep")


def _main(args, problems: Mapping[str, Problem]) -> int:
    if args.cmd == "run":
        shard = parse_shard(args.shard)
        grid = load_grid(args.grid, problems, args.set)
        if args.save_runs < 0:
            raise ConfigError(f"--save-runs: must be >= 0, got {args.save_runs}")
        # resumable: a sweep folder (its sweep.json) is kept, any other non-empty one refused
        check_out(args.out, keep_existing=(Path(args.out) / "sweep.json").is_file())
        table = run_sweep(grid, args.out, shard, progress=not args.no_progress,
                          save_runs=args.save_runs)
        print(f"{len(table)} runs -> {args.out}")
    else:
        check_out(args.out, keep_existing=True)    # --force decides about its runs table
        table = merge_shards(args.dirs, args.out, force=args.force)
        print(f"{len(table)} runs -> {Path(args.out) / 'runs.parquet'}")
    return 0
