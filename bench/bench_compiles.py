"""Distinct XLA programs compiled per stage of `adamspike reproduce --quick`, their compile
seconds, and the second run's speed-up from JAX's persistent compilation cache.

Two studies into two new folders share one new, empty compilation cache: the first
compiles every program and writes it there, the second loads them. Each stage's processes
log their compiles (JAX_LOG_COMPILES=1: "Finished XLA compilation of F in T sec", or a
"Persistent compilation cache hit" before it when the program was loaded): per stage, the
compiles (one per program and process: a program compiled in two worker processes counts
twice) and the seconds they took. The cache keeps every program
(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0; JAX's default, 1 s, keeps only the slow
ones), so its entry count after the first study is the study's distinct programs. The
results check: the data the two studies wrote (csv, parquet, npz, npy files) must be
identical (byte for byte; a table's timing columns, e.g. step_time_s, left out).

    python bench/bench_compiles.py                      # the whole --quick study, twice
    python bench/bench_compiles.py --only montecarlo mlp --keep /tmp/bc   # a subset
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
_COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec")
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
_DATA = (".csv", ".parquet", ".npz", ".npy")


def study(out: Path, cache: Path, scale: str, only: list[str]) -> tuple[float, float, dict]:
    """One `reproduce` into `out` with the shared compilation cache; wall seconds, the
    study's core-seconds (its processes' CPU time) and per stage: compiles, cache hits,
    compile seconds."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_LOG_COMPILES": "1",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "study", "reproduce", "--out", str(out)]
    cmd += [] if scale == "standard" else [f"--{scale}"]       # standard: no flag
    cmd += ["--only", *only] if only else []
    before = os.times()
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = os.times()
    core = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_compiles: reproduce into {out} exited {res.returncode}")
    per_stage = {}
    for st in json.loads((out / "stages.json").read_text()):
        text = (out / st["log"]).read_text(errors="replace")
        compiles = _COMPILED.findall(text)
        per_stage[st["name"]] = {"compiles": len(compiles), "hits": len(_HIT.findall(text)),
                                 "compile_s": sum(float(s) for _, s in compiles),
                                 "seconds": st["seconds"],
                                 "programs": sorted({f for f, _ in compiles})}
    return wall, core, per_stage


_TIMING = re.compile(r"time|seconds|wall|_s$")     # measured durations: differ run to run


def _digest(path: Path) -> str:
    """sha256 of a data file; of a table's columns other than its timings."""
    if path.suffix in (".csv", ".parquet") or path.is_dir():
        try:
            t = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
        except pd.errors.EmptyDataError:          # an empty CSV (no rows, no header)
            return hashlib.sha256(path.read_bytes()).hexdigest()
        t = t[[c for c in t.columns if not _TIMING.search(str(c))]]
        return hashlib.sha256(t.to_csv(index=False).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_files(root: Path) -> dict[str, str]:
    """Digest per data file; a run's parquet table (its part-*.parquet files, whose split
    depends on when rows were flushed) as one table."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.suffix not in _DATA or not p.is_file() or {".cache", ".stale"} & set(p.parts):
            continue
        if p.suffix == ".parquet" and p.name.startswith("part-"):
            out.setdefault(str(p.parent.relative_to(root)), _digest(p.parent))
        else:
            out[str(p.relative_to(root))] = _digest(p)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=[], metavar="STAGE",
                    help="these stages only (default: the whole study)")
    ap.add_argument("--scale", choices=("quick", "standard"), default="quick")
    ap.add_argument("--keep", help="folder for the two studies and the cache (kept); "
                                   "default: a temporary one, removed")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-compiles-"))
    if args.keep and root.exists() and any(root.iterdir()):
        print(f"bench_compiles: {root} is not empty", file=sys.stderr)
        return 2
    cache = root / "jax"
    try:
        w1, c1, s1 = study(root / "first", cache, args.scale, args.only)
        programs = sum(1 for p in cache.iterdir() if p.is_file()) if cache.exists() else 0
        w2, c2, s2 = study(root / "second", cache, args.scale, args.only)
        print(f"{'stage':24} {'compiles':>8} {'compile s':>9} {'stage s':>8} | "
              f"{'hits':>5} {'compile s':>9} {'stage s':>8}   (first | second run)")
        for name, a in s1.items():
            b = s2.get(name, {})
            print(f"{name:24} {a['compiles']:8d} {a['compile_s']:9.1f} {a['seconds']:8.1f} | "
                  f"{b.get('hits', 0):5d} {b.get('compile_s', 0):9.1f} {b.get('seconds', 0):8.1f}")
        tot = lambda s, k: sum(v[k] for v in s.values())          # noqa: E731
        print(f"{'total':24} {tot(s1, 'compiles'):8d} {tot(s1, 'compile_s'):9.1f} "
              f"{tot(s1, 'seconds'):8.1f} | {tot(s2, 'hits'):5d} {tot(s2, 'compile_s'):9.1f} "
              f"{tot(s2, 'seconds'):8.1f}")
        print(f"distinct programs (compilation cache entries after the first run): {programs}")
        print(f"wall: first {w1:.1f} s, second {w2:.1f} s: {w1 / w2:.2f}x; core-seconds: "
              f"first {c1:.0f}, second {c2:.0f}: {c1 / max(c2, 1e-9):.2f}x; load "
              f"{os.getloadavg()[0]:.1f}")
        # the cache's own share, apart from the machine's drift between the two runs (up to
        # 1.4x within an hour on the 2-core box): the compile seconds it saved (XLA compiles
        # on one thread, so they stand for core-seconds) against the rest, the computation
        saved = tot(s1, "compile_s") - tot(s2, "compile_s")
        rest1, rest2 = c1 - tot(s1, "compile_s"), c2 - tot(s2, "compile_s")
        print(f"the cache alone: {saved:.0f} compile seconds saved of {c1:.0f} core-seconds: "
              f"{c1 / max(c1 - saved, 1e-9):.2f}x at equal machine speed; the computation "
              f"besides compiles took {rest1:.0f} then {rest2:.0f} core-seconds "
              f"({rest1 / max(rest2, 1e-9):.2f}x: the machine)")
        d1, d2 = data_files(root / "first"), data_files(root / "second")
        differ = sorted(k for k in d1.keys() | d2.keys() if d1.get(k) != d2.get(k))
        print(f"results: {len(d1) - len(set(differ) & d1.keys())} of {len(d1)} data files "
              f"identical" + (f"; differ: {differ}" if differ else ""))
        (root / "bench_compiles.json").write_text(json.dumps(
            {"first": {"wall_s": w1, "core_s": c1, "stages": s1, "distinct_programs": programs},
             "second": {"wall_s": w2, "core_s": c2, "stages": s2}, "differ": differ}, indent=1))
        return 1 if differ else 0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
