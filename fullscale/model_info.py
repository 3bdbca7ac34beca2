"""What a LLaMA run costs before it runs: parameters, FLOPs/token, memory per card, step time.

Parameters come from adamspike.llama.param_specs and are cross-checked against
fullscale.model.Transformer built on the meta device (no memory allocated).
FLOPs/token: adamspike.llama.flops_per_token (6 N_non-embedding + 12 L d T, PaLM convention).

Memory per card, data-parallel FSDP/ZeRO-3 over a shard group of S cards (S = world size for
"fsdp", S = k for "hsdp:k" with world/k replicas). B = bytes per element.

  sharded state   N/S x bytes/param
                  layout "fsdp2" (this trainer): fp32 params 4 + grads (reduce dtype 4|2)
                  + Adam m 4 + v 4  = 16 B/param (14 with bf16 grads)
                  layout "megatron": bf16 params 2 + grads (2|4 with fp32 accumulation)
                  + fp32 master 4 + m 4 + v 4 = 16 B/param (18 with fp32 grads)
  transient       gathered block params  P_block x B_c x (2 with prefetch of the next block)
                  block grads in backward P_block x (B_c + reduce B when the dtypes differ)
                  root group (embedding, final norm, head; not resharded) P_root x B_c
  activations     full checkpointing: L x b x T x d x B_c (block inputs)
                  + one block recomputed: 2 x b x T x (15 d + 5 kv + 4 f) x B_c
                    (saved forward tensors of RMSNorm, q/k/v, RoPE, repeated k/v, flash
                    attention output, SwiGLU, and their gradients; an estimate)
                  without checkpointing: L x the block term
  logits          b x T x V x (B_c + 4 + 4) (compute-dtype logits, fp32 copy, fp32 gradient)

Per-step cost (assumptions are arguments; defaults documented in DEFAULTS):
  compute  = flops_per_token x tokens_per_step / (world x peak x MFU)   [MFU of model FLOPs]
  bytes received per card and micro-step: all-gather forward N (S-1)/S B_c, all-gather
  backward (blocks only) N_blocks (S-1)/S B_c, reduce-scatter N (S-1)/S B_r, and for hsdp an
  all-reduce across the replicas 2 (R-1)/R N/S B_r; a collective over a group larger than a
  node runs at the inter-node bandwidth, else at the intra-node one. Step time is reported
  with perfect overlap max(compute, comm) and without overlap (compute + comm).

Megatron / MindSpeed-LLM layout ("megatron:tpTppP", optionally "vV" layers per virtual
pipeline stage: "megatron:tp8pp4v5"; "megatron:auto" picks one, choose_megatron_layout):
TP x PP model parallel, DP = world / (TP PP) data parallel with the distributed optimizer,
sequence parallelism, 1F1B schedule with m = global / (DP b) micro-batches (interleaved
with V layers per virtual stage). Per card on the first pipeline stage (embedding, most
micro-batches in flight) and the last (head, logits), whichever is larger:
  weights bf16 2 P_rank, main grads fp32 4 P_rank (Megatron's default under bf16; bf16 2 with
  --grad-dtype bf16), fp32 master + m + v 12 P_rank/DP
  with P_rank = (L/PP) P_block / TP + (V d)/TP;
  activations, with n = layer-micro-batches in flight on the stage (Megatron core_v0.12.1
  schedules.get_pp_rank_microbatches: warm-up PP - r - 1 (+1 in 1F1B) micro-batches of L/PP
  layers; interleaved 2 (PP - r - 1) + (chunks - 1) PP (+1) chunk-micro-batches of V layers,
  at most m x chunks):
    recompute full:      n x b T d B_c / TP (block inputs) + one block recomputed / TP
    recompute none:      n x b T (15 d + 5 kv + 4 f) B_c / TP (the saved forward tensors of
                         a block) + one block's gradients of the same size
    recompute selective: as none less the core attention's output b T d per layer (Megatron's
                         selective recompute is core attention; with flash attention the
                         s^2 scores it was made for are never stored, so it saves little)
  logits b T V / TP x (B_c + 8) on the last stage.
A layout "fits" when the total is at most (1 - headroom) of the card's memory: the headroom
(Assumptions.memory_headroom, 0.15) is for what the estimate leaves out (allocator
fragmentation, HCCL buffers, kernel workspaces, the runtime; torch reports 62.4 of a 910B's
64 GB as usable).
Cost: compute x (1 + (PP-1)/(m chunks)) (pipeline bubble; chunks = (L/PP)/V when interleaved); TP collectives with SP (all-gather +
reduce-scatter twice per block in forward, backward and recompute: 12 x (TP-1)/TP x b T d B_c
per block per micro-batch) at the intra-node bandwidth; PP sends 2 b T d B_c / TP per
micro-batch and DP reduce-scatter of grads + all-gather of bf16 weights ((DP-1)/DP P_rank
each) at the inter-node bandwidth.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adamspike.config import ConfigError, load_config, to_dict
from adamspike.llama import PRESETS, LlamaConfig, flops_per_token, num_params, param_specs, preset
from adamspike.train_config import RunConfig
from fullscale.hf import load_hf_config, resolve_model

GB = 1e9


@dataclass
class Assumptions:
    """Hardware assumptions of the cost model (all overridable from the CLI)."""
    mfu: float = 0.45                 # model-FLOPs utilisation (reported 70B runs: 0.41-0.60)
    peak_flops: float = 313e12        # bf16 dense per card; configs/devices.toml "Ascend910B"
    intra_node_gbs: float = 150.0     # ring bus bandwidth per card inside a node, GB/s
    inter_node_gbs: float = 20.0      # per card across nodes: 200 Gb/s RoCE at ~80%, GB/s
    devices_per_node: int = 8
    device_memory_gb: float = 64.0    # 910B HBM (torch reports 62432 MB usable on a 910B2C)
    memory_headroom: float = 0.15     # share of device memory the estimate must leave free


DEFAULTS = Assumptions()


def parse_sharding(text: str, world_size: int) -> tuple[str, int]:
    """"fsdp" -> ("fsdp", world); "hsdp:k" -> ("hsdp", k) with k dividing the world size."""
    if text == "fsdp":
        return "fsdp", world_size
    if text.startswith("hsdp:"):
        try:
            k = int(text[5:])
        except ValueError:
            raise ConfigError(f"--sharding: expected hsdp:K with an integer K, got {text!r}") from None
        if k < 1 or world_size % k:
            raise ConfigError(f"--sharding: shard group size {k} must be >= 1 and divide "
                              f"--world-size {world_size}")
        return "hsdp", k
    raise ConfigError(f"--sharding: expected fsdp or hsdp:K, got {text!r}")


def param_counts(cfg: LlamaConfig) -> dict[str, int]:
    specs = param_specs(cfg)
    by_kind = lambda k: sum(s.numel for s in specs if s.kind == k)  # noqa: E731
    per_block = sum(s.numel for s in specs if s.depth == 0)
    return {"total": num_params(cfg), "embedding": by_kind("embed"), "output": by_kind("output"),
            "non_embedding": num_params(cfg, embeddings=False), "per_block": per_block,
            "blocks": per_block * cfg.num_layers,
            "root": sum(s.numel for s in specs if not 0 <= s.depth < cfg.num_layers)}


def meta_param_count(cfg: LlamaConfig) -> int:
    """Parameters of fullscale.model.Transformer built on the meta device."""
    # lazy: torch; `model info --no-meta-check` and `launch` run without it
    import torch
    from fullscale.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def memory_per_card(cfg: LlamaConfig, *, world_size: int, seq_len: int, micro_batch: int,
                    sharding: str = "fsdp", layout: str = "fsdp2", grad_dtype: str | None = None,
                    dtype: str = "bf16", activation_checkpointing: bool = True,
                    prefetch: bool = True) -> dict[str, float]:
    """Bytes per card by component (see the module docstring) plus "total"."""
    _, shard = parse_sharding(sharding, world_size)
    if layout not in ("fsdp2", "megatron"):
        raise ConfigError(f"--layout: expected fsdp2 or megatron, got {layout!r}")
    grad_dtype = grad_dtype or ("fp32" if layout == "fsdp2" else "bf16")
    if grad_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--grad-dtype: expected fp32 or bf16, got {grad_dtype!r}")
    bc = 2 if dtype == "bf16" else 4
    br = 4 if grad_dtype == "fp32" else 2
    n = param_counts(cfg)
    N, Pb = n["total"], n["per_block"]
    state_per_param = (4 + br + 8) if layout == "fsdp2" else (2 + br + 4 + 8)
    b, T, d, L = micro_batch, seq_len, cfg.dim, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    block_act = 2 * b * T * (15 * d + 5 * kv + 4 * cfg.ffn_dim) * bc
    out = {
        "state_sharded": N / shard * state_per_param,
        "gathered_block_params": Pb * bc * (2 if prefetch else 1),
        "block_grads_backward": Pb * (bc + (br if br != bc else 0)),
        "root_unsharded": n["root"] * bc if shard > 1 else 0.0,
        "activations_checkpoints": L * b * T * d * bc if activation_checkpointing else 0.0,
        "activations_blocks": block_act if activation_checkpointing else L * block_act,
        "logits": b * T * cfg.vocab_size * (bc + 4 + 4),
    }
    out["state_bytes_per_param"] = float(state_per_param)
    out["total"] = sum(v for k, v in out.items() if k != "state_bytes_per_param")
    return out


def step_cost(cfg: LlamaConfig, *, world_size: int, seq_len: int, micro_batch: int,
              global_batch: int, sharding: str = "fsdp", grad_dtype: str = "fp32",
              dtype: str = "bf16", assumptions: Assumptions = DEFAULTS) -> dict[str, float]:
    """Compute and communication time of one optimizer step (module docstring)."""
    kind, S = parse_sharding(sharding, world_size)
    if global_batch % (world_size * micro_batch):
        raise ConfigError(f"--global-batch {global_batch} is not divisible by --world-size "
                          f"{world_size} x --micro-batch {micro_batch}")
    a = assumptions
    accum = global_batch // (world_size * micro_batch)
    R = world_size // S
    bc, br = (2 if dtype == "bf16" else 4), (4 if grad_dtype == "fp32" else 2)
    n = param_counts(cfg)
    tokens = global_batch * seq_len
    fpt = flops_per_token(cfg, seq_len)
    compute_s = fpt * tokens / (world_size * a.peak_flops * a.mfu)
    frac = (S - 1) / S
    shard_bw = (a.intra_node_gbs if S <= a.devices_per_node else a.inter_node_gbs) * GB
    volumes = {  # bytes per card per step
        "all_gather_forward": accum * n["total"] * frac * bc,
        "all_gather_backward": accum * n["blocks"] * frac * bc,
        "reduce_scatter": accum * n["total"] * frac * br,
        "all_reduce_replicas": accum * 2 * (R - 1) / R * n["total"] / S * br if R > 1 else 0.0,
    }
    times = {k: v / shard_bw for k, v in volumes.items() if k != "all_reduce_replicas"}
    times["all_reduce_replicas"] = volumes["all_reduce_replicas"] / (a.inter_node_gbs * GB)
    comm_s = sum(times.values())
    overlap_s, serial_s = max(compute_s, comm_s), compute_s + comm_s
    per_card = tokens / world_size
    return {
        "sharding": kind, "shard_group": S, "replicas": R, "grad_accum_steps": accum,
        "tokens_per_step": tokens, "flops_per_step": fpt * tokens, "compute_s": compute_s,
        **{f"{k}_bytes": v for k, v in volumes.items()},
        **{f"{k}_s": v for k, v in times.items()},
        "comm_bytes": sum(volumes.values()), "comm_s": comm_s,
        "step_s_overlapped": overlap_s, "step_s_serial": serial_s,
        "tokens_per_s_per_card_overlapped": per_card / overlap_s,
        "tokens_per_s_per_card_serial": per_card / serial_s,
        "mfu_serial": compute_s / serial_s * a.mfu,
    }


RECOMPUTE = ("none", "selective", "full")


def parse_megatron(text: str, world_size: int) -> tuple[int, int, int]:
    """"megatron:tp8pp8" -> (8, 8, 0), "megatron:tp8pp4v5" -> (8, 4, 5) (layers per virtual
    pipeline stage; 0 = not interleaved), with TP x PP dividing the world size."""
    m = re.fullmatch(r"megatron:tp(\d+)pp(\d+)(?:v(\d+))?", text)
    if not m:
        raise ConfigError(f"--sharding: expected megatron:tpTppP[vV] (e.g. megatron:tp8pp4v5) or "
                          f"megatron:auto, got {text!r}")
    tp, pp, v = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(f"--sharding: TP x PP = {tp * pp} must divide --world-size {world_size}")
    return tp, pp, v


def megatron_sharding(tp: int, pp: int, vpp_layers: int = 0) -> str:
    return f"megatron:tp{tp}pp{pp}" + (f"v{vpp_layers}" if vpp_layers else "")


def _megatron_shape(cfg: LlamaConfig, world_size: int, sharding: str, micro_batch: int,
                    global_batch: int | None):
    tp, pp, v = parse_megatron(sharding, world_size)
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise ConfigError(f"--sharding: TP {tp} must divide num_heads {cfg.num_heads} and "
                          f"num_kv_heads {cfg.num_kv_heads}")
    if cfg.num_layers % pp:
        raise ConfigError(f"--sharding: PP {pp} must divide num_layers {cfg.num_layers}")
    if v and (pp < 3 or (cfg.num_layers // pp) % v):
        # core_v0.12.1 megatron/training/arguments.py: interleaving needs PP > 2 (without
        # --overlap-p2p-comm) and V dividing the stage's layers
        raise ConfigError(f"--sharding: {v} layers per virtual pipeline stage needs PP > 2 and must "
                          f"divide the {cfg.num_layers // pp} layers of a stage")
    dp = world_size // (tp * pp)
    if global_batch is not None and global_batch % (dp * micro_batch):
        raise ConfigError(f"--global-batch {global_batch} is not divisible by data-parallel size {dp} "
                          f"x --micro-batch {micro_batch}")
    m = (global_batch // (dp * micro_batch)) if global_batch is not None else pp
    if v and m % pp:
        # core_v0.12.1 schedules.py forward_backward_pipelining_with_interleaving: micro-batches
        # go in groups of PP; a remainder below PP is refused
        raise ConfigError(f"--sharding: the interleaved schedule needs the {m} micro-batches to be a "
                          f"multiple of PP {pp}")
    return tp, pp, dp, m, v


def layer_microbatches_in_flight(pp: int, m: int, stage: int, layers: int, vpp_layers: int = 0) -> int:
    """Layer-micro-batches whose activations pipeline stage `stage` holds at its peak
    (Megatron core_v0.12.1 get_pp_rank_microbatches: warm-up + the one of 1F1B)."""
    if pp == 1:
        return layers
    if not vpp_layers:
        return min(pp - stage, m) * layers
    chunks = layers // vpp_layers
    return min(2 * (pp - stage - 1) + (chunks - 1) * pp + 1, m * chunks) * vpp_layers


def megatron_memory(cfg: LlamaConfig, *, world_size: int, seq_len: int, micro_batch: int,
                    sharding: str, global_batch: int | None = None, grad_dtype: str = "fp32",
                    dtype: str = "bf16", recompute: str = "full") -> dict[str, float]:
    """Bytes per card of the Megatron layout (module docstring), at the larger pipeline end."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute: expected one of {', '.join(RECOMPUTE)} or auto, got {recompute!r}")
    tp, pp, dp, m, v = _megatron_shape(cfg, world_size, sharding, micro_batch, global_batch)
    bc, br = (2 if dtype == "bf16" else 4), (4 if grad_dtype == "fp32" else 2)
    n = param_counts(cfg)
    b, T, d = micro_batch, seq_len, cfg.dim
    kv = cfg.num_kv_heads * cfg.head_dim
    layers = cfg.num_layers // pp
    p_rank = (layers * n["per_block"] + cfg.vocab_size * d) / tp
    saved = b * T * (15 * d + 5 * kv + 4 * cfg.ffn_dim) * bc / tp   # one block's forward tensors
    per_layer = {"full": b * T * d * bc / tp, "none": saved,
                 "selective": saved - b * T * d * bc / tp}[recompute]
    workspace = 2 * saved if recompute == "full" else saved       # recomputed block + its grads

    def stage(index: int, logits: float) -> dict[str, float]:
        return {"weights": bc * p_rank, "main_grads": br * p_rank, "optimizer_sharded": 12 * p_rank / dp,
                "activations_checkpoints" if recompute == "full" else "activations_stored":
                    layer_microbatches_in_flight(pp, m, index, layers, v) * per_layer,
                "activations_blocks": workspace, "logits": logits}

    logits = b * T * cfg.vocab_size * (bc + 8) / tp
    first = stage(0, 0.0 if pp > 1 else logits)
    last = stage(pp - 1, logits)
    name, out = max((("first", first), ("last", last)), key=lambda x: sum(x[1].values()))
    total = sum(out.values())
    # bytes per parameter held on this card (its 1/(TP PP) share of the model)
    return {**out, "total": total, "state_bytes_per_param": float(bc + br + 12 / dp), "stage": name,
            "recompute": recompute, "vpp_layers": v}


