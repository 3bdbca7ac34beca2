"""`adamspike watch PATH`: follow a live training job and report each spike, alarm and
numerics event as it happens (reads files only).

    adamspike watch megatron.log [--on-event CMD] [--once] [--new-only] [--json]
                    [--num-params N | --model PRESET] [--eps E] [--clip C] [--poll S]
    adamspike watch RUN_DIR ...          (a probe / trainer run directory: steps + events)
    adamspike watch TB_DIR ...           (a Megatron / MindSpeed-LLM --tensorboard-dir)

A log is followed with `tail -F` semantics: complete lines are read as they are appended;
a rotated file (renamed away, a new one created under PATH) is drained and then the new
file read from its start; a truncated file (size below the read position) is read again
from its start. Such new content is a new job when its first iteration does not continue
the last one seen (a `new_job` event: the rule starts a new history, as `analyze` of the
new file alone would); when it does (logrotate's copytruncate, a rotation mid-job) the
history is kept, and stderr says which. A restarted job that appends to the same log goes
back to an earlier iteration: the rule's state is restored to what it was before that
iteration (snapshots of the last SNAPSHOT_ROWS rows) and judging goes on from there, as the
offline import does (a repeated iteration keeps its last line). An iteration printed again
with the same values (several ranks printing training_log) is ignored, said once.
A missing file is waited for (said once); a path whose folder does not exist is an error
(exit 2). What cannot be read (PATH a directory, a link loop, a file without read
permission, an I/O error) is said once on stderr and looked at again every poll; reading
resumes when it can be read. A line longer than MAX_LINE_BYTES (1 MiB) without a newline is
dropped (said once): memory stays bounded and each byte is scanned once. `--once` on a log
it cannot read is an error in one line (exit 2).

A TensorBoard log directory (Megatron's `--tensorboard-dir`: events.out.tfevents.* files,
no run.json) is followed the same way, by the same follower: its events files are read
incrementally (analysis.megatron_tb.EventTail, the offline import's reader) and each
complete iteration becomes the text log's iteration line, so the rule, the numerics events,
restarts and episodes are the text log's. A new events file in the directory (a restarted
job) continues the stream: its iterations that repeat earlier ones rewind the rule as a
restarted job's text log does. An iteration is reported when it is complete: when the next
iteration's first scalar (or a newer events file) is on disk, i.e. one logged iteration
(and the writer's flush: Megatron's --tensorboard-queue-size) after Megatron wrote it;
`--once` reads every iteration there. TensorBoard has no skipped / nan iteration counters
(analysis.megatron_tb): an fp16 overflow is seen as its loss-scale cut.

Decisions are the offline analysis's, one row at a time: lines are parsed by the one
parser (adamspike.megatron_log.iter_megatron_log, the import's streaming parser, here one
row per chunk), the loss and the grad norm are judged by the one online rule
(adamspike.spikes: SpikeParams.resolved with the run config of an imported log, so
LOG_MIN_HISTORY; the grad norm by analysis.report.grad_norm_rule, with the rule's default
warm-up where the log, or a new job in it, starts at its job's first iterations) on the rows
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
iteration), new_job, rule (the rule changed), the Megatron probe's own log lines
(fullscale.megatron_probe: probe_skip, probe_alarm, probe_spike, probe_disabled,
probe_error; `probe_event`), and for a run directory its events.jsonl records (alarm, skip,
rollback, fault, ...; routine ones such as checkpoints are left out). A run directory's
events.jsonl is read from where the last look stopped (an idle look is a stat); a record
that is not JSON is skipped (said once).

Events come in episodes: an event opens one unless its family (one series' spikes, the
numerics events, the probe's lines, one kind of run or log event) had an event within the
last EPISODE_ROWS (10) rows of the same job; a spike's end never opens one. One fp16 overflow
cascade is one episode. `--on-event CMD` runs CMD (through the shell) once per episode, at
its first event, with that event as JSON on stdin and in the environment
(ADAMSPIKE_EVENT_JSON, ADAMSPIKE_EVENT_KIND, ADAMSPIKE_EVENT_STEP, ADAMSPIKE_EVENT_DETAIL,
ADAMSPIKE_EVENT_EPISODE, ADAMSPIKE_WATCH_SOURCE; a NUL in a value is written `\\0`). Hooks
run one at a time on a worker thread, never in the follower's way, each in its own process
group, killed after --on-event-timeout seconds; their stdout goes to stderr (stdout stays
one line per event); a failure or a kill is said once and counted at the end. Ctrl-C or
SIGTERM ends watching with exit status 0 (queued hooks get --on-event-timeout more
seconds; a second Ctrl-C skips them); `--once` reads what is there and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import signal
import stat as stat_mod
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from adamspike.config import ConfigError, check_finite_args, check_value, cli_main
from adamspike.llama import PRESETS
from adamspike.llama import num_params as llama_num_params
from adamspike.megatron_log import MegatronLogError, iter_megatron_log
import pyarrow.parquet as pq
from adamspike.rundir import RunFormatError, flushed_step, read_meta, read_plain_part
from adamspike.spikes import SpikeParams, add_spike_flags
from analysis.cli import check_log_flags
from analysis.megatron_tb import EventTail, event_files, iteration_line
from analysis.numerics import numerics_events
from analysis.regime import log_arguments, num_params_from_args, rho_bar
from analysis.report import grad_norm_rule
from theory.eps_regime import regimes

POLL_S = 0.2               # seconds between looks at a file that did not grow
READ_BYTES = 1 << 20       # one read of a followed file
MAX_LINE_BYTES = 1 << 20   # a longer line without a newline is dropped (said once)
EPISODE_ROWS = 10          # an event within this many rows of its family's last: same episode
QUEUED_HOOKS = 256         # --on-event runs waiting at most; beyond: dropped, counted
MALFORMED_SAID = 5         # malformed lines shown on stderr (the rest are not)
SNAPSHOT_ROWS = 5000       # rows whose rule state is kept for a restart's rewind
DUPLICATE_ROWS = 64        # recent iterations whose print is remembered (repeats ignored)
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


def _print_signature(row: dict) -> tuple:
    """What identifies one print of an iteration line: the same iteration printed twice
    (several ranks running training_log, or a tee) has the same values; a restarted job
    re-running it differs in some (the grad norm is left out: the parser marks a repeated
    value stale on an overflowed step)."""
    return tuple(repr(row.get(k)) for k in ("loss", "lr", "loss_scale", "consumed_samples",
                                            "num_skipped_iterations", "num_nan_iterations",
                                            "tokens"))


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
        self.num_params, self.eps, self.clip = num_params, eps, clip
        self.rows = 0                 # rows fed (episodes of events are counted in rows)
        self.duplicates = 0           # rows ignored as a second print of the same iteration
        self.new_history()

    def new_history(self) -> None:
        """Forget every judged row: a new job (analysis of its file from its start)."""
        self.rule = self.params.resolved(np.array([]), self.config)
        self.grad_rule: SpikeParams | None = None    # set at the first row (its warm-up)
        self.loss_det = self.rule.detector()
        self.grad_det = None
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
        self.printed: dict[int, tuple] = {}     # step -> _print_signature, the last few
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
        sig = _print_signature(row)
        if self.max_step is not None and step <= self.max_step and self.printed.get(step) == sig:
            self.duplicates += 1            # the same iteration printed again (two ranks)
            return out
        self.printed[step] = sig
        if len(self.printed) > DUPLICATE_ROWS:
            del self.printed[next(iter(self.printed))]
        self.rows += 1
        if self.grad_rule is None:
            self.grad_rule = grad_norm_rule(self.rule, first_step=step)
            self.grad_det = self.grad_rule.detector()
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
    """Set by SIGINT / SIGTERM (or a test): the followers return at their next look; a
    second signal also ends the wait for queued --on-event hooks."""

    def __init__(self) -> None:
        self.flag = False
        self.signals = 0

    def __bool__(self) -> bool:
        return self.flag


class _Notes:
    """stderr lines about the input, each trouble said once: `trouble(key, text)` prints
    text when it differs from what was last said under key; `clear(key, text)` says that
    the trouble is over (text) and forgets it."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.open_ = say, {}

    def trouble(self, key: str, text: str) -> None:
        if self.open_.get(key) != text:
            self.open_[key] = text
            self.say(text)

    def clear(self, key: str, text: str | None = None) -> None:
        if self.open_.pop(key, None) is not None and text:
            self.say(text)

    def once(self, key: str, text: str) -> None:
        if key not in self.open_:
            self.open_[key] = text
            self.say(text)


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class LogFollower:
    """The lines of a growing log, `tail -F` style, in segments: one per file content.
    A segment ends when the file at PATH is another one (rotated away; replaced by a
    directory, a link loop, an unreadable file) or was truncated; `new_content` then says
    which, and the next segment reads what PATH holds from its start. What cannot be read
    is said once (stderr) and looked at again every poll; a missing file is waited for.
    A line longer than MAX_LINE_BYTES without a newline is dropped (said once): the
    partial line kept in memory is bounded, and each byte is scanned once."""

    def __init__(self, path: Path, stop: _Stop, notes: _Notes, *, once: bool = False,
                 poll: float = POLL_S, tensorboard: bool = False):
        self.path, self.stop, self.notes, self.once, self.poll = path, stop, notes, once, poll
        # a TensorBoard log directory: its events files as iteration lines (module doc)
        self.tail = EventTail(path) if tensorboard else None
        self.fh = None
        self.ident: tuple | None = None
        self.new_content: str | None = None     # why the current segment is new content
        self.ended = False
        self.pieces: list[bytes] = []           # the partial line so far
        self.partial = 0
        self.dropping = False                   # inside an over-long line: skip to its end
        self.dropped_lines = 0
        self.resume: tuple | None = None        # (identity, position) after a read error

    def segments(self) -> Iterator[Iterator[str]]:
        first = True
        while not self.ended and not self.stop:
            if not first and self.once:
                return
            first = False
            yield self._lines()

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")
            ident = _identity(os.fstat(fh.fileno()))
        except FileNotFoundError:
            if self.once:
                raise MegatronLogError(f"{self.path}: log file not found") from None
            self.notes.trouble("read", f"{self.path} does not exist (yet): waiting for it")
            return False
        except OSError as e:
            if self.once:
                raise MegatronLogError(f"{self.path}: cannot read ({_why(e)})") from None
            self.notes.trouble("read", f"cannot read {self.path} ({_why(e)}): still watching; "
                                       "reading resumes when it can be read")
            return False
        self.fh, self.ident = fh, ident
        return True

    def _close(self) -> None:
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass
        self.fh = None

    def _split(self, chunk: bytes) -> Iterator[str]:
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                break
            piece = chunk[start:i]
            start = i + 1
            if self.dropping:                   # the end of an over-long line
                self.dropping = False
                continue
            if self.pieces:
                piece = b"".join(self.pieces) + piece
                self.pieces, self.partial = [], 0
            yield piece.decode("utf-8", errors="replace")
        rest = chunk[start:]
        if rest and not self.dropping:
            self.pieces.append(rest)
            self.partial += len(rest)
            if self.partial > MAX_LINE_BYTES:
                self.pieces, self.partial, self.dropping = [], 0, True
                self.dropped_lines += 1
                self.notes.once("long", f"{self.path}: a line longer than "
                                        f"{MAX_LINE_BYTES >> 20} MiB without a newline: dropped "
                                        "(said once; later ones are dropped too)")

    def _last_piece(self) -> Iterator[str]:
        """The partial line at the end of a file that will not grow any more."""
        if self.pieces and not self.dropping:
            yield b"".join(self.pieces).decode("utf-8", errors="replace")
        self.pieces, self.partial, self.dropping = [], 0, False

    def _lines(self) -> Iterator[str]:
        if self.tail is not None:
            yield from self._event_lines()
            return
        while not self.stop:
            if self.fh is None:
                if not self._open():
                    if self.once:
                        break
                    time.sleep(self.poll)
                    continue
                if self.resume is not None:     # open again after a read error
                    (ident, pos), self.resume = self.resume, None
                    if self.ident == ident and pos is not None:
                        self.fh.seek(pos)       # the same file: on from where it failed
                    else:                       # another file meanwhile: new content
                        yield from self._last_piece()
                        self.new_content = "replaced (rotated)"
                        return
            try:
                chunk = self.fh.read(READ_BYTES)
            except OSError as e:                # EIO and the like: open it again
                self.resume = (self.ident, self._tell())
                self._close()
                self.notes.trouble("read", f"cannot read {self.path} ({_why(e)}): still "
                                           "watching; reading resumes when it can be read")
                time.sleep(self.poll)
                continue
            self.notes.clear("read", f"{self.path} can be read: following it")
            if chunk:
                yield from self._split(chunk)
                continue
            if self.once:
                yield from self._last_piece()
                break
            try:
                st = os.stat(self.path)
                moved = _identity(st) != self.ident or stat_mod.S_ISDIR(st.st_mode)
            except FileNotFoundError:
                st, moved = None, False         # mid-rotation: keep the old file for now
            except OSError:
                st, moved = None, True          # a link loop, an unreadable folder: gone
            if moved:
                yield from self._last_piece()   # the old file is drained: its last line
                self._close()
                self.new_content = "replaced (rotated)"
                self.notes.say(f"{self.path} was replaced: reading the new file from its start")
                return
            if st is not None and st.st_size < (self._tell() or 0):
                self.fh.seek(0)
                self.pieces, self.partial, self.dropping = [], 0, False
                self.new_content = "truncated"
                self.notes.say(f"{self.path} was truncated: reading it again from its start")
                return
            time.sleep(self.poll)
        self._close()
        self.ended = True

    def _event_lines(self) -> Iterator[str]:
        """A TensorBoard log directory's complete iterations as iteration lines, one
        segment: a new events file continues the stream (a restart rewinds the rule)."""
        while not self.stop:
            try:
                if not self.path.is_dir():
                    raise FileNotFoundError(2, "no such directory")
                rows = self.tail.poll(final=self.once)
                if not rows and not event_files(self.path):
                    self.notes.trouble("read", f"{self.path}: no TensorBoard events file "
                                               "(yet): waiting for one")
                else:
                    self.notes.clear("read", f"{self.path}: reading its TensorBoard events")
            except MegatronLogError as e:
                if self.once:
                    raise
                self.notes.trouble("read", f"{e}: still watching")
                rows = []
            except OSError as e:
                if self.once:
                    raise MegatronLogError(f"{self.path}: cannot read ({_why(e)})") from None
                self.notes.trouble("read", f"cannot read {self.path} ({_why(e)}): still "
                                           "watching; reading resumes when it can be read")
                rows = []
            last = self.tail.max_step or 0
            for step, values in rows:
                line = iteration_line(step, values, last)
                if line is not None:
                    yield line.rstrip("\n")
            if self.once:
                break
            time.sleep(self.poll)
        self.ended = True

    def _tell(self) -> int | None:
        try:
            return self.fh.tell()
        except (OSError, ValueError):
            return None


