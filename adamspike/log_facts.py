"""What a training log states besides its iteration lines, each value with its line: the
argument dumps of Megatron / Megatron-DeepSpeed / MindSpeed-LLM (`  name ..... value`),
GPT-NeoX's NeoXArgs and DeepSpeed's engine configuration with its ds_config JSON, the
printed parameter count and the checkpoint loads (`log_facts`). The one reader: analysis
(assess, analyze --log, watch) and simulate.predict (--profile-from-log) call it. Reads
files only; standard library."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ARG_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s\.{2,}\s(.*?)\s*$")
# GPT-NeoX's NeoXArgs.print (megatron/neox_arguments/arguments.py): `  name ..... value`
# padded with dots to 64 characters, then `updated` or `default`
_NEOX_TAIL = re.compile(r"\.*(?:updated|default)$")
# GPT-NeoX / DeepSpeed names -> the Megatron names the rest of the module reads
NEOX_NAMES = {"gradient_clipping": "clip_grad", "train_batch_size": "global_batch_size"}
# What stands before an argument line: DeepSpeed's logger (deepspeed/utils/logging.py at
# 38327e07: `[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] `), a
# launcher's rank tag (`[default0]:`, `worker-0: `); the line itself starts with spaces
_LINE_PREFIX = re.compile(r"^(?:\[[^\]]*\]:?[ \t]?|[A-Za-z0-9_.\-]+:[ \t])+")
# DeepSpeed's DeepSpeedConfig.print (deepspeed/runtime/config.py at 38327e07, called by the
# engine as "DeepSpeedEngine configuration"): `  name ..... value` per attribute (e.g.
# `optimizer_params ..... {'lr': ..., 'betas': [...], 'eps': ...}`, `train_batch_size`,
# `gradient_clipping`), then print_user_config: `  json = {` and the ds_config as indented
# JSON on the lines that follow
_DS_JSON_RE = re.compile(r"^\s*json = \{\s*$")
_DS_JSON_MAX_LINES = 2000
# the parameter count frameworks print: Megatron-LM's theoretical memory report
# (`Total number of parameters in billions: 8.03`), the model builders' per-rank count
# (Megatron / Megatron-DeepSpeed / MindSpeed-LLM: ` > number of parameters on (tensor,
# pipeline) model parallel rank (0, 0): 354871296`; GPT-NeoX megatron/utils.py
# get_total_params: ` > number of parameters on model parallel rank 0: 125000000`)
_PARAMS_TOTAL_RE = re.compile(r"Total number of parameters in billions:\s*([0-9.]+(?:[eE][-+]?\d+)?)")
_PARAMS_RANK_RE = re.compile(
    r"number of parameters on (?:\(tensor, pipeline\) )?model parallel rank\s*"
    r"\(?\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)?\s*:\s*([0-9.]+)\s*([KMBT]?)\b")
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
# Megatron's checkpoint load (` loading checkpoint from DIR at iteration N`,
# `  successfully loaded checkpoint from DIR [ t 0, p 0 ] at iteration N`): a resume
_RESUME_RE = re.compile(r"(?:successfully loaded checkpoint|loading checkpoint) from .*?"
                        r"at iteration\s+(\d+)")


@dataclass
class LogFacts:
    """What a log states besides its iteration lines, each with its line number."""
    args: dict = field(default_factory=dict)          # name -> (value text, line)
    # name -> what the log printed, where that is not the name itself
    # (`gradient_clipping`, `optimizer_params['eps'] (DeepSpeed config)`)
    printed: dict = field(default_factory=dict)
    num_params: int | None = None
    num_params_source: str = ""
    resumes: list = field(default_factory=list)       # (line, iteration)


def _optimizer_dict(value: Any, line: int, facts: "LogFacts", printed: str) -> None:
    """An optimizer dict's Adam settings as Megatron's argument names: GPT-NeoX's
    `optimizer` argument ({'type': 'Adam', 'params': {'lr': ..., 'betas': [b1, b2], 'eps':
    ...}}), DeepSpeed's `optimizer_params` (the params alone) or the ds_config JSON's
    `optimizer`. `value`: the dict or its Python-literal text."""
    d = value
    if isinstance(value, str):
        import ast   # lazy: only GPT-NeoX / DeepSpeed logs carry a dict-valued optimizer
        try:
            d = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return
    params = d.get("params", d) if isinstance(d, dict) else None
    if not isinstance(params, dict):
        return
    betas = params.get("betas")
    pairs = {"adam_eps": ("eps", params.get("eps")), "lr": ("lr", params.get("lr"))}
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        pairs.update(adam_beta1=("betas[0]", betas[0]), adam_beta2=("betas[1]", betas[1]))
    for k, (what, v) in pairs.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in facts.args:
            facts.args[k] = (repr(float(v)), line)
            facts.printed[k] = f"{printed}[{what}]"


def _ds_json(lines: list[str], first: int, facts: "LogFacts") -> None:
    """The ds_config DeepSpeed prints after `json = {` (lines, the first at line `first`):
    its optimizer, train_batch_size and gradient_clipping, each with the line of its key."""
    import json   # lazy: only DeepSpeed logs carry the block
    try:
        d = json.loads("{" + "\n".join(lines))
    except ValueError:
        return
    if not isinstance(d, dict):
        return

    def line_of(key: str) -> int:
        return next((first + i for i, t in enumerate(lines) if f'"{key}"' in t), first - 1)

    if isinstance(d.get("optimizer"), dict):
        _optimizer_dict(d["optimizer"], line_of("optimizer"), facts, "ds_config optimizer.params")
        for name, key in (("adam_eps", "eps"), ("lr", "lr"), ("adam_beta1", "betas"),
                          ("adam_beta2", "betas")):
            if facts.printed.get(name, "").startswith("ds_config"):
                facts.args[name] = (facts.args[name][0], line_of(key))
    for key in ("train_batch_size", "gradient_clipping"):
        v = d.get(key)
        name = NEOX_NAMES[key]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and name not in facts.args:
            facts.args[name] = (repr(v), line_of(key))
            facts.printed[name] = f"ds_config {key}"


def log_facts(path: str | Path, args_only: bool = False) -> LogFacts:
    """The argument dump (Megatron / Megatron-DeepSpeed / MindSpeed-LLM `  name ..... value`,
    GPT-NeoX's NeoXArgs dump with its `updated` / `default` tail, DeepSpeed's engine
    configuration and its ds_config JSON; a logger or rank prefix before the line is
    skipped; GPT-NeoX / DeepSpeed names mapped to Megatron's, NEOX_NAMES, the printed name
    kept in `printed`; the first statement of a name wins), the printed parameter count and the checkpoint loads of a log,
    each with its line number. The whole file is read (a count is printed after the first
    iterations, a resume anywhere; args_only: stop where the training lines start); lines
    are prefiltered by substring."""
    facts = LogFacts()
    ranks: dict = {}
    total = None
    in_args = True
    ds_json: list | None = None
    ds_json_line = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            # lines read in pieces of at most 1 Mi characters: a log without newlines
            # (binary garbage) does not come into memory whole
            for lineno, line in enumerate(iter(lambda: fh.readline(1 << 20), ""), start=1):
                if ds_json is not None:       # inside DeepSpeed's `json = {` block
                    ds_json.append(_LINE_PREFIX.sub("", line.rstrip("\r\n")))
                    if ds_json[-1].startswith("}") or len(ds_json) > _DS_JSON_MAX_LINES:
                        _ds_json(ds_json, ds_json_line, facts)
                        ds_json = None
                    continue
                if in_args and ("..." in line or "json = {" in line):
                    text = _LINE_PREFIX.sub("", line.rstrip("\r\n"))
                    m = _ARG_RE.match(text)
                    if m:
                        printed, value = m.group(1), _NEOX_TAIL.sub("", m.group(2)).strip()
                        name = NEOX_NAMES.get(printed, printed)
                        if name in ("optimizer", "optimizer_params") and value.startswith("{"):
                            _optimizer_dict(value, lineno, facts, name)
                        if name not in facts.args:
                            facts.args[name] = (value, lineno)
                            if printed != name:
                                facts.printed[name] = printed
                        continue
                    if _DS_JSON_RE.match(text):
                        ds_json, ds_json_line = [], lineno + 1
                        continue
                if in_args and facts.args and "iteration" in line and "|" in line:
                    in_args = False          # the training lines have started
                    if args_only:
                        break
                if "parameters" in line:
                    m = _PARAMS_TOTAL_RE.search(line)
                    if m and total is None:
                        total = (float(m.group(1)) * 1e9, lineno)
                    m = _PARAMS_RANK_RE.search(line)
                    if m:
                        key = (int(m.group(1)), int(m.group(2) or 0))
                        ranks.setdefault(key, (float(m.group(3)) * _SUFFIX[m.group(4)], lineno))
                if "checkpoint" in line:
                    m = _RESUME_RE.search(line)
                    if m:
                        facts.resumes.append((lineno, int(m.group(1))))
    except OSError:
        return facts
    if total is not None:
        facts.num_params = int(round(total[0]))
        facts.num_params_source = (f"log line {total[1]}: `Total number of parameters in "
                                   "billions` (2 decimals)")
    elif ranks:
        n = sum(v for v, _ in ranks.values())
        lines = sorted(ln for _, ln in ranks.values())
        tp = _num(facts.args.get("tensor_model_parallel_size", (None,))[0]) or 1
        pp = _num(facts.args.get("pipeline_model_parallel_size", (None,))[0]) or 1
        want = int(tp * pp)
        if len(ranks) < want:
            n = n * want / len(ranks)
            how = (f"extrapolated: {len(ranks)} of {want} model-parallel ranks printed "
                   f"(lines {', '.join(map(str, lines[:4]))}), scaled by {want}/{len(ranks)}")
        else:
            how = (f"log line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines[:4]))}"
                   f"{' ...' if len(lines) > 4 else ''}: `number of parameters on ... model "
                   f"parallel rank`, summed over {len(ranks)} rank(s)")
        facts.num_params, facts.num_params_source = int(round(n)), how
    return facts


def log_arguments(path: str | Path) -> dict[str, str]:
    """The argument block a log prints at start-up (log_facts), as strings; {} when the log
    has none."""
    return {k: v for k, (v, _) in log_facts(path, args_only=True).args.items()}


def _num(s: str | None) -> float | None:
    if s is None:
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None
