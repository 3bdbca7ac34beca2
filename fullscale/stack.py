"""Which Megatron stack a node runs, from what is installed: `python -m fullscale.stack --dir
MINDSPEED_LLM_DIR` prints `STACK CORE` (e.g. `mindspeed-llm 0.12.1`), which train_mindspeed.sh
uses to pick its flag set (fullscale/launch.py, STACKS) and the skip semantics of the loop;
an unknown combination is refused (exit 2) with one line naming what was found, never guessed.
Runs on the node's python (3.8+), imports neither torch nor anything of ours.

What is read: python's version; the torch, torch_npu and megatron-core distributions
(importlib.metadata); CANN's version (`version=` of ascend_toolkit_install.info under
$ASCEND_TOOLKIT_HOME or /usr/local/Ascend/ascend-toolkit/latest, or ADAMSPIKE_CANN_VERSION);
the checkout: mindspeed_llm/ (MindSpeed-LLM), modellink/ (ModelLink, before the rename),
megatron/training/ (Megatron-LM), and its megatron/core/package_info.py (MAJOR, MINOR, PATCH),
which wins over an installed megatron-core (the script runs the checkout's Megatron).

The stacks (upstream facts, cited):
- mindspeed-llm: MindSpeed-LLM 2.2+ on Megatron core_v0.12.1 (fullscale/megatron_options.json);
  its install guides link CANN 8.3.RC1 (tag v2.2.0, docs/pytorch/install_guide.md) and 8.5.0
  (v2.3.0): CANN 8 or newer, Megatron core 0.12 or newer.
- modellink-2024: ModelLink of 2024-03 (MindSpeed-LLM repository, commit 0df09cd1), whose own
  Megatron copy says core 0.4.0 (megatron/core/package_info.py): the seed's stack (CANN 7.0.1,
  torch 2.1.0, python 3.8). Megatron core before 0.12.
- megatron-lm: Megatron-LM core 0.12 or newer (--iterations-to-skip 0-based before 0.17,
  1-based from 0.17: commit b4e4d9618e).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Dict, Optional, Tuple

STACKS = ("mindspeed-llm", "modellink-2024", "megatron-lm")


class StackError(ValueError):
    """No known stack matches what was found (the message names it)."""


def _dist_version(name: str) -> Optional[str]:
    try:
        # lazy: importlib.metadata is python 3.8+; an older node reports "not found"
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cann_version() -> Optional[str]:
    v = os.environ.get("ADAMSPIKE_CANN_VERSION")
    if v:
        return v
    home = os.environ.get("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    for path in sorted(glob.glob(os.path.join(home, "*", "ascend_toolkit_install.info"))
                       + glob.glob(os.path.join(home, "ascend_toolkit_install.info"))):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("version="):
                        return line.split("=", 1)[1].strip()
        except OSError:
            continue
    return None


def _core_in_tree(root: str) -> Optional[str]:
    path = os.path.join(root, "megatron", "core", "package_info.py")
    try:
        text = open(path).read()
    except OSError:
        return None
    parts = [re.search(rf"^{k}\s*=\s*['\"]?(\w+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def gather(checkout: Optional[str]) -> Dict[str, Optional[str]]:
    """The version report of this node and checkout (None: not found)."""
    tree = None
    if checkout:
        for name, marker in (("mindspeed_llm", "mindspeed_llm"), ("modellink", "modellink"),
                             ("megatron", os.path.join("megatron", "training"))):
            if os.path.isdir(os.path.join(checkout, marker)):
                tree = name
                break
    return {"python": "%d.%d.%d" % sys.version_info[:3], "torch": _dist_version("torch"),
            "torch_npu": _dist_version("torch_npu"), "cann": _cann_version(),
            "megatron_core": (_core_in_tree(checkout) if checkout else None) or _dist_version("megatron-core"),
            "tree": tree}


def _vt(v: Optional[str]) -> Optional[Tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def describe(report: Dict[str, Optional[str]]) -> str:
    names = {"mindspeed_llm": "MindSpeed-LLM", "modellink": "ModelLink", "megatron": "Megatron-LM"}
    return (f"python {report.get('python')}, torch {report.get('torch') or 'not found'}, "
            f"torch_npu {report.get('torch_npu') or 'not found'}, CANN {report.get('cann') or 'not found'}, "
            f"megatron core {report.get('megatron_core') or 'not found'}, checkout "
            f"{names.get(report.get('tree') or '', 'with no mindspeed_llm/, modellink/ or megatron/training/')}")


def detect(report: Dict[str, Optional[str]]) -> Tuple[str, str]:
    """(stack, megatron core version) for a version report; StackError when none fits."""
    tree, core, cann = report.get("tree"), _vt(report.get("megatron_core")), _vt(report.get("cann"))
    found = describe(report)
    if core is None:
        raise StackError(f"no Megatron core version found ({found}); set MEGATRON_STACK to one of "
                         f"{', '.join(STACKS)} if you know it")
    ver = report["megatron_core"]
    if tree == "mindspeed_llm":
        if core < (0, 12):
            raise StackError(f"MindSpeed-LLM on Megatron core {ver} is not a stack this script "
                             f"knows (mindspeed-llm: core 0.12+): {found}")
        if cann is not None and cann < (8, 0):
            raise StackError(f"MindSpeed-LLM needs CANN 8 or newer (its 2.2.0 / 2.3.0 install guides: "
                             f"8.3.RC1 / 8.5.0), found: {found}; the seed's CANN 7.0 stack is "
                             "ModelLink of 2024 (MEGATRON_STACK=modellink-2024)")
        return "mindspeed-llm", ver
    if tree == "modellink":
        if core >= (0, 12):
            raise StackError(f"ModelLink on Megatron core {ver} is not a stack this script knows "
                             f"(modellink-2024: its own Megatron copy, core 0.4): {found}")
        return "modellink-2024", ver
    if tree == "megatron":
        if core < (0, 12):
            raise StackError(f"Megatron-LM core {ver} is older than the flag set here "
                             f"(megatron-lm: core 0.12+, with the rerun state machine): {found}")
        return "megatron-lm", ver
    raise StackError(f"unknown stack: {found}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fullscale.stack",
                                 description="Print the Megatron stack this node runs (STACK CORE), "
                                             "or refuse naming what was found (exit 2).")
    ap.add_argument("--dir", help="the MindSpeed-LLM / ModelLink / Megatron-LM checkout")
    a = ap.parse_args(argv)
    if a.dir and not os.path.isdir(a.dir):
        print(f"fullscale.stack: {a.dir}: no such directory", file=sys.stderr)
        return 2
    try:
        stack, core = detect(gather(a.dir))
    except StackError as e:
        print(f"fullscale.stack: {e}", file=sys.stderr)
        return 2
    print(stack, core)
    return 0


if __name__ == "__main__":
    sys.exit(main())
