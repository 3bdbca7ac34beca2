"""Reading Megatron's optimizers and parallel layout: leaf optimizers, (model, main) parameter
pairs, hyper-parameters, the ranks that own each element."""

from __future__ import annotations

import sys
from typing import Dict

import torch

from fullscale.probe.settings import ProbeError


def leaf_optimizers(optimizer) -> list:
    """The non-chained Megatron optimizers under `optimizer` (ChainedOptimizer's
    `chained_optimizers`, recursively)."""
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is None:
        return [optimizer]
    return [leaf for s in subs for leaf in leaf_optimizers(s)]


def _inner(leaf):
    """The torch optimizer that holds Adam's state."""
    inner = getattr(leaf, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "state") else leaf


def _pairs(leaf):
    """(model param, main param, start, stop) for every tensor `leaf` updates; start:stop
    is the flat range of the model parameter the main parameter holds."""
    out = []
    if hasattr(leaf, "shard_fp32_from_float16_groups"):            # DistributedOptimizer
        groups = list(zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups)) + \
            list(zip(leaf.model_fp32_groups, leaf.shard_fp32_groups))
        for model_group, main_group in groups:
            for p, main in zip(model_group, main_group):
                if main is None:
                    raise ProbeError("distributed optimizer without fp32 main parameters "
                                     "(precision-aware optimizer): not supported by the probe")
                r = leaf._get_model_param_range_map(p)["param"]
                out.append((p, main, int(r.start), int(r.end)))
    elif hasattr(leaf, "fp32_from_float16_groups"):                # Float16Optimizer...
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out.append((p, main, 0, p.numel()))
        for group in leaf.fp32_from_fp32_groups:
            for p in group:
                out.append((p, p, 0, p.numel()))
    else:                                                          # FP32Optimizer, torch
        for group in _inner(leaf).param_groups:
            for p in group["params"]:
                out.append((p, p, 0, p.numel()))
    return out


def _group_of(inner, main) -> dict:
    for g in inner.param_groups:
        for q in g["params"]:
            if q is main:
                return g
    raise ProbeError("a main parameter is in none of its optimizer's param groups")


def hyper_params(optimizer) -> Dict[str, float]:
    """b1, b2, eps, lr, weight_decay of the (first non-empty) param group, checking that
    b1, b2, eps agree across groups (the metrics assume one eps)."""
    groups = [g for leaf in leaf_optimizers(optimizer) for g in _inner(leaf).param_groups
              if g["params"]]
    if not groups:
        raise ProbeError("optimizer has no parameters")
    g0 = groups[0]
    for g in groups[1:]:
        if tuple(g["betas"]) != tuple(g0["betas"]) or g["eps"] != g0["eps"]:
            raise ProbeError(f"param groups disagree on betas/eps ({g['betas']}, {g['eps']} vs "
                             f"{g0['betas']}, {g0['eps']})")
    b1, b2 = (float(x) for x in g0["betas"])
    lrs = [float(g["lr"]) for g in groups]
    return {"b1": b1, "b2": b2, "eps": float(g0["eps"]), "lr": max(lrs),
            "weight_decay": float(g0.get("weight_decay", 0.0))}


def _parallel_ranks() -> Dict[str, int]:
    """tp, dp (with context parallel), expert-dp ranks and pp first/last stage flags;
    zeros / True without megatron's parallel_state (a single-process model)."""
    out = {"tp": 0, "dp": 0, "edp": 0, "pp_first": True}
    ps = sys.modules.get("megatron.core.parallel_state")   # loaded by any Megatron model
    if ps is None:
        return out
    try:
        if not ps.model_parallel_is_initialized():
            return out
        out["tp"] = ps.get_tensor_model_parallel_rank()
        try:
            out["dp"] = ps.get_data_parallel_rank(with_context_parallel=True)
        except TypeError:   # old signature
            out["dp"] = ps.get_data_parallel_rank()
        for fn in ("get_expert_data_parallel_rank", "get_data_modulo_expert_parallel_rank"):
            if hasattr(ps, fn):
                try:
                    out["edp"] = getattr(ps, fn)()
                    break
                except Exception:  # noqa: BLE001 - no expert groups in this run
                    pass
        out["pp_first"] = ps.is_pipeline_first_stage(ignore_virtual=True)
    except (AttributeError, AssertionError, RuntimeError) as e:
        raise ProbeError(f"megatron parallel_state: {e}") from None
    return out


def _distopt_instance(leaf) -> int:
    """This rank's index among distributed-optimizer instances (0 when only one)."""
    grp = getattr(leaf, "inter_distributed_optimizer_instance_group", None)
    if grp is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=grp)


def _step_of(state: dict, group: dict) -> int:
    k = state.get("step", group.get("step"))
    if k is None:
        raise ProbeError("no Adam step count in the optimizer state or param group")
    return int(k.item() if isinstance(k, torch.Tensor) else k)
