"""Analysis at 70B scale: load_run + spikes + precursors + fits + report (no figures).

Generates a synthetic LLaMA2-70B-shaped trace (analysis.synthetic: the real 723 tensors of
adamspike.llama's llama2-70b preset, 20,000 logged steps, spikes with a shallow-layer
precursor; written with RunWriter as parquet parts), then, in fresh child processes so
their peak memory is their own:
  1. end to end: analysis.report.analyze_run + write_run_report
  2. the same stages one by one (load_run, spikes, precursors, update_rms fit, rms_t
     check, regimes) with their times.
Targets: <= 30 s and <= 4 GB peak RSS on 2 cores. Prints medians over --repeat runs.

    python bench/bench_analysis.py [--steps 20000] [--model llama2-70b] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adamspike.rundir import load_run
from adamspike.spikes import loss_spikes
from analysis.fits import check_rms_t, fit_update_rms, spike_regimes
from analysis.precursors import precursors
from analysis.report import LAYER_COLUMNS, analyze_run, write_run_report
from analysis.synthetic import write_synthetic_run

TARGET_S, TARGET_GB = 30.0, 4.0


def child_end_to_end(run: str, out: str) -> dict:
    t = time.perf_counter()
    ra = analyze_run(run)
    write_run_report(ra, out)
    return {"seconds": time.perf_counter() - t, "num_spikes": len(ra.spikes),
            "eps_scale": ra.update_fit.eps_scale, "r2_log": ra.update_fit.r2_log}


def child_stages(run: str) -> dict:
    times = {}
    t = time.perf_counter()
    r = load_run(run, tables=("steps", "layers"), layer_columns=LAYER_COLUMNS)
    times["load_run"] = time.perf_counter() - t
    t = time.perf_counter()
    sp, _ = loss_spikes(r.steps)
    times["spikes"] = time.perf_counter() - t
    t = time.perf_counter()
    precursors(r.layers, sp)
    times["precursors"] = time.perf_counter() - t
    t = time.perf_counter()
    fit_update_rms(r.layers, 0.9, 0.95)
    times["update_rms_fit"] = time.perf_counter() - t
    t = time.perf_counter()
    check_rms_t(r.layers, 0.9, 0.95)
    times["rms_t_check"] = time.perf_counter() - t
    t = time.perf_counter()
    spike_regimes(r.layers, sp, r.config)
    times["regimes"] = time.perf_counter() - t
    times["layer_rows"] = len(r.layers)
    return times


def _child(kind: str, run: str, out: str) -> dict:
    res = child_end_to_end(run, out) if kind == "e2e" else child_stages(run)
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return res


def _spawn(kind: str, run: Path, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")
    cmd = [sys.executable, __file__, "--child", kind, str(run), str(out)]
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 2:
        cmd = ["taskset", "-c", "0,1"] + cmd  # the target is for 2 cores
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"child failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--model", default="llama2-70b")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", help="write / reuse the synthetic run here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    tmp = tempfile.TemporaryDirectory()
    run = Path(args.keep) if args.keep else Path(tmp.name) / "run70b"
    if not (run / "run.json").exists():
        spikes = [int(args.steps * f) for f in (0.2, 0.45, 0.7, 0.9)]
        t = time.perf_counter()
        write_synthetic_run(run, model=args.model, num_steps=args.steps, spikes=spikes,
                            hist_every=max(1, args.steps // 40), progress=True)
        print(f"generated {run} in {time.perf_counter() - t:.1f} s (not part of the target)")
    e2e = [_spawn("e2e", run, Path(tmp.name) / f"out{i}") for i in range(args.repeat)]
    stages = _spawn("stages", run, Path(tmp.name) / "unused")
    sec = statistics.median(r["seconds"] for r in e2e)
    rss = statistics.median(r["peak_rss_gb"] for r in e2e)
    print(f"layer rows: {stages['layer_rows']:,} ({args.model}, {args.steps} steps)")
    for k, v in stages.items():
        if k not in ("layer_rows", "peak_rss_gb"):
            print(f"  {k:16s} {v:7.2f} s")
    print(f"end to end (analyze_run + report, no figures): median {sec:.1f} s "
          f"(target <= {TARGET_S:.0f} s, ratio {sec / TARGET_S:.2f}); peak RSS {rss:.2f} GB "
          f"(target <= {TARGET_GB:.0f} GB, ratio {rss / TARGET_GB:.2f})")
    print(f"spikes found: {e2e[0]['num_spikes']}; update_rms fit eps scale "
          f"{e2e[0]['eps_scale']:.3f} (truth 1), R^2 {e2e[0]['r2_log']:.3f}")
    return 0 if sec <= TARGET_S and rss <= TARGET_GB else 1


if __name__ == "__main__":
    sys.exit(main())
