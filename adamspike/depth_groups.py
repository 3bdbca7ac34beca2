"""Depth groups: the one definition of "shallow" and "deep" used everywhere.

A parameter tensor has a depth (the run-directory contract): -1 for the embedding,
0..L-1 for the transformer blocks, L for the final norm and the output head. Groups:

    embed    depth == -1
    shallow  0 <= depth < num_shallow_blocks(L),  num_shallow_blocks(L) = max(1, L // 10)
    deep     num_shallow_blocks(L) <= depth < L
    head     depth == L

At LLaMA2-70B (L = 80) the shallow group is blocks 0..7, so the embedding plus the shallow
group (`shallow_depths`) are depths -1..7, where the seed report saw updates tied to eps.
Models without blocks (the quadratic, an MLP) give their depths directly: an MLP of L
layers has depths 0..L-1 and uses the same rule, with no embed or head group.
"""

from __future__ import annotations

import numpy as np

GROUPS = ("embed", "shallow", "deep", "head")


def num_shallow_blocks(num_layers: int) -> int:
    """Blocks in the shallow group: max(1, L // 10) (8 of LLaMA2-70B's 80)."""
    if int(num_layers) < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return max(1, int(num_layers) // 10)


def depth_group(depth: int, num_layers: int) -> str:
    """The group of a tensor at `depth` in a model of `num_layers` blocks."""
    depth, num_layers = int(depth), int(num_layers)
    if depth == -1:
        return "embed"
    if depth == num_layers:
        return "head"
    if not 0 <= depth < num_layers:
        raise ValueError(f"depth {depth} outside -1..{num_layers}")
    return "shallow" if depth < num_shallow_blocks(num_layers) else "deep"


def shallow_depths(num_layers: int) -> list[int]:
    """The depths the alarms and reports call shallow: the embedding and the shallow blocks."""
    return [-1, *range(num_shallow_blocks(num_layers))]


def is_shallow(depths, num_layers: int) -> list[bool]:
    """Per depth: in the embed or shallow group (the alarms' and reports' "shallow" side,
    depth < num_shallow_blocks(L)); deep blocks and the head are the other side."""
    cut = num_shallow_blocks(num_layers)
    return [int(d) < cut for d in depths]


def infer_num_layers(depths, kinds=None, names=None) -> int:
    """L of a run's layers table (`depths`, or the table itself: its depth, kind, name
    columns). Depth L is the head (final norm and output): L is the largest depth when a
    tensor there is the head or final norm (kind output / norm, or a name starting with
    "output" / "norm", as the MLP writes), else the largest depth + 1 (a table of blocks
    only). Bare depths (no kinds, no names) are taken as a whole table, whose largest depth
    is the head's."""
    if hasattr(depths, "columns"):
        depths, kinds, names = depths["depth"], depths.get("kind"), depths.get("name")
    d = np.asarray(depths, dtype=np.int64).ravel()
    top = int(d.max()) if d.size else 1
    if kinds is None and names is None:
        return max(1, top)
    at = d == top
    head = (kinds is not None and any(str(k) in ("output", "norm") for k in np.asarray(kinds)[at])
            or names is not None and any(str(n).startswith(("output", "norm"))
                                         for n in np.asarray(names)[at]))
    return max(1, top if head and top > 0 else top + 1)


def group_rho(rho, numel, axis: int = -1):
    """rho of a group of tensors (the project's one group statistic): the rms over the
    group's coordinates of g / eps, sqrt(sum_t numel_t rho_t^2 / sum_t numel_t) with
    rho_t = rms(g_t) / eps_t (each tensor's own eps); equivalently, for one eps,
    sqrt(sum of g^2 over the group / numel of the group) / eps. `rho` [..., tensors] along
    `axis`, `numel` [tensors]; NaN tensors are left out (NaN when none is finite)."""
    r = np.moveaxis(np.asarray(rho, dtype=np.float64), axis, -1)
    w = np.asarray(numel, dtype=np.float64)
    ok = np.isfinite(r)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(np.where(ok, r * r, 0.0) @ w / (ok @ w))
