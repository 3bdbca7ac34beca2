"""A Megatron-LM / MindSpeed-LLM TensorBoard log directory (`--tensorboard-dir`) as the
iteration lines of its training log, so `analyze --log DIR`, `assess DIR` and `watch DIR`
read it through the text log's own parser (adamspike.megatron_log: one set of rules for
flags, skipped steps and missing values) and get the same steps table.

Read with tensorboard's event reader (event_file_loader.EventFileLoader, the `tensorboard`
package: the optional `tensorboard` extra), incrementally: `EventTail` keeps one loader per
events file and reads only what was appended since its last look, so the offline import and
`watch` are one reader. The tags are Megatron's training_log's (megatron/training/
training.py, core_v0.12.1 a845aa7e lines 1413-1549, and main d98e8a64 lines 3376-3449 and
3564, the same names; MindSpeed-LLM's training_log keeps them): the loss dict's keys as
written (`lm loss`), `learning-rate`, `batch-size`, `loss-scale` (with
--log-loss-scale-to-tensorboard), `grad-norm` (absent on an iteration whose update was
skipped: grad_norm is None there), `num-zeros`, `params-norm`, `iteration-time` (seconds,
with --log-timers-to-tensorboard, written last), `skipped-train-samples` (data samples, not
iterations); the `... vs samples` twins are ignored. TensorBoard gets the values of each
logged iteration, not interval averages, and Megatron writes no skipped / nan iteration
counters there (the text log's `number of skipped iterations` / `number of nan iterations`
are total_loss_dict entries printed to the log only): an fp16 overflow shows only as a drop
of `loss-scale` and a missing `grad-norm` (the text log is the authority where both exist).

Rows. An iteration's scalars are written one by one (training_log writes learning-rate
first and iteration-time last), so an iteration is complete, and becomes a line, when a
later iteration's scalar is in the same events file, when a newer events file exists (a
restarted job writes a new one beside it: the old file is finished), or at the end of an
offline read. Files are read in name order (Megatron's names start with the creation
time); a restarted job's iterations that repeat earlier ones come after them, as in a
restarted job's text log, where the later line wins.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from adamspike.megatron_log import MegatronLogError

# TensorBoard tag -> the text log's field (adamspike.megatron_log parses these keys)
TAGS = {"lm loss": "lm loss", "learning-rate": "learning rate", "batch-size": "global batch size",
        "loss-scale": "loss scale", "grad-norm": "grad norm", "num-zeros": "num zeros",
        "params-norm": "params norm"}
TIME_TAG = "iteration-time"          # seconds -> "elapsed time per iteration (ms)"
EVENTS_GLOB = "events.out.tfevents.*"


def event_files(path: Path) -> list[Path]:
    return sorted((p for p in Path(path).rglob(EVENTS_GLOB) if p.is_file()),
                  key=lambda p: (p.name, str(p)))


def is_tensorboard_dir(path) -> bool:
    """A directory with event files that is not a run directory (ours keep their own
    TensorBoard scalars in RUN/tensorboard/ beside run.json)."""
    path = Path(path)
    return path.is_dir() and not (path / "run.json").exists() and bool(event_files(path))


def _loader_class():
    try:
        # lazy: tensorboard is an optional extra, needed only for TensorBoard log dirs
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util.tensor_util import make_ndarray
    except ImportError:
        raise MegatronLogError("reading a TensorBoard log dir needs the tensorboard package "
                               "(pip install -e .[tensorboard])") from None
    return EventFileLoader, make_ndarray


class EventTail:
    """The complete iterations of a TensorBoard log directory, in order, read incrementally
    (module doc: when an iteration is complete). `poll()` returns the rows completed since
    the last call, each (step, {tag: value}); `poll(final=True)` also the pending ones (the
    end of an offline read)."""

    def __init__(self, path):
        self.path = Path(path)
        self.files: dict[Path, dict] = {}   # file -> {"loader", "pending": {step: values}}
        self.max_step: int | None = None
        self.tags_seen: set[str] = set()

    def poll(self, final: bool = False) -> list[tuple[int, dict]]:
        loader_cls, make_ndarray = _loader_class()
        out: list[tuple[int, dict]] = []
        files = event_files(self.path)
        for f in files:
            st = self.files.get(f)
            if st is None:
                st = self.files[f] = {"loader": loader_cls(str(f)), "pending": {}, "done": False}
            if st["done"]:
                continue
            try:
                for ev in st["loader"].Load():
                    for v in ev.summary.value:
                        tag = v.tag
                        if tag not in TAGS and tag != TIME_TAG:
                            continue
                        if v.HasField("tensor"):
                            val = float(make_ndarray(v.tensor).item())
                        elif v.HasField("simple_value"):
                            val = float(v.simple_value)
                        else:
                            continue
                        step = int(ev.step)
                        pend = st["pending"]
                        for s in [s for s in pend if s < step]:   # a later iteration: done
                            out.append(self._done(s, pend.pop(s)))
                        pend.setdefault(step, {})[tag] = val     # a repeat in a file wins
                        self.tags_seen.add(tag)
            except MegatronLogError:
                raise
            except Exception as e:  # noqa: BLE001 - a corrupt event file: one line naming it
                raise MegatronLogError(f"{f}: cannot read the TensorBoard events "
                                       f"({type(e).__name__}: {e})") from None
            newer = f != files[-1]                 # a newer file exists: this one is finished
            if final or newer:
                pend = st["pending"]
                out += [self._done(s, pend.pop(s)) for s in sorted(pend)]
                st["done"] = newer
        return out

    def _done(self, step: int, values: dict) -> tuple[int, dict]:
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        return step, values


def iteration_line(step: int, values: dict, last: int) -> str | None:
    """The Megatron iteration line of one TensorBoard row (None without `lm loss`)."""
    if "lm loss" not in values:
        return None
    fields = [f"iteration {step:8d}/{last:8d}"]
    if TIME_TAG in values:
        fields.append(f"elapsed time per iteration (ms): {values[TIME_TAG] * 1000.0!r}")
    for tag, key in TAGS.items():
        if tag in values:
            v = values[tag]
            fields.append(f"{key}: {int(v) if tag == 'batch-size' and math.isfinite(v) else repr(v)}")
    return " | ".join(fields) + " |\n"


def tensorboard_lines(path) -> list[str]:
    """One Megatron iteration line per logged iteration with an `lm loss` scalar."""
    path = Path(path)
    tail = EventTail(path)
    rows = tail.poll(final=True)
    last = tail.max_step or 0
    lines = [ln for s, vals in rows if (ln := iteration_line(s, vals, last)) is not None]
    if not lines:
        raise MegatronLogError(f"{path}: no 'lm loss' scalars in its TensorBoard events "
                               "(found " + (", ".join(sorted(tail.tags_seen)) or "none of Megatron's tags") + ")")
    return lines


def open_tensorboard_dir(path) -> io.StringIO:
    """The directory's iteration lines as a text stream (analysis.megatron_log.open_log)."""
    return io.StringIO("".join(tensorboard_lines(path)))
