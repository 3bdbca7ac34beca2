"""Cluster launch scripts: `adamspike launch` (one run) and `adamspike plan` (one run per
predicted setting).

    adamspike launch --config configs/llama2-70b.toml --cluster configs/cluster-128x8.toml \
        --master-addr node-000 --out launch/baseline
    adamspike plan --predictions predictions.json --base configs/llama2-70b.toml --out plan/ --top 3

`launch` writes into a new directory OUT (an existing non-empty one is an error):

    run.toml             the resolved run config (dist.device set, paths made absolute)
    train_torchrun.sh    fullscale.train under torchrun (FSDP2; needs torch >= 2.4)
    train_mindspeed.sh   the same optimizer and schedule for MindSpeed-LLM / Megatron
                         pretrain_gpt.py (TP x PP), for the CANN 7 / torch 2.1 stack
    launch.json          what was generated and how to start it
    logs/                node<k>.log of each node (created by the torchrun script)

The fullscale run writes RUN (default OUT/run, --run-dir); the Megatron script writes its
checkpoints and logs to RUN_megatron/ (its --load = --save, so a rerun resumes).

Each script is ONE script for all nodes, parameterised by the node rank: on node k run
`bash train_torchrun.sh k` (or with NODE_RANK=k in the environment). The scripts set the
HCCL / Ascend environment for npu (sourcing the toolkit's set_env.sh) or NCCL's for cuda.

The Megatron layout (TP, PP, layers per virtual pipeline stage, activation recompute) comes
from the memory estimate (fullscale.model_info.choose_megatron_layout): upstream's layout for
the model where it fits without recompute, else the smallest TP x PP that fits the card less
a headroom, recompute only when nothing fits without it; [megatron] tp / pp / recompute in
the cluster config (or --tp / --pp / --recompute) fix them.

Checks (errors name the flag or key): nodes and devices per node >= 1, the world size
divides train.global_batch_size, the per-rank batch is a multiple of the micro batch; for
the Megatron script TP divides the heads and kv groups, PP divides the layers, TP x PP
divides the world size and the data-parallel size divides the global batch.

Mapping to Megatron arguments: loss scale s is folded into eps and the clip threshold
(Adam on s L with eps equals Adam on L with eps/s, the clip threshold on the scaled
gradient c equals c/s on the unscaled one); the mitigations' flags come from the registry
(adamspike.mitigations: megatron_args), and features Megatron does not have (every active
mitigation the registry calls not expressible, z-loss, the in-job rollback of the spike
guard) are listed in the script header and a warning, not silently dropped. Spike actions
under Megatron: the probe (online rules, skip-step, alarms from predictions.json, the
restart recipe; docs/mindspeed_probe.md) and, where the stack has them, Megatron's rerun
state machine (--check-for-spiky-loss / --check-for-large-grads / --rerun-mode) and
--ckpt-step (CKPT_STEP); the batch skip of the restart recipe is the probe's on every stack
(SKIP_ITERATIONS), Megatron-LM's own --iterations-to-skip where it has one
(ITERATIONS_TO_SKIP). The stack is detected on the node (fullscale.stack) unless named.

No machine-local path of the clone that ran `launch` is written into the scripts: the
adamspike checkout on the nodes is $ADAMSPIKE_HOME (required; a clear error when unset).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adamspike import mitigations
from adamspike.config import ConfigError, load_config, param, replace, to_dict
from adamspike.llama import num_params
from adamspike.predictions import (PredictionsError, indistinguishable, load_predictions,
                                   model_label, not_in_model,
                                   setting_config)
from adamspike.train_config import RunConfig
from fullscale.cli import _Parser, exit_status
from fullscale.hf import resolve_model
from fullscale.model_info import (UPSTREAM_LAYOUTS, choose_megatron_layout, megatron_sharding,
                                  memory_per_card, recompute_flags)

REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- cluster

@dataclass
class ClusterSection:
    nodes: int = param(1, lo=1)
    devices_per_node: int = param(8, lo=1)
    master_addr: str = param("127.0.0.1", help="host of node rank 0")
    master_port: int = param(29500, lo=1, hi=65535)
    device: str = param("npu", choices=("npu", "cuda", "cpu"))
    device_memory_gb: float = param(64.0, lo=1.0, help="memory per card the Megatron layout must fit "
                                    "(910B: 64; the layout leaves fullscale.model_info's headroom free)")


@dataclass
class NpuSection:
    set_env: str = param("/usr/local/Ascend/ascend-toolkit/set_env.sh")
    hccl_connect_timeout: int = param(1200, lo=1, help="s; AscendSpeed scripts use 1200")
    hccl_exec_timeout: int = param(1836, lo=0, help="s; A2 default 1836, 0 = never")
    ascend_global_log_level: int = param(3, lo=0, hi=4, help="0 debug .. 3 error")
    ascend_global_event_enable: int = param(0, lo=0, hi=1, help="1 when debugging HCCL faults")


@dataclass
class CudaSection:
    nccl_debug: str = param("WARN", choices=("VERSION", "WARN", "INFO", "TRACE"))


@dataclass
class MegatronSection:
    tp: int = param(0, lo=0, help="tensor parallel size, 0 = auto (fullscale.model_info."
                    "choose_megatron_layout: the smallest TP x PP whose memory estimate fits)")
    pp: int = param(0, lo=0, help="pipeline parallel size, 0 = auto (as tp)")
    recompute: str = param("auto", choices=("auto", "none", "selective", "full"),
                           help="activation recompute; auto = only when no layout fits without it")
    sequence_parallel: bool = param(True)
    distributed_optimizer: bool = param(True)


@dataclass
class ClusterConfig:
    cluster: ClusterSection = field(default_factory=ClusterSection)
    npu: NpuSection = field(default_factory=NpuSection)
    cuda: CudaSection = field(default_factory=CudaSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)


# ----------------------------------------------------------------------------- helpers

def toml_string(s: str) -> str:
    """A TOML basic string: characters outside the BMP stay literal (JSON's surrogate-pair
    escapes are invalid TOML); quote, backslash and control characters are escaped."""
    def esc(m: re.Match) -> str:
        c = m.group()
        return {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, f"\\u{ord(c):04X}")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"cannot write {s!r} to TOML: not valid UTF-8") from None
    return '"' + re.sub(r'["\\\x00-\x1f\x7f]', esc, s) + '"'


def dump_toml(data: dict[str, Any]) -> str:
    """TOML for a nested dict of scalars / lists (None values are left out: absent = default)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ConfigError(f"cannot write non-finite {v!r} to TOML")
            return repr(v)
        if isinstance(v, str):
            return toml_string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise ConfigError(f"cannot write {type(v).__name__} to TOML")

    lines, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif v is not None:
            lines.append(f"{k} = {value(v)}")
    for name, table in tables:
        lines += ["", f"[{name}]"] + [f"{k} = {value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


@contextmanager
def _staged_dir(out: Path):
    """A temporary sibling of `out` (which must not exist, or be empty), renamed onto it when
    the block succeeds and removed when it fails."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} already exists; refusing to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.chmod(0o755)             # mkdtemp makes it 0700
    if out.exists():
        out.rmdir()              # empty (checked above)
    os.replace(tmp, out)


def _abs(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else path


def _num(x: float) -> str:
    """A number for a Megatron flag: integral values as integers (some flags are type=int)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# Control characters (a newline ends a `#` comment line and starts a command; C1 and the
# Unicode line separators confuse editors and terminals) are refused in anything the
# scripts carry; everything else goes through shlex.quote.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"^{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")


def _script_safe(what: str, value: Any) -> str:
    """`value` as text fit for a generated shell script (quoted by the caller), or a
    ConfigError naming `what`."""
    s = str(value)
    if _CONTROL.search(s):
        raise ConfigError(f"{what}: {s!r} holds a control character (newline, tab, escape ...); "
                          "refusing to write it into a shell script")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{what}: {s!r} is not valid UTF-8; refusing to write it into a "
                          "shell script") from None
    return s