_PROBE_RE = re.compile(r"adamspike probe: (.*?)\s*$")
_PROBE_STEP_RE = re.compile(r"step (\d+): (.*)$")
_PROBE_DISABLED_RE = re.compile(r"disabled on every rank at step (\d+)")


def probe_event(line: str) -> dict | None:
    """The event a line of the Megatron probe (fullscale.megatron_probe, `_say`) reports,
    or None: `step N: ALARM ...` (probe_alarm), `step N: ...: optimizer update skipped on
    every rank ...` (probe_skip), `step N: <rule> spike ... (none: ...)` (probe_spike: a
    rule fired, no action), `disabled on every rank at step N ...` (probe_disabled), `not
    started` / `not installed` / `closing the run directory failed` (probe_error). Its
    start-up line (`on, run directory ...`) is no event."""
    m = _PROBE_RE.search(line)
    if not m:
        return None
    msg = m.group(1)
    sm = _PROBE_STEP_RE.match(msg)
    if sm:
        what = sm.group(2)
        kind = ("probe_alarm" if what.startswith("ALARM") else
                "probe_skip" if "optimizer update skipped on every rank" in what else
                "probe_spike")
        return {"kind": kind, "category": "probe", "step": int(sm.group(1)), "detail": what}
    dm = _PROBE_DISABLED_RE.match(msg)
    if dm:
        return {"kind": "probe_disabled", "category": "probe", "step": int(dm.group(1)),
                "detail": msg}
    if msg.startswith(("not started", "not installed", "closing the run directory failed")):
        return {"kind": "probe_error", "category": "probe", "step": "-", "detail": msg}
    return None


