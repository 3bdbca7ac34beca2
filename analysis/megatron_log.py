"""Import Megatron-LM / ModelLink / MindSpeed-LLM / AscendSpeed training logs as run
directories (`import_megatron_log`) and export a run's steps as a log (`megatron_lines`,
`adamspike megatron-log`). The parser (format, flags, validation lines, malformed lines) is
adamspike.megatron_log's; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
from pathlib import Path

import numpy as np
import pandas as pd

from adamspike.megatron_log import (MegatronLogError, ParsedLog, parse_megatron_log,  # noqa: F401
                                    read_megatron_log)
from adamspike.config import cli_main
from adamspike.rundir import RunFormatError, RunWriter, environment, load_run


def import_megatron_log(path: str | Path, out_run_dir: str | Path, *,
                        seq_len: int | None = None, clip: float | None = None,
                        optim: dict | None = None) -> ParsedLog:
    """Write a run directory (backend "megatron") from a training log.

    `optim` may carry what the log does not state (b1, b2, eps, ...) into run.json's
    config; validation losses and malformed lines become events, the parse statistics go
    into run.json under "import". RunWriter refuses a non-empty out_run_dir.
    """
    parsed = read_megatron_log(path, seq_len=seq_len, clip=clip)
    stats = parsed.stats
    config = {"optim": {**({"grad_clip": clip} if clip is not None else {}), **(optim or {})},
              "train": {**({"seq_len": seq_len} if seq_len is not None else {}),
                        "num_steps": int(parsed.steps["train_iters"].iloc[-1])},
              "source": {"megatron_log": str(Path(path).resolve())}}
    summary = {k: v for k, v in stats.items() if k != "malformed"}
    summary["malformed_lines"] = [m["line"] for m in stats["malformed"]]
    with RunWriter(out_run_dir, backend="megatron", config=config,
                   env=environment(importer="analysis.megatron_log"),
                   extra_meta={"import": summary}) as w:
        for rec in parsed.steps.to_dict("records"):
            rec["tokens"] = None if pd.isna(rec["tokens"]) else int(rec["tokens"])
            w.log_step(**rec)
        for m in stats["malformed"]:
            w.event("malformed_log_line", line=m["line"], reason=m["reason"], text=m["text"])
        for v in parsed.validation.to_dict("records"):
            w.event("validation", **v)
    return parsed


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