def recompute_flags(recompute: str) -> list[str]:
    return {"none": [], "selective": ["--recompute-granularity selective"],
            "full": ["--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"]}[recompute]


# Upstream's reference layout: Ascend/MindSpeed-LLM examples/mcore/llama2/pretrain_llama2_70b_ptd.sh
# at 251f267c20b315f6e639c8112e3aaeb5fad9cef3 (its last version; removed in f35bfccc, "Model
# Sunset Plan III"): TP 8, PP 4, --num-layers-per-virtual-pipeline-stage 5, --sequence-parallel,
# micro batch 1, global batch 1024, seq 4096, no --recompute-* flag (no recompute), on 4 x 8
# cards. Keyed by architecture (layers, dim, heads, kv heads) -> (TP, PP, layers per virtual
# stage). Flag names: Megatron-LM core_v0.12.1 (a845aa7e) megatron/training/arguments.py.
UPSTREAM_LAYOUTS = {(80, 8192, 64, 8): (8, 4, 5)}   # LLaMA2-70B
UPSTREAM_VPP_LAYERS = 5


def _vpp_layers(layers_per_stage: int, pp: int, m: int) -> int:
    """Layers per virtual pipeline stage: upstream's 5 where it divides the stage (the 70B at
    PP 4: 20 layers -> 4 chunks), else the largest divisor of the stage's layers below 5; 0 (not
    interleaved) where Megatron cannot interleave (PP <= 2, the micro-batches not a multiple
    of PP) or the stage would be one chunk."""
    if pp < 3 or m % pp:
        return 0
    v = next(k for k in range(min(UPSTREAM_VPP_LAYERS, layers_per_stage), 0, -1) if layers_per_stage % k == 0)
    return v if layers_per_stage // v > 1 else 0