class RunFollower:
    """New steps rows and events of a run directory being written (module doc of
    adamspike.rundir: parts appear atomically; a live writer's flushed.json bounds the
    rows that are complete; a resume truncates rows and events beyond its checkpoint and
    may reuse a part's name). events.jsonl is read from where the last look stopped: an
    idle look is one stat, whatever the file's size; a rewrite (a resume's atomic
    truncation: another file) or a truncation is read again from its start, the records
    already reported left out."""

    def __init__(self, path: Path, notes: _Notes | None = None):
        self.path = path
        self.notes = notes or _Notes(lambda s: None)
        self.parts: dict[str, tuple] = {}          # name -> (signature, steps consumed)
        self.waiting: set[str] = set()             # parts with rows beyond flushed.json
        self.events_seen: set[int] = set()         # hashes of the records read
        self.ev_ident: tuple | None = None         # events.jsonl: (dev, ino),
        self.ev_offset = 0                         # bytes consumed (complete lines),
        self.ev_size = -1                          # and its size at the last look
        self.bad_records = 0

    def poll(self) -> tuple[list[dict], list[dict]]:
        """(new steps rows by step, new non-routine events); what cannot be read is said
        once and looked at again next time."""
        # events first: a writer flushes step s's rows before it logs an event it raised
        # after them, so an event read here has its rows in the parts read next (read the
        # other way round, a flush landing between the two reads put the event first)
        got, failed = [], None
        for read in (self._events, self._rows):  # what one read consumed is kept
            try:
                got.append(read())
            except OSError as e:
                got.append([])
                failed = failed or e
        if failed is not None:
            self.notes.trouble("run", f"cannot read the run directory {self.path} "
                                      f"({_why(failed)}): still watching")
        else:
            self.notes.clear("run", f"{self.path} can be read again: following it")
        events, rows = got
        return rows, events

    def _rows(self) -> list[dict]:
        try:
            upto = flushed_step(self.path)
        except (RunFormatError, ValueError):
            upto = None
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
                steps = [int(s) for s in df["step"]]
            except Exception as e:  # noqa: BLE001 - a torn / foreign part: looked at again
                self.notes.trouble(f"part:{p.name}", f"cannot read {p} ({type(e).__name__}): "
                                                     "skipped until it changes")
                self.parts[p.name] = (sig, done)
                continue
            self.notes.clear(f"part:{p.name}")
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
        return fresh

    def _events(self) -> list[dict]:
        p = self.path / "events.jsonl"
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return []
        ident = _identity(st)
        if ident == self.ev_ident and st.st_size == self.ev_size:
            return []                                    # idle: nothing new
        if ident != self.ev_ident or st.st_size < self.ev_offset:
            self.ev_offset = 0                           # another file, or cut: from its start
        out = []
        with open(p, "rb") as fh:
            if stat_mod.S_ISDIR(os.fstat(fh.fileno()).st_mode):
                raise IsADirectoryError(21, "events.jsonl is a directory")
            fh.seek(self.ev_offset)
            while True:
                try:
                    data = fh.read(READ_BYTES)
                except OSError:
                    if out:                              # keep what was consumed; the
                        return out                       # error shows at the next look
                    raise
                if not data:
                    break
                end = data.rfind(b"\n")
                if end < 0:
                    if len(data) >= READ_BYTES:          # a record without an end: skip it
                        self.notes.once("ev-long", f"{p}: a record longer than "
                                                   f"{READ_BYTES >> 20} MiB: skipped")
                        self.ev_offset += len(data)
                        continue
                    break                                # the last piece may be half written
                for line in data[:end].split(b"\n"):
                    out += self._record(line)
                self.ev_offset += end + 1
                fh.seek(self.ev_offset)
        self.ev_ident, self.ev_size = ident, st.st_size
        return out

    def _record(self, line: bytes) -> list[dict]:
        h = hash(line)
        if h in self.events_seen or not line.strip():
            return []
        self.events_seen.add(h)
        try:
            rec = json.loads(line.decode("utf-8", errors="replace"))
        except (json.JSONDecodeError, RecursionError):
            self.bad_records += 1
            self.notes.once("ev-bad", f"{self.path / 'events.jsonl'}: a record that is not "
                                      "JSON (torn or damaged) is skipped (said once)")
            return []
        if isinstance(rec, dict) and str(rec.get("type")) not in ROUTINE_RUN_EVENTS:
            return [rec]
        return []


