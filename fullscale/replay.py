"""Causal replay of loss spikes through the torch trainer (its DCP checkpoints).

The torch half of `adamspike replay --torch-spikes N` (simulate/replay.py is the JAX study
and says what is measured). Never imports jax: spike detection and the interventions'
overrides are handed in.

    OUT/base-s<seed>/                      a full run of the spiking config (fullscale.train,
                                           checkpoint.every = snapshot_every, all kept,
                                           telemetry off)
    OUT/s<seed>-t<step>/<intervention>/    one run per intervention, started from the base
                                           run's checkpoint s0 (50-150 steps before the
                                           spike) by `Trainer(..., replay_from=ckpt)` under
                                           the intervention's overrides, to t + horizon

A replay is written into `<dir>.partial` and renamed when complete, so a killed study
resumes: complete runs are reused, a `.partial` (this study's own unfinished run) is
removed and redone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from adamspike.config import ConfigError, flatten, to_dict
from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from fullscale.checkpoint import step_dir
from fullscale import device as devices
from fullscale.train import _setup_distributed, train


def _loss(run_dir: Path) -> np.ndarray:
    steps = load_run(run_dir, tables=("steps",)).steps.sort_values("step")
    return steps["loss"].to_numpy(np.float64)


def _with(cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    out = RunConfig.from_dict({**flatten(to_dict(cfg)), **dict(overrides)})
    out.check()
    return out


def _run_once(cfg: RunConfig, final: Path, replay_from: Path | None = None) -> Path:
    """Train cfg into `final` unless it is complete already (via final.partial)."""
    if (final / "run.json").exists():
        return final
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)   # this study's own unfinished run
    partial.parent.mkdir(parents=True, exist_ok=True)
    train(cfg, partial, replay_from=replay_from)
    partial.rename(final)
    return final


def torch_replays(base: RunConfig, out: str | Path, num_spikes: int, seeds: Sequence[int],
                  detect: Callable[[np.ndarray, np.ndarray], Any],
                  overrides: Callable[[str, RunConfig, int, int], dict],
                  interventions: Sequence[str], *, snapshot_every: int, min_lead: int,
                  max_lead: int, horizon: int, progress: bool = True) -> list[dict]:
    """Base runs of `seeds` (in order, until num_spikes spikes with a checkpoint 50-150
    steps before them are found), then every intervention of each spike replayed from that
    checkpoint. detect(loss, steps) -> DataFrame with start, peak, baseline (the JAX
    study's detector); overrides(name, seed_cfg, t, restart) -> dotted keys.
    Returns one dict per spike: seed, t, s0, base_loss (steps 1..), base_spike (row),
    traces {intervention: losses of steps s0 + 1 .. t + horizon}, run dirs."""
    from tqdm.auto import tqdm   # progress only

    out = Path(out)
    own_group = _setup_distributed(base)
    base = _with(base, {"telemetry.enabled": False, "checkpoint.every": snapshot_every,
                        "checkpoint.keep": base.train.num_steps // snapshot_every + 1,
                        "checkpoint.async_save": False})
    found: list[dict] = []
    try:
        for seed in seeds:
            if len(found) >= num_spikes:
                break
            cfg = _with(base, {"train.seed": int(seed)})
            run = _run_once(cfg, out / f"base-s{seed}")
            loss = _loss(run)
            spikes = detect(loss, np.arange(1, len(loss) + 1))
            for _, sp in spikes.iterrows():
                t = int(sp["start"])
                s0 = (t - min_lead) // snapshot_every * snapshot_every
                ckpt = step_dir(run / "checkpoints", s0)
                if s0 < snapshot_every or t - s0 > max_lead or not ckpt.is_dir():
                    continue
                found.append({"seed": int(seed), "t": t, "s0": s0, "base_loss": loss,
                              "base_spike": sp, "ckpt": ckpt, "cfg": cfg})
                if len(found) >= num_spikes:
                    break
        bar = tqdm(total=len(found) * len(interventions), desc="replay: torch", unit="run",
                   disable=not progress)
        for f in found:
            cfg, t, s0 = f["cfg"], f["t"], f["s0"]
            end = t + horizon
            n = cfg.train.num_steps
            if any(cfg.optim.lr_at(s, n) != cfg.optim.lr_at(s, end) for s in range(1, end + 1)):
                raise ConfigError("optim: the lr schedule depends on train.num_steps before the "
                                  "replay's end; the torch replay stops at t + horizon")
            f["traces"], f["runs"] = {}, {}
            for name in interventions:
                ov = overrides(name, cfg, t, s0 + 1)
                rcfg = _with(cfg, {**ov, "train.num_steps": end, "checkpoint.every": 0,
                                   "checkpoint.keep": 1})
                rdir = _run_once(rcfg, out / f"s{f['seed']}-t{t}" / name, replay_from=f["ckpt"])
                trace = _loss(rdir)
                if len(trace) != end - s0:
                    raise RuntimeError(f"{rdir}: {len(trace)} steps, expected {end - s0}")
                f["traces"][name], f["runs"][name] = trace, str(rdir)
                bar.update(1)
        bar.close()
    finally:
        if own_group:
            devices.destroy_distributed(synchronize=True)
    return found
