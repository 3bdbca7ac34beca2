"""The restart recipe: PaLM's rollback + batch skip for a spike, as Megatron arguments."""

from __future__ import annotations

import os
import re
from typing import List, Optional

from fullscale.probe.actions import ProbeActions, RECIPE
from fullscale.probe.writer import _atomic_write


def _checkpoints(save: Optional[str]) -> List[int]:
    """Iterations of the Megatron checkpoints (iter_NNNNNNN folders) in `save`."""
    if not save or not os.path.isdir(save):
        return []
    out = []
    for f in os.listdir(save):
        m = re.fullmatch(r"iter_(\d+)", f)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def restart_recipe(step: int, margs, actions: ProbeActions) -> dict:
    """PaLM's rollback + batch skip for a spike at `step`, as Megatron arguments: the
    newest checkpoint at least `rollback_steps` before the spike (else the newest before
    it), and the iterations to skip after it: max(skip_batches, step - checkpoint), so
    every batch from the checkpoint through the spike is skipped (the same rule as
    fullscale.guard)."""
    save = getattr(margs, "save", None) or getattr(margs, "load", None)
    ckpts = [c for c in _checkpoints(save) if c < step]
    early = [c for c in ckpts if c <= step - actions.rollback_steps]
    ckpt = (early or ckpts or [None])[-1]
    base = ckpt or 0
    last = base + max(actions.skip_batches, step - base)
    has_skip = margs is None or hasattr(margs, "iterations_to_skip")
    # core_v0.12's loop skips when `iteration` (iterations completed, 0-based) is in the
    # list: logged iterations base+1..last are the values base..last-1 (Megatron-LM after
    # core_v0.12 compares iteration + 1: the logged numbers themselves)
    return {"step": int(step), "load": save, "ckpt_step": ckpt,
            "skipped_iterations": [base + 1, last], "iterations_to_skip": [base, last - 1],
            "num_skipped": last - base,
            "stack_has_iterations_to_skip": bool(has_skip),
            "stack_has_rerun_state_machine": bool(margs is not None and hasattr(margs, "rerun_mode"))}


def write_restart_recipe(out: str, step: int, reason: str, margs, actions: ProbeActions) -> dict:
    """RUN/restart_recipe.sh for the spike at `step` (replaced at every spike); returns
    the restart_recipe event's fields."""
    r = restart_recipe(step, margs, actions)
    lo, hi = r["iterations_to_skip"]
    load = r["load"] or "$CKPT_DIR"
    first, last = r["skipped_iterations"]
    lines = ["#!/bin/bash",
             f"# adamspike probe: restart recipe for the spike at iteration {step} ({reason})",
             f"# PaLM (Chowdhery et al. 2022, sec. 5.1): restart ~{actions.rollback_steps} steps "
             f"before the spike and skip {actions.skip_batches}+ batches",
             "# checkpoint: " + (f"iteration {r['ckpt_step']} in {load}" if r["ckpt_step"] is not None
                                 else "none found before the spike (from scratch, or set --ckpt-step)"),
             f"# batches skipped: logged iterations {first}..{last} ({last - first + 1}), every "
             "batch from the checkpoint through the spike",
             "# Add to the job's Megatron arguments (Megatron-LM core_v0.12, MindSpeed-LLM 2.2+; its",
             "# loop skips logged iteration N+1 for a value N; Megatron-LM after core_v0.12 takes",
             f"# the logged numbers: $(seq -s ' ' {first} {last})):",
             f"RESTART_ARGS=\"--load {load}" + (f" --ckpt-step {r['ckpt_step']}" if r["ckpt_step"] is not None else "")
             + f" --iterations-to-skip $(seq -s ' ' {lo} {hi})\""]
    lines += ["# With adamspike's train_mindspeed.sh, on every node:",
              f"#   CKPT_STEP={r['ckpt_step'] if r['ckpt_step'] is not None else ''} "
              f"ITERATIONS_TO_SKIP=\"$(seq -s ' ' {lo} {hi})\" bash train_mindspeed.sh NODE_RANK"]
    if not r["stack_has_iterations_to_skip"]:
        lines += ["# THIS STACK HAS NO --iterations-to-skip (Megatron before core_v0.12): restart from",
                  f"# --load {load} and advance the data by {hi - lo + 1} global batches yourself",
                  "# (e.g. --override-opt_param-scheduler with a larger consumed-samples count is NOT",
                  "# enough: the data iterator must skip them); or move to core_v0.12."]
    lines += ["# Megatron's rerun state machine (core_v0.12: --rerun-mode validate_results with",
              "# --check-for-spiky-loss / --check-for-large-grads) re-runs a suspicious iteration",
              "# to tell a transient fault from a reproducible spike (a reproducible one stops the",
              "# job; --result-rejected-tracker-filename records it)."]
    path = os.path.join(out, RECIPE)
    _atomic_write(path, ("\n".join(lines) + "\n").encode())
    return {**r, "path": path, "reason": reason}
