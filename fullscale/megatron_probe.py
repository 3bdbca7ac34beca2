"""`python -m fullscale.megatron_probe ... -- pretrain_gpt.py ARGS`: the entry point the
generated scripts and docs/mindspeed_probe.md name. The probe lives in fullscale/probe/ (one
module per idea, see its __init__); this module re-exports its names for existing callers."""

import sys

from fullscale.probe.actions import RECIPE, RULES, ProbeActions
from fullscale.probe.cli import _adaptors, main
from fullscale.probe.core import MegatronProbe
from fullscale.probe.kernels import (NUM_HIST_BINS, NUM_SUMS, adam_terms, bin_counts,
                                     rounded_edges, shard_sums, update_direction)
from fullscale.probe.naming import depth_kind, global_names
from fullscale.probe.optimizer import _inner, hyper_params, leaf_optimizers
from fullscale.probe.recipe import restart_recipe, write_restart_recipe
from fullscale.probe.settings import ENV_PREFIX, ProbeError
from fullscale.probe.wrapper import TRAIN_STEP, install, make_train_step_wrapper
from fullscale.probe.writer import PlainRunWriter, open_writer

__all__ = ["ENV_PREFIX", "MegatronProbe", "NUM_HIST_BINS", "NUM_SUMS", "PlainRunWriter",
           "ProbeActions", "ProbeError", "RECIPE", "RULES", "TRAIN_STEP", "adam_terms",
           "bin_counts", "depth_kind", "global_names", "hyper_params", "install",
           "leaf_optimizers", "main", "make_train_step_wrapper", "open_writer",
           "restart_recipe", "rounded_edges", "shard_sums", "update_direction", "write_restart_recipe",
           "_adaptors", "_inner"]

if __name__ == "__main__":
    sys.exit(main())
