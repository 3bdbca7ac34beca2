"""The restart recipe: PaLM's rollback + batch skip for a spike, as Megatron arguments."""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import List, Optional, Tuple

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


def _megatron_core_version() -> Optional[Tuple[int, int]]:
    """(major, minor) of the megatron-core package, where it is installed as one."""
    try:
        from importlib.metadata import version   # python >= 3.8
        v = version("megatron-core")
    except Exception:  # noqa: BLE001 - Megatron-LM from a source tree: no distribution
        mod = sys.modules.get("megatron.core.package_info")
        v = getattr(mod, "__version__", None)
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _scheduled_checkpoints(margs, start_iteration: int, step: int) -> List[int]:
    """The checkpoints Megatron saved before `step` by its schedule, for a writer that cannot
    list them (no shared storage): the loaded one (start_iteration, when > 0) and every
    multiple of --save-interval after it (Megatron-LM core_v0.12.1 training.py and
    MindSpeed-LLM c77308a1 mindspeed_llm/training/training.py: `iteration % args.save_interval
    == 0`). Saves outside the schedule (--exit-interval, a signal) are not known here."""
    every = int(getattr(margs, "save_interval", 0) or 0)
    out = [start_iteration] if 0 < start_iteration < step else []
    if every > 0 and getattr(margs, "save", None):
        out += list(range((start_iteration // every + 1) * every, step, every))
    return out


def restart_recipe(step: int, margs, actions: ProbeActions, loop=None,
                   storage: Optional[dict] = None) -> dict:
    """PaLM's rollback + batch skip for a spike at `step`, as Megatron arguments: the
    newest checkpoint at least `rollback_steps` before the spike (else the newest before
    it), and the iterations to skip after it: max(skip_batches, step - checkpoint), so
    every batch from the checkpoint through the spike is skipped (the same rule as
    fullscale.guard).

    The skip, per stack (fullscale.probe.loop has the upstream lines): the probe's
    ADAMSPIKE_PROBE_SKIP_ITERATIONS (logged numbers) works on every loop; where the loop has
    its own --iterations-to-skip its values are given in that loop's base: `loop` (the
    running loop's facts) when known, else megatron-core's version (0-based before
    core_v0.17, 1-based from it, commit b4e4d9618e).

    `storage` (the writer's storage_info with start_iteration): without shared storage the
    checkpoints come from Megatron's save schedule (_scheduled_checkpoints), not from a
    listing of this node's --save, which holds only the shards written on this node."""
    save = getattr(margs, "save", None) or getattr(margs, "load", None)
    shared = storage is None or storage.get("shared", True)
    if shared:
        ckpts = [c for c in _checkpoints(save) if c < step]
    else:
        ckpts = _scheduled_checkpoints(margs, int(storage.get("start_iteration", 0)), step)
    early = [c for c in ckpts if c <= step - actions.rollback_steps]
    ckpt = (early or ckpts or [None])[-1]
    base = ckpt or 0
    last = base + max(actions.skip_batches, step - base)
    if loop is not None:
        has_skip, one_based, source = loop.skips_itself, loop.skip_base == 1, loop.name
    else:
        ver = _megatron_core_version()
        has_skip = margs is None or hasattr(margs, "iterations_to_skip")
        one_based = ver is not None and ver >= (0, 17)
        source = f"megatron-core {ver[0]}.{ver[1]}" if ver else "megatron-core version unknown: 0-based"
    shift = 0 if one_based else 1
    return {"step": int(step), "load": save, "ckpt_step": ckpt,
            "skipped_iterations": [base + 1, last],
            "iterations_to_skip": [base + 1 - shift, last - shift] if has_skip else None,
            "iterations_to_skip_base": (1 if one_based else 0) if has_skip else None,
            "skip_semantics_from": source,
            "probe_skip_iterations": f"{base + 1}-{last}",
            "num_skipped": last - base,
            "stack_has_iterations_to_skip": bool(has_skip),
            "stack_has_rerun_state_machine": bool(margs is not None and hasattr(margs, "rerun_mode")),
            "checkpoints_from": "this node's --save" if shared else "--save-interval schedule (no shared storage)"}


def _comment_safe(text: str) -> str:
    """`text` for a shell comment line: control characters as Python escapes."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: repr(m.group())[1:-1], str(text))


def write_restart_recipe(out: str, step: int, reason: str, margs, actions: ProbeActions,
                         loop=None, storage: Optional[dict] = None) -> dict:
    """RUN/restart_recipe.sh for the spike at `step` (replaced at every spike); returns
    the restart_recipe event's fields."""
    r = restart_recipe(step, margs, actions, loop, storage)
    # Megatron's --save is a path: quoted as a shell word, and shown in comments with its
    # control characters escaped (a newline would end the comment and start a command)
    load = _comment_safe(r["load"]) if r["load"] else "$CKPT_DIR"
    load_word = shlex.quote(r["load"]) if r["load"] else '"$CKPT_DIR"'
    first, last = r["skipped_iterations"]
    lines = ["#!/bin/bash",
             f"# adamspike probe: restart recipe for the spike at iteration {step} ({_comment_safe(reason)})",
             f"# PaLM (Chowdhery et al. 2022, sec. 5.1): restart ~{actions.rollback_steps} steps "
             f"before the spike and skip {actions.skip_batches}+ batches",
             "# checkpoint: " + (f"iteration {r['ckpt_step']} in {load}" if r["ckpt_step"] is not None
                                 else "none found before the spike (from scratch, or set --ckpt-step)"),
             f"# batches skipped: logged iterations {first}..{last} ({last - first + 1}), every "
             "batch from the checkpoint through the spike",
             "# Every stack, with the probe on: it draws those batches without an update where the",
             "# loop has no --iterations-to-skip (MindSpeed-LLM); where the loop has it, the loop",
             "# skips them before train_step and the probe never sees them (never twice):",
             f"export ADAMSPIKE_PROBE_SKIP_ITERATIONS=\"{r['probe_skip_iterations']}\""]
    if storage is not None and not storage.get("shared", True):
        lines[4:4] = [
            f"# no shared storage: this file is on node {_comment_safe(storage.get('host'))} only; the checkpoint is",
            "# the newest that Megatron's --save-interval schedule saved since the loaded iteration",
            f"# {storage.get('start_iteration')} (not a listing of this node's --save); every node holds the",
            "# shards of its own ranks: check that iter_N is on every node, restart with the same node ranks"]
    restart = f"--load {load_word}" + (f" --ckpt-step {r['ckpt_step']}" if r["ckpt_step"] is not None else "")
    if r["stack_has_iterations_to_skip"]:
        lo, hi = r["iterations_to_skip"]
        one = r["iterations_to_skip_base"] == 1
        lines += [f"# This loop's own --iterations-to-skip ({r['skip_semantics_from']}) is "
                  f"{'1' if one else '0'}-based: a value N skips logged iteration "
                  f"{'N' if one else 'N+1'} (Megatron-LM core_v0.12-0.16 0-based; 1-based from",
                  "# core_v0.17, commit b4e4d9618e):"]
        restart += f" --iterations-to-skip $(seq -s ' ' {lo} {hi})"
    else:
        lines += ["# THIS STACK HAS NO --iterations-to-skip (" + r["skip_semantics_from"] + "): only the",
                  "# probe's list above skips the batches; keep the probe on (ADAMSPIKE_PROBE=1)."]
    lines += ["# shellcheck disable=SC2046", f"RESTART_ARGS=({restart})",
              "# With adamspike's train_mindspeed.sh, on every node:",
              f"#   CKPT_STEP={r['ckpt_step'] if r['ckpt_step'] is not None else ''} "
              f"SKIP_ITERATIONS=\"{r['probe_skip_iterations']}\" bash train_mindspeed.sh NODE_RANK"]
    lines += ["# Megatron's rerun state machine (core_v0.12+: --rerun-mode validate_results with",
              "# --check-for-spiky-loss / --check-for-large-grads) re-runs a suspicious iteration",
              "# to tell a transient fault from a reproducible spike (a reproducible one saves a",
              "# checkpoint and stops the job; --result-rejected-tracker-filename records it).",
              "# --check-for-spiky-loss fires only above 10x the largest loss seen so far",
              "# (SPIKY_LOSS_FACTOR); MindSpeed-LLM's loop ignores the stop, the probe carries it out."]
    path = os.path.join(out, RECIPE)
    _atomic_write(path, ("\n".join(lines) + "\n").encode())
    return {**r, "path": path, "reason": reason}
