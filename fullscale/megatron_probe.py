"""Per-tensor Adam telemetry inside an unmodified Megatron-LM / MindSpeed-LLM run.

docs/mindspeed_probe.md is the user's guide: what it needs on the cluster (python >= 3.8,
torch >= 2.1 + torch_npu, numpy; no jax / pandas / scipy), how to add it to a run (the
generated script, `python -m fullscale.megatron_probe ... -- pretrain_gpt.py ARGS`, or
`install()` after MindSpeed-LLM's adaptor import), which optimizer attributes it reads,
how it names tensors, and its cost. What is only here:

`megatron.training.training.train_step` receives `model` (a list of model chunks) and
`optimizer` as its 3rd and 4th arguments in every Megatron version since 2023. On logged
steps every rank computes the `adamspike.metrics.SUM_FIELDS` sums (and r-histogram counts)
of the elements it owns, one (num_tensors, 14 [+ 64]) float64 table is all-reduced over the
world, and the last rank turns it into `layers` / `hists` rows with
`adamspike.metrics.finalize`; a `steps` row is written every step.

Ownership (each element counts once): non-distributed optimizer: DP rank 0 of the
data-parallel-with-context-parallel group (expert parameters: expert-DP rank 0);
distributed optimizer: every DP rank's disjoint slice, only instance 0 when there are
several optimizer instances; non-split tensors (`tensor_model_parallel` false): TP rank 0;
a tied embedding: not the copy on the last stage (`shared_embedding` off the first stage).
The tensor list is the union over all ranks (one `all_gather_object` at the first logged
step). Elementwise math in float64 (cpu, cuda) or float32 (npu, where float64 kernels are
not dependable); counts are integer sums.

Online curvature proxy (`MegatronProbe._secant_step`, simulate.program's Secant): every
step each rank adds its owned elements' part of (g_t - g_{t-1}) . u_{t-1},
u_{t-1}' P_{t-1}^-1 u_{t-1} and |u_{t-1}|^2 (g the pre-clip gradient, u the applied change of
the fp32 main parameters, P^-1 = (sqrt(v_hat) + eps) / c_t) to block sums; they travel in
spare columns of the telemetry table's flag row (no extra collective) and the writer rank
writes one `curvature` row (group "update") per telemetry step: the Rayleigh quotient of
P^(1/2) H P^(1/2) along the block's updates (S_secant = lr q / 2) and that of H. Costs two
fp32 copies of the owned shard and a few dot products per step.

Settings come from install()'s arguments or the environment: ADAMSPIKE_PROBE_OUT (the run
directory; required), ADAMSPIKE_PROBE_EVERY (telemetry every K steps, default 10),
ADAMSPIKE_PROBE_HIST_EVERY (histograms every H steps, 0 = never, default 100),
ADAMSPIKE_PROBE_SECANT (the curvature proxy, 0 = off, default 1),
ADAMSPIKE_PROBE_FLUSH_S (seconds between flushes, default 60), ADAMSPIKE_PROBE_TIMEOUT_S
(the probe's collectives, default 120), and the actions' variables (ProbeActions.from_env).

Actions (docs/mindspeed_probe.md, "At a spike"): before each update the loss and grad-norm
rules (adamspike.spikes) judge all-reduced values, and skip-step returns Megatron's "update
not successful" on every rank; alarms of predictions.json on telemetry steps; the restart
recipe. Fail-open (same doc): every probe error is caught, travels with the next probe
collective (on the probe's own gloo group, with a timeout), and turns the probe off on every
rank at the same point; invariant: the sequence of probe collectives depends only on
agreed state (step, settings, agreed flags), never on a local error.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import importlib
import importlib.util
import json
import math
import os
import re
import runpy
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS, finalize

TRAIN_STEP = "megatron.training.training.train_step"
NUM_SUMS = len(SUM_FIELDS)
_COL = {f: i for i, f in enumerate(SUM_FIELDS)}
ENV_PREFIX = "ADAMSPIKE_PROBE_"


class ProbeError(RuntimeError):
    """The probe cannot read this optimizer / model (named in the message)."""


class _NeedsCluster(ProbeError):
    """An action needs the cluster extra's pandas (adamspike.spikes / .predictions)."""


# ----------------------------------------------------------------------------- names

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


# ----------------------------------------------------------------------------- optimizer

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


# ----------------------------------------------------------------------------- parallel

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


# ----------------------------------------------------------------------------- kernels

_FLOAT_COLS = [i for i, f in enumerate(SUM_FIELDS) if f not in ("n", "sat", "eps_small")]
_INT_COLS = [SUM_FIELDS.index(f) for f in ("n", "sat", "eps_small")]
# the float table's last row: column 0 the error flag, _SECANT_COLS the secant's block
# sums (num, den, uu) and its usable-step count, all-reduced with the table
_SECANT_COLS = slice(1, 5)
assert len(_FLOAT_COLS) >= 5


def update_direction(m, v, bc1, bc2, eps, zero_eps: bool):
    """m_hat, v_hat, sqrt(v_hat) and r = m_hat / (sqrt(v_hat) + eps) of exp_avg m and
    exp_avg_sq v (bc1, bc2 = 1 - b1^t, 1 - b2^t and eps: numbers, or tensors broadcasting
    against m); zero_eps: some eps is 0 (r = 0 where v_hat = 0 instead of 0/0)."""
    m_hat, v_hat = m / bc1, v / bc2
    s = torch.sqrt(v_hat)
    r = m_hat / (s + eps)
    if zero_eps:
        r = torch.where(v_hat > 0, r, 0.0)
    return m_hat, v_hat, s, r


def adam_terms(g, m, v, p, bc1, bc2, eps, zero_eps: bool, b1: float, m_prev=None):
    """The elementwise terms of SUM_FIELDS[1:] (g2 .. p2; sat and eps_small as bool) and r,
    shared by the probe and fullscale.telemetry's block kernel. m, v: exp_avg, exp_avg_sq
    after the step; g the gradient it consumed; p the parameter after the step; m_prev None:
    reconstructed as (m - (1 - b1) g) / b1."""
    m_hat, v_hat, s, r = update_direction(m, v, bc1, bc2, eps, zero_eps)
    g2, r2 = g * g, r * r
    denom = torch.maximum(v_hat, eps * eps) if torch.is_tensor(eps) else torch.clamp(v_hat, min=eps * eps)
    if zero_eps:  # v_hat = 0 implies g = 0 (v >= (1 - b2) g^2): count 0
        q = torch.where(denom > 0, g2 / torch.where(denom > 0, denom, 1.0), 0.0)
    else:
        q = g2 / denom
    if m_prev is None:
        m_prev = (m - (1 - b1) * g) / b1
    return (g2, r, r2, r2 * r, r2 * r2, q, r.abs() > SAT_THRESHOLD, s < eps, m_hat * m_hat, v_hat,
            g * m_prev, m_prev * m_prev, p * p), r


def shard_sums(g, m, v, p, bc1: float, bc2: float, b1: float, eps: float, fresh: bool,
               dtype: torch.dtype, hist_edges: Optional[torch.Tensor] = None):
    """One owned slice's SUM_FIELDS sums, on its device and without a host sync: (the 11
    real-valued sums in _FLOAT_COLS order, float64 or float32 on npu; the int64 counts n,
    sat, eps_small [+ the NUM_HIST_BINS r-histogram counts when `hist_edges`, the 63
    inner edges, is given]). bc1, bc2 = 1 - b1^t, 1 - b2^t; fresh: t = 1 (m_prev = 0)."""
    g, m, v, p = (x.reshape(-1).to(dtype) for x in (g, m, v, p))
    acc = torch.float64 if dtype == torch.float64 or g.device.type != "npu" else dtype
    terms, r = adam_terms(g, m, v, p, bc1, bc2, eps, eps == 0, b1)
    sums = [t.sum(dtype=acc) for i, t in enumerate(terms) if i not in (6, 7)]
    if fresh:   # m_prev = 0 exactly (m_t - (1 - b1) g is rounding noise)
        sums[8:10] = [torch.zeros((), dtype=acc, device=g.device)] * 2
    ints = [torch.full((1,), g.numel(), dtype=torch.int64, device=g.device),
            terms[6].sum().reshape(1), terms[7].sum().reshape(1)]
    if hist_edges is not None:
        ints.append(bin_counts(r, hist_edges, NUM_HIST_BINS))
    return torch.stack(sums), torch.cat([x.to(torch.int64) for x in ints])


def rounded_edges(edges, dtype: torch.dtype) -> torch.Tensor:
    """Histogram edges (float64) rounded up to `dtype`, so `e <= x` in dtype is numpy's
    float64 decision on the same x (the probe's and fullscale.telemetry's r histograms)."""
    npdt = np.float64 if dtype == torch.float64 else np.float32
    e = np.asarray(edges, dtype=np.float64)
    out = e.astype(npdt)
    up = out.astype(np.float64) < e
    out[up] = np.nextafter(out[up], np.array(np.inf, dtype=npdt))
    return torch.from_numpy(out)


