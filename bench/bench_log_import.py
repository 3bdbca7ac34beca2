"""Megatron log import at scale: lines per second and peak RSS against the line count.

Writes a synthetic Megatron-LM log (one `iteration N/ M | ... |` line per iteration, the
format of tests/analysis/test_megatron_log.py, with a DeepSpeed OVERFLOW line, a warning
line and a malformed, cut-off iteration line every --every iterations), then imports it
(analysis.megatron_log.import_megatron_log: streamed in chunks, one parquet part and at most
one malformed-lines event per chunk) in a fresh child process per size, so the peak RSS
is the import's own; CPU seconds beside the wall time (on a shared machine the wall time
varies with the load). Target: memory flat in the line count (<= 500 MB at 20 M lines).

Measured (2 shared cores, load ~4; a 70B-style line, 1 malformed line per 1000): 0.2 M
lines 5.0 s / 287 MB; 2 M 62.8 s (45 CPU s) / 288 MB; 20 M (6.3 GB) 752 s (497 CPU s) /
287 MB: ~45k lines per CPU second, 400 parts, 400 malformed-line events. Before streaming:
2 M lines 121 s and 2.66 GB, one fsynced event per malformed line. 170 MB of the peak is
the import of pandas / pyarrow.

    python bench/bench_log_import.py                 # 0.2 M and 2 M iteration lines
    python bench/bench_log_import.py --with-20m      # and 20 M (minutes; off by default)
    python bench/bench_log_import.py --sizes 200000 --malformed-every 2  # half malformed
    python bench/bench_log_import.py --same-line     # one line repeated (a restart loop)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_MB = 500.0


def write_log(path: Path, n: int, every: int, malformed_every: int, same_line: bool = False
              ) -> int:
    """n iteration lines (+ chatter; same_line: one iteration line n times, as a job
    restarted in a loop); returns the number of lines written."""
    lines = 0
    with open(path, "w") as fh:
        buf = []
        for it in range(1, n + 1):
            it = 1 if same_line else it
            loss = 2.0 + 0.5 / (1 + it / 1000) + 0.01 * ((it * 7919) % 13) / 13
            line = (f" [2024-06-01 12:00:01.123456] iteration {it:8d}/{n:8d} | consumed "
                    f"samples: {it * 1024:12d} | elapsed time per iteration (ms): 15234.5 | "
                    f"learning rate: 1.500000E-04 | global batch size:  1024 | lm loss: "
                    f"{loss:.6E} | loss scale: 65536.0 | grad norm: {0.8 + (it % 17) / 100:.3f}"
                    f" | number of skipped iterations:   0 | number of nan iterations:   0 |")
            if malformed_every and it % malformed_every == 0:
                line = line[:120]                   # cut off mid-print: malformed
            buf.append(line)
            if every and it % every == 0:
                buf.append("[2024-06-01 12:00:01,305] [INFO] [stage_1_and_2.py:1644:step] "
                           "[deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: "
                           "65536.0, reducing to 65536.0")
                buf.append("UserWarning: some library warning printed by every rank")
            if len(buf) >= 10_000:
                lines += len(buf)
                fh.write("\n".join(buf) + "\n")
                buf = []
        lines += len(buf)
        fh.write("\n".join(buf) + "\n" if buf else "")
    return lines


def child(log: str, out: str) -> None:
    from analysis.megatron_log import import_megatron_log   # in the measured child process only

    t, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    res = import_megatron_log(log, out)
    dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    peak_mb = r1.ru_maxrss / 1024
    num_events = sum(1 for _ in open(Path(out) / "events.jsonl")) \
        if (Path(out) / "events.jsonl").exists() else 0
    print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "peak_rss_mb": peak_mb, "rows": res.stats["num_rows"],
                      "lines": res.stats["num_lines"], "malformed": res.stats["num_malformed"],
                      "events": num_events,
                      "parts": len(list((Path(out) / "steps").glob("part-*")))}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[200_000, 2_000_000],
                    help="iteration lines per log (default 0.2 M and 2 M)")
    ap.add_argument("--with-20m", action="store_true", help="also 20 M iteration lines")
    ap.add_argument("--every", type=int, default=100,
                    help="an OVERFLOW and a warning line every N iterations (0: none)")
    ap.add_argument("--malformed-every", type=int, default=1000,
                    help="a cut-off iteration line every N iterations (0: none)")
    ap.add_argument("--same-line", action="store_true",
                    help="one iteration line repeated (every row a repeated iteration)")
    ap.add_argument("--child", nargs=2, metavar=("LOG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    sizes = list(args.sizes) + ([20_000_000] if args.with_20m else [])
    print(f"{'iterations':>11} {'lines':>11} {'MB':>7} {'seconds':>8} {'lines/s':>10} "
          f"{'CPU s':>7} {'lines/CPU s':>11} "
          f"{'peak RSS MB':>12} {'parts':>6} {'malformed':>9} {'events':>7}")
    worst = 0.0
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="bench_log_import_") as tmp:
            log = Path(tmp) / "train.log"
            nlines = write_log(log, n, args.every, args.malformed_every, args.same_line)
            r = subprocess.run([sys.executable, __file__, "--child", str(log),
                                str(Path(tmp) / "run")], capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            m = json.loads(r.stdout.strip().splitlines()[-1])
            worst = max(worst, m["peak_rss_mb"])
            print(f"{n:11d} {nlines:11d} {log.stat().st_size / 2**20:7.0f} "
                  f"{m['seconds']:8.1f} {nlines / m['seconds']:10.0f} "
                  f"{m['cpu_seconds']:7.1f} {nlines / m['cpu_seconds']:11.0f} "
                  f"{m['peak_rss_mb']:12.0f} {m['parts']:6d} {m['malformed']:9d} "
                  f"{m['events']:7d}", flush=True)
    print(f"peak RSS {worst:.0f} MB (target <= {TARGET_MB:.0f} MB, flat in the line count)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
