"""Parse Megatron-LM / ModelLink / MindSpeed-LLM / AscendSpeed training logs into the steps
schema (adamspike.rundir.STEP_COLUMNS); analysis.megatron_log writes them as run directories
and exports runs as logs.

`training_log` prints one line per `--log-interval` iterations (last rank only):

    [2024-05-01 10:00:00.123456] iteration      100/   10000 | consumed samples: 102400 |
      elapsed time per iteration (ms): 15234.5 | learning rate: 1.500000E-04 |
      global batch size:  1024 | lm loss: 2.345678E+00 | loss scale: 1.0 |
      grad norm: 0.812 | number of skipped iterations:   0 | number of nan iterations:   0 |

(one physical line). The timestamp prefix is optional (with or without microseconds), fields
are ` key: value |` in any order, unknown keys are accepted (numeric ones kept as columns),
AscendSpeed adds `consumed tokens`, `actual seqlen`, `samples per second`, `TFLOPs`. Losses
and the skipped / nan counters are per log interval (Megatron resets them after printing),
so with log-interval > 1 each row is an interval average and is flagged `interval_avg`.
Skipped iterations (an fp16 loss-scale overflow: the optimizer step is not applied) are
flagged `skipped`; an interval whose iterations were all skipped has no loss value (NaN:
Megatron-LM main prints it as `lm loss: 0.000000E+00`, MindSpeed-LLM and older Megatron
omit it, and no grad norm is printed), which `analyze` does not count as a spike.
Missing is missing: values a framework prints when it did not measure become NaN with a
flag, never data: a line without the loss field (`loss_missing`), `grad norm: 0.000`
(DeepSpeed's pipeline engine; below the print resolution at best), a grad norm equal to the
previous line's on a step with overflow evidence (stale; `grad_norm_stale`), both flagged
`grad_norm_missing`, and `loss scale: -1.0` (any loss scale <= 0); adamspike.spikes
.valued_rows leaves the flagged rows out of the spike rule, and the counts are in the stats.
DeepSpeed's fp16 `OVERFLOW! ... Skipping step` lines are counted on the iteration line that
follows them (`overflow_lines`; the step is `skipped`).
`iter_megatron_log` streams a log as LogChunks of bounded size (analysis.megatron_log
imports them one parquet part at a time); `parse_megatron_log` collects them.
MindSpeed-LLM's value-less field (`fix-router or fix-sub-seq-length is set, current loss
is not reliable, only for test |`) becomes the boolean column `loss_unreliable`.
Validation lines (`validation loss at iteration N | lm loss value: X | lm loss PPL: Y |`,
`validation-0 loss at ...` / `validation-NAME loss at ...` for several validation sets,
`... at iteration N on validation set |` / `on test set`, `... at the end of training for
val data |`, AscendSpeed's `... at the end of training and after model cleaning for val
data |`) go to a separate frame (step, split, dataset, name, value, ppl). Any line that looks like an iteration or validation line but does
not parse (truncated, a field without ': ', a non-numeric value of a known key) is counted
and reported with its line number and reason, never silently dropped. A repeated iteration
(a restarted job appending to the same log: a step not above the largest so far) keeps the
last occurrence and is counted.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections import Counter
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd

from adamspike.rundir import STEP_COLUMNS


class MegatronLogError(ValueError):
    """The log cannot be imported (missing, unreadable, no iteration lines)."""


KNOWN_KEYS = {
    "consumed samples": "consumed_samples",
    "skipped samples": "skipped_samples",
    "consumed tokens": "consumed_tokens",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "elapsed time per iteration (s)": "elapsed_s",
    "throughput per gpu (tflop/s/gpu)": "tflops",
    "tflops": "tflops",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "num_skipped_iterations",
    "number of nan iterations": "num_nan_iterations",
    "actual seqlen": "actual_seqlen",
    "samples per second": "samples_per_s",
}
_ITER_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_ITER_HINT = re.compile(r"\biteration\s+\d+\s*(/|\|)")  # also catches cut-off lines
# ` validation loss at iteration N | `, with several validation sets ` validation-0 loss at `
# / ` validation-NAME loss at ` (Megatron-LM --multiple-validation-sets, named by
# --validation-set-names), after training ` ... at iteration N on validation set | ` (or
# `on test set`), Megatron-LM before 2024 / AscendSpeed ` ... at the end of training for
# val data | `, AscendSpeed with compression training ` ... at the end of training and
# after model cleaning for val data | `
# GPT-NeoX (megatron/training.py evaluate_and_print_results): ` validation results at
# iteration N | lm_loss value: X | lm_loss_ppl value: Y | `, after training `... results at
# the end of training for val data | `
_VALID_RE = re.compile(r"validation(?:-(\S+?))? (?:loss|results) at (?:iteration\s+(\d+)(?:\s+on\s+([\w ]+?))?|"
                       r"the end of training(?: and after model cleaning)? for (\w+) data)\s*\|")
_VALID_HINT = re.compile(r"validation\S* (?:loss|results) at")
# fields without a value that a complete iteration line may carry: text -> boolean column
FLAG_FIELDS = {
    # MindSpeed-LLM training_log with --fix-router or --fix-sub-seq-length
    "fix-router or fix-sub-seq-length is set, current loss is not reliable, only for test":
        "loss_unreliable",
}
FLAG_COLUMNS = tuple(FLAG_FIELDS.values())
NOT_LOSSES = {*KNOWN_KEYS.values(), *FLAG_COLUMNS}   # columns named loss_* that are no loss
_TS_RE = re.compile(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\]")


@dataclass
class ParsedLog:
    steps: pd.DataFrame           # STEP_COLUMNS + extra columns, one row per logged iteration
    validation: pd.DataFrame      # step, split, name, value, ppl
    stats: dict[str, Any] = field(default_factory=dict)


def _column_name(key: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", key.lower()).strip("_")


_KEY_COLUMNS: dict[str, tuple[str, bool]] = {}   # field key -> (column, value required)


def _key_column(key: str) -> tuple[str, bool]:
    """The column of a field key (known keys, `... loss` keys -> loss_*, others by name)
    and whether its value must be numeric; memoised (a log repeats a few dozen keys)."""
    got = _KEY_COLUMNS.get(key)
    if got is None:
        low = key.lower()
        if low in KNOWN_KEYS:
            got = (KNOWN_KEYS[low], True)
        elif low.endswith("loss"):
            got = ("loss_" + (_column_name(key[:-4]) or "total"), True)
        else:
            got = (_column_name(key), False)
        if len(_KEY_COLUMNS) < 10_000:
            _KEY_COLUMNS[key] = got
    return got


def _parse_fields(parts: list[str], lineno: int) -> tuple[dict[str, float], str | None]:
    """`key: value` parts -> {column: float}; the reason if one part is malformed."""
    out: dict[str, float] = {}
    for part in parts:
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.rpartition(": ")
        if not sep:
            key, sep, val = part.rpartition(":")
        if part in FLAG_FIELDS:
            out[FLAG_FIELDS[part]] = True
            continue
        key = key.strip()
        if not sep or not key:
            return out, f"field without 'key: value': {part[:60]!r}"
        column, required = _key_column(key)
        try:
            out[column] = float(val)
        except ValueError:
            if required:
                return out, f"non-numeric value for {key!r}: {val.strip()[:40]!r}"
            # unknown, non-numeric field (e.g. an ETA string): not a column
    return out, None


def _timestamp(prefix: str) -> float | None:
    m = _TS_RE.search(prefix)
    if not m:
        return None
    s = m.group(1)
    try:
        t = _dt.datetime.fromisoformat(s)        # C parser; strptime is ~10x slower
    except ValueError:
        fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in s else "%Y-%m-%d %H:%M:%S"
        t = _dt.datetime.strptime(s, fmt)
    return t.replace(tzinfo=_dt.timezone.utc).timestamp()


def _parse_iteration(line: str, lineno: int) -> tuple[dict | None, str | None]:
    m = _ITER_RE.search(line)
    if not m:
        return None, "truncated or malformed 'iteration N/ M |' field"
    row: dict[str, Any] = {"step": int(m.group(1)), "train_iters": int(m.group(2))}
    try:
        ts = _timestamp(line[:m.start()])
    except ValueError as e:
        return None, f"bad timestamp ({e})"
    row["timestamp"] = math.nan if ts is None else ts
    rest = line[m.end():].rstrip()
    parts = rest.split("|")
    tail = parts[-1].strip()
    if tail:
        # Megatron closes every field with ' |' and ends with the nan-iterations counter; an
        # open last field is a cut-off line unless it is an extra after a complete line
        key = tail.partition(":")[0].strip().lower()
        complete = "number of nan iterations" in line.lower()
        if (not complete or ":" not in tail or key in KNOWN_KEYS or key.endswith("loss")):
            return None, f"truncated line (last field {tail[:40]!r} not closed by '|')"
    fields, why = _parse_fields(parts, lineno)
    if why:
        return None, why
    row.update(fields)
    return row, None


def _parse_validation(line: str, m: re.Match) -> tuple[list[dict], str | None]:
    step = int(m.group(2)) if m.group(2) else -1
    split = (m.group(3) or m.group(4) or "validation").strip()
    dataset = m.group(1) or ""
    rows: dict[str, dict] = {}
    rest = line[m.end():].rstrip()
    parts = rest.split("|")
    if parts[-1].strip():
        return [], f"truncated validation line (last field {parts[-1].strip()[:40]!r})"
    for part in parts:
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.rpartition(": ")
        if not sep:
            return [], f"field without 'key: value': {part[:60]!r}"
        key = key.strip()
        try:
            num = float(val)
        except ValueError:
            return [], f"non-numeric value for {key!r}: {val.strip()[:40]!r}"
        if key.endswith("_ppl value"):               # GPT-NeoX: lm_loss_ppl value
            rows.setdefault(key[:-10], {})["ppl"] = num
        elif key.endswith(" value"):
            rows.setdefault(key[:-6], {})["value"] = num
        elif key.endswith(" PPL"):
            rows.setdefault(key[:-4], {})["ppl"] = num
        else:
            rows.setdefault(key, {})["value"] = num
    if not rows:
        return [], "validation line without values"
    return [{"step": step, "split": split, "dataset": dataset, "name": k,
             "value": v.get("value", math.nan), "ppl": v.get("ppl", math.nan)}
            for k, v in rows.items()], None


# DeepSpeed's fp16 optimizers (ZeRO stage_1_and_2.py, fused / unfused fp16) on an overflow:
#   [...] [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1048576.0, reducing to 524288.0
# printed while the step runs, before that iteration's line: it belongs to the next one.
_OVERFLOW_RE = re.compile(r"OVERFLOW!.*Skipping step")
CHUNK_ROWS = 50_000           # iteration rows per chunk (bounded memory, one parquet part)
MAX_KEPT_MALFORMED = 1000     # malformed-line examples kept in the stats (the count is exact)
CHUNK_EXAMPLES = 5            # malformed-line examples per chunk (its one event)
MAX_KEPT_STEPS = 100          # repeated-iteration steps listed in the stats


@dataclass
class LogChunk:
    """A bounded slice of a log: its iteration rows (steps schema, as dicts), validation
    rows, and its malformed lines (count, line numbers, the first CHUNK_EXAMPLES)."""
    rows: list[dict]
    validation: list[dict]
    num_malformed: int
    malformed_lines: list[int]
    malformed_examples: list[dict]
    first_line: int
    last_line: int


class _Rows:
    """Per-line derivation of the steps columns, with the little state it needs across
    lines (previous grad norm / loss scale, overflow lines waiting for their iteration,
    the loss column, the log interval): memory does not grow with the log."""

    def __init__(self, seq_len: int | None, clip: float | None, stats: dict):
        self.seq_len, self.clip, self.stats = seq_len, clip, stats
        self.loss_key: str | None = None
        self.loss_cols: dict[str, None] = {}
        self.prev_step: int | None = None
        self.max_step: int | None = None
        self.prev_gn = math.nan
        self.prev_scale = math.nan
        self.pending_overflow = 0
        self.diffs: Counter = Counter()
        self.saw_tokens = False

    def overflow(self) -> None:
        self.pending_overflow += 1
        self.stats["num_overflow_lines"] += 1

    def log_interval(self) -> int:
        return self.diffs.most_common(1)[0][0] if self.diffs else 1

    def derive(self, row: dict) -> dict:
        st = self.stats
        step = row["step"]
        if self.max_step is not None and step <= self.max_step:
            st["num_duplicate_steps"] += 1
            if len(st["duplicate_steps"]) < MAX_KEPT_STEPS:
                st["duplicate_steps"].append(step)
        if self.prev_step is not None and step > self.prev_step:
            d = step - self.prev_step
            if d in self.diffs or len(self.diffs) < 64:     # bounded: a few intervals
                self.diffs[d] += 1
        self.prev_step = step
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        for k in row:
            if k.startswith("loss_") and k not in NOT_LOSSES and k not in self.loss_cols:
                self.loss_cols[k] = None
                if self.loss_key is None or k == "loss_lm":
                    self.loss_key = k
        skipped_n = row.get("num_skipped_iterations") or 0.0
        skipped_n = 0.0 if skipped_n != skipped_n else skipped_n
        nan_n = row.get("num_nan_iterations") or 0.0
        nan_n = 0.0 if nan_n != nan_n else nan_n
        overflow = self.pending_overflow
        self.pending_overflow = 0
        # the loss: an interval whose iterations were all skipped has none (Megatron-LM main
        # prints 0 / max(1, 0) = 0.000000E+00, MindSpeed-LLM omits it); a line without the
        # field has none either (a framework that did not measure it): missing, not NaN data
        loss = row.get(self.loss_key, math.nan) if self.loss_key else math.nan
        loss_missing = self.loss_key not in row
        if skipped_n > 0:
            for c in self.loss_cols:
                if row.get(c) == 0.0:
                    row[c] = math.nan
            if loss == 0.0 or loss_missing:
                loss, loss_missing = math.nan, True
                st["num_skipped_without_loss"] += 1
        # Megatron's bf16 NaN step: no loss printed, `grad norm: nan` (the step is not
        # applied): a NaN, not a missing value
        nan_step = bool(loss_missing and "grad_norm" in row and
                        not math.isfinite(row["grad_norm"]))
        if nan_step:
            st["num_nan_steps"] += 1
            if len(st["nan_steps"]) < MAX_KEPT_STEPS:
                st["nan_steps"].append(step)
        elif loss_missing and skipped_n == 0:
            st["num_loss_missing"] += 1
            if len(st["loss_missing_steps"]) < MAX_KEPT_STEPS:
                st["loss_missing_steps"].append(step)
        # the grad norm: absent (not computed on a skipped step), printed as 0.000 (DeepSpeed's
        # pipeline engine does not compute it; or below the print resolution), or the
        # previous line's value again on a step with overflow evidence (stale): missing
        gn = row.get("grad_norm", math.nan)
        gn_missing, gn_stale = "grad_norm" not in row, False
        if gn == 0.0:
            st["num_grad_norm_zero"] += 1
            gn, gn_missing = math.nan, True
        scale = row.get("loss_scale", math.nan)
        if scale <= 0.0:                       # DeepSpeed pipeline engine: -1.0
            st["num_loss_scale_unmeasured"] += 1
            row["loss_scale"] = scale = math.nan
        evidence = overflow > 0 or skipped_n > 0 or nan_n > 0 or scale < self.prev_scale
        if gn == self.prev_gn and evidence:
            st["num_grad_norm_stale"] += 1
            gn_missing = gn_stale = True
        elif gn == gn:
            self.prev_gn = gn
        if gn_stale:
            gn = math.nan
        if scale == scale:
            self.prev_scale = scale
        if gn_missing and not gn_stale and "grad_norm" not in row:
            st["num_grad_norm_absent"] += 1
        if self.seq_len is not None:
            cs = row.get("consumed_samples")
            tokens = None if cs is None or cs != cs else int(cs) * int(self.seq_len)
        else:
            ct = row.get("consumed_tokens")
            self.saw_tokens = self.saw_tokens or ct is not None
            tokens = None if ct is None or ct != ct else int(ct)
        el = row.get("elapsed_ms", math.nan)
        el = row.get("elapsed_s", math.nan) * 1000.0 if el != el else el
        out = {"step": step, "tokens": tokens, "loss": float(loss), "lr": row.get("lr", math.nan),
               "grad_norm": float(gn),
               "clipped": bool(self.clip is not None and gn == gn and gn > self.clip),
               "update_norm": math.nan, "step_time_s": el / 1000.0,
               "skipped": bool(skipped_n + nan_n > 0 or overflow > 0)}
        for k, v in row.items():
            if k not in out and k not in ("lr", "grad_norm", "elapsed_ms", "elapsed_s"):
                out[k] = v
        for c in FLAG_COLUMNS:
            out[c] = bool(row.get(c, False))
            st["num_" + c] += out[c]
        out["loss_missing"] = bool(loss_missing)
        out["nan_step"] = nan_step
        out["grad_norm_missing"] = bool(gn_missing)
        out["grad_norm_stale"] = gn_stale
        out["overflow_lines"] = overflow
        return out

    def chunk(self, rows, val_rows, bad_lines, examples, first, last) -> LogChunk:
        interval_avg = self.log_interval() > 1     # from every row so far, this chunk's too
        for r in rows:
            r["interval_avg"] = interval_avg
        self.stats["num_rows"] += len(rows)
        return LogChunk(rows, val_rows, len(bad_lines), bad_lines, examples, first, last)


def _new_stats(source: str) -> dict[str, Any]:
    return {"source": source, "num_lines": 0, "num_iteration_lines": 0,
            "num_validation_lines": 0, "num_rows": 0, "num_malformed": 0, "malformed": [],
            "num_duplicate_steps": 0, "duplicate_steps": [], "num_skipped_without_loss": 0,
            "num_loss_missing": 0, "loss_missing_steps": [], "num_grad_norm_zero": 0,
            "num_nan_steps": 0, "nan_steps": [],
            "num_grad_norm_absent": 0, "num_grad_norm_stale": 0,
            "num_loss_scale_unmeasured": 0, "num_overflow_lines": 0,
            "num_overflow_lines_after_last_iteration": 0,
            **{"num_" + c: 0 for c in FLAG_COLUMNS}}


def iter_megatron_log(lines: Iterable[str], *, seq_len: int | None = None,
                      clip: float | None = None, source: str = "<lines>",
                      chunk_rows: int = CHUNK_ROWS, stats: dict | None = None
                      ) -> Iterator[LogChunk]:
    """Parse log lines as a stream of LogChunks of at most `chunk_rows` iteration rows
    (memory bounded by the chunk, not the log). `stats` (a dict, filled in place) holds the
    parse statistics once the iterator is exhausted; MegatronLogError at the end if no
    iteration line parsed (no chunk is yielded before the first iteration row)."""
    st = _new_stats(source) if stats is None else stats
    st.update(_new_stats(source))
    rs = _Rows(seq_len, clip, st)
    rows: list[dict] = []
    val_rows: list[dict] = []
    bad_lines: list[int] = []
    examples: list[dict] = []
    first = 1
    lineno = 0

    def note_malformed(lineno: int, why: str, line: str) -> None:
        rec = {"line": lineno, "reason": why, "text": line[:200]}
        st["num_malformed"] += 1
        if len(st["malformed"]) < MAX_KEPT_MALFORMED:
            st["malformed"].append(rec)
        bad_lines.append(lineno)
        if len(examples) < CHUNK_EXAMPLES:
            examples.append(rec)

    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip("\r\n")
        if "alidation" in line:
            vm = _VALID_RE.search(line)
            if vm:
                st["num_validation_lines"] += 1
                got, why = _parse_validation(line, vm)
                if why:
                    note_malformed(lineno, why, line)
                val_rows.extend(got)
                continue
            if _VALID_HINT.search(line):
                st["num_validation_lines"] += 1
                note_malformed(lineno, "unrecognised validation line", line)
                continue
        if "OVERFLOW!" in line:
            if _OVERFLOW_RE.search(line):
                rs.overflow()
                continue
        if "iteration" not in line or not _ITER_HINT.search(line):
            continue
        st["num_iteration_lines"] += 1
        row, why = _parse_iteration(line, lineno)
        if why:
            note_malformed(lineno, why, line)
            continue
        row["line"] = lineno
        rows.append(rs.derive(row))
        if len(rows) >= chunk_rows or len(bad_lines) >= chunk_rows:
            yield rs.chunk(rows, val_rows, bad_lines, examples, first, lineno)
            rows, val_rows, bad_lines, examples, first = [], [], [], [], lineno + 1
    st["num_lines"] = lineno
    st["num_overflow_lines_after_last_iteration"] = rs.pending_overflow
    st["loss_key"] = rs.loss_key
    st["loss_columns"] = list(rs.loss_cols)
    st["log_interval"] = rs.log_interval()
    st["tokens_from"] = (f"consumed samples x seq_len {seq_len}" if seq_len is not None else
                         "consumed tokens" if rs.saw_tokens else None)
    if st["num_rows"] + len(rows) == 0:
        raise MegatronLogError(
            f"{source}: no parseable iteration lines ({lineno} lines read, "
            f"{st['num_iteration_lines']} looked like iteration lines, {st['num_malformed']} "
            "malformed); expected Megatron 'iteration N/ M | ... |' lines")
    if rows or val_rows or bad_lines:
        yield rs.chunk(rows, val_rows, bad_lines, examples, first, lineno)


def parse_megatron_log(lines: Iterable[str], *, seq_len: int | None = None,
                       clip: float | None = None, source: str = "<lines>") -> ParsedLog:
    """Parse log lines into one steps table (STEP_COLUMNS first, then extras; a repeated
    iteration keeps its last line) and the validation table: iter_megatron_log collected
    (for logs that fit in memory; `analysis.megatron_log.import_megatron_log` streams)."""
    stats: dict[str, Any] = {}
    rows: list[dict] = []
    val: list[dict] = []
    for ch in iter_megatron_log(lines, seq_len=seq_len, clip=clip, source=source, stats=stats):
        rows += ch.rows
        val += ch.validation
    steps = steps_frame(rows)
    steps = steps.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)
    return ParsedLog(steps=steps, validation=pd.DataFrame(
        val, columns=["step", "split", "dataset", "name", "value", "ppl"]), stats=stats)


def steps_frame(rows: list[dict]) -> pd.DataFrame:
    """Iteration rows (dicts) as a steps DataFrame with the table's dtypes."""
    df = pd.DataFrame(rows)
    df["step"] = df["step"].astype("int64")
    df["tokens"] = pd.array([pd.NA if t is None else t for t in df["tokens"]], dtype="Int64")
    for c in ("loss", "lr", "grad_norm", "update_norm", "step_time_s"):
        df[c] = df[c].astype(float)
    assert list(df.columns[:len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    return df


def read_megatron_log(path: str | Path, **kw) -> ParsedLog:
    path = Path(path)
    if path.is_dir():
        raise MegatronLogError(f"{path}: is a directory, not a log file (a run directory "
                               "is analysed as RUN, without --log)")
    if not path.is_file():
        raise MegatronLogError(f"{path}: log file not found")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return parse_megatron_log(fh, source=str(path), **kw)
    except OSError as e:
        raise MegatronLogError(f"{path}: cannot read ({e})") from None