def bin_counts(x: torch.Tensor, inner_edges: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 counts (num_bins,) of x, bin i holding e_i <= x < e_{i+1} (`inner_edges`: the
    edges without the first and last): values outside in the end bins, NaN in the last."""
    idx = torch.bucketize(x, inner_edges, right=True)
    idx = torch.where(torch.isnan(x), torch.full_like(idx, num_bins - 1), idx)
    return torch.bincount(idx, minlength=num_bins)


def _step_of(state: dict, group: dict) -> int:
    k = state.get("step", group.get("step"))
    if k is None:
        raise ProbeError("no Adam step count in the optimizer state or param group")
    return int(k.item() if isinstance(k, torch.Tensor) else k)


# ----------------------------------------------------------------------------- writers

def _atomic_write(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _clean(o):
    # A copy of adamspike.rundir.json_clean: this probe runs inside a Megatron job on
    # python 3.8 and must import with torch + numpy only (no adamspike, no pandas).
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        return _clean(o.item())
    if isinstance(o, np.ndarray):
        return _clean(o.tolist())
    return o


class PlainRunWriter:
    """The run-directory writer without pandas / pyarrow: run.json, events.jsonl and
    TABLE/part-NNNNNN.jsonl parts (one JSON object per row; non-finite floats as null),
    each part written to a temporary name, fsynced and renamed (a crash loses at most the
    rows since the last flush). Read by adamspike.rundir.load_run. Same API subset as
    RunWriter: log_step, log_layers(columns=), log_hist, log_curvature, event, flush, close."""

    TABLES = ("steps", "layers", "hists", "curvature")

    def __init__(self, path: str, *, backend: str, config: dict, env: dict,
                 extra_meta: Optional[dict] = None, resume_from_step: Optional[int] = None,
                 flush_every_s: float = 60.0, hist_edges=HIST_EDGES):
        self.path = str(path)
        self.flush_every_s = float(flush_every_s)
        self._rows: Dict[str, List[dict]] = {t: [] for t in self.TABLES}
        self._last = time.monotonic()
        meta_path = os.path.join(self.path, "run.json")
        if resume_from_step is None:
            if os.path.exists(meta_path) or (os.path.isdir(self.path) and os.listdir(self.path)):
                raise ProbeError(f"{self.path}: run directory exists and is not empty")
            for t in self.TABLES:
                os.makedirs(os.path.join(self.path, t), exist_ok=True)
            meta = {"schema_version": 1, "backend": backend, "config": config, "environment": env,
                    "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "hist_edges": [float(x) for x in hist_edges], **(extra_meta or {})}
            _atomic_write(meta_path, json.dumps(_clean(meta), indent=2).encode())
            self._next = {t: 0 for t in self.TABLES}
        else:
            self._next = {t: self._truncate(t, int(resume_from_step)) for t in self.TABLES}
            self.event("resume", step=int(resume_from_step))

    def _parts(self, table: str) -> List[str]:
        d = os.path.join(self.path, table)
        return sorted(f for f in os.listdir(d) if f.startswith("part-") and f.endswith(".jsonl"))

    def _truncate(self, table: str, step: int) -> int:
        d = os.path.join(self.path, table)
        os.makedirs(d, exist_ok=True)
        for f in self._parts(table):
            full = os.path.join(d, f)
            with open(full, encoding="utf-8") as fh:
                rows = [json.loads(x) for x in fh if x.strip()]
            keep = [r for r in rows if r["step"] <= step]
            if not keep:
                os.unlink(full)
            elif len(keep) < len(rows):
                _atomic_write(full, "".join(json.dumps(r) + "\n" for r in keep).encode())
        parts = self._parts(table)
        return int(parts[-1][5:11]) + 1 if parts else 0

    def log_step(self, **row) -> None:
        self._rows["steps"].append(row)
        self._maybe_flush()

    def log_layers(self, step: int, columns: dict) -> None:
        n = len(columns["name"])
        cols = {k: (list(v) if not isinstance(v, np.ndarray) else v.tolist()) for k, v in columns.items()}
        self._rows["layers"].extend({"step": int(step), **{k: cols[k][i] for k in cols}}
                                    for i in range(n))
        self._maybe_flush()

    def log_hist(self, step: int, name: str, depth: int, kind: str, counts) -> None:
        self._rows["hists"].append({"step": int(step), "name": name, "depth": int(depth),
                                    "kind": kind, "counts": [int(c) for c in counts]})

    def log_curvature(self, step: int, group: str, precond_curvature: float,
                      raw_curvature: float, lr: float) -> None:
        self._rows["curvature"].append({"step": int(step), "group": str(group),
                                        "precond_curvature": float(precond_curvature),
                                        "raw_curvature": float(raw_curvature), "lr": float(lr)})
        self._maybe_flush()

    def event(self, type: str, **fields) -> None:
        line = json.dumps(_clean({"time": time.time(), "type": type, **fields}), allow_nan=False)
        with open(os.path.join(self.path, "events.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        for t, rows in self._rows.items():
            if rows:
                name = os.path.join(self.path, t, f"part-{self._next[t]:06d}.jsonl")
                _atomic_write(name, "".join(json.dumps(_clean(r), allow_nan=False) + "\n"
                                            for r in rows).encode())
                self._next[t] += 1
                self._rows[t] = []
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()


def open_writer(path: str, *, config: dict, env: dict, extra_meta: dict,
                resume_from_step: Optional[int], flush_every_s: float, plain: bool = False):
    """RunWriter (parquet) when adamspike.rundir imports (pandas + pyarrow), else the
    plain writer. A run directory keeps the format it was started with."""
    if resume_from_step is not None and os.path.isdir(os.path.join(path, "steps")):
        plain = plain or any(f.endswith(".jsonl") for f in os.listdir(os.path.join(path, "steps")))
    if not plain:
        try:
            # lazy: pandas + pyarrow, which a 910B node may lack (then the plain JSON-lines writer)
            from adamspike.rundir import RunWriter
        except ImportError:
            plain = True
    if plain:
        return PlainRunWriter(path, backend="megatron", config=config, env=env,
                              extra_meta=extra_meta, resume_from_step=resume_from_step,
                              flush_every_s=flush_every_s)
    return RunWriter(path, backend="megatron", config=config, env=env, extra_meta=extra_meta,
                     resume_from_step=resume_from_step, flush_every_s=flush_every_s)


# ----------------------------------------------------------------------------- actions

RECIPE = "restart_recipe.sh"
RULES = ("loss", "grad_norm")


class ProbeActions:
    """What the probe does at a spike (docs/mindspeed_probe.md, "At a spike"); every
    action can be switched off.

    rules: the online spike rules judged before each update, ("loss", "grad_norm") or a
      subset: adamspike.spikes.RollingSpikeDetector (the rule `adamspike analyze` applies
      offline) with SpikeParams(window, k, min_rel_jump), on the loss Megatron's loss
      function returned and on the global grad norm before clipping.
    skip: skip the optimizer update when a rule fires (every rank: the decision is
      all-reduced), at most `skip_budget` times; after that the update is applied and an
      "alarm" (rule probe.skip_budget) is raised once.
    recipe: write RUN/restart_recipe.sh at a spike: the PaLM rollback + batch skip as
      Megatron arguments (--load, --ckpt-step, --iterations-to-skip).
    predictions: a predictions.json whose armed alarm rules are evaluated on every
      telemetry step (fullscale.alarms.Alarms: adamspike.predictions.OnlineAlarms, the
      trainer's and the offline analysis' rule); None: no alarms.
    """

    def __init__(self, rules=RULES, *, skip: bool = True, skip_budget: int = 10,
                 recipe: bool = True, predictions: Optional[str] = None,
                 window: int = 50, mad_k: float = 6.0, min_rel_jump: float = 0.2,
                 rollback_steps: int = 100, skip_batches: int = 200):
        rules = tuple(rules)
        bad = [r for r in rules if r not in RULES]
        if bad:
            raise ProbeError(f"{ENV_PREFIX}RULES: unknown rule(s) {bad}; known: {', '.join(RULES)}")
        if skip_budget < 0 or rollback_steps < 0 or skip_batches < 0:
            raise ProbeError("skip budget, rollback steps and skip batches must be >= 0")
        self.rules, self.skip, self.skip_budget = rules, bool(skip) and bool(rules), int(skip_budget)
        self.recipe = bool(recipe) and bool(rules)
        self.rollback_steps, self.skip_batches = int(rollback_steps), int(skip_batches)
        self.spike_params = None
        if rules:
            try:
                # lazy: adamspike.spikes needs pandas (the cluster extra), which a bare
                # 910B node may lack; then the rules are off, telemetry stays
                from adamspike.spikes import SpikeParams
            except ImportError as e:
                raise _NeedsCluster(f"the loss / grad-norm rules need adamspike.spikes ({e}): "
                                 f"pip install -e .[cluster], or {ENV_PREFIX}RULES=0") from None
            self.spike_params = SpikeParams.from_table(
                {"window": window, "k": mad_k, "min_rel_jump": min_rel_jump, "log": False,
                 "absorb": False})
        self.alarms = None
        if predictions:
            try:
                # lazy: adamspike.predictions needs pandas (the cluster extra)
                from fullscale.alarms import Alarms
                self.alarms = Alarms(predictions)
            except ImportError as e:
                raise _NeedsCluster(f"{ENV_PREFIX}PREDICTIONS needs adamspike.predictions ({e}): "
                                 "pip install -e .[cluster]") from None
            except (OSError, ValueError) as e:
                raise ProbeError(f"{ENV_PREFIX}PREDICTIONS={predictions}: {e}") from None

    @classmethod
    def from_env(cls, env=None) -> "ProbeActions":
        """From ADAMSPIKE_PROBE_RULES (comma list, 0 / none: off; default loss,grad_norm),
        _SKIP (0/1, default 1), _SKIP_BUDGET (10), _RECIPE (0/1, 1), _PREDICTIONS (path;
        _ALARMS=0 ignores it), _SPIKE_WINDOW (50), _SPIKE_MAD_K (6), _SPIKE_MIN_REL_JUMP
        (0.2), _ROLLBACK_STEPS (100), _SKIP_BATCHES (200)."""
        env = os.environ if env is None else env

        def get(key, default, conv):
            v = env.get(ENV_PREFIX + key)
            if v is None or v == "":
                return default
            try:
                return conv(v)
            except ValueError:
                raise ProbeError(f"{ENV_PREFIX}{key}: cannot read {v!r}") from None

        def flag(v):
            if v.lower() in ("1", "true", "yes", "on"):
                return True
            if v.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(v)

        given = get("RULES", None, str)
        rules = ",".join(RULES) if given is None else given
        rules = () if rules.lower() in ("0", "none", "off", "false") else \
            tuple(r.strip() for r in rules.split(",") if r.strip())
        preds = get("PREDICTIONS", None, str) if get("ALARMS", True, flag) else None
        kw = dict(skip=get("SKIP", True, flag), skip_budget=get("SKIP_BUDGET", 10, int),
                  recipe=get("RECIPE", True, flag), predictions=preds,
                  window=get("SPIKE_WINDOW", 50, int), mad_k=get("SPIKE_MAD_K", 6.0, float),
                  min_rel_jump=get("SPIKE_MIN_REL_JUMP", 0.2, float),
                  rollback_steps=get("ROLLBACK_STEPS", 100, int),
                  skip_batches=get("SKIP_BATCHES", 200, int))
        try:
            return cls(rules, **kw)
        except _NeedsCluster as e:
            if given is not None and "adamspike.spikes" in str(e):
                raise               # rules asked for explicitly
            # a node without pandas: rules and alarms off, telemetry stays
            out = cls((), **{**kw, "predictions": None})
            out.note = str(e)
            return out

    note = ""

    def describe(self) -> str:
        if not self.rules:
            return "rules off (telemetry only" + (f": {self.note})" if self.note else ")")
        s = f"rules {'+'.join(self.rules)}"
        s += f", skip-step on (budget {self.skip_budget})" if self.skip else ", skip-step off"
        s += ", restart recipe on" if self.recipe else ", restart recipe off"
        return s + (f", alarms from {self.alarms.path}" if self.alarms is not None else ", no alarms")


class _SpikeRules:
    """One RollingSpikeDetector per rule (identical on every rank: same all-reduced
    inputs in the same order)."""

    def __init__(self, actions: ProbeActions):
        self.det = {r: actions.spike_params.detector() for r in actions.rules}

    def update(self, loss: Optional[float], grad_norm: Optional[float]) -> List[dict]:
        fired = []
        for metric, v in (("loss", loss), ("grad_norm", grad_norm)):
            d = self.det.get(metric)
            if d is None or v is None:
                continue
            if d.update(v):
                fired.append({"metric": metric, "value": float(v), "baseline": d.baseline,
                              "threshold": d.threshold})
        return fired


def _loss_scale(optimizer) -> float:
    """Megatron's loss scale (fp16; 1 for bf16 / fp32 and plain torch optimizers)."""
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "grad_scaler", None) is not None:
            try:
                return float(leaf.get_loss_scale())
            except Exception:  # noqa: BLE001 - no scaler API: unscaled
                return 1.0
    return 1.0


