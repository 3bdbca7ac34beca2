"""What the running training loop does with a skip list and with the rerun state machine's
checkpoint-and-exit, read from the loop's own source (the function that called train_step),
so the probe acts only where the loop does not.

Upstream facts (read in the sources, cited by file and commit):
- Megatron-LM megatron/training/training.py, train(): `if iteration in
  args.iterations_to_skip:` -> dummy_train_step (core_v0.12.1 a845aa7e, line 1978; same in
  core_v0.13.0 .. core_v0.16.0): `iteration` counts completed iterations, so a value N skips
  the logged iteration N+1. Commit b4e4d9618e (2026-03-20, first tag core_v0.17.0) changed it
  to `if (iteration + 1) in args.iterations_to_skip:` (core_v0.17.0 9539a12e, line 2966): the
  logged numbers themselves.
- Same loop: `if should_checkpoint: save_checkpoint_and_time(iteration, ...)` and `if
  should_exit: break`, then `sys.exit(exit_code)` after the loop (core_v0.12.1 lines
  2000-2006 and 2127-2132).
- MindSpeed-LLM mindspeed_llm/training/training.py, train() (registered over Megatron's by
  features_manager/megatron_basic/training_basic.py and features_manager/common/training.py;
  v2.2.0 53f3639c line 642, v26.0.0 57c33296 line 660, master c77308a1 line 715): unpacks
  `loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
  num_zeros_in_grad = train_step(...)` and never reads should_checkpoint / should_exit; it has
  no iterations_to_skip. Its train_step is Megatron's (imported by name, line 50-51), whose
  rerun state machine does re-run the step.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from typing import Dict, Optional

# a caller's code object -> its facts, None when it is not a training loop (one read each)
_CACHE: Dict[object, Optional["LoopFacts"]] = {}
# a loop: `... = train_step(` (MindSpeed-LLM breaks the line after "= \\") inside
# `while iteration < args.train_iters` (Megatron-LM and MindSpeed-LLM alike)
_CALLS_TRAIN_STEP = re.compile(r"=\s*(\\\s*)?train_step\(")
_WHILE_ITERATION = re.compile(r"\bwhile\s+iteration\b")


class LoopFacts:
    """skips_itself: the loop has --iterations-to-skip; skip_base: 0 when a value N skips the
    logged iteration N+1 (core_v0.12-0.16), 1 when it skips N (core_v0.17+); honours_exit:
    the loop acts on train_step's should_checkpoint / should_exit; returns: how many values
    the loop unpacks from train_step (4 before the rerun machine; 7 from core_v0.12 and in
    MindSpeed-LLM; 8 in core_v0.16, which adds max_attention_logit);
    frame: the loop's frame (its locals name the iteration and the FLOPs so far)."""

    def __init__(self, name: str, source: str, frame=None):
        self.name = name
        self.skips_itself = "iterations_to_skip" in source
        self.skip_base = 1 if re.search(r"\(\s*iteration\s*\+\s*1\s*\)\s+in\s+args\.iterations_to_skip",
                                        source) else 0
        self.honours_exit = re.search(r"\bif\s+should_exit\b", source) is not None
        self.returns = _unpacked(source)
        self.frame = frame

    def describe(self) -> str:
        skip = (f"own --iterations-to-skip ({'1' if self.skip_base else '0'}-based)"
                if self.skips_itself else "no --iterations-to-skip: the probe skips")
        if self.returns < 7:
            return f"training loop {self.name}: {skip}; no rerun state machine"
        ex = "honours" if self.honours_exit else "ignores (the probe honours it)"
        return f"training loop {self.name}: {skip}; {ex} the rerun's checkpoint-and-exit"


def _unpacked(source: str) -> int:
    """How many names the loop's `... = train_step(...)` unpacks (7 where it cannot tell)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return 7 if "should_checkpoint" in source else 4
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "train_step" and \
                isinstance(node.targets[0], ast.Tuple):
            return len(node.targets[0].elts)
    return 7 if "should_checkpoint" in source else 4


def _source(code) -> Optional[str]:
    try:
        return inspect.getsource(code)
    except (OSError, TypeError):
        return None


def find_loop(depth: int = 1, max_up: int = 8) -> Optional[LoopFacts]:
    """The facts of the nearest caller (from `depth` frames above this call) whose source
    runs train_step in a loop; None when no frame looks like a training loop (a test's
    direct call, a frozen module)."""
    try:
        f = sys._getframe(depth + 1)
    except ValueError:
        return None
    for _ in range(max_up):
        if f is None:
            return None
        code = f.f_code
        if code not in _CACHE:
            src = _source(code)
            _CACHE[code] = (LoopFacts(f"{code.co_filename}:{code.co_name}", src)
                            if src and _CALLS_TRAIN_STEP.search(src) and _WHILE_ITERATION.search(src)
                            else None)
        facts = _CACHE[code]
        if facts is not None:
            facts.frame = f
            return facts
        f = f.f_back
    return None
