"""Layout naming: a Megatron parameter's name in the whole model and its run-directory (depth, kind)."""

from __future__ import annotations

import re
from typing import Dict, Sequence, Tuple

import torch


_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)$")


def _strip_module(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def global_names(chunks: Sequence[torch.nn.Module]) -> Dict[int, str]:
    """id(param) -> its name in the whole model: `module.` prefixes stripped, each
    transformer layer's local index replaced by its global `layer_number - 1`."""
    out: Dict[int, str] = {}
    for chunk in chunks:
        renames = []
        for mod_name, mod in chunk.named_modules():
            m = _LAYER_RE.search(mod_name)
            num = getattr(mod, "layer_number", None)
            if m and isinstance(num, int):
                renames.append((_strip_module(mod_name) + ".",
                                _strip_module(mod_name[:m.start(2)]) + f"{num - 1}."))
        renames.sort(key=lambda r: -len(r[0]))
        for name, p in chunk.named_parameters():
            name = _strip_module(name)
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out.setdefault(id(p), name)
    return out


# kinds of Megatron tensors (core and legacy names); fused ones get fused kinds
_KIND_RULES = (
    (re.compile(r"layer_?norm|_norm\b|norm\.|\bnorm_"), "norm"),
    (re.compile(r"linear_qkv|query_key_value"), "wqkv"),
    (re.compile(r"linear_q\b|linear_q\.|\.query\."), "wq"),
    (re.compile(r"linear_kv|key_value"), "wkv"),
    (re.compile(r"linear_proj|self_attention\.dense|attention\.dense"), "wo"),
    (re.compile(r"linear_fc2|dense_4h_to_h"), "w2"),
    (re.compile(r"linear_fc1|dense_h_to_4h"), "w13"),
)


def depth_kind(name: str, num_layers: int, gated: bool = True) -> Tuple[int, str]:
    """The run directory's (depth, kind) of a Megatron parameter name: -1 / embed for the
    embeddings, the block index for `layers.N.`, num_layers for the final norm / output."""
    if "embedding" in name.split(".")[0] or ".embedding." in name or name.startswith("embedding"):
        return -1, "embed"
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m:
        rest = name[m.end():]
        for rx, kind in _KIND_RULES:
            if rx.search(rest):
                if kind == "w13" and not gated:
                    kind = "w1"
                return int(m.group(1)), kind
        return int(m.group(1)), "param"
    if "output_layer" in name:
        return num_layers, "output"
    if "norm" in name:
        return num_layers, "norm"
    return num_layers, "param"