def _op(alarms, rule_id: str) -> str:
    for r in getattr(alarms, "rules", []):
        if r.id == rule_id:
            return r.op
    return ">"


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


def _comment_safe(text: str) -> str:
    """`text` for a shell comment line: control characters as Python escapes."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: repr(m.group())[1:-1], str(text))


def write_restart_recipe(out: str, step: int, reason: str, margs, actions: ProbeActions) -> dict:
    """RUN/restart_recipe.sh for the spike at `step` (replaced at every spike); returns
    the restart_recipe event's fields."""
    r = restart_recipe(step, margs, actions)
    lo, hi = r["iterations_to_skip"]
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
             "# Add to the job's Megatron arguments (Megatron-LM core_v0.12, MindSpeed-LLM 2.2+; its",
             "# loop skips logged iteration N+1 for a value N; Megatron-LM after core_v0.12 takes",
             f"# the logged numbers: $(seq -s ' ' {first} {last})):",
             "# shellcheck disable=SC2046",
             f"RESTART_ARGS=(--load {load_word}" + (f" --ckpt-step {r['ckpt_step']}" if r["ckpt_step"] is not None else "")
             + f" --iterations-to-skip $(seq -s ' ' {lo} {hi}))"]
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


# ----------------------------------------------------------------------------- probe

class _Slot:
    """One owned slice of a model tensor on this rank."""
    __slots__ = ("row", "model", "main", "start", "stop", "inner", "group")

    def __init__(self, row, model, main, start, stop, inner, group):
        self.row, self.model, self.main, self.start, self.stop = row, model, main, start, stop
        self.inner, self.group = inner, group