def choose_megatron_layout(cfg: LlamaConfig, *, world_size: int, seq_len: int, micro_batch: int,
                           global_batch: int, devices_per_node: int = 8, device_memory_gb: float = 64.0,
                           headroom: float = DEFAULTS.memory_headroom, grad_dtype: str = "fp32",
                           dtype: str = "bf16", recompute: str = "auto", tp: int = 0,
                           pp: int = 0, vpp_layers: int | None = None) -> dict[str, Any]:
    """The Megatron layout a run gets: upstream's reference layout for the architecture
    (UPSTREAM_LAYOUTS: the vendor ran and tuned it) when TP / PP are not fixed, it is valid
    for this world size and batch and its estimate fits without recompute; else the smallest
    model-parallel size TP x PP whose estimate (megatron_memory) fits (1 - headroom) x the
    card's memory; at equal size the larger TP (TP inside a node: no pipeline bubble;
    upstream's 70B uses TP 8); interleaved pipeline stages (_vpp_layers) where Megatron
    allows them. Recompute only when nothing fits without it: none, then selective, then
    full ("auto"); a named recompute, TP or PP (non-zero) or vpp_layers (not None; 0 = not
    interleaved) is kept. When nothing fits, the largest model-parallel size with full
    recompute, "fits": False. Returns tp, pp, vpp_layers, recompute, sharding, memory,
    fits, usable_bytes, chosen_by (upstream | smallest fitting | none fits) and `tried`
    (each candidate's total)."""
    if recompute != "auto" and recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute: expected auto or one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    usable = device_memory_gb * GB * (1 - headroom)
    tps = [t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0] if not tp else [tp]
    pps = [p for p in range(1, cfg.num_layers + 1) if cfg.num_layers % p == 0] if not pp else [pp]
    shapes = []
    for t in tps:
        for p in pps:
            if cfg.num_heads % t or cfg.num_kv_heads % t or world_size % (t * p):
                continue
            dp = world_size // (t * p)
            if global_batch % (dp * micro_batch):
                continue
            v = vpp_layers if vpp_layers is not None else _vpp_layers(
                cfg.num_layers // p, p, global_batch // (dp * micro_batch))
            shapes.append((t * p, -t, t, p, v))
    if not shapes:
        raise ConfigError(f"no Megatron layout: no TP x PP (TP dividing {devices_per_node} devices per node "
                          f"and the {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, PP dividing "
                          f"{cfg.num_layers} layers) divides world size {world_size} and global batch "
                          f"{global_batch} / micro batch {micro_batch}")
    shapes.sort()
    tried = []
    ref = UPSTREAM_LAYOUTS.get((cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads))
    if ref and not tp and not pp and vpp_layers is None and recompute in ("auto", "none"):
        t, p, v = ref
        shape = next((x for x in shapes if x[2:4] == (t, p)), None)
        if shape is not None and shape[4] == v:   # valid here, and interleavable as upstream
            mem = megatron_memory(cfg, world_size=world_size, seq_len=seq_len, micro_batch=micro_batch,
                                  sharding=megatron_sharding(t, p, v), global_batch=global_batch,
                                  grad_dtype=grad_dtype, dtype=dtype, recompute="none")
            tried.append({"sharding": megatron_sharding(t, p, v), "recompute": "none",
                          "total_gb": mem["total"] / GB, "upstream": True})
            if mem["total"] <= usable:
                return {"tp": t, "pp": p, "vpp_layers": v, "recompute": "none",
                        "sharding": megatron_sharding(t, p, v), "memory": mem, "fits": True,
                        "usable_bytes": usable, "tried": tried, "chosen_by": "upstream"}
    for rc in (RECOMPUTE if recompute == "auto" else (recompute,)):
        for _, _, t, p, v in shapes:
            mem = megatron_memory(cfg, world_size=world_size, seq_len=seq_len, micro_batch=micro_batch,
                                  sharding=megatron_sharding(t, p, v), global_batch=global_batch,
                                  grad_dtype=grad_dtype, dtype=dtype, recompute=rc)
            tried.append({"sharding": megatron_sharding(t, p, v), "recompute": rc, "total_gb": mem["total"] / GB})
            if mem["total"] <= usable:
                return {"tp": t, "pp": p, "vpp_layers": v, "recompute": rc, "sharding": megatron_sharding(t, p, v),
                        "memory": mem, "fits": True, "usable_bytes": usable, "tried": tried,
                        "chosen_by": "smallest fitting"}
    _, _, t, p, v = shapes[-1]
    mem = megatron_memory(cfg, world_size=world_size, seq_len=seq_len, micro_batch=micro_batch,
                          sharding=megatron_sharding(t, p, v), global_batch=global_batch,
                          grad_dtype=grad_dtype, dtype=dtype, recompute=rc)
    return {"tp": t, "pp": p, "vpp_layers": v, "recompute": rc, "sharding": megatron_sharding(t, p, v),
            "memory": mem, "fits": False, "usable_bytes": usable, "tried": tried, "chosen_by": "none fits"}


def megatron_cost(cfg: LlamaConfig, *, world_size: int, seq_len: int, micro_batch: int,
                  global_batch: int, sharding: str, grad_dtype: str = "fp32", dtype: str = "bf16",
                  assumptions: Assumptions = DEFAULTS) -> dict[str, float]:
    """Step time of the Megatron layout (module docstring)."""
    tp, pp, dp, m, v = _megatron_shape(cfg, world_size, sharding, micro_batch, global_batch)
    a = assumptions
    bc, br = (2 if dtype == "bf16" else 4), (4 if grad_dtype == "fp32" else 2)
    n = param_counts(cfg)
    b, T, d = micro_batch, seq_len, cfg.dim
    layers = cfg.num_layers // pp
    p_rank = (layers * n["per_block"] + cfg.vocab_size * d) / tp
    tokens = global_batch * seq_len
    fpt = flops_per_token(cfg, seq_len)
    compute_s = fpt * tokens / (world_size * a.peak_flops * a.mfu)
    # interleaving divides the bubble by the chunks per stage (Narayanan et al. 2021, sec. 2.2)
    bubble_s = compute_s * (pp - 1) / m / ((layers // v) if v else 1)
    tp_bw = (a.intra_node_gbs if tp <= a.devices_per_node else a.inter_node_gbs) * GB
    volumes = {
        "tensor_parallel": m * layers * 12 * (tp - 1) / tp * b * T * d * bc,
        "pipeline_p2p": m * 2 * b * T * d * bc / tp if pp > 1 else 0.0,
        "dp_reduce_scatter": (dp - 1) / dp * p_rank * br,
        "dp_all_gather": (dp - 1) / dp * p_rank * bc,
    }
    times = {"tensor_parallel": volumes["tensor_parallel"] / tp_bw,
             **{k: v / (a.inter_node_gbs * GB) for k, v in volumes.items() if k != "tensor_parallel"}}
    comm_s = sum(times.values())
    busy = compute_s + bubble_s
    overlap_s, serial_s = max(busy, comm_s), busy + comm_s
    per_card = tokens / world_size
    return {
        "sharding": "megatron", "tp": tp, "pp": pp, "dp": dp, "vpp_layers": v, "grad_accum_steps": m,
        "tokens_per_step": tokens, "flops_per_step": fpt * tokens, "compute_s": compute_s,
        "pipeline_bubble_s": bubble_s,
        **{f"{k}_bytes": v for k, v in volumes.items()}, **{f"{k}_s": v for k, v in times.items()},
        "comm_bytes": sum(volumes.values()), "comm_s": comm_s,
        "step_s_overlapped": overlap_s, "step_s_serial": serial_s,
        "tokens_per_s_per_card_overlapped": per_card / overlap_s,
        "tokens_per_s_per_card_serial": per_card / serial_s,
    }


# ----------------------------------------------------------------------------- config args

def resolve_config(arg: str):
    """--config: a preset name, a RunConfig TOML or a HF config.json ->
    (LlamaConfig, RunConfig or None, description)."""
    if arg in PRESETS:
        return preset(arg), None, f"preset {arg}"
    path = Path(arg)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").is_file()):
        return load_hf_config(path), None, f"HF config {path}"
    if path.suffix == ".toml":
        run = load_config(RunConfig, path)
        return resolve_model(run.model), run, f"run config {path}"
    raise ConfigError(f"--config: {arg!r} is neither a preset ({', '.join(PRESETS)}), a .toml run "
                      "config nor a HF config.json")


def default_world_size(argv: list[str]) -> int | None:
    """The world size `model info --config X` assumes without --world-size: for a run config,
    the cards its batch implies with no gradient accumulation, train.global_batch_size /
    train.micro_batch_size (configs/llama2-70b.toml: 1024 / 1 = the report's 1024 cards);
    None (the CLI's default: --cluster's cards, else 1) with --cluster, for a preset, a HF config, a run config without a micro
    batch, or a --config that does not load (the CLI then names the error)."""
    if any(a == "--cluster" or a.startswith("--cluster=") for a in argv):
        return None   # the cluster gives the world size
    try:
        i = argv.index("--config")
        arg = argv[i + 1]
    except (ValueError, IndexError):
        arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if not arg or not arg.endswith(".toml"):
        return None
    try:
        run = load_config(RunConfig, Path(arg))
    except Exception:  # noqa: BLE001 - the CLI reports a bad config itself
        return None
    t = run.train
    if not t.micro_batch_size or t.global_batch_size % t.micro_batch_size:
        return None
    return t.global_batch_size // t.micro_batch_size


def model_info(cfg: LlamaConfig, *, world_size: int = 1, seq_len: int | None = None,
               micro_batch: int = 1, global_batch: int | None = None, sharding: str = "fsdp",
               layout: str = "fsdp2", grad_dtype: str | None = None, dtype: str = "bf16",
               activation_checkpointing: bool = True, prefetch: bool = True,
               assumptions: Assumptions = DEFAULTS, meta_check: bool = True,
               recompute: str | None = None) -> dict[str, Any]:
    """Everything `adamspike model info` prints, as one JSON-able dict. Megatron layouts:
    `recompute` none | selective | full (default: full with activation_checkpointing, else
    none) or auto; sharding "megatron:auto" or recompute "auto" choose the layout
    (choose_megatron_layout, reported under "layout_choice")."""
    if world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1, got {world_size}")
    if micro_batch < 1:
        raise ConfigError(f"--micro-batch: must be >= 1, got {micro_batch}")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ConfigError(f"--seq-len: {seq_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
    global_batch = world_size * micro_batch if global_batch is None else global_batch
    if global_batch < 1:
        raise ConfigError(f"--global-batch: must be >= 1, got {global_batch}")
    choice = None
    if sharding.startswith("megatron:"):
        layout = "megatron"       # the engine fixes the layout (fp32 main grads)
        grad_dtype = grad_dtype or "fp32"
        recompute = recompute or ("full" if activation_checkpointing else "none")
        if sharding == "megatron:auto" or recompute == "auto":
            tp = pp = 0
            vpp = None
            if sharding != "megatron:auto":
                tp, pp, v = parse_megatron(sharding, world_size)
                vpp = v or None      # "megatron:tp8pp4": interleaving chosen; "...v2": kept
            choice = choose_megatron_layout(
                cfg, world_size=world_size, seq_len=seq_len, micro_batch=micro_batch,
                global_batch=global_batch, devices_per_node=assumptions.devices_per_node,
                device_memory_gb=assumptions.device_memory_gb, headroom=assumptions.memory_headroom,
                grad_dtype=grad_dtype, dtype=dtype, recompute=recompute, tp=tp, pp=pp, vpp_layers=vpp)
            sharding, recompute = choice["sharding"], choice["recompute"]
        activation_checkpointing = recompute != "none"
    grad_dtype = grad_dtype or ("fp32" if layout == "fsdp2" else "bf16")
    counts = param_counts(cfg)
    if meta_check:
        counts["meta_device"] = meta_param_count(cfg)
        if counts["meta_device"] != counts["total"]:
            raise RuntimeError(f"fullscale.model.Transformer has {counts['meta_device']} parameters, "
                               f"param_specs says {counts['total']}")
    shape = dict(world_size=world_size, seq_len=seq_len, micro_batch=micro_batch, sharding=sharding,
                 grad_dtype=grad_dtype, dtype=dtype)
    if layout == "megatron" and sharding.startswith("megatron:"):
        memory = megatron_memory(cfg, global_batch=global_batch, recompute=recompute, **shape)
        cost = megatron_cost(cfg, global_batch=global_batch, assumptions=assumptions, **shape)
    else:
        memory = memory_per_card(cfg, layout=layout, activation_checkpointing=activation_checkpointing,
                                 prefetch=prefetch, **shape)
        cost = step_cost(cfg, global_batch=global_batch, assumptions=assumptions, **shape)
    memory["device_memory"] = assumptions.device_memory_gb * GB
    memory["usable_memory"] = memory["device_memory"] * (1 - assumptions.memory_headroom)
    memory["fits"] = memory["total"] <= memory["usable_memory"]
    return {
        "architecture": to_dict(cfg), "params": counts,
        "flops_per_token": flops_per_token(cfg, seq_len), "seq_len": seq_len,
        "world_size": world_size, "micro_batch": micro_batch, "global_batch": global_batch,
        "sharding": sharding, "layout": layout, "grad_dtype": grad_dtype, "dtype": dtype,
        "activation_checkpointing": activation_checkpointing, "prefetch": prefetch,
        "memory_bytes": memory, "cost": cost, "assumptions": dataclasses.asdict(assumptions),
        **({"recompute": recompute} if layout == "megatron" else {}),
        **({"layout_choice": {k: v for k, v in choice.items() if k != "memory"}} if choice else {}),
    }


def format_info(info: dict[str, Any], source: str = "") -> str:
    p, m, c, a = info["params"], info["memory_bytes"], info["cost"], info["assumptions"]
    arch = info["architecture"]
    lines = [f"model: {source}" if source else "model:",
             f"  dim {arch['dim']}, layers {arch['num_layers']}, heads {arch['num_heads']} "
             f"(kv {arch['num_kv_heads']}), ffn {arch['ffn_dim']}, vocab {arch['vocab_size']}",
             f"parameters: {p['total']:,} (embedding {p['embedding']:,}, head {p['output']:,}, "
             f"per block {p['per_block']:,})"
             + (f"; meta-device model: {p['meta_device']:,}" if "meta_device" in p else ""),
             f"FLOPs/token at seq {info['seq_len']}: {info['flops_per_token'] / 1e9:.1f} G",
             f"memory per card: world {info['world_size']}, {info['sharding']}, layout {info['layout']}, "
             f"micro batch {info['micro_batch']}, {info['dtype']}, grads {info['grad_dtype']}, "
             f"activation checkpointing {'on' if info['activation_checkpointing'] else 'off'}"]
    for k, v in m.items():
        if k in ("total", "device_memory", "usable_memory", "fits", "state_bytes_per_param", "stage",
                 "recompute", "vpp_layers"):
            continue
        lines.append(f"  {k:<26} {v / GB:9.2f} GB")
    lines.append(f"  {'total':<26} {m['total'] / GB:9.2f} GB of {m['usable_memory'] / GB:.1f} GB usable "
                 f"({m['device_memory'] / GB:.0f} GB less {a['memory_headroom']:.0%} headroom; "
                 f"{'fits' if m['fits'] else 'DOES NOT FIT'}; state {m['state_bytes_per_param']:.0f} B/param)")
    if "recompute" in info:
        lines.append(f"  recompute {info['recompute']}" + (
            f", {c['vpp_layers']} layers per virtual pipeline stage" if c.get("vpp_layers") else ""))
    if "layout_choice" in info:
        ch = info["layout_choice"]
        why = {"upstream": "upstream's layout for this model (MindSpeed-LLM), fits without recompute",
               "smallest fitting": "the smallest TP x PP that fits, recompute only when none fits without",
               "none fits": "nothing fits"}[ch["chosen_by"]]
        lines.append(f"  layout chosen: {ch['sharding']} recompute {ch['recompute']} ({why}; "
                     f"{len(ch['tried'])} tried)"
                     + ("" if ch["fits"] else "; NOTHING FITS: the largest layout with full recompute"))
    layout = (f"TP {c['tp']} x PP {c['pp']} x DP {c['dp']}" if c["sharding"] == "megatron"
              else f"shard group {c['shard_group']} x {c['replicas']} replica(s)")
    lines += [f"step cost: global batch {info['global_batch']} x {info['seq_len']} = "
              f"{c['tokens_per_step']:,} tokens, {c['grad_accum_steps']} micro-step(s), {layout}",
              f"  compute {c['compute_s']:.2f} s at MFU {a['mfu']:.2f} of {a['peak_flops'] / 1e12:.0f} TF"
              + (f" + pipeline bubble {c['pipeline_bubble_s']:.2f} s" if "pipeline_bubble_s" in c else "")]
    for k in c:
        if k.endswith("_bytes") and k != "comm_bytes":
            name = k[:-len("_bytes")]
            lines.append(f"  {name.replace('_', ' '):<24} {c[k] / GB:8.1f} GB {c[name + '_s']:8.2f} s")
    lines += [f"  (bandwidth per card: intra-node {a['intra_node_gbs']:.0f} GB/s, inter-node "
              f"{a['inter_node_gbs']:.0f} GB/s, {a['devices_per_node']} per node)",
              f"  step {c['step_s_overlapped']:.2f} s overlapped / {c['step_s_serial']:.2f} s serial -> "
              f"{c['tokens_per_s_per_card_overlapped']:.0f} / {c['tokens_per_s_per_card_serial']:.0f} "
              "tokens/s/card"]
    return "\n".join(lines)
