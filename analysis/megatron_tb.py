"""A Megatron-LM / MindSpeed-LLM TensorBoard log directory (`--tensorboard-dir`) as the
iteration lines of its training log, so `analyze --log DIR` / `assess DIR` read it through the
text log's own parser (adamspike.megatron_log: one set of rules for flags, skipped steps and
missing values) and get the same steps table.

Read with tensorboard's event reader (EventAccumulator, the `tensorboard` package: the
optional `tensorboard` extra). The tags are Megatron's training_log's (megatron/training/
training.py, core_v0.12.1 a845aa7e, lines 1413-1549; MindSpeed-LLM's training_log keeps them):
the loss dict's keys as written (`lm loss`), `learning-rate`, `batch-size`, `loss-scale`
(with --log-loss-scale-to-tensorboard), `grad-norm`, `num-zeros`, `params-norm`,
`iteration-time` (seconds, with --log-timers-to-tensorboard), `skipped-train-samples`; the
`... vs samples` twins are ignored. TensorBoard gets the values of each logged iteration, not
interval averages, and Megatron writes no skipped / nan iteration counters there: an fp16
overflow shows only as a drop of `loss-scale` (the text log's `number of skipped
iterations` is the authority where both exist).
"""

from __future__ import annotations

import io
from pathlib import Path

from adamspike.megatron_log import MegatronLogError

# TensorBoard tag -> the text log's field (adamspike.megatron_log parses these keys)
TAGS = {"lm loss": "lm loss", "learning-rate": "learning rate", "batch-size": "global batch size",
        "loss-scale": "loss scale", "grad-norm": "grad norm", "num-zeros": "num zeros",
        "params-norm": "params norm"}
TIME_TAG = "iteration-time"          # seconds -> "elapsed time per iteration (ms)"


def event_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("events.out.tfevents.*") if p.is_file())


def is_tensorboard_dir(path) -> bool:
    """A directory with event files that is not a run directory (ours keep their own
    TensorBoard scalars in RUN/tensorboard/ beside run.json)."""
    path = Path(path)
    return path.is_dir() and not (path / "run.json").exists() and bool(event_files(path))


def _scalars(path: Path) -> dict[str, dict[int, float]]:
    try:
        # lazy: tensorboard is an optional extra, needed only for TensorBoard log dirs
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise MegatronLogError(f"{path}: reading a TensorBoard log dir needs the tensorboard "
                               "package (pip install -e .[tensorboard])") from None
    dirs = sorted({f.parent for f in event_files(path)})
    out: dict[str, dict[int, float]] = {}
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})   # 0: keep every value
        try:
            acc.Reload()
        except Exception as e:  # noqa: BLE001 - a corrupt event file: one line naming it
            raise MegatronLogError(f"{d}: cannot read the TensorBoard events ({type(e).__name__}: {e})") from None
        for tag in acc.Tags().get("scalars", []):
            if tag in TAGS or tag == TIME_TAG:
                for ev in acc.Scalars(tag):     # a later event of the same step wins (a restart)
                    out.setdefault(tag, {})[int(ev.step)] = float(ev.value)
    return out


def tensorboard_lines(path) -> list[str]:
    """One Megatron iteration line per logged iteration of the `lm loss` tag."""
    path = Path(path)
    sc = _scalars(path)
    if "lm loss" not in sc:
        raise MegatronLogError(f"{path}: no 'lm loss' scalars in its TensorBoard events "
                               f"(found {sorted(sc) or 'none of Megatron''s tags'})")
    steps = sorted(sc["lm loss"])
    last = steps[-1]
    lines = []
    for s in steps:
        fields = [f"iteration {s:8d}/{last:8d}"]
        if s in sc.get(TIME_TAG, {}):
            fields.append(f"elapsed time per iteration (ms): {sc[TIME_TAG][s] * 1000.0!r}")
        for tag, key in TAGS.items():
            if s in sc.get(tag, {}):
                v = sc[tag][s]
                fields.append(f"{key}: {int(v) if tag == 'batch-size' else repr(v)}")
        lines.append(" | ".join(fields) + " |\n")
    return lines


def open_tensorboard_dir(path) -> io.StringIO:
    """The directory's iteration lines as a text stream (analysis.megatron_log.open_log)."""
    return io.StringIO("".join(tensorboard_lines(path)))