class MegatronProbe:
    """Per-tensor Adam telemetry of a Megatron model + optimizer.

    `collect(model, optimizer, step)` after optimizer.step() on every rank (collective on
    logged steps) returns the (num_tensors, NUM_SUMS [+ NUM_HIST_BINS]) all-reduced table
    and writes it on the writer rank; `after_train_step(...)` is what the train_step
    wrapper calls (steps row + collect).

    Args:
      out: the run directory (created by the writer rank; resumed when it exists).
      every, hist_every: telemetry every K steps, histograms every H (0: never).
      precision: "float64" | "float32" elementwise dtype (npu: float32 always).
      writer_rank: the rank that writes (default: the last, where Megatron logs).
      config: extra run.json config (e.g. model / train sections).
      plain: force the plain JSON-lines writer.
      actions: ProbeActions (online rules, skip-step, alarms, restart recipe); None: off
        (telemetry only). install() builds them from the environment.
      timeout_s: timeout of the probe's collectives (its own gloo group).
      secant: the online curvature proxy (`_secant_step`; a `curvature` row of group
        "update" per telemetry step); False: off (no copies of the parameters kept).
      inject: test hook, called as inject(point, step) at the probe's failure points.

    Fail-open: every probe error is caught, reported with the next collective (an error
    flag all-reduced with the data, or a collective that times out after `timeout_s`),
    and then the probe is off on every rank; `disabled_reason` says why, one line is
    printed by the rank that failed, and train_step runs unwrapped from then on.
    """

    def __init__(self, out: str, *, every: int = 10, hist_every: int = 100,
                 precision: str = "float64", writer_rank: Optional[int] = None,
                 config: Optional[dict] = None, flush_every_s: float = 60.0,
                 plain: bool = False, actions: Optional["ProbeActions"] = None,
                 timeout_s: float = 120.0, secant: bool = True, inject=None):
        if every < 1 or hist_every < 0:
            raise ProbeError(f"every must be >= 1 and hist_every >= 0, got {every}, {hist_every}")
        if precision not in ("float32", "float64"):
            raise ProbeError(f"precision must be float32 or float64, got {precision!r}")
        self.out, self.every, self.hist_every = str(out), int(every), int(hist_every)
        self.precision = precision
        self.extra_config = dict(config or {})
        self.flush_every_s, self.plain = float(flush_every_s), bool(plain)
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.writer_rank = self.world - 1 if writer_rank is None else int(writer_rank)
        self.writer = None
        self._layout = None          # (names, depth, kind, slots) once built
        self._optimizer_id = None
        self.overhead_s = 0.0        # time spent in the probe (this rank)
        self.timeout_s = float(timeout_s)
        self.inject = inject
        self.actions = actions
        self.disabled = False
        self.disabled_reason = ""
        self._error: Optional[str] = None     # a local error not yet agreed on
        self._pg = None                       # the probe's gloo group (lazy)
        self._pending: List[Tuple[str, dict]] = []   # events for the writer
        self._spikes = None                   # _SpikeRules once the rules are on
        self.skips = 0                        # updates skipped by the probe
        self._budget_alarm = False
        self._fired_text = ""
        self._skip_reason: Optional[str] = None
        self.last_rule_inputs: Tuple[Optional[float], Optional[float]] = (None, None)
        self.secant = bool(secant)
        self._sec_reset()
        self._sec_block = None                # (num, den, uu) block sums on the device
        self._sec_n = 0                       # usable steps in the block (this rank)
        self._sec_reading: Optional[np.ndarray] = None   # all-reduced, for the writer

    # -- fail-open -------------------------------------------------------------------
    def _group(self):
        """The probe's own gloo group with a short timeout: a failing or hung rank makes
        the others' probe collectives raise after timeout_s (instead of the job's HCCL /
        NCCL timeout), and the probe turns itself off."""
        if self._pg is None:
            self._pg = torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._pg

    def _fail(self, e: BaseException, step: int) -> None:
        """A local error: remembered, reported to the other ranks at the next collective."""
        if self._error is None:
            self._error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self._error_step = int(step)

    def _say(self, msg: str) -> None:
        try:
            print(f"adamspike probe: {msg}", flush=True)
        except Exception:  # noqa: BLE001 - a closed stdout must not stop training
            pass

    def _disable(self, step: int, why: Optional[str] = None) -> None:
        """Off on this rank (every rank reaches this at the same collective). The rank
        with the error prints the one line."""
        if self.disabled:
            return
        self.disabled = True
        mine = why or self._error
        self.disabled_reason = mine or "an error on another rank"
        if mine:
            self._say(f"disabled on every rank at step {step} (rank {self.rank}: {mine}); "
                      "training continues without it")
        try:
            if self.writer is not None:
                self.writer.event("probe_disabled", step=int(step), reason=self.disabled_reason,
                                  rank=self.rank)
                self.writer.close()
        except Exception:  # noqa: BLE001 - the writer may be what failed
            pass
        self.writer = None

    def _collective(self, fn, step: int) -> bool:
        """Run one probe collective; a failure or timeout disables the probe here."""
        try:
            if self.inject is not None:
                self.inject("collective", step)
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e, step)
            self._disable(step, self._error)
            return False

    def _agree(self, step: int) -> bool:
        """All ranks learn whether any has a pending error (one all-reduce); False when
        the probe is now disabled."""
        if self.world == 1:
            if self._error is not None:
                self._disable(step)
                return False
            return True
        flag = torch.tensor([0.0 if self._error is None else 1.0], dtype=torch.float64)
        if not self._collective(lambda: torch.distributed.all_reduce(flag, group=self._group()), step):
            return False
        if float(flag[0]) > 0:
            self._disable(step)
            return False
        return True

    def guarded(self, what: str, step: int, fn, *a, **k):
        """fn(*a, **k) with any exception caught (a pending error); None on failure."""
        if self.disabled or self._error is not None:
            return None
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e, step)
            return None

    # -- layout ----------------------------------------------------------------------
    def _local_layout(self, chunks, optimizer) -> list:
        """This rank's owned slices (no collective)."""
        names = global_names(chunks)
        cfg = getattr(chunks[0], "config", None)
        self._cfg_layers = int(getattr(cfg, "num_layers", 0) or 0)
        self._gated = bool(getattr(cfg, "gated_linear_unit", True))
        ranks = _parallel_ranks()
        local: List[Tuple[str, Any, Any, int, int, Any, dict]] = []
        for leaf in leaf_optimizers(optimizer):
            inner = _inner(leaf)
            distributed = hasattr(leaf, "shard_fp32_from_float16_groups")
            instance = _distopt_instance(leaf) if distributed else 0
            for p, main, start, stop in _pairs(leaf):
                if id(p) not in names:
                    raise ProbeError("an optimizer parameter is not in model.named_parameters()")
                name = names[id(p)]
                expert = getattr(p, "allreduce", True) is False
                if distributed:
                    own = instance == 0
                else:
                    own = (ranks["edp"] if expert else ranks["dp"]) == 0
                if not getattr(p, "tensor_model_parallel", False) and ranks["tp"] != 0:
                    own = False
                if getattr(p, "shared_embedding", False) and not ranks["pp_first"] \
                        and "output_layer" in name:
                    own = False   # the last stage's copy of a tied embedding
                if own and stop > start:
                    local.append((name, p, main, start, stop, inner, _group_of(inner, main)))
        return local

    def _ensure_layout(self, chunks, optimizer, step: int) -> bool:
        """Build the tensor layout (once per optimizer): local part, agreement, one
        all_gather_object of the names. False when the probe got disabled."""
        if self._layout is not None and self._optimizer_id == id(optimizer):
            return True
        local = None
        if self._error is None:
            try:
                local = self._local_layout(chunks, optimizer)
            except Exception as e:  # noqa: BLE001 - fail open: reported at the agreement
                self._fail(e, step)
        if not self._agree(step):
            return False
        mine = sorted({x[0] for x in local})
        if self.world > 1:
            gathered: List[Any] = [None] * self.world
            if not self._collective(lambda: torch.distributed.all_gather_object(
                    gathered, mine, group=self._group()), step):
                return False
            all_names = sorted({n for part in gathered for n in part})
        else:
            all_names = mine
        try:
            if self.inject is not None:
                self.inject("layout", step)
            self._finish_layout(optimizer, local, all_names)
        except Exception as e:  # noqa: BLE001 - fail open: agreed on just below
            self._layout = None
            self._fail(e, step)
        return self._agree(step)      # every rank has a layout, or the probe is off

    def _finish_layout(self, optimizer, local, all_names) -> None:
        num_layers = self._cfg_layers
        if num_layers == 0:
            num_layers = 1 + max([int(m.group(1)) for n in all_names
                                  for m in [re.search(r"layers\.(\d+)\.", n)] if m] or [-1])
        row = {n: i for i, n in enumerate(all_names)}
        dk = [depth_kind(n, num_layers, self._gated) for n in all_names]
        slots = [_Slot(row[name], p, main, start, stop, inner, group)
                 for name, p, main, start, stop, inner, group in local]
        self.num_layers = num_layers
        self.device = slots[0].main.device if slots else torch.device("cpu")
        self.dtype = torch.float32 if (self.device.type == "npu" or self.precision == "float32") \
            else torch.float64
        self.edges = rounded_edges(HIST_EDGES[1:-1], self.dtype).to(self.device)
        self._layout = (all_names, np.array([d for d, _ in dk], dtype=np.int32),
                        [k for _, k in dk], slots)
        self._optimizer_id = id(optimizer)

    # -- per step --------------------------------------------------------------------
    def active(self, step: int) -> bool:
        return step % self.every == 0

    def hist_active(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    @torch.no_grad()
    def table(self, chunks, optimizer, step: int) -> Optional[np.ndarray]:
        """The all-reduced (num_tensors, NUM_SUMS [+ NUM_HIST_BINS]) float64 table of this
        step (collective: every rank calls it). None when the probe got disabled: a local
        error on any rank travels with the all-reduce (an extra row), so every rank
        disables at the same point."""
        if not self._ensure_layout(chunks, optimizer, step):
            return None
        names, _, _, slots = self._layout
        with_hist = self.hist_active(step)
        n_int = 3 + (NUM_HIST_BINS if with_hist else 0)
        acc = torch.float64 if self.dtype == torch.float64 or self.device.type != "npu" else self.dtype
        tf = torch.zeros((len(names) + 1, len(_FLOAT_COLS)), dtype=acc, device=self.device)
        ti = torch.zeros((len(names), n_int), dtype=torch.int64, device=self.device)
        if self._error is None:
            try:
                hp = hyper_params(optimizer)
                b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
                rows, fl, it = [], [], []
                for s in slots:
                    st = s.inner.state.get(s.main)
                    if not st or "exp_avg" not in st or s.main.grad is None:
                        continue   # no update this step (skipped iteration): rows stay 0
                    t = _step_of(st, s.group)
                    f, i = shard_sums(s.main.grad, st["exp_avg"], st["exp_avg_sq"], s.main,
                                      1 - b1 ** t, 1 - b2 ** t, b1, eps, t == 1, self.dtype,
                                      self.edges if with_hist else None)
                    rows.append(s.row)
                    fl.append(f)
                    it.append(i)
                if self.inject is not None:
                    self.inject("table", step)
                # one table per kind on the device: float sums, exact int64 counts
                if rows:
                    idx = torch.tensor(rows, dtype=torch.long, device=self.device)
                    tf.index_add_(0, idx, torch.stack(fl))
                    ti.index_add_(0, idx, torch.stack(it))
                if self.secant and self._sec_block is not None:
                    # the secant's block sums ride in the flag row's spare columns
                    tf[-1, 1:4] = self._sec_block.to(acc)
                    tf[-1, 4] = float(self._sec_n)
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        if self._error is not None:
            tf.zero_()
            ti.zero_()
            tf[-1, 0] = 1.0
        tf, ti = tf.cpu(), ti.cpu()      # the probe's collectives run on its gloo group
        if self.world > 1:
            if not self._collective(lambda: torch.distributed.all_reduce(tf, group=self._group()), step):
                return None
        if float(tf[-1, 0]) > 0:
            self._disable(step)
            return None
        if self.secant:      # this block's sums, summed over ranks; the next block starts
            self._sec_reading = tf[-1, _SECANT_COLS].to(torch.float64).numpy().copy()
            if self._sec_block is not None:
                self._sec_block.zero_()
            self._sec_n = 0
        if self.world > 1:
            if not self._collective(lambda: torch.distributed.all_reduce(ti, group=self._group()), step):
                return None
        tf, ti = tf[:-1].to(torch.float64).numpy(), ti.numpy()
        tab = np.zeros((len(names), NUM_SUMS + n_int - 3), dtype=np.float64)
        tab[:, _FLOAT_COLS] = tf
        tab[:, _INT_COLS] = ti[:, :3]
        tab[:, NUM_SUMS:] = ti[:, 3:]
        return tab

    def collect(self, chunks, optimizer, step: int) -> Optional[np.ndarray]:
        """Telemetry of `step` if it is logged: the table (every rank), written on the
        writer rank, and the predictions' alarm rules evaluated on it."""
        if not self.active(step) or self.disabled:
            return None
        t0 = time.perf_counter()
        tab = self.table(chunks, optimizer, step)
        reading, self._sec_reading = self._sec_reading, None
        if tab is not None and self.writer is not None:
            self.guarded("writer", step, self._write_table, optimizer, step, tab)
            if reading is not None:
                self.guarded("writer", step, self._write_secant, optimizer, step, reading)
        self.overhead_s += time.perf_counter() - t0
        return tab

    def _write_table(self, optimizer, step: int, tab: np.ndarray) -> None:
        names, depth, kind, _ = self._layout
        eps = hyper_params(optimizer)["eps"]
        sums = tab[:, :NUM_SUMS]
        ok = sums[:, 0] > 0      # tensors that were updated this step
        if not ok.any():
            return
        metrics = finalize(sums[ok], eps)
        sel = np.flatnonzero(ok)
        columns = {"name": [names[i] for i in sel], "depth": depth[sel],
                   "kind": [kind[i] for i in sel], "numel": sums[ok, 0].astype(np.int64),
                   **{k: np.asarray(metrics[k], dtype=np.float64) for k in METRIC_NAMES}}
        if self.inject is not None:
            self.inject("writer", step)
        self.writer.log_layers(step, columns=columns)
        if tab.shape[1] > NUM_SUMS:
            for i in sel:
                self.writer.log_hist(step, names[i], int(depth[i]), kind[i],
                                     np.rint(tab[i, NUM_SUMS:]).astype(np.int64))
        alarms = self.actions.alarms if self.actions is not None else None
        if alarms is not None:
            for alarm in alarms.log(self.writer, step, columns):
                self._say(f"step {step}: ALARM {alarm['rule']}: {alarm['metric']} = "
                          f"{alarm['value']:.4g} {_op(alarms, alarm['rule'])} {alarm['threshold']:g} "
                          f"({alarms.path})")

    def _write_secant(self, optimizer, step: int, reading: np.ndarray) -> None:
        """The block's `curvature` row (group "update"): q = sum num / sum den (the
        Rayleigh quotient of P^(1/2) H P^(1/2) along the block's updates; S_secant =
        lr q / 2) and sum num / sum uu (that of H), NaN where a denominator is not > 0;
        none when no step of the block was usable (simulate.program.secant_readings)."""
        num, den, uu, n = (float(x) for x in reading)
        if not n > 0:
            return
        q = num / den if den > 0 else math.nan
        raw = num / uu if uu > 0 else math.nan
        self.writer.log_curvature(step, "update", q, raw, hyper_params(optimizer)["lr"])

    # -- the online curvature proxy (S_secant) -----------------------------------------
    def _sec_reset(self) -> None:
        """Forget the previous step (a new layout, or the start): the next step only
        records its update."""
        self._sec_p: Optional[List[torch.Tensor]] = None    # owned main params after the last step
        self._sec_u: Optional[List[torch.Tensor]] = None    # u_{t-1} per slot
        self._sec_prev = None          # (g.u, u' P^-1 u, |u|^2) of u_{t-1}, this rank's part
        self._sec_prev_ok = False      # those are usable
        self._sec_layout = None        # the layout the buffers belong to

    @property
    def secant_on(self) -> bool:
        return self.secant and not self.disabled

    @torch.no_grad()
    def before_update(self, chunks, optimizer, step: int) -> None:
        """Inside train_step, before optimizer.step (every rank; the train_step wrapper):
        when the secant has no copy of the parameters yet, copy them now (p_t of this
        step), so this step's update already counts (as simulate.program's secant_init).
        Builds the layout first if it is missing (collective: every rank at the same step)."""
        if not self.secant_on or self._sec_p is not None:
            return
        t0 = time.perf_counter()
        try:
            if not self._ensure_layout(chunks, optimizer, step) or self._error is not None:
                return
            try:
                self._sec_start()
            except Exception as e:  # noqa: BLE001 - fail open
                self._sec_reset()
                self._fail(e, step)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _sec_start(self) -> None:
        slots = self._layout[3]
        self._sec_reset()
        self._sec_p = [s.main.detach().clone() for s in slots]
        self._sec_u = [torch.zeros_like(s.main) for s in slots]
        self._sec_layout = self._layout

    @torch.no_grad()
    def _secant_step(self, optimizer, step: int, skipped: bool, grad_norm) -> None:
        """Step t of the proxy, after optimizer.step (no collective; no host sync but
        reading Adam's step count, as `table` does; mirrors simulate.program.secant_update). The main parameters now hold p_{t+1}; s.main.grad
        the gradient g_t Adam consumed at p_t, clipped in place by Megatron's
        clip_grad_norm_fp32: its dot products are divided here by the clip factor
        min(1, clip / (grad_norm + 1e-6)) (main grads are unscaled: no loss scale). Adds
        this rank's part of

            (g_t - g_{t-1}) . u_{t-1} = g_t . u_{t-1} - g_{t-1} . u_{t-1},
            u_{t-1}' P_{t-1}^-1 u_{t-1},   |u_{t-1}|^2

        to the block sums, then keeps u_t = p_{t+1} - p_t, g_t . u_t, u_t' P_t^-1 u_t
        (P_t^-1 = (sqrt(v_hat_t) + eps) / c_t, c_t = (1 - b1) / ((1 + b1)(1 - b1^t))) and
        |u_t|^2. A step whose gradient is not known (skipped update, clipping on without a
        finite grad norm) adds nothing and neither does the next one (its g_{t-1} . u_{t-1}
        is unknown), so the block is never poisoned."""
        slots = self._layout[3]
        if self._sec_layout is not self._layout:
            self._sec_start()          # first step (or a new optimizer): only records u_t
            have_prev = False
        else:
            have_prev = True
        dtype = self.dtype
        acc = torch.float64 if dtype == torch.float64 or self.device.type != "npu" else dtype
        hp = hyper_params(optimizer)
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        g_ok, unclip = not skipped, 1.0
        clip = _clip_grad(optimizer)
        if g_ok and clip:
            gn = math.nan if grad_norm is None else float(grad_norm)
            if math.isfinite(gn):
                f = min(1.0, clip / (gn + 1e-6))
                unclip = 1.0 / f if f < 1.0 else 1.0
            else:
                g_ok = False
        use = have_prev and self._sec_prev_ok and g_ok
        new_ok = have_prev and g_ok

        def dot(a, b):
            return torch.dot(a, b) if a.dtype == acc else (a * b).sum(dtype=acc)

        # the clip factor and P_t's scalars multiply the sums, not the elements:
        # u' P^-1 u = (sum u^2 sqrt(v) / sqrt(1 - b2^t) + eps |u|^2) / c_t
        num, gu, uu = [], [], []
        by_t: Dict[int, Tuple[list, list]] = {}   # Adam's step -> (u^2 . sqrt(v), |u|^2)
        for s, pp, u in zip(slots, self._sec_p, self._sec_u):
            p = s.main.detach()
            g = s.main.grad if g_ok else None     # None after a good step: no gradient, g = 0
            if g is not None:
                g = g.detach().reshape(-1).to(dtype)
            if use and g is not None:
                num.append(dot(g, u.reshape(-1).to(dtype)))
            torch.sub(p, pp, out=u)                # u_t
            pp.copy_(p)                            # p_{t+1} for the next step
            if not new_ok:
                continue
            uf = u.reshape(-1).to(dtype)
            if g is not None:
                gu.append(dot(g, uf))
            st = s.inner.state.get(s.main)
            if not st or "exp_avg_sq" not in st:
                new_ok = False                     # no Adam state yet: P_t unknown
                continue
            w = uf * uf
            part = by_t.setdefault(max(_step_of(st, s.group), 1), ([], []))
            part[0].append(dot(w, torch.sqrt(st["exp_avg_sq"].reshape(-1).to(dtype))))
            part[1].append(w.sum(dtype=acc))
            uu.append(part[1][-1])
        zero = torch.zeros((), dtype=acc, device=self.device)

        def total(xs):
            return torch.stack(xs).sum() if xs else zero

        if self._sec_block is None or self._sec_block.device != self.device \
                or self._sec_block.dtype != acc:
            self._sec_block = torch.zeros(3, dtype=acc, device=self.device)
        if use:
            self._sec_block += torch.stack([total(num) * unclip - self._sec_prev[0],
                                            self._sec_prev[1], self._sec_prev[2]])
            self._sec_n += 1
        if new_ok:
            upu = zero
            for t, (wv, ww) in by_t.items():
                c = (1 - b1) / ((1 + b1) * (1 - b1 ** t))
                upu = upu + (total(wv) / math.sqrt(1 - b2 ** t) + eps * total(ww)) / c
            self._sec_prev = torch.stack([total(gu) * unclip, upu, total(uu)])
        else:
            self._sec_prev = None
        self._sec_prev_ok = new_ok

    # -- actions: the loss / grad-norm rules and skip-step, before the update ----------
    @property
    def rules_on(self) -> bool:
        return self.actions is not None and bool(self.actions.rules) and not self.disabled

    @torch.no_grad()
    def _local_loss_grad(self, optimizer, losses, step: int) -> List[float]:
        """This rank's (sum of losses, count, owned sum of squared gradients) before the
        update: the loss values its loss functions returned this step, and the gradient
        Megatron's grad norm is computed from (param.main_grad, the reduced fp32 gradient
        of Megatron's DDP, or .grad) over the elements this rank owns."""
        ls = lc = 0.0
        if losses:                   # device tensors: one copy to the host per step, here
            pairs = torch.stack([torch.stack([torch.as_tensor(v).float().reshape(()).cpu()
                                              if not isinstance(v, torch.Tensor) else
                                              v.float().reshape(()), torch.as_tensor(c).float()
                                              .reshape(()).to(v.device if isinstance(v, torch.Tensor)
                                                              else "cpu")])
                                 for v, c in losses]).sum(0).tolist()
            ls, lc = pairs
        gsq = 0.0
        if "grad_norm" in self.actions.rules:
            acc = []
            for s in self._layout[3]:
                g = getattr(s.model, "main_grad", None)
                if g is None:
                    g = s.model.grad
                if g is None:
                    continue
                g = g.detach().reshape(-1)[s.start:s.stop].to(self.dtype)
                acc.append(torch.dot(g, g).reshape(1))
            if acc:
                gsq = float(torch.cat(acc).to(torch.float64).sum())
        if self.inject is not None:
            self.inject("pre_step", step)
        return [ls, lc, gsq]

    def pre_step(self, chunks, optimizer, losses, step: int) -> bool:
        """Before the optimizer update, on every rank (two small collectives): this step's
        loss and grad norm judged by the rules (adamspike.spikes, the offline rule);
        True: skip the update on every rank (the decision is all-reduced)."""
        if not self.rules_on:
            return False
        t0 = time.perf_counter()
        try:
            return self._pre_step(chunks, optimizer, losses, step)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _pre_step(self, chunks, optimizer, losses, step: int) -> bool:
        if not self._ensure_layout(chunks, optimizer, step):
            return False
        vals = [0.0, 0.0, 0.0]
        if self._error is None:
            try:
                vals = self._local_loss_grad(optimizer, losses, step)
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        vec = torch.tensor([0.0 if self._error is None else 1.0] + vals, dtype=torch.float64)
        if self.world > 1 and not self._collective(
                lambda: torch.distributed.all_reduce(vec, group=self._group()), step):
            return False
        if float(vec[0]) > 0:
            self._disable(step)
            return False
        want = 0.0
        if self._error is None:
            try:
                ls, lc, gsq = (float(x) for x in vec[1:])
                want = 1.0 if self._judge(optimizer, step, ls / lc if lc > 0 else None, gsq) else 0.0
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        dec = torch.tensor([0.0 if self._error is None else 1.0, want], dtype=torch.float64)
        if self.world > 1 and not self._collective(lambda: torch.distributed.all_reduce(
                dec, op=torch.distributed.ReduceOp.MAX, group=self._group()), step):
            return False
        if float(dec[0]) > 0:
            self._disable(step)
            return False
        if float(dec[1]) > 0:
            self.skips += 1
            what = self._fired_text or "a rule fired on another rank"
            self._skip_reason = f"probe: {what}"
            if self.rank == self.writer_rank:
                self._say(f"step {step}: {what}: optimizer update skipped on every rank "
                          f"({self.skips} of budget {self.actions.skip_budget}; "
                          f"{ENV_PREFIX}SKIP=0 turns skipping off)")
            return True
        return False

    def _judge(self, optimizer, step: int, loss: Optional[float], gsq: float) -> bool:
        """Feed the rules; events for the writer; True when the update should be skipped
        (a rule fired, skip-step on, budget left). Same inputs and state on every rank."""
        self._fired_text = ""
        if self._spikes is None:
            self._spikes = _SpikeRules(self.actions)
        scale = _loss_scale(optimizer)
        gn = None
        if "grad_norm" in self.actions.rules:
            gn = math.sqrt(gsq) / scale if gsq >= 0 else math.nan
            if not math.isfinite(gn) and scale != 1.0:
                gn = None    # fp16 overflow: Megatron's own skip handles it
        self.last_rule_inputs = (loss, gn)
        fired = self._spikes.update(loss, gn)
        if not fired:
            return False
        a = self.actions
        text = "; ".join(f"{f['metric'].replace('_', ' ')} spike {f['value']:.6g} > "
                         f"threshold {f['threshold']:.6g} (median {f['baseline']:.6g})"
                         if math.isfinite(f["value"]) else f"non-finite {f['metric'].replace('_', ' ')}"
                         for f in fired)
        self._fired_text = text
        skip = a.skip and self.skips < a.skip_budget
        action = "skip" if skip else ("none: skip budget spent" if a.skip else "none: skip-step off")
        for f in fired:
            self._pending.append(("spike", {"step": int(step), "rule": f"probe.{f['metric']}",
                                            "action": action, "reason": text, **f}))
        if a.recipe:
            self._pending.append(("_recipe", {"step": int(step), "reason": text}))
        if not skip:
            if a.skip and not self._budget_alarm:
                self._budget_alarm = True
                self._pending.append(("alarm", {"rule": "probe.skip_budget", "step": int(step),
                                                "metric": fired[0]["metric"],
                                                "value": fired[0]["value"],
                                                "threshold": fired[0]["threshold"],
                                                "skips": self.skips, "budget": a.skip_budget}))
                if self.rank == self.writer_rank:
                    self._say(f"step {step}: ALARM skip budget spent ({self.skips} of "
                              f"{a.skip_budget} updates skipped): {text}; the update is applied"
                              + ("; restart recipe: " + os.path.join(self.out, RECIPE)
                                 if a.recipe else ""))
            elif self.rank == self.writer_rank:
                self._say(f"step {step}: {text} ({action})")
        return skip

    # -- writer ----------------------------------------------------------------------
    def _open(self, optimizer, step: int, env_extra: dict) -> None:
        if self.rank != self.writer_rank or self.writer is not None:
            return
        hp = hyper_params(optimizer)
        clip = _clip_grad(optimizer)
        config = {"optim": {"lr": hp["lr"], "b1": hp["b1"], "b2": hp["b2"], "eps": hp["eps"],
                            "weight_decay": hp["weight_decay"], "grad_clip": clip},
                  "telemetry": {"every": self.every, "hist_every": self.hist_every,
                                "precision": self.precision, "secant": self.secant,
                                "source": "fullscale.megatron_probe"}}
        for k, v in self.extra_config.items():
            config[k] = {**config.get(k, {}), **v} if isinstance(v, dict) else v
        env = {"python": sys.version.split()[0], "torch": torch.__version__,
               "numpy": np.__version__, "world_size": self.world, **env_extra}
        resume = step - 1 if os.path.exists(os.path.join(self.out, "run.json")) else None
        self.writer = open_writer(self.out, config=config, env=env,
                                  extra_meta={"probe": {"writer": "fullscale.megatron_probe"}},
                                  resume_from_step=resume, flush_every_s=self.flush_every_s,
                                  plain=self.plain)
        self.writer.event("start", step=step, world_size=self.world)

    def after_train_step(self, chunks, optimizer, step: int, *, loss: float = math.nan,
                         skipped: bool = False, grad_norm: float = math.nan,
                         step_time_s: float = math.nan, tokens: Optional[int] = None,
                         env_extra: Optional[dict] = None, margs=None) -> Optional[np.ndarray]:
        """The steps row of `step` (writer rank), the actions' events and, on logged steps,
        the telemetry (returns collect's table, or None). Never raises."""
        if self.disabled:
            return None
        t0 = time.perf_counter()
        reason, self._skip_reason = self._skip_reason, None
        self.guarded("writer", step, self._write_step, optimizer, step, loss, skipped,
                     grad_norm, step_time_s, tokens, env_extra or {}, reason, margs)
        self.overhead_s += time.perf_counter() - t0
        if self.secant_on:
            self._secant(chunks, optimizer, step, skipped, grad_norm)
        return None if skipped else self.collect(chunks, optimizer, step)

    def _secant(self, chunks, optimizer, step: int, skipped: bool, grad_norm) -> None:
        """Every step, every rank: the layout (collective once, where no telemetry or
        rule built it yet), then `_secant_step` (local; an error waits for the next
        collective like every other)."""
        t0 = time.perf_counter()
        try:
            if self._ensure_layout(chunks, optimizer, step):
                self.guarded("secant", step, self._secant_step, optimizer, step, skipped,
                             grad_norm)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _write_step(self, optimizer, step, loss, skipped, grad_norm, step_time_s, tokens,
                    env_extra, skip_reason, margs) -> None:
        self._open(optimizer, step, env_extra)
        pending, self._pending = self._pending, []
        if self.writer is None:
            return
        clip = _clip_grad(optimizer)
        gn = float(grad_norm) if grad_norm is not None else math.nan
        self.writer.log_step(step=int(step), tokens=tokens, loss=float(loss),
                             lr=hyper_params(optimizer)["lr"], grad_norm=gn,
                             clipped=bool(clip and math.isfinite(gn) and gn > clip),
                             update_norm=math.nan, step_time_s=float(step_time_s),
                             skipped=bool(skipped))
        for kind, fields in pending:
            if kind == "_recipe":
                info = write_restart_recipe(self.out, fields["step"], fields["reason"], margs,
                                            self.actions)
                self.writer.event("restart_recipe", **info)
            else:
                self.writer.event(kind, **fields)
        if skipped:
            self.writer.event("skip", step=int(step), reason=skip_reason or
                              "optimizer step not applied (loss-scale overflow or nan)")
        if self.inject is not None:
            self.inject("writer", step)

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001 - at exit: one line, never a traceback
                self._say(f"closing the run directory failed: {type(e).__name__}: {e}")


def _clip_grad(optimizer) -> Optional[float]:
    for leaf in leaf_optimizers(optimizer):
        c = getattr(getattr(leaf, "config", None), "clip_grad", None)
        if c:
            return float(c)
    return None


# ----------------------------------------------------------------------------- the hook

_PROBE: Optional[MegatronProbe] = None


def _env_int(key: str, default: int) -> int:
    v = os.environ.get(ENV_PREFIX + key)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ProbeError(f"{ENV_PREFIX}{key} must be an integer, got {v!r}") from None


def _megatron_args():
    for name in ("megatron.training", "megatron"):   # Megatron-LM >= 2024.03, then older
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "get_args"):
            try:
                return mod.get_args()
            except Exception:  # noqa: BLE001 - arguments not parsed (not Megatron's loop)
                return None
    return None