def _check_host(addr: str) -> None:
    """cluster.master_addr must be an IP address or a host name (letters, digits, '-', '_'
    and dots: nothing a shell or torchrun would read as more than a name)."""
    try:
        ipaddress.ip_address(addr)
        return
    except ValueError:
        pass
    if len(addr) > 253 or not _HOST.match(addr):
        raise ConfigError(f"cluster.master_addr (--master-addr or the cluster TOML): {addr!r} is "
                          "not a host name or IP address")


def _check_strings(prefix: str, table: dict[str, Any]) -> None:
    """Every string setting (run and cluster config) that a script or its comments may carry."""
    for k, v in table.items():
        if isinstance(v, dict):
            _check_strings(f"{prefix}{k}.", v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, str):
                    _script_safe(f"{prefix}{k}", x)
        elif isinstance(v, str):
            _script_safe(f"{prefix}{k}", v)


def _q(s: str | Path) -> str:
    return shlex.quote(_script_safe("a value in the generated script", s))


# ----------------------------------------------------------------------------- the plan

@dataclass
class Launch:
    run: Any                  # RunConfig (resolved)
    cluster: ClusterConfig
    run_dir: Path
    engines: tuple[str, ...]
    world_size: int = 0
    micro_batch: int = 0
    tp: int = 1
    pp: int = 1
    vpp_layers: int = 0       # --num-layers-per-virtual-pipeline-stage (0: not interleaved)
    megatron_micro_batch: int = 1   # --micro-batch-size (the one the memory estimate assumed)
    recompute: str = "none"   # Megatron activation recompute: none | selective | full
    layout_fits: bool = True  # the memory estimate of the Megatron layout fits the card
    notes: list[str] = field(default_factory=list)
    memory_gb: dict[str, float] = field(default_factory=dict)   # fullscale.model_info estimates
    layout_choice: dict[str, Any] = field(default_factory=dict)  # choose_megatron_layout's answer