# -------------------------------------------------------------------- output

def _family(ev: dict) -> str:
    """What an episode groups: one series' spikes, the numerics events (one fp16 overflow
    cascade is many of them), the probe's lines, one kind of run event or log event."""
    if ev["category"] == "spike":
        return str(ev.get("series", ev["kind"]))
    if ev["category"] in ("numerics", "probe"):
        return ev["category"]
    return str(ev["kind"])


class HookRunner:
    """Runs the --on-event command for each episode on a worker thread (the follower
    never waits for it), one at a time, in its own process group, killed after `timeout`
    seconds. Failures are said once and counted; a queue of QUEUED_HOOKS bounds the
    backlog (beyond it hooks are dropped and counted)."""

    def __init__(self, cmd: str, timeout: float, notes: _Notes):
        self.cmd, self.timeout, self.notes = cmd, timeout, notes
        self.q: queue.Queue = queue.Queue(maxsize=QUEUED_HOOKS)
        self.counts = {"run": 0, "failed": 0, "killed": 0, "dropped": 0, "not_run": 0}
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._work, name="on-event", daemon=True)
        self.thread.start()

    def submit(self, payload: str, env: dict) -> None:
        try:
            self.q.put_nowait((payload, env))
        except queue.Full:
            self.counts["dropped"] += 1
            self.notes.once("hook-full", f"--on-event: {QUEUED_HOOKS} hooks waiting; further "
                                         "ones are dropped (counted at the end)")

    def _work(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                self._run(*item)
            except Exception as e:  # noqa: BLE001 - the hook must never end watching
                self.counts["failed"] += 1
                self.notes.once("hook-error", f"--on-event could not run: {e}")
            finally:
                self.q.task_done()

    def _run(self, payload: str, env: dict) -> None:
        try:
            out = sys.stderr.fileno()           # stdout stays one line (or JSON) per event
        except (AttributeError, OSError, ValueError):
            out = None
        self.proc = proc = subprocess.Popen(self.cmd, shell=True, stdin=subprocess.PIPE,
                                            stdout=out, env=env, start_new_session=True)
        self.counts["run"] += 1
        try:
            proc.communicate(payload.encode() + b"\n", timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            self.counts["killed"] += 1
            self.notes.once("hook-killed", f"--on-event ran past {self.timeout:g} s: killed "
                                           "(said once; counted at the end)")
            return
        finally:
            self.proc = None
        if proc.returncode:
            self.counts["failed"] += 1
            self.notes.once("hook-failed", f"--on-event exited {proc.returncode} (said once; "
                                           "counted at the end)")

    def close(self, wait_s: float, give_up: Callable[[], bool] = lambda: False) -> dict:
        """Let the queued hooks run for up to wait_s seconds (or until give_up()), then
        kill what is left."""
        deadline = time.monotonic() + wait_s
        if self.q.unfinished_tasks:
            self.notes.say(f"waiting up to {wait_s:g} s for {self.q.unfinished_tasks} "
                           "--on-event hook(s) (a second Ctrl-C skips them)")
        while self.q.unfinished_tasks and time.monotonic() < deadline and not give_up():
            time.sleep(0.02)
        while True:
            try:
                self.q.get_nowait()
                self.q.task_done()
                self.counts["not_run"] += 1
            except queue.Empty:
                break
        if self.proc is not None:
            _kill_group(self.proc)
        self.q.put(None)
        self.thread.join(5)
        return self.counts


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _env_safe(s: Any) -> str:
    return str(s).replace("\x00", "\\0")       # a NUL cannot be in the environment


class OutputClosed(Exception):
    """stdout's reader has gone: watching ends (exit 0, as `tail -f | head` does)."""


class Reporter:
    """Prints each event (one line, or JSON) and runs the --on-event hook once per
    episode: an event opens an episode of its family (_family) unless that family had an
    event in the last EPISODE_ROWS rows of the same job; a spike's end never opens one.
    Events carry their episode's number."""

    def __init__(self, source: str, judge: OnlineJudge, *, as_json: bool = False,
                 on_event: str | None = None, hook_timeout: float = 30.0, quiet: bool = False,
                 notes: _Notes | None = None):
        self.source, self.judge, self.as_json = source, judge, as_json
        self.on_event, self.hook_timeout, self.quiet = on_event, hook_timeout, quiet
        self.notes = notes or _Notes(lambda s: print(f"adamspike watch: {s}", file=sys.stderr,
                                                     flush=True))
        self.events: list[dict] = []
        self.episodes = 0
        self.open_: dict[str, tuple[int, int, int]] = {}  # family -> (episode, row, job)
        self.job = 0                                      # new_history calls so far
        self.hooks = HookRunner(on_event, hook_timeout, self.notes) if on_event else None

    def _episode(self, ev: dict) -> tuple[int, bool]:
        fam, row = _family(ev), self.judge.rows
        cur = self.open_.get(fam)
        joins = cur is not None and cur[2] == self.job and (
            ev["kind"].endswith("_end") or row - cur[1] <= EPISODE_ROWS)
        if joins:
            self.open_[fam] = (cur[0], row, self.job)
            return cur[0], False
        self.episodes += 1
        self.open_[fam] = (self.episodes, row, self.job)
        return self.episodes, True

    def emit(self, ev: dict) -> None:
        episode, opens = self._episode(ev)
        ev = {**ev, "source": self.source, "time": time.time(), "episode": episode,
              "state": self.judge.state_line()}
        self.events.append(ev)
        try:
            if self.quiet:                # nothing printed; hooks still run
                pass
            elif self.as_json:
                print(json.dumps(_jsonable(ev), allow_nan=False), flush=True)
            else:
                print(f"[{time.strftime('%H:%M:%S')}] step {ev['step']}  "
                      f"{ev['kind'].upper().replace('_', ' ')}: {ev['detail']}  || "
                      f"{ev['state']}", flush=True)
        except BrokenPipeError:           # `watch LOG | head -1`: the reader has gone
            raise OutputClosed from None
        if self.hooks is not None and opens:
            payload = json.dumps(_jsonable(ev), allow_nan=False)
            env = {**os.environ, "ADAMSPIKE_EVENT_JSON": payload,
                   "ADAMSPIKE_EVENT_KIND": ev["kind"], "ADAMSPIKE_EVENT_STEP": ev["step"],
                   "ADAMSPIKE_EVENT_DETAIL": ev["detail"], "ADAMSPIKE_EVENT_EPISODE": episode,
                   "ADAMSPIKE_WATCH_SOURCE": self.source}
            self.hooks.submit(payload, {k: _env_safe(v) for k, v in env.items()})

    def close(self, give_up: Callable[[], bool] = lambda: False) -> dict | None:
        return (self.hooks.close(self.hook_timeout + 1.0, give_up) if self.hooks is not None
                else None)


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if o is None or isinstance(o, (str, int, bool)):
        return o
    return str(o)


def run_event(rec: dict) -> dict:
    """A run directory's events.jsonl record as a watch event."""
    typ = str(rec.get("type"))
    step = rec.get("step")
    rest = {k: v for k, v in rec.items() if k not in ("type", "step", "time")}
    detail = ", ".join(f"{k}={v}" for k, v in list(rest.items())[:6]) or typ
    return {"kind": typ, "category": "alarm" if typ == "alarm" else "run_event",
            "step": step if isinstance(step, int) else "-", "detail": detail, "record": rec}


# -------------------------------------------------------------------- the command

def _kind(path: Path) -> str:
    """'dir', 'file', 'missing', 'no-folder' (its folder does not exist) or 'other'
    (exists but cannot be told: a link loop, an unreadable folder)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing" if os.path.isdir(path.absolute().parent) else "no-folder"
    except OSError:
        return "other"
    return "dir" if stat_mod.S_ISDIR(st.st_mode) else "file"


def watch(path: str | Path, *, params: SpikeParams = SpikeParams(), once: bool = False,
          new_only: bool = False, as_json: bool = False, on_event: str | None = None,
          hook_timeout: float = 30.0, poll: float = POLL_S, num_params: int | None = None,
          eps: float | None = None, clip: float | None = None, stop: _Stop | None = None,
          quiet: bool = False, ready: Callable[[], None] | None = None,
          summary: dict | None = None) -> list[dict]:
    """Follow PATH (a log file or a run directory) until `stop` (or its end with `once`);
    returns the events reported (`summary`, a dict, gets the hook counts and episodes)."""
    path = Path(path)
    stop = stop if stop is not None else _Stop()
    kind = _kind(path)
    if kind == "no-folder":
        raise MegatronLogError(f"{path}: its folder {path.absolute().parent} does not exist")
    tensorboard = kind == "dir" and not (path / "run.json").exists()
    if once and kind != "dir":            # nothing to follow: an error in one line
        try:
            open(path, "rb").close()
        except FileNotFoundError:
            raise MegatronLogError(f"{path}: log file not found") from None
        except OSError as e:
            raise MegatronLogError(f"{path}: cannot read ({_why(e)})") from None
    say = ((lambda s: None) if quiet else
           (lambda s: print(f"adamspike watch: {s}", file=sys.stderr, flush=True)))
    notes = _Notes(say)
    if kind == "dir" and not tensorboard:
        meta = read_meta(path)
        config = meta.get("config") or {}
        o = config.get("optim") or {}
        judge = OnlineJudge(params, config, num_params=num_params,
                            eps=eps if eps is not None else o.get("eps"),
                            clip=clip if clip is not None else o.get("grad_clip"))
    else:
        args = log_arguments(path) if kind == "file" else {}
        if num_params is None and args:
            num_params = num_params_from_args(args)[0]
        eps = eps if eps is not None else _num(args.get("adam_eps"))
        clip = clip if clip is not None else _num(args.get("clip_grad"))
        config = {"source": {"megatron_log": str(path)},
                  "optim": {k: v for k, v in (("eps", eps), ("grad_clip", clip)) if v}}
        judge = OnlineJudge(params, config, num_params=num_params, eps=eps, clip=clip)
    rep = Reporter(str(path), judge, as_json=as_json, on_event=on_event,
                   hook_timeout=hook_timeout, quiet=quiet, notes=notes)
    say(f"following {path}"
        + (" as a TensorBoard log directory (an iteration is reported once the next one's "
           "first scalar is written)" if tensorboard else "")
        + f" (rule: {judge.rule.describe()}; grad norm: the same on log grad norm); Ctrl-C "
        "to stop")        # stderr: stdout stays one line (or JSON) per event
    if ready:
        ready()
    try:
        if kind == "dir" and not tensorboard:
            _follow_run(path, judge, rep, notes, stop, once=once, new_only=new_only, poll=poll)
        else:
            _follow_log(path, judge, rep, notes, stop, once=once, new_only=new_only, poll=poll,
                        tensorboard=tensorboard)
    except OutputClosed:
        say("stdout was closed: stopped")
        try:                              # no second BrokenPipeError at the exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    finally:
        counts = rep.close(lambda: stop.signals >= 2)
    if summary is not None:
        summary.update(episodes=rep.episodes, hooks=counts, duplicates=judge.duplicates)
    if counts and any(counts[k] for k in ("failed", "killed", "dropped", "not_run")):
        say("--on-event: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()))
    return rep.events


def _follow_run(path: Path, judge: OnlineJudge, rep: Reporter, notes: _Notes, stop: _Stop, *,
                once: bool, new_only: bool, poll: float) -> None:
    fol = RunFollower(path, notes)
    first = True
    while True:
        rows, recs = fol.poll()
        if first and new_only:            # what is there at start: judged, not reported
            for r in rows:
                _judged(judge, r, notes)
            rows, recs = [], []
        first = False
        # one order for what one look found: by step, a step's row before its events
        # (an alarm logged at step s is evaluated after step s); events without a step last
        items = sorted([(int(r["step"]), 0, i) for i, r in enumerate(rows)]
                       + [(e["step"] if isinstance(e.get("step"), int) else math.inf, 1, j)
                          for j, e in enumerate(recs)])
        for _, kind, k in items:
            if kind == 0:
                for ev in _judged(judge, rows[k], notes):
                    rep.emit(ev)
            else:
                rep.emit(run_event(recs[k]))
        if once or stop:
            return
        time.sleep(poll)


def _follow_log(path: Path, judge: OnlineJudge, rep: Reporter, notes: _Notes, stop: _Stop, *,
                once: bool, new_only: bool, poll: float, tensorboard: bool = False) -> None:
    """The log, one segment (file content) at a time, each through its own parser: a new
    content whose first iteration does not continue the job seen so far is a new job. A
    TensorBoard log directory is one segment of iteration lines (LogFollower)."""
    history_lines = 0
    if new_only:
        try:
            history_lines = (len(EventTail(path).poll()) if tensorboard else
                             _count_lines(path))
        except (OSError, MegatronLogError):
            pass
    fol = LogFollower(path, stop, notes, once=once, poll=poll, tensorboard=tensorboard)
    malformed_said = 0
    for seg, lines in enumerate(fol.segments()):
        new_content = fol.new_content if seg else None
        quiet_upto = history_lines if seg == 0 else 0
        counter = [0]

        def scan(lines=lines, counter=counter, quiet_upto=quiet_upto):
            for ln in lines:
                counter[0] += 1
                if "adamspike probe:" in ln:
                    ev = probe_event(ln)
                    if ev is not None and counter[0] > quiet_upto:
                        rep.emit({**ev, "line": counter[0]})
                    elif ev is None and "adamspike probe: on, run directory" in ln:
                        notes.once("probe-on", "the job runs the adamspike probe ("
                                   + ln.split("adamspike probe: ", 1)[1].strip()[:200]
                                   + "): watch its run directory for its telemetry")
                yield ln

        try:
            for ch in iter_megatron_log(scan(), source=str(path), chunk_rows=1):
                for ex in ch.malformed_examples:
                    malformed_said += 1
                    if malformed_said <= MALFORMED_SAID:
                        notes.say(f"malformed line {ex['line']}: {ex['reason']}"
                                  + ("" if malformed_said < MALFORMED_SAID else
                                     " (further malformed lines are not shown)"))
                for row in ch.rows:
                    if new_content is not None:
                        _new_content(path, judge, rep, notes, new_content, int(row["step"]))
                        new_content = None
                    dup = judge.duplicates
                    evs = _judged(judge, row, notes)
                    if judge.duplicates > dup:
                        notes.once("dup", f"iteration {row['step']} printed again with the "
                                          "same values (several ranks print training_log?): "
                                          "repeated lines are ignored")
                    if (row.get("line") or 0) <= quiet_upto:
                        continue                 # --new-only: judged, not reported
                    for ev in evs:
                        rep.emit({**ev, "line": row.get("line")})
        except MegatronLogError:
            if once and seg == 0:
                raise
            # no iteration line in this segment (yet): nothing to judge


def _judged(judge: OnlineJudge, row: dict, notes: _Notes) -> list[dict]:
    """judge.feed(row); a row it cannot judge (a value no parser should give) is said
    once and left out: watching goes on."""
    try:
        return judge.feed(row)
    except (ArithmeticError, TypeError, ValueError, KeyError) as e:
        notes.once("judge", f"iteration {row.get('step')} could not be judged "
                            f"({type(e).__name__}: {e}); left out (said once)")
        return []


def _new_content(path: Path, judge: OnlineJudge, rep: Reporter, notes: _Notes, why: str,
                 step: int) -> None:
    """The first iteration of a rotated-in or truncated file: the same job goes on when it
    continues the last iteration seen; otherwise it is a new job and a new history."""
    last = judge.max_step
    if last is None:
        return
    if step > last:
        notes.say(f"{path} ({why}): its first iteration {step} continues the job "
                  f"(last {last}): the rule keeps its history")
        return
    judge.new_history()
    rep.job += 1
    rep.emit({"kind": "new_job", "category": "log", "step": step,
              "detail": f"{path} was {why} and its first iteration ({step}) does not continue "
                        f"the job's last ({last}): a new job; the rule starts a new history "
                        f"(the loss judged once {judge.rule.history} earlier value(s) exist)"})


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
    ap.add_argument("path", help="a Megatron / MindSpeed training log, its TensorBoard log "
                    "directory (--tensorboard-dir), or a run directory")
    ap.add_argument("--on-event", metavar="CMD", help="shell command run once per episode "
                    "of events, beside watching (the episode's first event as JSON on stdin "
                    "and in ADAMSPIKE_EVENT_JSON)")
    ap.add_argument("--on-event-timeout", type=float, default=30.0, metavar="S",
                    help="kill a hook still running after S seconds (default 30)")
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
    check_finite_args(args)
    check_log_flags(args)        # analysis.cli: --eps, --clip, --num-params like config fields
    for flag in ("poll", "on_event_timeout"):
        if getattr(args, flag) is not None:
            check_value("--" + flag.replace("_", "-"), getattr(args, flag), float, lo=0.0,
                        lo_open=True)
    n = int(args.num_params) if args.num_params else None
    if args.model:
        if args.model not in PRESETS:
            raise ConfigError(f"--model: unknown preset {args.model!r}; known: "
                              f"{', '.join(PRESETS)}")
        n = n or llama_num_params(PRESETS[args.model])
    path = Path(args.path)
    if _kind(path) == "dir" and not (path / "run.json").is_file() and not event_files(path):
        raise RunFormatError(f"{path}: neither a run directory (no run.json) nor a "
                             "TensorBoard log directory (no events.out.tfevents.* file)")
    stop = _Stop()

    def handler(signum, frame):   # noqa: ARG001
        stop.flag = True
        stop.signals += 1

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    summary: dict = {}
    try:
        evs = watch(path, params=params,
                    once=args.once, new_only=args.new_only, as_json=args.json,
                    on_event=args.on_event, hook_timeout=args.on_event_timeout,
                    poll=args.poll, num_params=n, eps=args.eps, clip=args.clip, stop=stop,
                    summary=summary)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    hooks = summary.get("hooks")
    print(f"adamspike watch: stopped; {len(evs)} event(s) reported in "
          f"{summary.get('episodes', 0)} episode(s)"
          + (f", {hooks['run']} --on-event run(s)" if hooks else ""), file=sys.stderr,
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