def _train_step_module():
    """The module that defines train_step: megatron.training.training (Megatron-LM since
    2024.03, MindSpeed-LLM) or megatron.training (older Megatron-LM, ModelLink of early
    2024)."""
    for name in (TRAIN_STEP.rsplit(".", 1)[0], "megatron.training"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(mod, "train_step", None)):
            return mod
    raise ProbeError("no megatron train_step found (megatron.training.training or "
                     "megatron.training): is Megatron-LM on the python path?")


def _loss_of(ret) -> float:
    """'lm loss' (or the first value) of train_step's loss dict; NaN where it is empty
    (ranks off the last pipeline stage)."""
    d = ret[0] if isinstance(ret, tuple) and ret and isinstance(ret[0], dict) else None
    if not d:
        return math.nan
    v = d.get("lm loss", next(iter(d.values())))
    if isinstance(v, (tuple, list)) and len(v) == 2:    # (sum, num_tokens): core_v0.12
        return float(v[0]) / max(float(v[1]), 1.0)
    if isinstance(v, torch.Tensor):
        v = v.float()
        v = (v[0] / v[1]) if v.numel() == 2 else v.mean()
        return float(v.item())
    return float(v)


def _tokens(args) -> Optional[int]:
    if args is None:
        return None
    try:
        # lazy: Megatron is the training script's, present only under it (older ones lack this)
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size
        gbs = get_current_global_batch_size()
    except Exception:  # noqa: BLE001 - older Megatron
        gbs = getattr(args, "global_batch_size", None)
    seq = getattr(args, "seq_length", None)
    done = getattr(args, "consumed_train_samples", None)
    if gbs is None or seq is None or done is None:
        return None
    return int((done + gbs) * seq)   # train() adds this step's samples after train_step


