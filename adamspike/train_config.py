"""The training config both backends read: same sections, same field names.

The JAX toy LLaMA (simulate/) uses model, optim, train, data, telemetry, guard, checkpoint
(its in-memory snapshots) and mitigation; the torch trainer (fullscale/) uses all sections.
Every experiment setting anywhere (CLI flags, sweep grids, replication arms, predictions.json
settings, `adamspike plan`) is a dict of dotted keys of this schema ("optim.eps",
"train.global_batch_size", every "mitigation.*" key of the registry), turned into a config by
`RunConfig.from_dict(overrides, base)`. TOML example (configs/tiny.toml):

    [model]
    preset = "tiny"
    [optim]
    lr = 3e-3
    eps = 1e-8
    [train]
    num_steps = 200
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from adamspike.config import ConfigError, merge, flatten, from_dict, nest, param, to_dict
from adamspike.mitigations import MitigationSection, moved_keys
from adamspike.llama import PRESETS, LlamaConfig, preset


@dataclass
class ModelSection:
    preset: str = param("tiny", choices=tuple(PRESETS), help="architecture preset")
    # Field overrides of the preset (absent = the preset's value).
    vocab_size: int | None = param(None, lo=2)
    dim: int | None = param(None, lo=2)
    num_layers: int | None = param(None, lo=1)
    num_heads: int | None = param(None, lo=1)
    num_kv_heads: int | None = param(None, lo=1)
    ffn_dim: int | None = param(None, lo=1)
    max_seq_len: int | None = param(None, lo=2)
    norm_eps: float | None = param(None, lo=0.0, lo_open=True)
    rope_theta: float | None = param(None, lo=0.0, lo_open=True)
    init_std: float | None = param(None, lo=0.0, lo_open=True)
    hf_config: str = param("", help="path of a HuggingFace config.json to import instead")
    MOVED_KEYS = moved_keys("model")

    def llama(self) -> LlamaConfig:
        """The resolved architecture (preset + overrides)."""
        fields = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim",
                  "max_seq_len", "norm_eps", "rope_theta", "init_std")
        return preset(self.preset, **{f: getattr(self, f) for f in fields})


@dataclass
class OptimSection:
    lr: float = param(3e-3, lo=0.0, lo_open=True, help="peak learning rate")
    min_lr: float = param(0.0, lo=0.0, help="floor of the decay schedule")
    schedule: str = param("cosine", choices=("cosine", "constant", "linear"))
    warmup_steps: int = param(0, lo=0)
    b1: float = param(0.9, lo=0.0, hi=1.0, hi_open=True)
    b2: float = param(0.95, lo=0.0, hi=1.0, hi_open=True)
    eps: float = param(1e-8, lo=0.0)
    weight_decay: float = param(0.0, lo=0.0)
    grad_clip: float = param(1.0, lo=0.0, help="global-norm clip threshold, 0 = off")
    implementation: str = param("foreach", choices=("foreach", "fused", "for-loop"),
                                help="torch.optim.AdamW kernel (torch only)")
    # Adam's step counter starts at this value, so at optimizer step t the bias corrections
    # are 1 - b^(t + offset). 0: torch.optim.AdamW / apex FusedAdam. 1: the NPU AdamW of
    # AscendSpeed 2023 (ascendspeed/optimizer/adam.py hands torch_npu.npu_apply_adam_w
    # beta**t, and the kernel multiplies by beta once more); docs/results/seed_stack_adamw.md
    bias_correction_offset: int = param(0, lo=0, help="bias corrections 1 - b^(t + offset); "
                                        "1 = AscendSpeed 2023's npu_apply_adam_w call")

    def lr_at(self, step: int, num_steps: int) -> float:
        """Learning rate applied at optimizer step `step` (1-based), identical in both backends:
        linear warmup lr*step/warmup_steps for step <= warmup_steps, then with
        p = (step - warmup) / max(1, num_steps - warmup) in [0, 1]:
        cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2; linear: lr - (lr - min_lr) p;
        constant: lr.
        """
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        p = min(1.0, (step - self.warmup_steps) / max(1, num_steps - self.warmup_steps))
        if self.schedule == "linear":
            return self.lr - (self.lr - self.min_lr) * p
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    MOVED_KEYS = moved_keys("optim")

    def check(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr: {self.min_lr} exceeds optim.lr={self.lr}")


@dataclass
class TrainSection:
    num_steps: int = param(200, lo=1)
    global_batch_size: int = param(16, lo=1, help="sequences per optimizer step")
    micro_batch_size: int = param(0, lo=0, help="per-rank sequences per forward; 0 = all")
    seq_len: int = param(32, lo=2)
    seed: int = param(0, lo=0)
    # Loss scale s: Adam on s*L equals Adam on L with eps/s (and grad_clip*s).
    loss_scale: float = param(1.0, lo=0.0, lo_open=True)
    dtype: str = param("fp32", choices=("fp32", "bf16"))
    activation_checkpointing: bool = param(False)
    z_loss: float = param(0.0, lo=0.0)


@dataclass
class DataSection:
    source: str = param("synthetic", choices=("synthetic", "indexed"))
    # zipf: simulate.zipf_data.ZipfMarkov (JAX toy only), Zipf unigram tail of this exponent
    task: str = param("markov", choices=("markov", "copy", "zipf"))
    zipf_exponent: float = param(1.1, lo=0.0, lo_open=True, help="Zipf exponent s (task zipf)")
    alpha: float = param(0.1, lo=0.0, lo_open=True, help="Dirichlet concentration (markov)")
    num_samples: int = param(1 << 20, lo=1)
    path: str = param("", help="Megatron dataset prefix (without .bin/.idx)")
    skip_batches: list[int] = param([], help="optimizer steps whose batch is skipped")
    # Poisoned batches (tests / spike studies): at these steps the batch's targets are
    # replaced by a constant token, a deterministic way to induce a loss spike.
    poison_steps: list[int] = param([])


@dataclass
class TelemetrySection:
    every: int = param(1, lo=1, help="per-tensor metrics every N steps")
    hist_every: int = param(10, lo=0, help="r histograms every K steps, 0 = off")
    flush_every_s: float = param(30.0, lo=0.0)
    tensorboard: bool = param(False)
    wandb: bool = param(False, help="torch trainer: the steps row and per-group medians to "
                        "a W&B run in RUN/wandb (needs the wandb package; offline unless "
                        "WANDB_MODE says otherwise)")
    enabled: bool = param(True)
    precision: str = param("float32", choices=("float32", "float64"),
                           help="torch trainer: compute dtype of the metrics (npu: float32)")
    # JAX trainer: top (preconditioned) curvature per depth group every N steps (0 = off),
    # simulate.curvature; power-iteration steps per estimate
    curvature_every: int = param(0, lo=0, help="curvature table every N steps, 0 = off (JAX)")
    curvature_iters: int = param(20, lo=1, help="power-iteration steps per curvature (JAX)")
    compile: str = param("auto", choices=("auto", "on", "off"),
                         help="torch trainer: compiled telemetry kernels (cpu: native, cuda: "
                              "inductor); auto = on for cpu / cuda unless "
                              "ADAMSPIKE_TELEMETRY_COMPILE=off. JAX trainer: off keeps XLA's "
                              "reductions instead of the native CPU kernel")


@dataclass
class CheckpointSection:
    every: int = param(0, lo=0, help="checkpoint every N steps, 0 = only at the end")
    keep: int = param(2, lo=1)
    async_save: bool = param(False)


@dataclass
class GuardSection:
    enabled: bool = param(False)
    window: int = param(50, lo=4, help="past steps for the rolling median / MAD")
    mad_k: float = param(6.0, lo=0.0, lo_open=True)
    min_rel_jump: float = param(0.2, lo=0.0)
    skip_batches: int = param(200, lo=0, help="batches skipped after a rollback (PaLM)")
    max_retries: int = param(3, lo=0)


@dataclass
class DistSection:
    timeout_s: float = param(300.0, lo=1.0, help="collective timeout")
    device: str = param("auto", choices=("auto", "npu", "cuda", "cpu"))


@dataclass
class AlarmSection:
    predictions: str = param("", help="predictions.json whose alarm rules run online")


@dataclass
class FaultsSection:
    """Fault injection (torch trainer) to rehearse the guard, the checkpoints and a resume
    before a long run; docs/faults.md. Off by default; every injected fault is logged as a
    "fault_injected" event."""
    nan_grad_at_step: list[int] = param([], help="optimizer steps whose gradients become NaN "
                                                 "(all ranks, after backward)")
    poison_batches: list[int] = param([], help="[from, to]: global batch numbers from..to "
                                               "(inclusive) get constant targets (bad data)")
    hang_rank_at_step: list[int] = param([], help="[rank, step]: that rank stops (sleeps "
                                                  "faults.hang_s) before the step's forward")
    hang_s: float = param(3600.0, lo=0.0, help="how long a hung rank sleeps")
    kill_rank_at_step: list[int] = param([], help="[rank, step]: that rank SIGKILLs itself "
                                                  "after the step (not in a --resume launch)")

    def check(self) -> None:
        for key in ("poison_batches", "hang_rank_at_step", "kill_rank_at_step"):
            v = getattr(self, key)
            if v and (len(v) != 2 or min(v) < 0):
                raise ConfigError(f"faults.{key}: expected [{'from, to' if key == 'poison_batches' else 'rank, step'}] "
                                  f"of two integers >= 0, got {v}")
        if self.poison_batches and self.poison_batches[0] > self.poison_batches[1]:
            raise ConfigError(f"faults.poison_batches: from {self.poison_batches[0]} is after "
                              f"to {self.poison_batches[1]}")
        if any(s < 1 for s in self.nan_grad_at_step):
            raise ConfigError(f"faults.nan_grad_at_step: steps are >= 1, got {self.nan_grad_at_step}")


# Settings added after cell and arm ids were first computed from whole configs
# (simulate.phase_map, simulate.claims): at these defaults they are left out of the id, so
# the ids (and the cells cached under them) of configs from before them stay the same.
# (telemetry.wandb: where telemetry goes, not what is computed)
LATE_DEFAULTS: dict[str, Any] = {"optim.bias_correction_offset": 0, "telemetry.wandb": False}


def id_settings(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A dotted config for hashing into an id: `flat` without LATE_DEFAULTS at their default."""
    return {k: v for k, v in flat.items() if not (k in LATE_DEFAULTS and v == LATE_DEFAULTS[k])}


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    guard: GuardSection = field(default_factory=GuardSection)
    dist: DistSection = field(default_factory=DistSection)
    alarms: AlarmSection = field(default_factory=AlarmSection)
    mitigation: MitigationSection = field(default_factory=MitigationSection)

    @classmethod
    def from_dict(cls, overrides: Mapping[str, Any] | None = None,
                  base: "RunConfig | Mapping[str, Any] | None" = None) -> "RunConfig":
        """The one way to build a config from settings: `overrides` (dotted keys such as
        {"optim.eps": 1e-6, "train.seed": 3}, or nested tables) applied over
        `base` (a RunConfig, a nested dict, or None for the defaults), validated as a whole.
        Every problem raises ConfigError naming the key (unknown, moved, wrong type, out
        of range)."""
        if base is None:
            data: dict[str, Any] = {}
        elif isinstance(base, RunConfig):
            data = to_dict(base)
        else:
            data = nest(base)
        return from_dict(cls, merge(data, nest(overrides or {})))

    def overrides(self, base: "RunConfig | None" = None) -> dict[str, Any]:
        """The dotted keys whose values differ from `base` (default: the defaults)."""
        mine, ref = flatten(to_dict(self)), flatten(to_dict(base or RunConfig()))
        return {k: v for k, v in mine.items() if ref.get(k) != v}
    faults: FaultsSection = field(default_factory=FaultsSection)

    def check(self) -> None:
        llama = self.model.llama() if not self.model.hf_config else None
        if llama is not None and self.train.seq_len > llama.max_seq_len:
            raise ConfigError(f"train.seq_len: {self.train.seq_len} exceeds model max_seq_len="
                              f"{llama.max_seq_len}")
        mb = self.train.micro_batch_size
        if mb and self.train.global_batch_size % mb:
            raise ConfigError(f"train.micro_batch_size: {mb} does not divide "
                              f"train.global_batch_size={self.train.global_batch_size}")
