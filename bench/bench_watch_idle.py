"""`adamspike watch` on a run directory at rest: CPU seconds per idle look against the
size of events.jsonl, and a log line without a newline: time and memory against its size.

For each size, a run directory with a few steps rows and an events.jsonl of that size
(~1 KB records) is followed by a real `watch` process (--poll 0.2); after its first read
(the whole file, once), its CPU time (/proc/PID/stat utime + stime) is sampled over
--idle seconds: CPU seconds per idle look = delta / (idle / poll). Target: flat in the
size (each idle look is a stat of events.jsonl, not a read). Then `watch --once` reads a
log made of one line of --long-mb MiB without a newline and 50 iteration lines: its wall
time and peak RSS (the partial line is capped at 1 MiB and dropped; each byte scanned
once).

Measured (2 shared cores, load ~8; --poll 0.2, 10 s idle): events.jsonl of 1.0 MB and
31.6 MB: 0.4 CPU ms per idle look at both (0.04 CPU s per idle 20 s); before (reading the
whole file every look): 3.0 and 42.4 CPU ms per look (0.3 and 4.2 CPU s per idle 20 s),
the first read 11.4 CPU s at 31.6 MB (now 2.1, start-up included). A 64 MiB line without a
newline then 50 lines: 7.5-9.3 s wall (start-up ~2.5 CPU s of imports included), peak RSS
184 MB, that of a 1-line log (before: 20.4 s, 309 MB).

    python bench/bench_watch_idle.py                       # 1 MB and 30 MB, 10 s idle
    python bench/bench_watch_idle.py --sizes 1 35 --idle 20
    python bench/bench_watch_idle.py --repo /work/main     # another checkout (before)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_run(path: Path, mb: float, repo: Path) -> None:
    code = ("import sys; from adamspike.rundir import RunWriter\n"
            "w = RunWriter(sys.argv[1], backend='jax', config={'optim': {'eps': 1e-8}})\n"
            "for s in range(1, 6):\n"
            "    w.log_step(step=s, tokens=s, loss=3.0, lr=1e-3, grad_norm=0.5, clipped=False,"
            " update_norm=0.1, step_time_s=0.1, skipped=False)\n"
            "w.flush(); w.close()\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=repo,
                   env={**os.environ, "PYTHONPATH": str(repo)})
    pad = "x" * 900
    n = int(mb * (1 << 20) / 960)
    with open(path / "events.jsonl", "a") as fh:
        for i in range(n):
            fh.write(json.dumps({"time": i, "type": "checkpoint", "step": i, "pad": pad}) + "\n")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cost(run: Path, repo: Path, idle: float, poll: float) -> tuple[float, float]:
    """(CPU s of the first read, CPU s per idle look)."""
    p = subprocess.Popen([sys.executable, "-m", "study", "watch", str(run), "--poll",
                          str(poll)], cwd=repo, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        last = cpu_s(p.pid)                          # wait until the first read is over
        while True:
            time.sleep(1.0)
            now = cpu_s(p.pid)
            if now - last < 0.1 and now > 1.0:      # under 10 % of a core: at rest
                break
            last = now
        first = now
        time.sleep(idle)
        per_look = (cpu_s(p.pid) - first) / (idle / poll)
    finally:
        p.terminate()
        p.wait(10)
    return first, per_look


def long_line(tmp: Path, mb: int, repo: Path) -> tuple[float, float]:
    log = tmp / "long.log"
    with open(log, "wb") as fh:
        block = b"a" * (1 << 20)
        for _ in range(mb):
            fh.write(block)
        fh.write(b"\n")
        for i in range(1, 51):
            fh.write((f"iteration {i:8d}/ 1000 | lm loss: {3.0 + (3 if i == 40 else 0):.6E} |"
                      " grad norm: 0.500 |\n").encode())
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "study", "watch", str(log), "--once", "--json"],
                       cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    wall = time.time() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert r.returncode == 0, r.stderr
    assert any(json.loads(ln)["step"] == 40 for ln in r.stdout.splitlines()), r.stdout
    return wall, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 30], help="MB of events")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds sampled at rest")
    ap.add_argument("--poll", type=float, default=0.2)
    ap.add_argument("--long-mb", type=int, default=64, help="MiB of a line without newline")
    ap.add_argument("--repo", type=Path, default=ROOT, help="checkout to run watch from")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if a.long_mb:                # first: the peak RSS of the children is this one's
            wall, rss = long_line(tmp, a.long_mb, a.repo)
            print(f"a {a.long_mb} MiB line without newline + 50 lines: {wall:.1f} s wall, "
                  f"peak RSS {rss:.0f} MB", flush=True)
        for mb in a.sizes:
            run = tmp / f"run{mb:g}"
            make_run(run, mb, a.repo)
            size = (run / "events.jsonl").stat().st_size / 1e6
            first, per = idle_cost(run, a.repo, a.idle, a.poll)
            print(f"events.jsonl {size:6.1f} MB: start + first read {first:6.2f} CPU s; "
                  f"idle {per * 1e3:8.3f} CPU ms per look ({per / a.poll * 20:6.3f} CPU s "
                  "per idle 20 s)", flush=True)


if __name__ == "__main__":
    main()
