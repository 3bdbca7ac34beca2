"""`adamspike watch PATH`: follow a live training job and report each spike, alarm and
numerics event as it happens (reads files only).

    adamspike watch megatron.log [--on-event CMD] [--once] [--new-only] [--json]
                    [--num-params N | --model PRESET] [--eps E] [--clip C] [--poll S]
    adamspike watch RUN_DIR ...          (a probe / trainer run directory: steps + events)

A log is followed with `tail -F` semantics: complete lines are read as they are appended;
a rotated file (renamed away, a new one created under PATH) is drained and then the new
file read from its start; a truncated file (size below the read position) is read again
from its start; a file that does not exist yet is waited for. A restarted job that appends
to the same log (or writes a new one) goes back to an earlier iteration: the rule's state is
restored to what it was before that iteration (snapshots of the last SNAPSHOT_ROWS rows)
and judging goes on from there, as the offline import does (a repeated iteration keeps its
last line).

Decisions are the offline analysis's, one row at a time: lines are parsed by the one
parser (adamspike.megatron_log.iter_megatron_log, the import's streaming parser, here one
row per chunk), the loss and the grad norm are judged by the one online rule
(adamspike.spikes: SpikeParams.resolved with the run config of an imported log, so
LOG_MIN_HISTORY; the grad norm by analysis.report.grad_norm_rule) on the rows
adamspike.spikes.valued_rows keeps, and numerics events are analysis.numerics
.numerics_events of the row against the previous one. So the steps `watch` flags on a file
are the spike starts `analyze --log` finds on it (tests/analysis/test_watch.py), with one
exception it reports when it happens: with `--log-loss auto` the rule switches to log loss
once the loss has spanned two decades (offline decides that over the whole file).

Per event one line on stdout (`--json`: one JSON object per line): the step, what happened,
and a short state line (loss against its band, grad norm, loss scale, lr, and the regime
card's rho_bar = min(gn, clip) / (sqrt(N) eps) with its eps regime when N and eps are known:
--num-params / --model / --eps / --clip or the log's printed arguments). Kinds: loss_spike
(onset), loss_spike_end (back inside the band), grad_norm_spike, the numerics kinds of
analysis.numerics (loss_scale_cut, loss_scale_raise, overflow, skipped, nan_iterations,
stale_grad_norm, nonfinite_loss, no_loss), restart (the job went back to an earlier
iteration), rule (the rule changed), and for a run directory its events.jsonl records
(alarm, skip, rollback, fault, ...; routine ones such as checkpoints are left out).

`--on-event CMD` runs CMD (through the shell) once per event, with the event as JSON on
stdin and in the environment (ADAMSPIKE_EVENT_JSON, ADAMSPIKE_EVENT_KIND,
ADAMSPIKE_EVENT_STEP, ADAMSPIKE_EVENT_DETAIL, ADAMSPIKE_WATCH_SOURCE); a failing or slow
hook (--on-event-timeout) is reported on stderr and watching goes on. Ctrl-C or SIGTERM
ends watching with exit status 0; `--once` reads what is there and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from adamspike.config import ConfigError, cli_main
from adamspike.llama import PRESETS
from adamspike.llama import num_params as llama_num_params
from adamspike.megatron_log import MegatronLogError, iter_megatron_log
import pyarrow.parquet as pq

from adamspike.rundir import RunFormatError, flushed_step, read_meta, read_plain_part
from adamspike.spikes import SpikeParams, add_spike_flags
from analysis.cli import check_log_flags
from analysis.numerics import numerics_events
from analysis.regime import log_arguments, num_params_from_args, rho_bar
from analysis.report import grad_norm_rule
from theory.eps_regime import regimes

POLL_S = 0.2               # seconds between looks at a file that did not grow
SNAPSHOT_ROWS = 5000       # rows whose rule state is kept for a restart's rewind
ROUTINE_RUN_EVENTS = frozenset({"start", "end", "finished", "checkpoint", "validation",
                                "problem", "malformed_log_lines", "replay_from",
                                "lock_taken_over", "events_repaired"})


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _valued(row: dict, column: str) -> bool:
    """adamspike.spikes.valued_rows for one row: a skipped step without a value, or a
    value flagged `<column>_missing`, has no value."""
    if row.get(f"{column}_missing") is True:
        return False
    return not (row.get("skipped") is True and not _finite(row.get(column)))


def _g(x: Any, digits: int = 4) -> str:
    return f"{float(x):.{digits}g}" if _finite(x) else "-"


class OnlineJudge:
    """The offline analysis's per-row decisions (module doc), one row at a time:
    `feed(row)` takes a steps row (a dict: the parser's, or a run directory's) and returns
    the events it raises, in order."""

    def __init__(self, params: SpikeParams = SpikeParams(), config: dict | None = None, *,
                 num_params: int | None = None, eps: float | None = None,
                 clip: float | None = None):
        self.params, self.config = params, config or {}
        self.auto_log = params.log is None
        self.rule = params.resolved(np.array([]), self.config)
        self.grad_rule = grad_norm_rule(self.rule)
        self.num_params, self.eps, self.clip = num_params, eps, clip
        self.loss_det = self.rule.detector()
        self.grad_det = self.grad_rule.detector()
        self.env: deque = deque(maxlen=max(int(self.rule.envelope or 0), 1))
        self.recent: deque = deque(maxlen=self.rule.window)   # finite positive x (auto log)
        self.lo, self.hi = math.inf, -math.inf
        self.in_spike: dict | None = None
        self.in_grad = False
        self.grad_pending: list[dict] = []     # NaN grad norms before any finite one
        self.grad_seen_finite = False
        self.scale_ctx: dict | None = None      # the last row with a finite loss scale
        self.counters = False                   # a row carried skipped / nan counters
        self.max_step: int | None = None
        self.snapshots: deque = deque(maxlen=SNAPSHOT_ROWS)
        self.last: dict = {}

    # ---------------------------------------------------------------- state for rewinds
    def _state(self, step: int) -> tuple:
        return (step, self.rule, tuple(self.loss_det._hist), self.loss_det.num_updates,
                tuple(self.grad_det._hist), self.grad_det.num_updates, tuple(self.env),
                tuple(self.recent), self.lo, self.hi,
                None if self.in_spike is None else dict(self.in_spike), self.in_grad,
                list(self.grad_pending), self.grad_seen_finite, self.scale_ctx)

    def _restore(self, s: tuple) -> None:
        (_, self.rule, lh, lu, gh, gu, env, recent, self.lo, self.hi, in_spike, self.in_grad,
         pending, self.grad_seen_finite, self.scale_ctx) = s
        self.loss_det = self.rule.detector()
        self.loss_det.load_state_dict({"history": list(lh), "num_updates": lu})
        self.grad_det = self.grad_rule.detector()
        self.grad_det.load_state_dict({"history": list(gh), "num_updates": gu})
        self.env = deque(env, maxlen=self.env.maxlen)
        self.recent = deque(recent, maxlen=self.recent.maxlen)
        self.in_spike = in_spike
        self.grad_pending = pending

    def _rewind(self, step: int) -> dict:
        later = [s for s in self.snapshots if s[0] >= step]
        exact = bool(later) and (len(later) < len(self.snapshots) or later[0][0] == step)
        if later:
            self._restore(later[0])
            keep = [s for s in self.snapshots if s[0] < step]
            self.snapshots = deque(keep, maxlen=SNAPSHOT_ROWS)
        detail = (f"the job went back from iteration {self.max_step} to {step} (a restart): "
                  "judging goes on from the rule's state before it" if exact else
                  f"the job went back from iteration {self.max_step} to {step}, beyond the "
                  f"last {SNAPSHOT_ROWS} rows kept: judging goes on from the oldest state kept")
        return {"kind": "restart", "category": "log", "step": step, "detail": detail}

    # ---------------------------------------------------------------- one row
    def feed(self, row: dict) -> list[dict]:
        step = int(row["step"])
        out: list[dict] = []
        if self.max_step is not None and step <= self.max_step:
            out.append(self._rewind(step))
        self.snapshots.append(self._state(step))
        self.max_step = step if self.max_step is None or out else max(self.max_step, step)
        self.last = row
        out += self._loss(row, step)
        out += self._grad(row, step)
        out += self._numerics(row, step)
        return out

    def _switch_to_log(self, step: int) -> dict:
        span = math.log10(self.hi) - math.log10(self.lo)
        self.rule = self.params.resolved(np.array([self.lo, self.hi]), self.config)
        self.loss_det = self.rule.detector()
        self.loss_det.load_state_dict({"history": [math.log(x) for x in self.recent],
                                       "num_updates": self.loss_det.num_updates})
        return {"kind": "rule", "category": "rule", "step": step,
                "detail": f"the loss has spanned {span:.2f} decades: the rule now runs on log "
                          "loss with every value in its history (--log-loss auto); offline, "
                          "analyze decides this over the whole file, so earlier steps may be "
                          "judged differently there"}

    def _loss(self, row: dict, step: int) -> list[dict]:
        if not _valued(row, "loss"):
            return []
        v = float(row.get("loss", math.nan))
        out = []
        if self.auto_log and not self.rule.log and math.isfinite(v) and v > 0:
            self.lo, self.hi = min(self.lo, v), max(self.hi, v)
            if math.log10(self.hi) - math.log10(self.lo) > 2:
                out.append(self._switch_to_log(step))
        x = v
        if self.rule.envelope and self.rule.envelope > 1:   # detect_spikes' running max
            self.env.append(v)
            vals = [e for e in self.env if not math.isnan(e)]
            x = max(vals) if vals else math.nan
        if math.isfinite(x) and x > 0:
            self.recent.append(x)
        det = self.loss_det
        flag = det.update(x)
        if flag and self.in_spike is None:
            self.in_spike = {"start": step, "peak": v, "baseline": det.baseline}
            ratio = v / det.baseline if _finite(det.baseline) and det.baseline > 0 and \
                math.isfinite(v) else math.nan
            what = ("non-finite loss" if not math.isfinite(v) else
                    f"loss {_g(v)} above its band (median {_g(det.baseline)}, threshold "
                    f"{_g(det.threshold)}, x{_g(ratio, 3)})")
            out.append({"kind": "loss_spike", "category": "spike", "step": step,
                        "series": "loss", "value": v, "baseline": det.baseline,
                        "threshold": det.threshold, "detail": what})
        elif flag:
            if not (self.in_spike["peak"] >= v):      # NaN peaks stay
                self.in_spike["peak"] = v
        elif self.in_spike is not None:
            sp, self.in_spike = self.in_spike, None
            out.append({"kind": "loss_spike_end", "category": "spike", "step": step,
                        "series": "loss", "value": v, "start": sp["start"],
                        "peak": sp["peak"], "baseline": sp["baseline"],
                        "detail": f"loss {_g(v)} back inside its band: the spike from step "
                                  f"{sp['start']} lasted {step - sp['start']} step(s), peak "
                                  f"{_g(sp['peak'])}"})
        return out

    def _grad(self, row: dict, step: int) -> list[dict]:
        if "grad_norm" not in row or not _valued(row, "grad_norm"):
            return []
        v = float(row["grad_norm"]) if row["grad_norm"] is not None else math.nan
        # offline, a trace without any finite grad norm is not judged: NaNs wait for one
        if not self.grad_seen_finite:
            if not math.isfinite(v):
                self.grad_pending.append({"step": step, "value": v})
                return []
            self.grad_seen_finite = True
            pend, self.grad_pending = self.grad_pending, []
            return [e for p in pend for e in self._grad_one(p["step"], p["value"])] + \
                self._grad_one(step, v)
        return self._grad_one(step, v)

    def _grad_one(self, step: int, v: float) -> list[dict]:
        det = self.grad_det
        flag = det.update(v)
        out = []
        if flag and not self.in_grad:
            out.append({"kind": "grad_norm_spike", "category": "spike", "step": step,
                        "series": "grad_norm", "value": v, "baseline": det.baseline,
                        "threshold": det.threshold,
                        "detail": ("non-finite grad norm" if not math.isfinite(v) else
                                   f"grad norm {_g(v)} above its band (median "
                                   f"{_g(det.baseline)}, threshold {_g(det.threshold)}): it "
                                   "often leads a loss spike by a few steps")})
        self.in_grad = flag
        return out

    def _numerics(self, row: dict, step: int) -> list[dict]:
        num = ("num_skipped_iterations", "num_nan_iterations")
        self.counters = self.counters or any(c in row for c in num)
        scale = row.get("loss_scale", math.nan)
        ctx = self.scale_ctx
        loss = row.get("loss", math.nan)
        maybe = ((_finite(scale) and ctx is not None and float(scale) != ctx["loss_scale"])
                 or (row.get("overflow_lines") or 0) > 0 or row.get("skipped") is True
                 or row.get("grad_norm_stale") is True or row.get("loss_missing") is True
                 or not _finite(loss) or any(_finite(row.get(c)) and row[c] > 0 for c in num))
        if _finite(scale):
            self.scale_ctx = {"step": -1, "loss": 0.0, "loss_scale": float(scale)}
        if not maybe:
            return []
        cur = dict(row)
        if self.counters:
            for c in num:
                cur.setdefault(c, math.nan)
        frame = pd.DataFrame([ctx, cur] if ctx is not None else [cur])
        ev, _, _ = numerics_events(frame)
        return [{"kind": e["kind"], "category": "numerics", "step": step,
                 "detail": e["detail"]} for e in ev if e["step"] == step]

    # ---------------------------------------------------------------- the state line
    def state_line(self) -> str:
        r, det = self.last, self.loss_det
        parts = [f"loss {_g(r.get('loss'))}"
                 + (f" (band: median {_g(det.baseline)}, spike above {_g(det.threshold)})"
                    if _finite(det.threshold) else " (band: not enough history yet)"),
                 f"grad norm {_g(r.get('grad_norm'))}"]
        if _finite(r.get("loss_scale")):
            parts.append(f"loss scale {_g(r['loss_scale'], 6)}")
        if _finite(r.get("lr")):
            parts.append(f"lr {_g(r['lr'], 3)}")
        parts.append(self.rho_text(r.get("grad_norm")))
        return " | ".join(parts)

    def rho_text(self, gn: Any) -> str:
        if not (self.num_params and self.eps):
            return "rho_bar n/a (N or eps unknown)"
        if not _finite(gn):
            return "rho_bar n/a (no measured grad norm on this line)"
        rb = float(rho_bar([float(gn)], self.clip, self.num_params, self.eps)[0])
        return f"rho_bar {rb:.3g} ({regimes(rb)})"


# -------------------------------------------------------------------- following files

class _Stop:
    """Set by SIGINT / SIGTERM (or a test): the followers return at their next look."""

    def __init__(self) -> None:
        self.flag = False

    def __bool__(self) -> bool:
        return self.flag


def follow_lines(path: Path, stop: _Stop, *, once: bool = False, poll: float = POLL_S,
                 on_note: Callable[[str], None] = lambda s: None) -> Iterator[str]:
    """The complete lines of a growing file, `tail -F` style (module doc); returns when
    `stop` is set, or at the end of the file with `once`."""
    fh, ino, buf = None, None, b""
    while not stop:
        if fh is None:
            try:
                fh = open(path, "rb")
                ino = os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                if once:
                    raise MegatronLogError(f"{path}: log file not found") from None
                time.sleep(poll)
                continue
        chunk = fh.read(1 << 20)
        if chunk:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for ln in lines:
                yield ln.decode("utf-8", errors="replace")
            continue
        if once:
            if buf:
                yield buf.decode("utf-8", errors="replace")
            break
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None                       # mid-rotation: keep the old file for now
        if st is not None and st.st_ino != ino:
            on_note(f"{path} was replaced (rotated): reading the new file from its start")
            if buf:                         # the old file is drained: its last line
                yield buf.decode("utf-8", errors="replace")
            fh.close()
            fh, buf = None, b""
            continue
        if st is not None and st.st_size < fh.tell():
            on_note(f"{path} was truncated: reading it again from its start")
            fh.seek(0)
            buf = b""
            continue
        time.sleep(poll)
    if fh is not None:
        fh.close()


def follow_log_rows(path: Path, stop: _Stop, **kw) -> Iterator[dict]:
    """Parsed iteration rows of a followed log (one row per parser chunk)."""
    try:
        for ch in iter_megatron_log(follow_lines(path, stop, **kw), source=str(path),
                                    chunk_rows=1):
            for ex in ch.malformed_examples:
                print(f"adamspike watch: malformed line {ex['line']}: {ex['reason']}",
                      file=sys.stderr)
            yield from ch.rows
    except MegatronLogError:
        if kw.get("once"):
            raise
        # stopped before any iteration line: nothing to judge


class RunFollower:
    """New steps rows and events of a run directory being written (module doc of
    adamspike.rundir: parts appear atomically; a live writer's flushed.json bounds the
    rows that are complete; a resume truncates rows and events beyond its checkpoint and
    may reuse a part's name)."""

    def __init__(self, path: Path):
        self.path = path
        self.parts: dict[str, tuple] = {}          # name -> (signature, steps consumed)
        self.waiting: set[str] = set()             # parts with rows beyond flushed.json
        self.events_seen: set[int] = set()

    def poll(self) -> tuple[list[dict], list[dict]]:
        """(new steps rows by step, new non-routine events)."""
        # events first: a writer flushes step s's rows before it logs an event it raised
        # after them, so an event read here has its rows in the parts read next (read the
        # other way round, a flush landing between the two reads put the event first)
        events = self._events()
        upto = flushed_step(self.path)
        fresh: list[dict] = []
        d = self.path / "steps"
        paths = (sorted(d.glob("part-*.parquet")) + sorted(d.glob("part-*.jsonl"))
                 if d.is_dir() else [])
        for p in paths:
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            old_sig, done = self.parts.get(p.name, (None, frozenset()))
            if old_sig == sig and p.name not in self.waiting:
                continue
            try:
                df = (pq.read_table(p).to_pandas() if p.suffix == ".parquet" else
                      read_plain_part(p, "steps").to_pandas())
            except (OSError, RunFormatError):
                continue
            steps = [int(s) for s in df["step"]]
            if old_sig != sig:            # rewritten (truncated, or a reused name)
                done = done & frozenset(steps)
            rows = [r for r, s in zip(df.to_dict("records"), steps)
                    if s not in done and (upto is None or s <= upto)]
            self.parts[p.name] = (sig, done | {int(r["step"]) for r in rows})
            if upto is not None and any(s > upto for s in steps):
                self.waiting.add(p.name)
            else:
                self.waiting.discard(p.name)
            fresh += rows
        names = {p.name for p in paths}
        for name in [n for n in self.parts if n not in names]:
            del self.parts[name]
            self.waiting.discard(name)
        fresh.sort(key=lambda r: int(r["step"]))
        return fresh, events

    def _events(self) -> list[dict]:
        p = self.path / "events.jsonl"
        out = []
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return out
        for line in text.split("\n")[:-1]:           # the last piece may be half written
            h = hash(line)
            if h in self.events_seen or not line.strip():
                continue
            self.events_seen.add(h)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("type") not in ROUTINE_RUN_EVENTS:
                out.append(rec)
        return out


# -------------------------------------------------------------------- output

class Reporter:
    """Prints each event (one line, or JSON) and runs the --on-event hook."""

    def __init__(self, source: str, judge: OnlineJudge, *, as_json: bool = False,
                 on_event: str | None = None, hook_timeout: float = 30.0, quiet: bool = False):
        self.source, self.judge, self.as_json = source, judge, as_json
        self.on_event, self.hook_timeout, self.quiet = on_event, hook_timeout, quiet
        self.events: list[dict] = []

    def emit(self, ev: dict) -> None:
        ev = {**ev, "source": self.source, "time": time.time(),
              "state": self.judge.state_line()}
        self.events.append(ev)
        if self.quiet:
            return
        if self.as_json:
            print(json.dumps(_jsonable(ev), allow_nan=False), flush=True)
        else:
            print(f"[{time.strftime('%H:%M:%S')}] step {ev['step']}  "
                  f"{ev['kind'].upper().replace('_', ' ')}: {ev['detail']}  || {ev['state']}",
                  flush=True)
        if self.on_event:
            self._hook(ev)

    def _hook(self, ev: dict) -> None:
        payload = json.dumps(_jsonable(ev), allow_nan=False)
        env = {**os.environ, "ADAMSPIKE_EVENT_JSON": payload,
               "ADAMSPIKE_EVENT_KIND": str(ev["kind"]), "ADAMSPIKE_EVENT_STEP": str(ev["step"]),
               "ADAMSPIKE_EVENT_DETAIL": str(ev["detail"]), "ADAMSPIKE_WATCH_SOURCE": self.source}
        try:
            r = subprocess.run(self.on_event, shell=True, input=payload + "\n", text=True,
                               env=env, timeout=self.hook_timeout)
            if r.returncode:
                print(f"adamspike watch: --on-event exited {r.returncode} for the "
                      f"{ev['kind']} at step {ev['step']}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print(f"adamspike watch: --on-event ran past {self.hook_timeout:g} s for the "
                  f"{ev['kind']} at step {ev['step']} (killed)", file=sys.stderr)
        except OSError as e:
            print(f"adamspike watch: --on-event failed: {e}", file=sys.stderr)


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, (np.bool_,)):
        return bool(o)
    return o