def _loss_pair(ret) -> Optional[Tuple[Any, Any]]:
    """(sum, count) of one loss-function return's 'lm loss' (or first) value, as device
    tensors or numbers: Megatron's loss functions return (loss, {'lm loss': v}) or
    (loss, num_tokens, {'lm loss': v}) with v a scalar (older: averaged over data parallel),
    a (sum, num_tokens) pair or a 2-element tensor (core_v0.12 and newer)."""
    d = ret[-1] if isinstance(ret, tuple) and ret and isinstance(ret[-1], dict) else None
    if not d:
        return None
    v = d.get("lm loss", next(iter(d.values())))
    if isinstance(v, (tuple, list)) and len(v) == 2:
        return (v[0].detach() if isinstance(v[0], torch.Tensor) else v[0],
                v[1].detach() if isinstance(v[1], torch.Tensor) else v[1])
    if isinstance(v, torch.Tensor):
        v = v.detach().float()
        if v.numel() == 2:
            return v[0], v[1]
        return v.mean(), 1.0
    return float(v), 1.0


def _record_losses(forward_step_func, sink: list):
    """forward_step_func whose loss function also appends its (sum, count) to `sink`
    (no host sync: the values stay on the device until the optimizer step)."""

    @functools.wraps(forward_step_func)
    def forward_step(*a, **k):
        out = forward_step_func(*a, **k)
        if not (isinstance(out, tuple) and len(out) >= 2 and callable(out[1])):
            return out
        loss_func = out[1]

        def recording_loss_func(*x, **y):
            r = loss_func(*x, **y)
            try:
                pair = _loss_pair(r)
                if pair is not None:
                    sink.append(pair)
            except Exception:  # noqa: BLE001 - never in Megatron's way; no loss recorded
                pass
            return r

        return (out[0], recording_loss_func) + tuple(out[2:])

    return forward_step