def prepare(run, cluster: ClusterConfig, run_dir: Path, engines=("fsdp", "megatron")) -> Launch:
    """Validate a run config against a cluster; resolve micro batch and TP/PP."""
    c = cluster.cluster
    if c.master_addr == "MASTER_HOST" and c.nodes > 1:
        raise ConfigError("--master-addr: required (the cluster config still has the placeholder "
                          "MASTER_HOST); pass node rank 0's host name or address")
    _check_host(c.master_addr)
    _check_strings("", to_dict(run))
    _check_strings("", to_dict(cluster))
    _script_safe("the run directory", run_dir)
    world = c.nodes * c.devices_per_node
    G = run.train.global_batch_size
    cfg = resolve_model(run.model)
    launch = Launch(run, cluster, run_dir, tuple(engines), world)
    if "fsdp" in engines:
        if G % world:
            raise ConfigError(f"--nodes x --devices-per-node = {c.nodes} x {c.devices_per_node} = {world} "
                              f"does not divide train.global_batch_size = {G}")
        per_rank = G // world
        launch.micro_batch = mb = run.train.micro_batch_size or per_rank
        if per_rank % mb:
            raise ConfigError(f"train.micro_batch_size = {mb} does not divide the per-rank batch "
                              f"{per_rank} (= train.global_batch_size {G} / world size {world})")
        launch.memory_gb["fsdp"] = memory_per_card(
            cfg, world_size=world, seq_len=run.train.seq_len, micro_batch=mb, dtype=run.train.dtype,
            activation_checkpointing=run.train.activation_checkpointing)["total"] / 1e9
    if "megatron" in engines:
        m = cluster.megatron
        hint = " (or --engine fsdp to write only the torchrun script)"
        if m.tp and (cfg.num_heads % m.tp or cfg.num_kv_heads % m.tp):
            raise ConfigError(f"--tp {m.tp} must divide num_heads {cfg.num_heads} and num_kv_heads "
                              f"{cfg.num_kv_heads}{hint}")
        if m.pp and cfg.num_layers % m.pp:
            raise ConfigError(f"--pp {m.pp} must divide num_layers {cfg.num_layers}{hint}")
        if world % ((m.tp or 1) * (m.pp or 1)):
            raise ConfigError(f"--tp x --pp = {(m.tp or 1) * (m.pp or 1)} must divide the world size "
                              f"{world}{hint}")
        # micro batch: the run config's; with micro_batch_size 0, a fixed layout's per-replica
        # share (G / DP) as before, and for a chosen layout upstream's --micro-batch-size 1
        mmb = run.train.micro_batch_size or (max(1, G // (world // (m.tp * m.pp))) if m.tp and m.pp else 1)
        # Layout and recompute from the memory estimate, not a fixed TP8 PP8 + full recompute
        # (fullscale.model_info.choose_megatron_layout): upstream's layout for the model where
        # it fits without recompute (the 70B: MindSpeed-LLM examples/mcore/llama2/
        # pretrain_llama2_70b_ptd.sh at 251f267c, TP8 PP4, 5 layers per virtual stage, no
        # recompute), else the smallest TP x PP that fits 64 GB less the headroom, recompute
        # only when nothing fits without it. Differences from upstream's layout have one of
        # these reasons: a card too small for it (more PP / recompute), or a world size / batch
        # it does not divide (launch.json: megatron_layout lists what was tried).
        try:
            choice = choose_megatron_layout(
                cfg, world_size=world, seq_len=run.train.seq_len, micro_batch=mmb, global_batch=G,
                devices_per_node=c.devices_per_node, dtype=run.train.dtype,
                device_memory_gb=c.device_memory_gb, recompute=m.recompute, tp=m.tp, pp=m.pp)
        except ConfigError as e:
            raise ConfigError(f"Megatron: {e}{hint}") from None
        launch.tp, launch.pp, launch.megatron_micro_batch = choice["tp"], choice["pp"], mmb
        launch.vpp_layers, launch.recompute = choice["vpp_layers"], choice["recompute"]
        launch.layout_fits = choice["fits"]
        launch.layout_choice = {k: v for k, v in choice.items() if k != "memory"}
        launch.notes += _megatron_gaps(run)
        launch.memory_gb["megatron"] = choice["memory"]["total"] / 1e9
    return launch


def _megatron_gaps(run) -> list[str]:
    gaps = mitigations.megatron_gaps(run)   # the registry's "not expressible"
    if run.train.z_loss:
        gaps.append(f"train.z_loss = {run.train.z_loss}: no Megatron flag; not applied")
    if run.guard.enabled:
        gaps.append("guard: no automatic in-job rollback under Megatron; instead the probe skips "
                    "spiking updates (within ADAMSPIKE_PROBE_SKIP_BUDGET) and writes the restart "
                    "recipe (RUN_megatron/telemetry/restart_recipe.sh: rerun with CKPT_STEP and "
                    "SKIP_ITERATIONS), and Megatron's rerun state machine checks spiky losses "
                    "and large grads (MEGATRON_RERUN_MODE)")
    if run.data.skip_batches or run.data.poison_steps:
        gaps.append("data.skip_batches / data.poison_steps: not applied by Megatron")
    if to_dict(run.faults) != to_dict(type(run.faults)()):
        gaps.append("faults (docs/faults.md): not injected by Megatron; rehearse with train_torchrun.sh")
    if run.optim.implementation != "foreach":
        gaps.append("optim.implementation: Megatron uses its own (fused) Adam")
    if run.optim.bias_correction_offset:
        gaps.append(f"optim.bias_correction_offset = {run.optim.bias_correction_offset}: the "
                    "stacks launched here correct at step t (apex FusedAdam, torch AdamW, "
                    "MindSpeed's fused AdamW); only AscendSpeed 2023's own AdamW ran offset 1 "
                    "(docs/results/seed_stack_adamw.md); not applied")
    if run.data.source != "indexed":
        gaps.append("data.source = synthetic: Megatron gets --mock-data (random tokens), not the "
                    "same synthetic task")
    return gaps


# ----------------------------------------------------------------------------- scripts

def _header(title: str, launch: Launch, script: str) -> list[str]:
    c = launch.cluster.cluster
    return ["#!/usr/bin/env bash",
            f"# {title}",
            f"# Generated by `adamspike launch` on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.",
            f"# {c.nodes} nodes x {c.devices_per_node} {c.device} = {launch.world_size} ranks. "
            "One script for every node:",
            f"#   on node k (0 .. {c.nodes - 1}):  bash {script} k     (or NODE_RANK=k bash {script})",
            "set -euo pipefail",
            f"NNODES={c.nodes}",
            'NODE_RANK="${1:-${NODE_RANK:-}}"',
            'if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || (( 10#$NODE_RANK >= NNODES )); then',
            f'  echo "usage: $0 NODE_RANK   (an integer in 0..{c.nodes - 1}, got \'$NODE_RANK\')" >&2',
            "  exit 2",
            "fi",
            # the environment wins; the default is quoted on its own (never inside "${..:-..}")
            'MASTER_ADDR="${MASTER_ADDR:-}"',
            f'if [[ -z "$MASTER_ADDR" ]]; then MASTER_ADDR={_q(c.master_addr)}; fi',
            f'MASTER_PORT="${{MASTER_PORT:-{c.master_port}}}"',
            ""]


def _device_env(launch: Launch, megatron: bool) -> list[str]:
    c, npu, cuda = launch.cluster.cluster, launch.cluster.npu, launch.cluster.cuda
    devices = ",".join(str(i) for i in range(c.devices_per_node))
    lines = []
    if c.device == "npu":
        lines += ["# Ascend environment (CANN). set_env.sh reads unset variables, hence set +u.",
                  f"set +u; source {_q(npu.set_env)}; set -u",
                  f"export ASCEND_RT_VISIBLE_DEVICES={devices}",
                  f"export HCCL_CONNECT_TIMEOUT={npu.hccl_connect_timeout}   # link setup, s",
                  f"export HCCL_EXEC_TIMEOUT={npu.hccl_exec_timeout}   # ranks waiting in a collective, s",
                  f"export ASCEND_GLOBAL_LOG_LEVEL={npu.ascend_global_log_level}   # 0 debug .. 3 error",
                  f"export ASCEND_GLOBAL_EVENT_ENABLE={npu.ascend_global_event_enable}   # 1: event logs "
                  "for HCCL faults (plog in ~/ascend/log)",
                  "# HCCL_IF_IP: this node's address on the HCCL network; set it (in the environment)",
                  "# when a host has several NICs and HCCL picks the wrong one.",
                  'if [[ -n "${HCCL_IF_IP:-}" ]]; then export HCCL_IF_IP; fi']
    elif c.device == "cuda":
        lines += [f"export CUDA_VISIBLE_DEVICES={devices}",
                  f"export NCCL_DEBUG={cuda.nccl_debug}",
                  "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # fail fast on a hung collective",
                  "# NCCL_SOCKET_IFNAME: set it (in the environment) when hosts have several NICs.",
                  'if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then export NCCL_SOCKET_IFNAME; fi']
    if megatron:
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron: ordered TP/SP overlap")
    return lines + [""]


def torchrun_script(launch: Launch, run_toml: Path) -> str:
    c = launch.cluster.cluster
    # Logs live next to the scripts: the trainer wants its run directory new (or --resume).
    log_dir = run_toml.parent / "logs"
    lines = _header("fullscale.train (FSDP2) under torchrun", launch, "train_torchrun.sh")
    lines += _device_env(launch, megatron=False)
    lines += ['ADAMSPIKE_HOME="${ADAMSPIKE_HOME:?set ADAMSPIKE_HOME to the adamspike checkout on this node}"',
              'TORCHRUN="${TORCHRUN:-torchrun}"',
              "# After a fault (a hung collective, a dead node) rerun with RESUME=1 on every node:",
              "# training continues from the newest valid checkpoint in the run directory.",
              'RESUME_ARGS=()',
              'if [[ "${RESUME:-0}" == 1 ]]; then RESUME_ARGS=(--resume); fi',
              'cd "$ADAMSPIKE_HOME"',
              f"mkdir -p {_q(log_dir)}",
              f'"$TORCHRUN" --nnodes {c.nodes} --nproc-per-node {c.devices_per_node} '
              '--node-rank "$NODE_RANK" \\',
              '  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts 0 \\',
              f"  -m fullscale.train --config {_q(run_toml)} --out {_q(launch.run_dir)} "
              '${RESUME_ARGS[@]+"${RESUME_ARGS[@]}"} \\',
              f'  2>&1 | tee -a {_q(log_dir)}/"node${{NODE_RANK}}.log"',
              ""]
    return "\n".join(lines)


def megatron_dir(launch: Launch) -> Path:
    """Megatron's checkpoints and logs: RUN_megatron/ beside the fullscale run directory."""
    return launch.run_dir.with_name(launch.run_dir.name + "_megatron")


def megatron_args(launch: Launch) -> list[str]:
    """pretrain_gpt.py arguments equivalent to the run config (see the module docstring)."""
    run = launch.run
    cfg = resolve_model(run.model)
    o, t = run.optim, run.train
    s = t.loss_scale
    mb = launch.megatron_micro_batch
    ckpt = megatron_dir(launch) / "checkpoints"
    args = [
        f"--tensor-model-parallel-size {launch.tp}", f"--pipeline-model-parallel-size {launch.pp}",
        f"--num-layers {cfg.num_layers}", f"--hidden-size {cfg.dim}",
        f"--ffn-hidden-size {cfg.ffn_dim}", f"--num-attention-heads {cfg.num_heads}",
        f"--group-query-attention --num-query-groups {cfg.num_kv_heads}",
        f"--seq-length {t.seq_len}", f"--max-position-embeddings {cfg.max_seq_len}",
        "--position-embedding-type rope",   # --rotary-base: stack-gated (mindspeed_script)
        f"--normalization RMSNorm --norm-epsilon {cfg.norm_eps:g}", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-dropout 0.0", "--hidden-dropout 0.0", f"--init-method-std {cfg.init_std:g}",
        "--make-vocab-size-divisible-by 1",   # keep the vocabulary unpadded (32000)
        f"--micro-batch-size {mb}", f"--global-batch-size {t.global_batch_size}",
        f"--train-iters {t.num_steps}", f"--seed {t.seed}",
        f"--lr {o.lr:g}", f"--min-lr {o.min_lr:g}", f"--lr-decay-style {o.schedule}",
        f"--lr-warmup-iters {o.warmup_steps}", f"--lr-decay-iters {t.num_steps}",
        "--optimizer adam", f"--adam-beta1 {o.b1:g}", f"--adam-beta2 {o.b2:g}",
        f"--adam-eps {o.eps / s:g}", f"--weight-decay {o.weight_decay:g}",
        f"--clip-grad {o.grad_clip / s:g}",
        *mitigations.megatron_args(run),
    ]
    if t.dtype == "bf16":
        args.append("--bf16")
    if launch.vpp_layers:
        # upstream's 70B: --num-layers-per-virtual-pipeline-stage 5 (MindSpeed-LLM 251f267c);
        # every vendored stack parses it (fullscale/megatron_options.json)
        args.append(f"--num-layers-per-virtual-pipeline-stage {launch.vpp_layers}")
    # recompute from the layout choice (prepare), not train.activation_checkpointing (the FSDP
    # trainer's switch): upstream's 70B passes no --recompute-* flag
    args += recompute_flags(launch.recompute)
    m = launch.cluster.megatron
    if m.sequence_parallel and launch.tp > 1:
        args.append("--sequence-parallel")
    if m.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if launch.cluster.cluster.device == "npu":
        # --attention-softmax-in-fp32 with --no-masked-softmax-fusion, as upstream's NPU llama2
        # scripts (MindSpeed-LLM 70B 7e2f454c, 13B c77308a1) and the seed's arguments
        args += ["--use-flash-attn", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--attention-softmax-in-fp32"]
    if run.data.source == "indexed":
        args += [f"--data-path {_q(run.data.path)}", "--split 100,0,0"]
        if not _llama_tokenizer(launch):   # LLaMA2's tokenizer: stack-gated (_stack_case)
            args.append(f"--tokenizer-type NullTokenizer --vocab-size {cfg.vocab_size}")
    else:
        args += ["--mock-data", f"--tokenizer-type NullTokenizer --vocab-size {cfg.vocab_size}"]
    every = run.checkpoint.every or t.num_steps
    args += [f"--save {_q(ckpt)}", f"--load {_q(ckpt)}", f"--save-interval {every}",
             "--log-interval 1", f"--eval-interval {t.num_steps}", "--eval-iters 0"]
    return args


# Version-dependent flags of the Megatron stacks users run. Every flag the script can pass
# is checked against the option names of that stack's argument parsers, vendored with
# their source repository and commit in fullscale/megatron_options.json
# (tests/fullscale/test_launch_mindspeed.py):
#   mindspeed-llm   MindSpeed-LLM 2.2+ on Megatron core_v0.12.1 (its examples/mcore/llama2
#                   scripts: --use-mcore-models, --transformer-impl local (core_v0.12
#                   defaults to transformer_engine), --tokenizer-type PretrainedFromHF
#                   --tokenizer-name-or-path, MindSpeed's fused kernels)
#   modellink-2024  ModelLink of early 2024 (CANN 7.0; legacy models, its own Megatron copy,
#                   AscendSpeed kernels): no --rotary-base, --mock-data, rerun state machine,
#                   --iterations-to-skip or --ckpt-step
#   megatron-lm     Megatron-LM core_v0.12 or newer (mcore models, Llama2Tokenizer)
#   --rotary-base: 10000 is every version's default, so it is passed only for another
#     rope_theta.
# Megatron's own spike tools (core_v0.12): --check-for-spiky-loss (a loss > 10x the largest
# seen), --check-for-large-grads, with --rerun-mode validate_results: the rerun state machine
# re-runs a suspicious iteration to tell a transient fault from a reproducible result;
# --iterations-to-skip and --ckpt-step apply the probe's restart recipe.
STACKS = ("mindspeed-llm", "modellink-2024", "megatron-lm")
ROPE_DEFAULT = 10000.0
OPTIONS_FILE = Path(__file__).with_name("megatron_options.json")
MEGATRON_GUARD = ("--check-for-spiky-loss", "--check-for-large-grads", "--rerun-mode")


def _llama_tokenizer(launch: Launch) -> bool:
    return launch.run.data.source == "indexed" and resolve_model(launch.run.model).vocab_size == 32000


def setting_tag(launch: Launch) -> str:
    """The setting's name in log file names: the run directory's name, or its parent's
    when it is plan's `<setting>/run`."""
    d = launch.run_dir
    return re.sub(r"[^A-Za-z0-9._-]+", "_", d.parent.name if d.name == "run" else d.name)


def _stack_case(launch: Launch) -> list[str]:
    theta = resolve_model(launch.run.model).rope_theta
    rot = [] if float(theta) == ROPE_DEFAULT else [f"--rotary-base {_num(theta)}"]
    npu = launch.cluster.cluster.device == "npu"
    fused = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
    tok = _llama_tokenizer(launch)
    hf_tok = ['--tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_PATH"'] if tok else []
    sp_tok = ['--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"'] if tok else []
    need_hf = (['    : "${TOKENIZER_PATH:?set TOKENIZER_PATH to the LLaMA2 tokenizer directory '
                '(Hugging Face format: tokenizer.model, tokenizer_config.json)}"'] if tok else [])
    need_sp = (['    : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the LLaMA2 tokenizer.model}"']
               if tok else [])
    guard = '${GUARD_ARGS[@]+"${GUARD_ARGS[@]}"} ${RESTART_ARGS[@]+"${RESTART_ARGS[@]}"}'
    lines = ["# MEGATRON_STACK (" + " | ".join(STACKS) + ") picks the version-specific flags; unset: detected",
             "# on this node from the checkout and the installed python, torch, torch_npu, CANN and",
             "# Megatron core (python -m fullscale.stack; a combination it does not know stops here,",
             "# naming what it found). The seed's stack (CANN 7.0.1, torch 2.1.0, python 3.8,",
             "# ModelLink of 2024 with AscendSpeed) is modellink-2024; there AUTO_RECOMPUTE_DEVICE_SIZE",
             "# (MB) maps the seed's auto_recompute_device_size onto --adaptive-recompute-device-size.",
             'MEGATRON_STACK="${MEGATRON_STACK:-}" MEGATRON_CORE="${MEGATRON_CORE:-}"',
             'if [[ -z "$MEGATRON_STACK" ]]; then',
             '  DETECTED="$(PYTHONPATH="${ADAMSPIKE_HOME:?set MEGATRON_STACK, or ADAMSPIKE_HOME to detect it}" '
             'python -m fullscale.stack --dir "$MINDSPEED_LLM_DIR")" || exit 2',
             '  read -r MEGATRON_STACK MEGATRON_CORE <<< "$DETECTED"',
             '  echo "MEGATRON_STACK=$MEGATRON_STACK (detected; Megatron core $MEGATRON_CORE)"',
             "fi",
             "# Megatron's own spike tools (core_v0.12+; not in modellink-2024): the rerun state",
             "# machine re-runs an iteration with a spiky loss or large grads to tell a transient",
             "# fault from a reproducible result. --check-for-spiky-loss fires only above 10x the",
             "# largest loss seen (pretrain_gpt.py SPIKY_LOSS_FACTOR = 10, core_v0.12.1): a 1.5-4x",
             "# spike does not trigger it (the probe's rules judge those). --rerun-mode is always",
             "# passed: its default changed (disabled through core_v0.13, validate_results from",
             "# core_v0.14, megatron/training/arguments.py). disabled: --rerun-mode disabled only.",
             'MEGATRON_RERUN_MODE="${MEGATRON_RERUN_MODE:-validate_results}"   # validate_results | report_stats | disabled',
             "# The probe's restart recipe (RUN_megatron/telemetry/restart_recipe.sh): PaLM's",
             "# rollback + batch skip. CKPT_STEP: the checkpoint iteration to load; SKIP_ITERATIONS:",
             "# the logged iterations whose batches are drawn without an update (\"A-B C\"; the probe",
             "# does it on every stack, also where the loop has no --iterations-to-skip, as",
             "# MindSpeed-LLM's; it needs ADAMSPIKE_PROBE=1). ITERATIONS_TO_SKIP: raw values for",
             "# Megatron-LM's own --iterations-to-skip (0-based before core_v0.17, the logged numbers",
             "# from it); refused on the stacks whose loop ignores it.",
             'CKPT_STEP="${CKPT_STEP:-}" SKIP_ITERATIONS="${SKIP_ITERATIONS:-}" ITERATIONS_TO_SKIP="${ITERATIONS_TO_SKIP:-}"',
             "GUARD_ARGS=(--rerun-mode disabled) RESTART_ARGS=()",
             'if [[ "$MEGATRON_RERUN_MODE" != disabled ]]; then',
             '  GUARD_ARGS=(--check-for-spiky-loss --check-for-large-grads --rerun-mode "$MEGATRON_RERUN_MODE")',
             "fi",
             'if [[ -n "$SKIP_ITERATIONS" ]]; then',
             '  if [[ "${ADAMSPIKE_PROBE:-1}" != 1 ]]; then echo "SKIP_ITERATIONS needs the probe '
             '(ADAMSPIKE_PROBE=1): it draws those batches without an update" >&2; exit 2; fi',
             '  export ADAMSPIKE_PROBE_SKIP_ITERATIONS="$SKIP_ITERATIONS"',
             "fi",
             'if [[ -n "$ITERATIONS_TO_SKIP" && "$MEGATRON_STACK" != megatron-lm ]]; then',
             '  echo "ITERATIONS_TO_SKIP: the $MEGATRON_STACK training loop has no --iterations-to-skip '
             '(it would parse and do nothing); use SKIP_ITERATIONS (logged numbers, the probe skips)" >&2; exit 2',
             "fi",
             'if [[ -n "$CKPT_STEP" ]]; then RESTART_ARGS+=(--ckpt-step "$CKPT_STEP"); fi',
             '# shellcheck disable=SC2206',
             'if [[ -n "$ITERATIONS_TO_SKIP" ]]; then RESTART_ARGS+=(--iterations-to-skip $ITERATIONS_TO_SKIP); fi',
             "# NO_SHARED_STORAGE=1: the nodes share no file system. MindSpeed-LLM gets its",
             "# --no-shared-storage (each node builds its own dataset cache; features_manager/",
             "# megatron_basic/megatron_basic.py, c77308a1); on every stack the probe writes its run",
             "# directory on the last node's disk, says where, and takes the restart recipe's",
             "# checkpoint from --save-interval (docs/mindspeed_probe.md). Copy data, tokenizer and",
             "# predictions.json to every node at the same paths.",
             'NO_SHARED_STORAGE="${NO_SHARED_STORAGE:-0}"',
             'if [[ "$NO_SHARED_STORAGE" == 1 ]]; then export ADAMSPIKE_PROBE_NO_SHARED_STORAGE=1; fi',
             'case "$MEGATRON_STACK" in',
             "  mindspeed-llm)"] + need_hf + (
             # upstream: examples/mcore/llama2/pretrain_llama2_13b_ptd.sh (c77308a1) exports it
             ['    export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"']
             if npu else []) + [
             # --ckpt-format torch: upstream's llama2 70B (7e2f454c) and 13B (c77308a1) scripts
             f"    STACK_ARGS=(--use-mcore-models --transformer-impl local --ckpt-format torch "
             f"{' '.join(rot + (fused if npu else []) + hf_tok + [guard])}) ;;"]
    ml = ["  modellink-2024)",
          '    if [[ -n "$CKPT_STEP" ]]; then echo "MEGATRON_STACK=modellink-2024 '
          '(CANN 7.0) has no --ckpt-step (Megatron before core_v0.12): restart from --load with its '
          'latest_checkpointed_iteration.txt at the checkpoint; SKIP_ITERATIONS works (the probe '
          'skips)" >&2; exit 2; fi']
    if rot:
        ml.append(f'    echo "MEGATRON_STACK=modellink-2024 (CANN 7.0) has no --rotary-base; rope_theta '
                  f'{_num(theta)} cannot be set" >&2; exit 2 ;;')
    elif launch.run.data.source != "indexed":
        ml.append('    echo "MEGATRON_STACK=modellink-2024 (CANN 7.0) has no --mock-data; use '
                  'data.source = indexed" >&2; exit 2 ;;')
    else:
        # --accumulate-allreduce-grads-in-fp32: the seed's own argument dump has it True (an
        # AscendSpeed / Megatron option of that time).
        # The seed's AscendSpeed recompute flags (its code: AscendSpeed 64b1937a, 2023-12, the
        # `seed_reference` list of fullscale/megatron_options.json) are not options of
        # ModelLink 0df09cd1 / AscendSpeed 5310714d, so they are mapped, not passed:
        # - auto_recompute_device_size (MB; > 0: auto selective recompute, AscendSpeed
        #   arguments.py 821, core/memory/auto_recomputing/autorecompute.py 192) became
        #   --adaptive-recompute-device-size, switched on by ADAPTIVE_RECOMPUTING=1 (AscendSpeed
        #   5310714d arguments.py 92, megatron_adaptor.py 238-245), and refuses any
        #   --recompute-granularity / --recompute-method (adaptive_recompute.py 639-642). The
        #   seed's value is not in its notes: AUTO_RECOMPUTE_DEVICE_SIZE (MB) passes it.
        # - checkpoint_policy / checkpoint_block_layer (block, 25) are parsed by AscendSpeed
        #   64b1937a (arguments.py 1336-1339) and read nowhere else in its tree: they changed
        #   nothing in the seed's job, so nothing stands for them here.
        adaptive = ["    if [[ -n \"${AUTO_RECOMPUTE_DEVICE_SIZE:-}\" ]]; then",
                    '      if ! [[ "$AUTO_RECOMPUTE_DEVICE_SIZE" =~ ^[1-9][0-9]*$ ]]; then echo '
                    '"AUTO_RECOMPUTE_DEVICE_SIZE must be a positive integer (MB), got '
                    '\'$AUTO_RECOMPUTE_DEVICE_SIZE\'" >&2; exit 2; fi']
        if launch.recompute != "none":
            adaptive += ['      echo "AUTO_RECOMPUTE_DEVICE_SIZE: adaptive recompute refuses the layout\'s '
                         f'--recompute-granularity ({launch.recompute}); set [megatron] recompute = '
                         '\"none\" (--recompute none) to use it" >&2; exit 2']
        adaptive += ['      export ADAPTIVE_RECOMPUTING=1',
                     '      STACK_ARGS+=(--adaptive-recompute-device-size "$AUTO_RECOMPUTE_DEVICE_SIZE")',
                     "    fi ;;"]
        ml += need_sp + [f"    STACK_ARGS=({' '.join(([f for f in fused if 'swiglu' not in f] if npu else []) + ['--accumulate-allreduce-grads-in-fp32'] + sp_tok)})"] + adaptive
    lines += ml
    lines += ["  megatron-lm)"] + need_sp + [
              f"    STACK_ARGS=(--use-mcore-models {' '.join(rot + sp_tok + [guard])}) ;;"
              + ("   # --rotary-base needs Megatron-LM core_r0.8 or newer" if rot else ""),
              "  *) echo \"MEGATRON_STACK must be one of " + ", ".join(STACKS)
              + ", got '$MEGATRON_STACK'\" >&2; exit 2 ;;",
              "esac",
              'if [[ "$NO_SHARED_STORAGE" == 1 && "$MEGATRON_STACK" == mindspeed-llm ]]; then '
              "STACK_ARGS+=(--no-shared-storage); fi"]
    return lines


def _probe_lines(launch: Launch, probe_dir: Path) -> list[str]:
    tel = launch.run.telemetry
    lines = ["# Per-tensor Adam telemetry and spike actions (fullscale.megatron_probe wraps",
             "# train_step; docs/mindspeed_probe.md): at a loss / grad-norm spike it skips the",
             "# update on every rank (at most ADAMSPIKE_PROBE_SKIP_BUDGET times, then an alarm),",
             "# writes restart_recipe.sh and prints one line here; any probe error turns it off",
             "# on every rank and training continues. ADAMSPIKE_PROBE=0 runs without it;",
             "# ADAMSPIKE_PROBE_SKIP=0 / _RULES=0 / _RECIPE=0 / _ALARMS=0 turn single actions off.",
             f"export ADAMSPIKE_PROBE_OUT={_q(probe_dir)}",
             f"export ADAMSPIKE_PROBE_EVERY={tel.every} ADAMSPIKE_PROBE_HIST_EVERY={tel.hist_every}"]
    if launch.run.alarms.predictions:
        lines += ['ADAMSPIKE_PROBE_PREDICTIONS="${ADAMSPIKE_PROBE_PREDICTIONS:-}"   # online alarm rules',
                  'if [[ -z "$ADAMSPIKE_PROBE_PREDICTIONS" ]]; then ADAMSPIKE_PROBE_PREDICTIONS='
                  f'{_q(launch.run.alarms.predictions)}; fi',
                  "export ADAMSPIKE_PROBE_PREDICTIONS"]
    lines += ["ENTRY=(pretrain_gpt.py)",
              'if [[ "${ADAMSPIKE_PROBE:-1}" == 1 ]]; then',
              '  ADAMSPIKE_HOME="${ADAMSPIKE_HOME:?set ADAMSPIKE_HOME to the adamspike checkout on '
              'this node (its fullscale/megatron_probe.py goes on PYTHONPATH), or ADAMSPIKE_PROBE=0}"',
              '  if [[ ! -f "$ADAMSPIKE_HOME/fullscale/megatron_probe.py" ]]; then',
              '    echo "ADAMSPIKE_HOME=$ADAMSPIKE_HOME has no fullscale/megatron_probe.py" >&2; exit 2',
              "  fi",
              '  export PYTHONPATH="$ADAMSPIKE_HOME${PYTHONPATH:+:$PYTHONPATH}"',
              "  ENTRY=(-m fullscale.megatron_probe --adaptor auto -- pretrain_gpt.py)",
              "fi"]
    return lines


def mindspeed_script(launch: Launch) -> str:
    c = launch.cluster.cluster
    run = launch.run
    log = megatron_dir(launch) / "logs"
    tag = setting_tag(launch)
    probe_dir = megatron_dir(launch) / "telemetry"
    cfg = resolve_model(run.model)
    lines = _header("MindSpeed-LLM / Megatron pretrain_gpt.py, same optimizer and schedule", launch,
                    "train_mindspeed.sh")
    if run.train.loss_scale != 1.0:
        lines.insert(5, f"# train.loss_scale = {run.train.loss_scale:g} folded in: --adam-eps = eps / s, "
                        "--clip-grad = grad_clip / s")
    ch = launch.layout_choice
    if ch:
        why = {"upstream": "upstream's layout for this model (MindSpeed-LLM pretrain_llama2_70b_ptd.sh, "
                           "251f267c), fits without recompute",
               "smallest fitting": "the smallest TP x PP whose estimate fits, recompute only when "
                                   "nothing fits without it",
               "none fits": "NOTHING FITS the estimate; the largest layout with full recompute"}[ch["chosen_by"]]
        up = next((t for t in ch["tried"] if t.get("upstream")), None)
        ref = UPSTREAM_LAYOUTS.get((cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads))
        if ch["chosen_by"] != "upstream" and ref:
            why += ("; differs from upstream's " + megatron_sharding(*ref) + " without recompute: "
                    + (f"its estimate {up['total_gb']:.1f} GB does not fit" if up else
                       "not valid for this world size / batch / fixed TP, PP or recompute"))
        lines.insert(5, f"# Megatron layout: TP {launch.tp} x PP {launch.pp}"
                        + (f", {launch.vpp_layers} layers per virtual pipeline stage" if launch.vpp_layers else "")
                        + f", recompute {launch.recompute}: {why} (estimate "
                        f"{launch.memory_gb['megatron']:.1f} GB of {ch['usable_bytes'] / 1e9:.1f} GB usable per card; "
                        "adamspike model info --cluster)")
    at0 = 6 if ch else 5
    for i, gap in enumerate(launch.notes):
        lines.insert(at0 + i, f"# NOTE: {gap}")
    at = at0 + len(launch.notes)
    lines[at:at] = [
        "# At a loss spike (docs/mindspeed_probe.md):",
        "#   the probe (ADAMSPIKE_PROBE=1): online loss / grad-norm rules, skip-step on every rank",
        "#     within a budget, alarms from predictions.json, restart_recipe.sh (PaLM rollback +",
        "#     batch skip); fails open (any probe error: off on every rank, training continues)",
        "#   Megatron itself (core_v0.12: MEGATRON_STACK mindspeed-llm / megatron-lm, not",
        "#     modellink-2024): --check-for-spiky-loss, --check-for-large-grads, --rerun-mode",
        "#     (its rerun state machine re-runs a suspicious iteration: transient fault or",
        "#     reproducible spike; MindSpeed-LLM's loop ignores its checkpoint-and-exit, the",
        "#     probe carries it out), --ckpt-step (CKPT_STEP below) to restart before a spike;",
        "#     the spike's batches: SKIP_ITERATIONS below (the probe skips them on every stack)"]
    lines += _device_env(launch, megatron=True)
    lines += ['MINDSPEED_LLM_DIR="${MINDSPEED_LLM_DIR:?set MINDSPEED_LLM_DIR to the MindSpeed-LLM '
              '(ModelLink) or Megatron-LM checkout holding pretrain_gpt.py}"']
    lines += _stack_case(launch)
    lines += _probe_lines(launch, probe_dir)
    lines += ['cd "$MINDSPEED_LLM_DIR"', f"mkdir -p {_q(log)}",
              # underscore spellings: accepted by every torchrun, including torch 2.1's
              f"DISTRIBUTED_ARGS=(--nnodes {c.nodes} --nproc_per_node {c.devices_per_node} "
              '--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")',
              'torchrun "${DISTRIBUTED_ARGS[@]}" "${ENTRY[@]}" \\']
    lines += [f"  {a} \\" for a in megatron_args(launch)]
    lines += ['  ${STACK_ARGS[@]+"${STACK_ARGS[@]}"} \\',
              f'  2>&1 | tee -a {_q(log)}/{tag}".node${{NODE_RANK}}.log"']
    lines += [f"# {h}" for h in analyze_hint(launch)] + [""]
    return "\n".join(lines)


def analyze_hint(launch: Launch) -> list[str]:
    """The commands that analyse this setting's Megatron run (the last node's log: the
    last rank prints Megatron's training log and writes the probe's run directory)."""
    o, t, s = launch.run.optim, launch.run.train, launch.run.train.loss_scale
    log = megatron_dir(launch) / "logs" / f"{setting_tag(launch)}.node{launch.cluster.cluster.nodes - 1}.log"
    out = megatron_dir(launch) / "analysis"
    pred = launch.run.alarms.predictions
    p = f" --predictions {_q(pred)}" if pred else ""
    return ["Analyse (with adamspike installed, after copying the last node's files):",
            f"  adamspike analyze {_q(megatron_dir(launch) / 'telemetry')}{p} --out {_q(out)}"
            "      # per-tensor telemetry (the probe)",
            f"  adamspike analyze --log {_q(log)}{p} --model {launch.run.model.preset} "
            f"--seq-len {t.seq_len} --clip {o.grad_clip / s:g} "
            f"--b1 {o.b1:g} --b2 {o.b2:g} --eps {o.eps / s:g} --lr {o.lr:g} --out {_q(out)}_log",
            "  (several settings into one report: one --log per setting's log, one --out)"]


def write_launch(launch: Launch, out: Path, final: Path | None = None) -> dict[str, Any]:
    """Write run.toml, the scripts and launch.json into a new directory `out`; the files
    refer to themselves under `final` (default `out`), where the caller will move them."""
    out = Path(out).resolve()
    final = Path(final).resolve() if final is not None else out
    _script_safe("--out", final)
    with _staged_dir(out) as tmp:
        run_toml = final / "run.toml"
        (tmp / "run.toml").write_text(
            "# Resolved by `adamspike launch`; edit the source config and regenerate instead.\n"
            + dump_toml(to_dict(launch.run)))
        scripts = {}
        if "fsdp" in launch.engines:
            (tmp / "train_torchrun.sh").write_text(torchrun_script(launch, run_toml))
            scripts["torchrun"] = str(final / "train_torchrun.sh")
        if "megatron" in launch.engines:
            (tmp / "train_mindspeed.sh").write_text(mindspeed_script(launch))
            scripts["mindspeed"] = str(final / "train_mindspeed.sh")
        for name in scripts:
            p = tmp / Path(scripts[name]).name
            p.chmod(0o755)
        c = launch.cluster.cluster
        info = {"run_toml": str(run_toml), "run_dir": str(launch.run_dir), "scripts": scripts,
                "megatron_dir": str(megatron_dir(launch)) if "megatron" in launch.engines else None,
                "nodes": c.nodes, "devices_per_node": c.devices_per_node, "world_size": launch.world_size,
                "device": c.device, "master_addr": c.master_addr, "master_port": c.master_port,
                "micro_batch": launch.micro_batch, "megatron_tp": launch.tp, "megatron_pp": launch.pp,
                "megatron_vpp_layers": launch.vpp_layers, "megatron_recompute": launch.recompute,
                "megatron_layout": launch.layout_choice,
                "megatron_notes": launch.notes,
                "estimated_memory_gb_per_card": launch.memory_gb,
                "start": "on node k: bash SCRIPT k   (k = 0 .. nodes-1)",
                "cluster_config": to_dict(launch.cluster)}
        (tmp / "launch.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# ----------------------------------------------------------------------------- CLI

def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", help="cluster TOML (configs/cluster-128x8.toml); flags override it")
    p.add_argument("--nodes", type=int)
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--device", choices=("npu", "cuda", "cpu"))
    p.add_argument("--device-memory-gb", type=float, help="memory per card (cluster.device_memory_gb, default 64)")
    p.add_argument("--tp", type=int, help="Megatron tensor parallel size (0 = auto)")
    p.add_argument("--pp", type=int, help="Megatron pipeline parallel size (0 = auto)")
    p.add_argument("--recompute", choices=("auto", "none", "selective", "full"),
                   help="Megatron activation recompute (auto: only when no layout fits without it)")
    p.add_argument("--engine", choices=("both", "fsdp", "megatron"), default="both",
                   help="which scripts to write (default both)")


def _cluster(args) -> ClusterConfig:
    overrides = []
    for flag, key in (("nodes", "cluster.nodes"), ("devices_per_node", "cluster.devices_per_node"),
                      ("master_addr", "cluster.master_addr"), ("master_port", "cluster.master_port"),
                      ("device", "cluster.device"), ("device_memory_gb", "cluster.device_memory_gb"),
                      ("tp", "megatron.tp"), ("pp", "megatron.pp"),
                      ("recompute", "megatron.recompute")):
        v = getattr(args, flag)
        if v is not None:
            overrides += [f"--{key}", str(v)]
    try:
        return load_config(ClusterConfig, args.cluster, overrides)
    except ConfigError as e:
        # name the CLI flag rather than the TOML key when the value came from a flag
        msg = str(e)
        for flag, key in (("--nodes", "cluster.nodes"), ("--devices-per-node", "cluster.devices_per_node"),
                          ("--master-port", "cluster.master_port"), ("--tp", "megatron.tp"),
                          ("--pp", "megatron.pp")):
            if msg.startswith(key) and f"--{key}" in overrides:
                msg = f"{flag} ({key}){msg[len(key):]}"
        raise ConfigError(msg) from None


def _engines(name: str) -> tuple[str, ...]:
    return {"both": ("fsdp", "megatron"), "fsdp": ("fsdp",), "megatron": ("megatron",)}[name]


def _resolve_run(run, device: str):
    """Absolute paths, and dist.device set to the cluster's device."""
    return replace(run, **{"dist.device": device, "data.path": _abs(run.data.path),
                           "model.hf_config": _abs(run.model.hf_config),
                           "alarms.predictions": _abs(run.alarms.predictions)})


def _parse(p: argparse.ArgumentParser, argv: list[str]):
    """(args, --section.key value overrides) of a launch / plan command line."""
    args, overrides = p.parse_known_args(argv)
    if overrides and not overrides[0].startswith("--"):
        raise ConfigError(f"unexpected argument {overrides[0]!r}")
    return args, overrides


def launch_main(argv: list[str]) -> int:
    return exit_status("adamspike launch", lambda: _launch(argv))


def _launch(argv: list[str]) -> int:
    p = _Parser(prog="adamspike launch", description="Write per-node launch scripts for one run. "
                "Extra --section.key value pairs override the run config.", allow_abbrev=False)
    p.add_argument("--config", required=True, help="run config TOML")
    p.add_argument("--out", required=True, help="new directory for the scripts")
    p.add_argument("--run-dir", help="run directory the job writes (default OUT/run)")
    _cluster_args(p)
    args, overrides = _parse(p, argv)
    _script_safe("--out", args.out)
    cluster = _cluster(args)
    run = _resolve_run(load_config(RunConfig, args.config, overrides), cluster.cluster.device)
    out = Path(args.out).resolve()
    run_dir = Path(args.run_dir).resolve() if args.run_dir else out / "run"
    launch = prepare(run, cluster, run_dir, _engines(args.engine))
    info = write_launch(launch, out)
    for note in launch.notes:
        print(f"adamspike launch: warning: Megatron script: {note}", file=sys.stderr)
    _memory_warnings("adamspike launch", launch)
    print(f"wrote {out}: " + ", ".join(Path(s).name for s in info["scripts"].values())
          + f" for {info['nodes']} x {info['devices_per_node']} {info['device']}; on node k run: "
          + " or ".join(f"bash {s} k" for s in info["scripts"].values()))
    return 0


def _memory_warnings(prog: str, launch: Launch) -> None:
    """Warn when fullscale.model_info's estimate exceeds a 910B's 64 GB (npu only: the GPU
    model is not known here) or no Megatron layout fits [cluster] device_memory_gb."""
    if not launch.layout_fits:
        print(f"{prog}: warning: megatron: no TP x PP fits the estimate even with full recompute; "
              f"using TP {launch.tp} PP {launch.pp} (see `adamspike model info --sharding megatron:auto`)",
              file=sys.stderr)
    if launch.cluster.cluster.device != "npu":
        return
    for engine, gb in launch.memory_gb.items():
        if gb > 64:
            print(f"{prog}: warning: {engine}: estimated {gb:.0f} GB per card exceeds the 910B's 64 GB "
                  "(see `adamspike model info`)", file=sys.stderr)


def _safe_id(setting_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", setting_id).strip("._") or "setting"


def plan_main(argv: list[str]) -> int:
    """One run config + launch scripts per setting in predictions.json's `validate` list."""
    return exit_status("adamspike plan", lambda: _plan(argv), (PredictionsError,))


def _plan(argv: list[str]) -> int:
    p = _Parser(prog="adamspike plan",
                description="Run configs and launch scripts for the settings predictions.json recommends. "
                "Extra --section.key value pairs override the base config.", allow_abbrev=False)
    p.add_argument("--predictions", required=True)
    p.add_argument("--base", required=True, help="base run config TOML (e.g. configs/llama2-70b.toml)")
    p.add_argument("--out", required=True, help="new directory: one subdirectory per setting")
    p.add_argument("--top", type=int, help="only the first N settings of `validate`")
    p.add_argument("--runs-dir", help="where the runs write (default OUT/<setting>/run)")
    _cluster_args(p)
    prog = "adamspike plan"
    args, overrides = _parse(p, argv)
    _script_safe("--out", args.out)
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top: must be >= 1, got {args.top}")
    pred_path = Path(args.predictions)
    if not pred_path.is_file():
        raise ConfigError(f"--predictions: file not found: {pred_path}")
    preds = load_predictions(pred_path)
    ids = preds.validate[:args.top] if args.top else list(preds.validate)
    if not ids:
        raise ConfigError(f"{pred_path}: the validate list is empty; nothing to plan")
    cluster = _cluster(args)
    base = load_config(RunConfig, args.base, overrides)
    out = Path(args.out).resolve()
    with _staged_dir(out) as tmp:
        shutil.copyfile(pred_path, tmp / "predictions.json")
        rows, seen = [], set()
        for sid in ids:
            s = preds.setting(sid)
            name = _safe_id(sid)
            if name in seen:
                raise ConfigError(f"{pred_path}: settings {sid!r} and another map to the same directory {name!r}")
            seen.add(name)
            # plan = base config + the setting's overrides; min_lr keeps its ratio to lr
            # (e.g. cosine to 10%), so a lower lr stays valid.
            over = dict(s["overrides"])
            if "optim.lr" in over and "optim.min_lr" not in over:
                over["optim.min_lr"] = over["optim.lr"] * base.optim.min_lr / base.optim.lr
            over["alarms.predictions"] = str(out / "predictions.json")
            run = setting_config({"overrides": over}, f"setting {sid!r}", base=base)
            run = _resolve_run(run, cluster.cluster.device)
            run_dir = (Path(args.runs_dir).resolve() / name) if args.runs_dir else out / name / "run"
            try:
                launch = prepare(run, cluster, run_dir, _engines(args.engine))
            except ConfigError as e:
                raise ConfigError(f"setting {sid!r}: {e}") from None
            info = write_launch(launch, tmp / name, final=out / name)
            _memory_warnings(prog, launch)
            rows.append({"id": sid, "dir": str(out / name), "rank": s.get("rank"), "risk": s.get("risk"),
                         "risk_label": s.get("risk_label"), "overrides": dict(s["overrides"]),
                         "scripts": [Path(x).name for x in info["scripts"].values()],
                         "megatron_notes": launch.notes})
        # planned settings the spike-rate model cannot tell apart (the same model features,
        # so the same predicted rate): running both tests nothing the model predicts
        twins = indistinguishable(preds.setting(i) for i in ids)
        for g in twins:
            print(f"{prog}: warning: settings {', '.join(g)} have the same model features: "
                  "the spike-rate model predicts the same rate for them (they differ only in "
                  "keys it does not use), so running all of them tests no prediction; keep "
                  "one, or plan them as a test of that key", file=sys.stderr)
        feats = ((preds.rate_model or {}).get("features")
                 or (preds.settings[0].get("model_features") if preds.settings else None) or [])
        model = model_label({**(preds.rate_model or {}), "features": list(feats)})
        blind = not_in_model(feats)
        (tmp / "plan.json").write_text(json.dumps(
            {"predictions": str(out / "predictions.json"), "base": _abs(args.base), "settings": rows,
             "indistinguishable": twins, "model": model, "not_in_model": blind},
            indent=2) + "\n")
    print(f"model: {model}" + (f"; not in the model: {', '.join(blind)}" if blind else ""))
    print(f"wrote {out}: {len(rows)} setting(s): " + ", ".join(r["id"] for r in rows)
          + (f"; {sum(len(g) for g in twins)} of them indistinguishable for the model "
             f"({'; '.join(' = '.join(g) for g in twins)})" if twins else ""))
    return 0