def run_event(rec: dict) -> dict:
    """A run directory's events.jsonl record as a watch event."""
    typ = str(rec.get("type"))
    step = rec.get("step")
    rest = {k: v for k, v in rec.items() if k not in ("type", "step", "time")}
    detail = ", ".join(f"{k}={v}" for k, v in list(rest.items())[:6]) or typ
    return {"kind": typ, "category": "alarm" if typ == "alarm" else "run_event",
            "step": step if step is not None else "-", "detail": detail, "record": rec}


# -------------------------------------------------------------------- the command

def watch(path: str | Path, *, params: SpikeParams = SpikeParams(), once: bool = False,
          new_only: bool = False, as_json: bool = False, on_event: str | None = None,
          hook_timeout: float = 30.0, poll: float = POLL_S, num_params: int | None = None,
          eps: float | None = None, clip: float | None = None, stop: _Stop | None = None,
          quiet: bool = False, ready: Callable[[], None] | None = None) -> list[dict]:
    """Follow PATH (a log file or a run directory) until `stop` (or its end with `once`);
    returns the events reported."""
    path = Path(path)
    stop = stop if stop is not None else _Stop()
    if path.is_dir():
        meta = read_meta(path)
        config = meta.get("config") or {}
        o = config.get("optim") or {}
        judge = OnlineJudge(params, config, num_params=num_params,
                            eps=eps if eps is not None else o.get("eps"),
                            clip=clip if clip is not None else o.get("grad_clip"))
    else:
        args = log_arguments(path) if path.is_file() else {}
        if num_params is None and args:
            num_params = num_params_from_args(args)[0]
        eps = eps if eps is not None else _num(args.get("adam_eps"))
        clip = clip if clip is not None else _num(args.get("clip_grad"))
        config = {"source": {"megatron_log": str(path)},
                  "optim": {k: v for k, v in (("eps", eps), ("grad_clip", clip)) if v}}
        judge = OnlineJudge(params, config, num_params=num_params, eps=eps, clip=clip)
    rep = Reporter(str(path), judge, as_json=as_json, on_event=on_event,
                   hook_timeout=hook_timeout, quiet=quiet)
    history_lines = _count_lines(path) if new_only and path.is_file() else 0
    if not quiet:                         # stderr: stdout stays one line (or JSON) per event
        print(f"adamspike watch: following {path} (rule: {judge.rule.describe()}; grad norm: "
              "the same on log grad norm); Ctrl-C to stop", file=sys.stderr, flush=True)
    if ready:
        ready()
    note = (lambda s: print(f"adamspike watch: {s}", file=sys.stderr, flush=True))
    if path.is_dir():
        fol = RunFollower(path)
        first = True
        while True:
            rows, recs = fol.poll()
            if first and new_only:        # what is there at start: judged, not reported
                for r in rows:
                    judge.feed(r)
                rows, recs = [], []
            first = False
            # one order for what one look found: by step, a step's row before its events
            # (an alarm logged at step s is evaluated after step s); events without a step last
            items = sorted([(int(r["step"]), 0, i) for i, r in enumerate(rows)]
                           + [(int(e["step"]) if isinstance(e.get("step"), int) else
                               math.inf, 1, j) for j, e in enumerate(recs)])
            for _, kind, k in items:
                if kind == 0:
                    for ev in judge.feed(rows[k]):
                        rep.emit(ev)
                else:
                    rep.emit(run_event(recs[k]))
            if once or stop:
                break
            time.sleep(poll)
        return rep.events
    for row in follow_log_rows(path, stop, once=once, poll=poll, on_note=note):
        evs = judge.feed(row)
        if (row.get("line") or 0) <= history_lines:
            continue                       # --new-only: judged, not reported
        for ev in evs:
            rep.emit({**ev, "line": row.get("line")})
    return rep.events