def make_train_step_wrapper(probe_factory):
    """A wrapper for train_step (name ends in `_wrapper`, as MindSpeed's patch manager
    requires for stacking): calls it, then the probe with its model and optimizer.

    With the probe's rules on, train_step's forward_step_func records the loss values and
    optimizer.step is replaced for the call: before the update the probe judges the loss
    and grad norm (MegatronProbe.pre_step, collective) and, to skip, returns Megatron's
    "update not successful" (False, None, None) without stepping: Megatron's train_step
    then counts a skipped iteration and leaves the lr schedule, as at a loss-scale
    overflow. Fail-open: an error inside the probe never reaches Megatron (the probe
    disables itself on every rank and train_step runs unwrapped)."""

    def train_step_wrapper(fn):
        state = {"step": None, "grad_norm": None, "ok": True}

        def wrapped(*args, **kwargs):
            try:
                probe = probe_factory()
            except Exception as e:  # noqa: BLE001 - fail open: the probe cannot start
                probe = None
                if not state.get("said"):
                    state["said"] = True
                    print(f"adamspike probe: not started ({type(e).__name__}: {e}); "
                          "training continues without it", flush=True)
            if probe is None or probe.disabled:
                return fn(*args, **kwargs)
            model = kwargs.get("model", args[2] if len(args) > 2 else None)
            optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
            opt_step = getattr(optimizer, "step", None)
            margs = _megatron_args()
            if margs is not None and getattr(margs, "curr_iteration", None) is not None:
                step = int(margs.curr_iteration) + 1
            elif kwargs.get("iteration") is not None:
                step = int(kwargs["iteration"]) + 1
            else:
                step = (state["step"] or 0) + 1
            state["step"] = step
            chunks = model if isinstance(model, (list, tuple)) else [model]
            losses: list = []
            rules = probe.rules_on
            if rules:
                if "forward_step_func" in kwargs:
                    kwargs["forward_step_func"] = _record_losses(kwargs["forward_step_func"], losses)
                elif args and callable(args[0]):
                    args = (_record_losses(args[0], losses),) + tuple(args[1:])

            def step_capture(*a, **k):   # Megatron's step returns (ok, grad_norm, num_zeros)
                try:
                    skip = rules and probe.pre_step(chunks, optimizer, losses, step)
                except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                    probe._fail(e, step)
                    skip = False
                if skip:
                    state["ok"], state["grad_norm"] = False, None
                    return False, None, None
                try:   # the secant's first copy of the parameters (p_t), every rank
                    probe.before_update(chunks, optimizer, step)
                except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                    probe._fail(e, step)
                out = opt_step(*a, **k)
                state["grad_norm"] = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                state["ok"] = out[0] if isinstance(out, tuple) and out else True
                return out

            state["ok"], state["grad_norm"] = True, None
            own = "step" in getattr(optimizer, "__dict__", {})   # someone's instance patch
            if opt_step is not None:
                try:
                    optimizer.step = step_capture
                except Exception as e:  # noqa: BLE001 - cannot patch: no capture, no skip
                    probe._fail(e, step)
                    opt_step = None
            t0 = time.perf_counter()
            try:
                ret = fn(*args, **kwargs)
            finally:
                if opt_step is not None:
                    if own:
                        optimizer.step = opt_step
                    else:
                        del optimizer.step   # back to the class method
            dt = time.perf_counter() - t0
            try:
                skipped = not bool(state["ok"])
                if isinstance(ret, tuple) and len(ret) > 1 and isinstance(ret[1], int):
                    skipped = skipped or ret[1] > 0
                gn = state["grad_norm"]
                if gn is None and isinstance(ret, tuple) and len(ret) == 4 and \
                        isinstance(ret[2], (int, float)) and not isinstance(ret[2], bool):
                    gn = ret[2]   # (loss dict, skipped, grad_norm, num_zeros): Megatron < 2024.06
                gn = math.nan if gn is None else float(gn)
                loss, tokens = _loss_of(ret), _tokens(margs)
                extra = {"megatron_args": _args_summary(margs)} if margs is not None else None
            except Exception as e:  # noqa: BLE001 - fail open
                probe._fail(e, step)
                skipped, gn, loss, tokens, extra = False, math.nan, math.nan, None, None
            try:
                probe.after_train_step(chunks, optimizer, step, loss=loss, skipped=skipped,
                                       grad_norm=gn, step_time_s=dt, tokens=tokens,
                                       env_extra=extra, margs=margs)
            except Exception as e:  # noqa: BLE001 - last resort: never into Megatron
                probe._fail(e, step)
            return ret

        wrapped.__wrapped__ = fn
        return wrapped

    return train_step_wrapper


