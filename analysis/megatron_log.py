"""Import Megatron-LM / ModelLink / MindSpeed-LLM / AscendSpeed training logs as run
directories (`import_megatron_log`) and export a run's steps as a log (`megatron_lines`,
`adamspike megatron-log`). The parser (format, flags, validation lines, malformed lines) is
adamspike.megatron_log's; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from adamspike.megatron_log import (CHUNK_ROWS, MegatronLogError, ParsedLog,  # noqa: F401
                                    iter_megatron_log, parse_megatron_log, read_megatron_log)
from adamspike.config import cli_main
from analysis.megatron_tb import is_tensorboard_dir, open_tensorboard_dir
from analysis.regime import LogFacts, log_facts
from adamspike.rundir import (RunFormatError, RunWriter, atomic_write_bytes, environment,
                              json_clean, load_run)

MAX_EVENT_LINES = 100   # malformed line numbers listed in a chunk's event


@dataclass
class ImportedLog:
    """What import_megatron_log wrote: the run directory and the parse statistics."""
    run_dir: Path
    stats: dict


def import_megatron_log(path: str | Path, out_run_dir: str | Path, *,
                        seq_len: int | None = None, clip: float | None = None,
                        optim: dict | None = None, chunk_rows: int = CHUNK_ROWS) -> ImportedLog:
    """Write a run directory (backend "megatron") from a training log, streamed: the log
    is parsed `chunk_rows` iteration lines at a time (adamspike.megatron_log
    .iter_megatron_log), each chunk one steps part, so memory does not grow with the log.

    `optim` may carry what the log does not state (b1, b2, eps, ...) into run.json's
    config; validation losses become events, malformed lines one `malformed_log_lines`
    event per chunk (their count, line numbers, the first examples); the parse statistics
    go into run.json under "import". RunWriter refuses a non-empty out_run_dir; a log
    without iteration lines creates nothing.
    """
    path, out = Path(path), Path(out_run_dir)
    stats: dict = {}
    with open_log(path) as fh:
        chunks = iter_megatron_log(fh, seq_len=seq_len, clip=clip, source=str(path),
                                   stats=stats, chunk_rows=chunk_rows)
        first = next(chunks)             # MegatronLogError before anything is created
        facts = log_facts(path)
        config, sources = log_settings(facts, optim or {}, clip, seq_len)
        config["source"] = {"megatron_log": str(path.resolve())}
        with RunWriter(out, backend="megatron", config=config,
                       env=environment(importer="analysis.megatron_log"),
                       flush_every_rows=10 * chunk_rows, flush_every_s=math.inf) as w:
            last_iters = None
            for ch in itertools.chain([first], chunks):
                if ch.rows:
                    last_iters = ch.rows[-1].get("train_iters", last_iters)
                for i, rec in enumerate(ch.rows):
                    w.log_step(**rec)
                    ch.rows[i] = None        # the writer holds its copy: one copy at a time
                w.flush()
                if ch.num_malformed:
                    w.event("malformed_log_lines", count=ch.num_malformed,
                            first_line=ch.first_line, last_line=ch.last_line,
                            lines=ch.malformed_lines[:MAX_EVENT_LINES],
                            examples=ch.malformed_examples)
                for v in ch.validation:
                    w.event("validation", **v)
            summary = {k: v for k, v in stats.items() if k != "malformed"}
            summary["malformed_lines"] = [m["line"] for m in stats["malformed"]]
            summary["setting_sources"] = sources
            if facts.num_params:
                summary["num_params_printed"] = facts.num_params
                summary["num_params_printed_source"] = facts.num_params_source
            summary["resumes"] = [{"line": ln, "iteration": it} for ln, it in facts.resumes]
            if last_iters is not None:
                config["train"]["num_steps"] = int(last_iters)
            w.meta.update(config=config, **{"import": summary})
            atomic_write_bytes(out / "run.json", json.dumps(json_clean(w.meta), indent=2,
                                                            allow_nan=False).encode())
    return ImportedLog(out, stats)


# run settings a log's argument dump states (Megatron names; analysis.regime.log_facts
# maps GPT-NeoX's): dotted config key -> argument name
LOG_SETTING_ARGS = {"optim.eps": "adam_eps", "optim.b1": "adam_beta1", "optim.b2": "adam_beta2",
                    "optim.grad_clip": "clip_grad", "optim.lr": "lr",
                    "train.global_batch_size": "global_batch_size", "train.seq_len": "seq_length"}
FLAG_OF = {"optim.grad_clip": "--clip", "train.seq_len": "--seq-len"}


def log_settings(facts: LogFacts, optim: dict, clip: float | None, seq_len: int | None
                 ) -> tuple[dict, dict]:
    """(run config, {dotted key: source}): the flags' values ("flag --eps"), else the log's
    argument dump ("log line 57: adam_eps"); a key neither states is absent (whoever uses
    it must say what it assumes)."""
    config: dict = {"optim": {}, "train": {}}
    sources: dict = {}
    given = {**{f"optim.{k}": v for k, v in optim.items() if v is not None},
             **({"optim.grad_clip": clip} if clip is not None else {}),
             **({"train.seq_len": seq_len} if seq_len is not None else {})}
    for key, arg in LOG_SETTING_ARGS.items():
        sec, name = key.split(".")
        if key in given:
            config[sec][name] = given[key]
            sources[key] = "flag " + FLAG_OF.get(key, "--" + name)
            continue
        text, line = facts.args.get(arg, (None, None))
        try:
            v = float(text) if text is not None else math.nan
        except ValueError:
            v = math.nan
        if math.isfinite(v):
            config[sec][name] = int(v) if sec == "train" and v == int(v) else v
            sources[key] = f"log line {line}: {facts.printed.get(arg, arg)}"
    for key, v in given.items():        # flags outside LOG_SETTING_ARGS (none today)
        sec, name = key.split(".")
        config[sec].setdefault(name, v)
    return config, sources


def open_log(path: Path):
    """The log as text lines (undecodable bytes replaced); a TensorBoard log directory as
    its iteration lines (analysis.megatron_tb); MegatronLogError if missing or another
    directory."""
    if is_tensorboard_dir(path):
        return open_tensorboard_dir(path)
    if path.is_dir():
        raise MegatronLogError(f"{path}: is a directory, not a log file (a run directory "
                               "is analysed as RUN, without --log)")
    if not path.is_file():
        raise MegatronLogError(f"{path}: log file not found")
    try:
        return open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise MegatronLogError(f"{path}: cannot read ({e})") from None


# ----------------------------------------------------------------------------- export

def megatron_lines(steps: pd.DataFrame, *, global_batch_size: int,
                   start: str = "2024-06-01 12:00:00") -> list[str]:
    """Megatron-LM core `training_log` lines (log interval 1, the format in the module
    docstring) of a steps table: its loss, lr, grad norm and step time; consumed samples =
    step x global_batch_size; skipped steps counted as skipped iterations."""
    t0 = _dt.datetime.fromisoformat(start)
    total = int(steps["step"].max()) if len(steps) else 0
    out, elapsed = [], 0.0
    for r in steps.to_dict("records"):
        it = int(r["step"])
        dt = float(r.get("step_time_s") or 0.0)
        dt = dt if math.isfinite(dt) else 0.0
        elapsed += dt
        ts = (t0 + _dt.timedelta(seconds=elapsed)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lr = r.get("lr")
        gn = r.get("grad_norm")
        loss = r.get("loss")
        s = (f" [{ts}] iteration {it:8d}/{total:8d} | consumed samples: "
             f"{it * int(global_batch_size):12d} | elapsed time per iteration (ms): "
             f"{1000 * dt:.1f} |")
        if lr is not None and math.isfinite(float(lr)):
            s += f" learning rate: {float(lr):.6E} |"
        s += f" global batch size: {int(global_batch_size):5d} |"
        if loss is not None and math.isfinite(float(loss)):
            s += f" lm loss: {float(loss):.6E} |"
        s += " loss scale: 1.0 |"
        if gn is not None and math.isfinite(float(gn)):
            s += f" grad norm: {float(gn):.6E} |"   # Megatron: .3f; toys need the digits
        sk = r.get("skipped")
        sk = 1 if (sk is True or (isinstance(sk, (int, float, np.bool_)) and sk == 1)) else 0
        s += (f" number of skipped iterations: {sk:3d} |"
              f" number of nan iterations: {0:3d} |")
        out.append(s)
    return out


def export_main(argv: list[str] | None = None) -> int:
    """`adamspike megatron-log RUN --out LOG`: a run directory's steps as a Megatron-LM
    training log (megatron_lines), so the log path of `adamspike analyze --log` can be
    exercised on a measured run. Refuses an existing --out (exit 2)."""
    ap = argparse.ArgumentParser(prog="adamspike megatron-log", description=export_main.__doc__
                                 .split("\n\n")[0])
    ap.add_argument("run", help="run directory")
    ap.add_argument("--out", required=True, help="log file to write (must not exist)")
    return cli_main(ap, argv, _export, "adamspike megatron-log", (RunFormatError,))


def _export(args) -> int:
    out = Path(args.out)
    if out.exists():
        raise RunFormatError(f"{out}: exists (nothing was overwritten)")
    run = load_run(args.run, tables=("steps",))
    if run.steps.empty:
        raise RunFormatError(f"{args.run}: no steps")
    bs = (run.config.get("train") or {}).get("global_batch_size")
    if not bs:
        raise RunFormatError(f"{args.run}: run.json has no train.global_batch_size")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(megatron_lines(run.steps, global_batch_size=int(bs))) + "\n")
    print(f"{len(run.steps)} iterations -> {out}")
    return 0