def _count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))


def _num(s: str | None) -> float | None:
    try:
        v = float(s) if s is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adamspike watch", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("path", help="a Megatron / MindSpeed training log, or a run directory")
    ap.add_argument("--on-event", metavar="CMD", help="shell command run once per event "
                    "(event JSON on stdin and in ADAMSPIKE_EVENT_JSON)")
    ap.add_argument("--on-event-timeout", type=float, default=30.0, metavar="S")
    ap.add_argument("--once", action="store_true", help="read what is there, then exit")
    ap.add_argument("--new-only", action="store_true",
                    help="judge the existing lines silently; report from the first new line")
    ap.add_argument("--json", action="store_true", help="one JSON object per event")
    ap.add_argument("--poll", type=float, default=POLL_S, help="seconds between looks")
    add_spike_flags(ap)
    ap.add_argument("--num-params", type=float, metavar="N", help="parameters (rho_bar)")
    ap.add_argument("--model", metavar="PRESET", help="adamspike.llama preset (N for rho_bar)")
    ap.add_argument("--eps", type=float, help="Adam eps of the run (rho_bar)")
    ap.add_argument("--clip", type=float, help="grad-clip threshold of the run (rho_bar)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`adamspike watch`."""
    return cli_main(_parser(), argv, _main, "adamspike watch",
                    (ConfigError, MegatronLogError, RunFormatError, ValueError))


def _main(args) -> int:
    params = SpikeParams.from_flags(args)
    check_log_flags(args)        # analysis.cli: --eps, --clip, --num-params like config fields
    if not args.poll > 0:
        raise ConfigError(f"--poll: must be > 0, got {args.poll}")
    n = int(args.num_params) if args.num_params else None
    if args.model:
        if args.model not in PRESETS:
            raise ConfigError(f"--model: unknown preset {args.model!r}; known: "
                              f"{', '.join(PRESETS)}")
        n = n or llama_num_params(PRESETS[args.model])
    path = Path(args.path)
    if path.is_dir() and not (path / "run.json").is_file():
        raise RunFormatError(f"{path}: not a run directory (no run.json)")
    stop = _Stop()

    def handler(signum, frame):   # noqa: ARG001
        stop.flag = True

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        evs = watch(path, params=params,
                    once=args.once, new_only=args.new_only, as_json=args.json,
                    on_event=args.on_event, hook_timeout=args.on_event_timeout,
                    poll=args.poll, num_params=n, eps=args.eps, clip=args.clip, stop=stop)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(f"adamspike watch: stopped; {len(evs)} event(s) reported", file=sys.stderr,
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