def _args_summary(args) -> dict:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
            "hidden_size", "seq_length", "global_batch_size", "micro_batch_size",
            "use_distributed_optimizer", "bf16", "fp16", "clip_grad", "adam_beta1",
            "adam_beta2", "adam_eps", "lr", "train_iters")
    return {k: getattr(args, k) for k in keys if isinstance(getattr(args, k, None),
                                                               (int, float, bool, str))}


def _env_flag(key: str, default: bool) -> bool:
    v = os.environ.get(ENV_PREFIX + key)
    if v is None or v == "":
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ProbeError(f"{ENV_PREFIX}{key} must be 0 or 1, got {v!r}")


def install(out: Optional[str] = None, *, every: Optional[int] = None,
            hist_every: Optional[int] = None, precision: str = "float32",
            actions: Optional[ProbeActions] = None, secant: Optional[bool] = None) -> None:
    """Wrap `megatron.training.training.train_step` with the probe.

    Under MindSpeed (mindspeed.patch_utils importable): registered with
    MindSpeedPatchesManager as a wrapper and applied (call it after MindSpeed-LLM's
    `megatron_adaptor` import, whose FeatureAdaptor.execute removes earlier patches).
    Otherwise: setattr on megatron.training.training, and every loaded module that
    imported the original `train_step` by name is pointed at the wrapper too.

    `actions` default: ProbeActions.from_env() (rules, skip-step, recipe, alarms);
    `secant` default: ADAMSPIKE_PROBE_SECANT (1: the online curvature proxy on).
    A bad setting raises ProbeError here, before training (the launcher then runs the
    script without the probe); from the first train_step on the probe fails open."""
    out = out or os.environ.get(ENV_PREFIX + "OUT")
    if not out:
        raise ProbeError(f"no run directory: pass install(out=...) or set {ENV_PREFIX}OUT")
    every = _env_int("EVERY", 10) if every is None else int(every)
    hist_every = _env_int("HIST_EVERY", 100) if hist_every is None else int(hist_every)
    secant = _env_flag("SECANT", True) if secant is None else bool(secant)
    flush = float(os.environ.get(ENV_PREFIX + "FLUSH_S", "60"))
    timeout = float(os.environ.get(ENV_PREFIX + "TIMEOUT_S", "120"))
    if every < 1 or hist_every < 0:
        raise ProbeError(f"every must be >= 1 and hist_every >= 0, got {every}, {hist_every}")
    actions = ProbeActions.from_env() if actions is None else actions

    def factory():
        global _PROBE
        if _PROBE is None:
            _PROBE = MegatronProbe(out, every=every, hist_every=hist_every, precision=precision,
                                   flush_every_s=flush, actions=actions, timeout_s=timeout,
                                   secant=secant)
            atexit.register(_PROBE.close)
            if _PROBE.rank == _PROBE.writer_rank:
                _PROBE._say(f"on, run directory {out}: telemetry every {every} steps, "
                            f"curvature proxy {'on' if secant else 'off'}; "
                            f"{actions.describe()} (docs/mindspeed_probe.md)")
        return _PROBE

    wrapper = make_train_step_wrapper(factory)
    try:
        # lazy: optional, only MindSpeed-LLM stacks have it
        from mindspeed.patch_utils import MindSpeedPatchesManager
    except ImportError:
        MindSpeedPatchesManager = None
    if MindSpeedPatchesManager is not None and _train_step_module().__name__ == TRAIN_STEP.rsplit(".", 1)[0]:
        MindSpeedPatchesManager.register_patch(TRAIN_STEP, wrapper)
        MindSpeedPatchesManager.apply_patches()
        return
    mod = _train_step_module()
    orig = mod.train_step
    new = wrapper(orig)
    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "train_step", None) is orig:
            try:
                setattr(m, "train_step", new)
            except (AttributeError, TypeError):
                pass
    mod.train_step = new


def _adaptors(choice: str) -> List[str]:
    """The imports that apply a framework's patches, in the order its pretrain_gpt.py does
    them: MindSpeed-LLM `from mindspeed_llm import megatron_adaptor`; ModelLink of early
    2024 `from ascendspeed import megatron_adaptor` then `import modellink`."""
    def have(pkg):
        try:
            return importlib.util.find_spec(pkg) is not None
        except (ImportError, ValueError):
            return False

    if choice == "none":
        return []
    if choice != "auto":
        return [choice]
    if have("mindspeed_llm"):
        return ["mindspeed_llm:megatron_adaptor"]
    if have("modellink"):
        return (["ascendspeed:megatron_adaptor"] if have("ascendspeed") else []) + ["modellink"]
    return []


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m fullscale.megatron_probe [--out RUN ...] [--adaptor MOD] -- SCRIPT ARGS`:
    install the probe, then run SCRIPT as __main__ with ARGS (Megatron parses sys.argv)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:   # a launcher that swallowed the "--": cut before the script
        cut = next((i for i, x in enumerate(argv) if x.endswith(".py")), None)
        if cut is not None:
            argv.insert(cut, "--")
    if "--" not in argv:
        print("usage: python -m fullscale.megatron_probe [--out RUN] [--every K] "
              "[--hist-every H] [--secant 0|1] [--adaptor MODULE|none] -- SCRIPT.py ARGS...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m fullscale.megatron_probe")
    ap.add_argument("--out", default=os.environ.get(ENV_PREFIX + "OUT"))
    ap.add_argument("--every", type=int)
    ap.add_argument("--hist-every", type=int)
    ap.add_argument("--precision", choices=("float32", "float64"), default="float32")
    ap.add_argument("--secant", type=int, choices=(0, 1),
                    help=f"the online curvature proxy (default: {ENV_PREFIX}SECANT, else 1)")
    ap.add_argument("--adaptor", default="auto",
                    help="PKG[:NAME] whose import applies the framework's patches before the "
                         "probe is installed (auto: mindspeed_llm:megatron_adaptor, or "
                         "ascendspeed:megatron_adaptor + modellink, if importable; none: plain "
                         "Megatron-LM)")
    a = ap.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest:
        print("megatron_probe: no training script after --", file=sys.stderr)
        return 2
    if not a.out:
        print(f"megatron_probe: --out (or {ENV_PREFIX}OUT) is required", file=sys.stderr)
        return 2
    script = rest[0]
    if not os.path.isfile(script):
        print(f"megatron_probe: {script}: no such training script", file=sys.stderr)
        return 2
    sys.argv = rest      # the adaptor and the script parse Megatron's arguments
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for name in _adaptors(a.adaptor):
        pkg, _, attr = name.partition(":")
        mod = importlib.import_module(pkg)        # `from pkg import attr`
        if attr and not hasattr(mod, attr):
            importlib.import_module(f"{pkg}.{attr}")
    try:
        install(a.out, every=a.every, hist_every=a.hist_every, precision=a.precision,
                secant=None if a.secant is None else bool(a.secant))
    except ProbeError as e:   # fail open: the job runs without the probe
        print(f"adamspike probe: not installed ({e}); training runs without it", flush=True)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
