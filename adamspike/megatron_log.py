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
MindSpeed-LLM's value-less field (`fix-router or fix-sub-seq-length is set, current loss
is not reliable, only for test |`) becomes the boolean column `loss_unreliable`.
Validation lines (`validation loss at iteration N | lm loss value: X | lm loss PPL: Y |`,
`validation-0 loss at ...` / `validation-NAME loss at ...` for several validation sets,
`... at iteration N on validation set |` / `on test set`, `... at the end of training for
val data |`, AscendSpeed's `... at the end of training and after model cleaning for val
data |`) go to a separate frame (step, split, dataset, name, value, ppl). Any line that looks like an iteration or validation line but does
not parse (truncated, a field without ': ', a non-numeric value of a known key) is counted
and reported with its line number and reason, never silently dropped. A repeated iteration
(a restarted job appending to the same log) keeps the last occurrence and is counted.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

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
_VALID_RE = re.compile(r"validation(?:-(\S+?))? loss at (?:iteration\s+(\d+)(?:\s+on\s+([\w ]+?))?|"
                       r"the end of training(?: and after model cleaning)? for (\w+) data)\s*\|")
_VALID_HINT = re.compile(r"validation\S* loss at")
# fields without a value that a complete iteration line may carry: text -> boolean column
FLAG_FIELDS = {
    # MindSpeed-LLM training_log with --fix-router or --fix-sub-seq-length
    "fix-router or fix-sub-seq-length is set, current loss is not reliable, only for test":
        "loss_unreliable",
}
_TS_RE = re.compile(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\]")


@dataclass
class ParsedLog:
    steps: pd.DataFrame           # STEP_COLUMNS + extra columns, one row per logged iteration
    validation: pd.DataFrame      # step, split, name, value, ppl
    stats: dict[str, Any] = field(default_factory=dict)


def _column_name(key: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", key.lower()).strip("_")


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
        if not sep or not key.strip():
            return out, f"field without 'key: value': {part[:60]!r}"
        key, val = key.strip(), val.strip()
        known = KNOWN_KEYS.get(key.lower())
        try:
            num = float(val)
        except ValueError:
            if known or key.lower().endswith("loss"):
                return out, f"non-numeric value for {key!r}: {val[:40]!r}"
            continue  # unknown, non-numeric field (e.g. an ETA string): not a column
        if known:
            out[known] = num
        elif key.lower().endswith("loss"):
            out["loss_" + (_column_name(key[:-4]) or "total")] = num
        else:
            out[_column_name(key)] = num
    return out, None


def _timestamp(prefix: str) -> float | None:
    m = _TS_RE.search(prefix)
    if not m:
        return None
    s = m.group(1)
    fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in s else "%Y-%m-%d %H:%M:%S"
    return _dt.datetime.strptime(s, fmt).replace(tzinfo=_dt.timezone.utc).timestamp()


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
        if key.endswith(" value"):
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


def parse_megatron_log(lines: Iterable[str], *, seq_len: int | None = None,
                       clip: float | None = None, source: str = "<lines>") -> ParsedLog:
    """Parse log lines into the steps table (STEP_COLUMNS first, then extras)."""
    rows: list[dict] = []
    val_rows: list[dict] = []
    malformed: list[dict] = []
    num_lines = num_iter = num_val = 0
    for lineno, line in enumerate(lines, start=1):
        num_lines += 1
        line = line.rstrip("\r\n")
        vm = _VALID_RE.search(line)
        if vm:
            num_val += 1
            got, why = _parse_validation(line, vm)
            if why:
                malformed.append({"line": lineno, "reason": why, "text": line[:200]})
            val_rows.extend(got)
            continue
        if _VALID_HINT.search(line):
            num_val += 1
            malformed.append({"line": lineno, "reason": "unrecognised validation line",
                              "text": line[:200]})
            continue
        if not _ITER_HINT.search(line):
            continue
        num_iter += 1
        row, why = _parse_iteration(line, lineno)
        if why:
            malformed.append({"line": lineno, "reason": why, "text": line[:200]})
            continue
        row["line"] = lineno
        rows.append(row)
    stats: dict[str, Any] = {"source": source, "num_lines": num_lines,
                             "num_iteration_lines": num_iter, "num_validation_lines": num_val,
                             "num_malformed": len(malformed), "malformed": malformed}
    if not rows:
        raise MegatronLogError(
            f"{source}: no parseable iteration lines ({num_lines} lines read, {num_iter} "
            f"looked like iteration lines, {len(malformed)} malformed); expected Megatron "
            "'iteration N/ M | ... |' lines")
    df = pd.DataFrame(rows)
    num_dupes = int(df.duplicated("step", keep="last").sum())
    stats["num_duplicate_steps"] = num_dupes
    stats["duplicate_steps"] = sorted(set(df.loc[df.duplicated("step", keep="last"), "step"]))
    df = df.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)
    steps = _to_steps(df, seq_len=seq_len, clip=clip, stats=stats)
    val = pd.DataFrame(val_rows, columns=["step", "split", "dataset", "name", "value", "ppl"])
    return ParsedLog(steps=steps, validation=val, stats=stats)


def _to_steps(df: pd.DataFrame, *, seq_len: int | None, clip: float | None,
              stats: dict) -> pd.DataFrame:
    def col(name: str) -> pd.Series:
        return df[name] if name in df else pd.Series(np.nan, index=df.index)

    loss_cols = [c for c in df.columns if c.startswith("loss_")]
    loss_key = "loss_lm" if "loss_lm" in loss_cols else (loss_cols[0] if loss_cols else None)
    stats["loss_key"] = loss_key
    stats["loss_columns"] = loss_cols
    diffs = np.diff(df["step"].to_numpy())
    log_interval = int(pd.Series(diffs).mode().iloc[0]) if len(diffs) else 1
    stats["log_interval"] = log_interval
    if seq_len is not None:
        tokens = col("consumed_samples") * int(seq_len)
        stats["tokens_from"] = f"consumed samples x seq_len {seq_len}"
    elif "consumed_tokens" in df:
        tokens = df["consumed_tokens"]
        stats["tokens_from"] = "consumed tokens"
    else:
        tokens = pd.Series(np.nan, index=df.index)
        stats["tokens_from"] = None
    grad_norm = col("grad_norm").astype(float)
    # an interval whose iterations were all skipped: Megatron-LM main prints its loss as
    # 0.000000E+00 (0 / max(1, advanced iterations = 0)), MindSpeed-LLM omits it: no value
    skipped_n = col("num_skipped_iterations").fillna(0).to_numpy()
    no_value = np.zeros(len(df), dtype=bool)
    for c in loss_cols:
        zero = (df[c].to_numpy(float) == 0.0) & (skipped_n > 0)
        df.loc[zero, c] = np.nan
        if c == loss_key:
            no_value = zero | (np.isnan(df[c].to_numpy(float)) & (skipped_n > 0))
    stats["num_skipped_without_loss"] = int(no_value.sum())
    clipped = (grad_norm > clip).to_numpy() if clip is not None else np.zeros(len(df), bool)
    num_skip = col("num_skipped_iterations").fillna(0) + col("num_nan_iterations").fillna(0)
    out = pd.DataFrame({
        "step": df["step"].astype("int64"),
        "tokens": tokens.astype("Int64") if tokens.notna().any() else pd.array(
            [pd.NA] * len(df), dtype="Int64"),
        "loss": df[loss_key].astype(float) if loss_key else np.nan,
        "lr": col("lr").astype(float),
        "grad_norm": grad_norm,
        "clipped": clipped,
        "update_norm": np.nan,
        "step_time_s": col("elapsed_ms").astype(float) / 1000.0,
        "skipped": (num_skip > 0).to_numpy(),
    })
    extras = [c for c in df.columns if c not in ("step", "lr", "grad_norm", "elapsed_ms")]
    for c in extras:
        out[c] = df[c].to_numpy()
    out["interval_avg"] = log_interval > 1
    if "loss_unreliable" in out:
        out["loss_unreliable"] = out["loss_unreliable"].fillna(False).astype(bool)
        stats["num_loss_unreliable"] = int(out["loss_unreliable"].sum())
    assert list(out.columns[:len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    return out


def read_megatron_log(path: str | Path, **kw) -> ParsedLog:
    path = Path(path)
    if not path.is_file():
        raise MegatronLogError(f"{path}: log file not found")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return parse_megatron_log(fh, source=str(path), **kw)
    except OSError as e:
        raise MegatronLogError(f"{path}: cannot read ({e})") from None
