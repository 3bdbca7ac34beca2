"""`adamspike model info` and `adamspike data inspect|convert`.

    adamspike model info --config llama2-70b --world-size 1024 [--sharding hsdp:8] [--json]
    adamspike data inspect data/corpus_text_document [--vocab-size 32000] [--json]
    adamspike data convert --input docs.jsonl --out data/corpus_text_document [--dtype uint16]

Bad input prints one line naming the problem to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from adamspike.config import ConfigError
from fullscale.data import DataFormatError, IndexedTokens, IndexedWriter
from fullscale.model_info import DEFAULTS, Assumptions, format_info, model_info, resolve_config


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so errors come back as status 2."""

    def error(self, message):
        raise ConfigError(message)


def exit_status(prog: str, body, errors=()) -> int:
    """body() -> its status, for every `adamspike` command of fullscale (model, data, launch,
    plan): argparse's exit (--help) -> its status; ConfigError or one of `errors` -> one
    line `PROG: error: ...` on stderr and 2."""
    try:
        return body()
    except SystemExit as e:
        return int(e.code or 0)
    except (ConfigError, *errors) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- model

def model_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="adamspike model info", allow_abbrev=False,
                description="Parameters, FLOPs/token, memory per card and step cost of a LLaMA model.")
    p.add_argument("--config", required=True,
                   help="preset name, RunConfig .toml, or HuggingFace config.json")
    p.add_argument("--world-size", type=int, help="cards (default: --cluster's nodes x devices, else 1)")
    p.add_argument("--cluster", help="cluster TOML (configs/cluster-128x8.toml): world size, devices per "
                   "node and the Megatron layout ([megatron] tp / pp / recompute; 0 / auto: chosen)")
    p.add_argument("--seq-len", type=int, help="default: the run config's train.seq_len, else max_seq_len")
    p.add_argument("--micro-batch", type=int, help="sequences per card per forward (default: run config, else 1)")
    p.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step (default: run config, else world x micro batch)")
    p.add_argument("--sharding", help="fsdp (shard over all cards), hsdp:K (shard within groups of K), "
                   "megatron:tpTppP[vV] (Megatron TP x PP x DP, V layers per virtual pipeline stage) or "
                   "megatron:auto (the smallest TP x PP that fits); default: fsdp, with --cluster its "
                   "Megatron layout")
    p.add_argument("--layout", default="fsdp2", choices=("fsdp2", "megatron"),
                   help="state layout: fsdp2 (fp32 sharded params, this trainer) or megatron (bf16 + fp32 master)")
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"),
                   help="gradient / reduction dtype (default fp32 for fsdp2, bf16 for megatron)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default: run config, else bf16)")
    p.add_argument("--activation-checkpointing", choices=("on", "off"),
                   help="default: run config, else on (Megatron: on = --recompute full, off = none)")
    p.add_argument("--recompute", choices=("auto", "none", "selective", "full"),
                   help="Megatron activation recompute (auto: only when no layout fits without it; "
                   "default: --cluster's [megatron] recompute, else from --activation-checkpointing)")
    p.add_argument("--no-prefetch", action="store_true", help="no all-gather prefetch of the next block")
    p.add_argument("--mfu", type=float, default=DEFAULTS.mfu, help=f"assumed MFU (default {DEFAULTS.mfu})")
    p.add_argument("--peak-tflops", type=float,
                   help="peak bf16 dense TFLOP/s per card (default: --device-name in configs/devices.toml)")
    p.add_argument("--device-name", default="Ascend910B", help="device looked up in configs/devices.toml")
    p.add_argument("--intra-node-gbs", type=float, default=DEFAULTS.intra_node_gbs,
                   help=f"bus bandwidth per card inside a node, GB/s (default {DEFAULTS.intra_node_gbs})")
    p.add_argument("--inter-node-gbs", type=float, default=DEFAULTS.inter_node_gbs,
                   help=f"bus bandwidth per card across nodes, GB/s (default {DEFAULTS.inter_node_gbs})")
    p.add_argument("--devices-per-node", type=int, help=f"default: --cluster's, else {DEFAULTS.devices_per_node}")
    p.add_argument("--device-memory-gb", type=float,
                   help=f"default: --cluster's device_memory_gb, else {DEFAULTS.device_memory_gb}")
    p.add_argument("--memory-headroom", type=float, default=DEFAULTS.memory_headroom,
                   help="share of device memory the estimate must leave free "
                   f"(default {DEFAULTS.memory_headroom})")
    p.add_argument("--no-meta-check", action="store_true",
                   help="skip building fullscale.model.Transformer on the meta device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _assumptions(args):
    from fullscale.device import DeviceError, peak_flops   # lazy: torch; `adamspike data` needs none

    for flag, v in (("--mfu", args.mfu), ("--intra-node-gbs", args.intra_node_gbs),
                    ("--inter-node-gbs", args.inter_node_gbs), ("--device-memory-gb", args.device_memory_gb)):
        if not v > 0:
            raise ConfigError(f"{flag}: must be > 0, got {v}")
    if args.mfu > 1:
        raise ConfigError(f"--mfu: must be <= 1, got {args.mfu}")
    if not 0 <= args.memory_headroom < 1:
        raise ConfigError(f"--memory-headroom: must be in [0, 1), got {args.memory_headroom}")
    if args.devices_per_node < 1:
        raise ConfigError(f"--devices-per-node: must be >= 1, got {args.devices_per_node}")
    if args.peak_tflops is not None:
        if not args.peak_tflops > 0:
            raise ConfigError(f"--peak-tflops: must be > 0, got {args.peak_tflops}")
        peak = args.peak_tflops * 1e12
    else:
        try:
            peak = peak_flops(args.device_name)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        if peak is None:
            raise ConfigError(f"--device-name: {args.device_name!r} has no entry in configs/devices.toml; "
                              "pass --peak-tflops")
    return Assumptions(mfu=args.mfu, peak_flops=peak, intra_node_gbs=args.intra_node_gbs,
                       inter_node_gbs=args.inter_node_gbs, devices_per_node=args.devices_per_node,
                       device_memory_gb=args.device_memory_gb, memory_headroom=args.memory_headroom)


def _apply_cluster(args) -> None:
    """--cluster fills what the command line left out: the world size (nodes x devices per
    node), devices per node, and a Megatron layout from its [megatron] section (tp / pp 0:
    megatron:auto) with its recompute; explicit flags win."""
    if args.cluster:
        from fullscale.launch import ClusterConfig   # lazy: the cluster schema lives with launch
        from adamspike.config import load_config

        cl = load_config(ClusterConfig, args.cluster)
        m = cl.megatron
        if args.world_size is None:
            args.world_size = cl.cluster.nodes * cl.cluster.devices_per_node
        if args.devices_per_node is None:
            args.devices_per_node = cl.cluster.devices_per_node
        if args.device_memory_gb is None:
            args.device_memory_gb = cl.cluster.device_memory_gb
        if args.sharding is None:
            args.sharding = (f"megatron:tp{m.tp}pp{m.pp}" if m.tp and m.pp else "megatron:auto")
        if args.recompute is None and args.activation_checkpointing is None and args.sharding.startswith("megatron:"):
            args.recompute = m.recompute
    args.world_size = 1 if args.world_size is None else args.world_size
    args.devices_per_node = DEFAULTS.devices_per_node if args.devices_per_node is None else args.devices_per_node
    args.sharding = args.sharding or "fsdp"
    if args.device_memory_gb is None:
        args.device_memory_gb = DEFAULTS.device_memory_gb
    if args.sharding == "megatron:auto" and (args.recompute is None and args.activation_checkpointing is None):
        args.recompute = "auto"


def model_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: adamspike model info --config CONFIG [options]   (adamspike model info --help)")
        return 0 if argv else 2
    return exit_status("adamspike model", lambda: _model_info(argv))


def _model_info(argv: list[str]) -> int:
    if argv[0] != "info":
        raise ConfigError(f"unknown subcommand {argv[0]!r} (known: info)")
    args = model_parser().parse_args(argv[1:])
    _apply_cluster(args)
    cfg, run, source = resolve_config(args.config)
    train = run.train if run is not None else None
    seq_len = args.seq_len if args.seq_len is not None else (train.seq_len if train else None)
    global_batch = args.global_batch if args.global_batch is not None else (
        train.global_batch_size if train else None)
    if args.micro_batch is not None:
        micro = args.micro_batch
    elif train and train.micro_batch_size:
        micro = train.micro_batch_size
    elif train:          # micro_batch_size 0 = the rank's whole share in one forward
        micro = max(1, train.global_batch_size // args.world_size)
    else:
        micro = 1
    dtype = args.dtype or (train.dtype if train else "bf16")
    ac = (args.activation_checkpointing == "on" if args.activation_checkpointing
          else (train.activation_checkpointing if train else True))
    info = model_info(cfg, world_size=args.world_size, seq_len=seq_len, micro_batch=micro,
                      global_batch=global_batch, sharding=args.sharding, layout=args.layout,
                      grad_dtype=args.grad_dtype, dtype=dtype, activation_checkpointing=ac,
                      prefetch=not args.no_prefetch, assumptions=_assumptions(args),
                      meta_check=not args.no_meta_check, recompute=args.recompute)
    info["source"] = source
    print(json.dumps(info) if args.json else format_info(info, source))
    return 0


# ----------------------------------------------------------------------------- data

def data_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="adamspike data", allow_abbrev=False, description="Inspect or write Megatron .bin/.idx token data.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    i = sub.add_parser("inspect", help="counts, dtype, documents, token range, vocab check")
    i.add_argument("prefix", help="dataset prefix (with or without .bin/.idx)")
    i.add_argument("--vocab-size", type=int, help="check every token id is below this")
    i.add_argument("--json", action="store_true")
    c = sub.add_parser("convert", help="tokens (.npy or .jsonl) -> PREFIX.bin/.idx")
    c.add_argument("--input", required=True,
                   help=".npy (1-D: one document; 2-D: one per row) or .jsonl (one document per "
                        "line: a JSON list of ids or {\"tokens\": [...]})")
    c.add_argument("--out", required=True, help="output prefix; existing files are never overwritten")
    c.add_argument("--dtype", default="uint16", choices=("uint8", "int8", "int16", "uint16", "int32", "int64"))
    return p


def _read_documents(path: Path):
    """Documents (1-D int arrays) from .npy or .jsonl; errors name the file and line."""
    if not path.is_file():
        raise DataFormatError(f"--input: file not found: {path}")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataFormatError(f"{path}: not a readable .npy file: {e}") from None
        if arr.dtype.kind not in "iu":
            raise DataFormatError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim == 1:
            yield arr
        elif arr.ndim == 2:
            yield from arr
        else:
            raise DataFormatError(f"{path}: expected a 1-D or 2-D array, got shape {arr.shape}")
        return
    if path.suffix != ".jsonl":
        raise DataFormatError(f"--input: {path} must end in .npy or .jsonl")
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: invalid JSON: {e}") from None
            tokens = obj.get("tokens") if isinstance(obj, dict) else obj
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise DataFormatError(f"{path}:{lineno}: expected a list of integer token ids "
                                      "or {\"tokens\": [...]}")
            yield np.asarray(tokens, dtype=np.int64)


def data_main(argv: list[str]) -> int:
    return exit_status("adamspike data", lambda: _data(data_parser().parse_args(argv)),
                       (DataFormatError,))


def _data(args) -> int:
    if args.cmd == "inspect":
        ds = IndexedTokens(args.prefix)
        out = ds.summary()
        rng = ds.token_range(progress=True)
        out["token_min"], out["token_max"] = rng if rng else (None, None)
        if args.vocab_size is not None:
            if args.vocab_size < 1:
                raise ConfigError(f"--vocab-size: must be >= 1, got {args.vocab_size}")
            ds.check_vocab(args.vocab_size, progress=True)
            out["vocab_size"], out["vocab_check"] = args.vocab_size, "ok"
        if args.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:<20} {v}")
        return 0
    documents = _read_documents(Path(args.input))
    w = IndexedWriter(args.out, np.dtype(args.dtype))
    try:
        for doc in documents:
            w.add_document(doc)
    except BaseException:
        w.abort()
        raise
    bin_path, idx_path = w.finalize()
    print(f"wrote {bin_path} and {idx_path}: {len(w.sequence_lengths)} documents, "
          f"{sum(w.sequence_lengths)} tokens, {args.dtype}")
    return 0
