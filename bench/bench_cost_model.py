"""Cost-model table for LLaMA2-70B at 64 / 256 / 1024 cards (fullscale.model_info).

    python bench/bench_cost_model.py [--mfu 0.45] [--inter-node-gbs 20] [--intra-node-gbs 150]

Global batch 1024 x 4096 tokens (the report's), bf16, full activation
checkpointing, FSDP2 layout (16 B/param of sharded state), full sharding over all cards,
micro batch 1 / 2 / 4 where the global batch allows it; then the Megatron TP8 x PP8 layout
that train_mindspeed.sh runs.
These are model outputs under the printed assumptions, not measurements; the reference
line is what Megatron/ModelLink reports on 910B (350 tokens/s/card on 64 NPUs, 420 on the
Atlas 900 A2 PODc), for comparison only.
"""

from __future__ import annotations

import argparse

from adamspike.llama import PRESETS
from fullscale.model_info import (DEFAULTS, Assumptions, megatron_cost, megatron_memory,
                                  memory_per_card, step_cost)

GB = 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mfu", type=float, default=DEFAULTS.mfu)
    p.add_argument("--peak-tflops", type=float, default=DEFAULTS.peak_flops / 1e12)
    p.add_argument("--intra-node-gbs", type=float, default=DEFAULTS.intra_node_gbs)
    p.add_argument("--inter-node-gbs", type=float, default=DEFAULTS.inter_node_gbs)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=4096)
    args = p.parse_args()
    a = Assumptions(mfu=args.mfu, peak_flops=args.peak_tflops * 1e12,
                    intra_node_gbs=args.intra_node_gbs, inter_node_gbs=args.inter_node_gbs)
    cfg = PRESETS["llama2-70b"]
    print(f"LLaMA2-70B, global batch {args.global_batch} x {args.seq_len}, bf16, full AC, fsdp; "
          f"MFU {a.mfu}, peak {a.peak_flops / 1e12:.0f} TF, intra {a.intra_node_gbs:.0f} GB/s, "
          f"inter {a.inter_node_gbs:.0f} GB/s per card, {a.device_memory_gb:.0f} GB/card")
    head = (f"{'cards':>5} {'micro':>5} {'accum':>5} {'mem GB':>7} {'fits':>4} {'compute s':>9} "
            f"{'comm s':>7} {'step s ovl':>10} {'step s ser':>10} {'tok/s/card':>10} {'(serial)':>8}")
    print(head)
    print("-" * len(head))
    for world in (64, 256, 1024):
        for mb in (1, 2, 4):
            if args.global_batch % (world * mb):
                continue
            mem = memory_per_card(cfg, world_size=world, seq_len=args.seq_len, micro_batch=mb)
            c = step_cost(cfg, world_size=world, seq_len=args.seq_len, micro_batch=mb,
                          global_batch=args.global_batch, assumptions=a)
            print(f"{world:>5} {mb:>5} {c['grad_accum_steps']:>5} {mem['total'] / GB:>7.1f} "
                  f"{'yes' if mem['total'] <= a.device_memory_gb * GB else 'NO':>4} {c['compute_s']:>9.2f} "
                  f"{c['comm_s']:>7.2f} {c['step_s_overlapped']:>10.2f} {c['step_s_serial']:>10.2f} "
                  f"{c['tokens_per_s_per_card_overlapped']:>10.0f} {c['tokens_per_s_per_card_serial']:>8.0f}")
    print(f"\nMegatron / MindSpeed-LLM layout (train_mindspeed.sh): TP 8 x PP 8, micro batch 1, "
          "distributed optimizer, SP, full recompute, 1F1B")
    head = (f"{'cards':>5} {'DP':>3} {'m-batches':>9} {'mem GB':>7} {'compute s':>9} {'bubble s':>8} "
            f"{'TP s':>6} {'DP s':>6} {'step s ovl':>10} {'tok/s/card':>10} {'(serial)':>8}")
    print(head)
    print("-" * len(head))
    for world in (64, 256, 1024):
        kw = dict(world_size=world, seq_len=args.seq_len, micro_batch=1, sharding="megatron:tp8pp8",
                  global_batch=args.global_batch)
        mem, c = megatron_memory(cfg, **kw), megatron_cost(cfg, assumptions=a, **kw)
        print(f"{world:>5} {c['dp']:>3} {c['grad_accum_steps']:>9} {mem['total'] / GB:>7.1f} "
              f"{c['compute_s']:>9.2f} {c['pipeline_bubble_s']:>8.2f} {c['tensor_parallel_s']:>6.2f} "
              f"{c['dp_reduce_scatter_s'] + c['dp_all_gather_s']:>6.2f} {c['step_s_overlapped']:>10.2f} "
              f"{c['tokens_per_s_per_card_overlapped']:>10.0f} {c['tokens_per_s_per_card_serial']:>8.0f}")
    # HSDP inside a node (shard group 8, on HCCS) would cut the cross-node traffic, but 70B's
    # sharded state alone is then 16 B x 69e9 / 8 = 138 GB per card.
    hsdp = memory_per_card(cfg, world_size=1024, seq_len=args.seq_len, micro_batch=1, sharding="hsdp:8")
    print(f"hsdp:8 (shard within a node) at 1024 cards: {hsdp['total'] / GB:.0f} GB/card: does not fit")
    print("reference (reported, Megatron TP8/PP8 on 910B): 350 tokens/s/card (64 NPUs), 420 (Atlas 900 A2)")


if __name__ == "__main__":
    main()
