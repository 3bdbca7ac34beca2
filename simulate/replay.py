"""Causal replay of loss spikes (JAX): restore a snapshot before each spike, replay the same
batches with exactly one intervention, and count how often the spike comes back.

    adamspike replay --config configs/toy_spike.toml --out DIR [--seeds N]
                     [--min-incidents K] [--max-spikes M] [--train.num_steps S]
                     [--spike-k K]

1. Base runs. Seeds 0, 1, ... of the config (default configs/toy_spike.toml; with
   --min-incidents K, in order until K incidents are found, at most N) train through
   simulate.program's one jitted step (the trainer's: the registry's StepPlan, skips and
   the lr as per-step controls), in chunks of CHUNK steps. Snapshots (params + Adam state, step s) are kept in memory every
   SNAPSHOT_EVERY steps for the last MAX_LEAD steps. After each chunk the loss trace so far
   goes through the project's detector (adamspike.spikes.detect_spikes: window 50, 6 MAD
   (--spike-k: another k),
   and the 10 % relative-jump rule of the toy reports); the detector is causal, so a spike
   found online is the one an offline pass finds. Each spike start t gets the newest
   snapshot s0 with MIN_LEAD <= t - s0 (so 50 <= t - s0 < 50 + SNAPSHOT_EVERY = 75 <= 150).
2. Replays. From s0, every intervention replays steps s0 + 1 .. t + horizon on the same
   batches (batch_at of the base config: skipped steps do not shift later batches) as one
   lane each of the same program:
       none           no change (the determinism control; it must reproduce the spike)
       eps_shallow    mitigation.eps_embed and eps_shallow = 0.1 x their eps
       eps_deep       mitigation.eps_deep = 0.1 x its eps (the head follows eps_deep)
       v_reset        mitigation.v_reset_steps = [s0 + 1], v_reset_groups = [embed, shallow]
       skip_window    data.skip_batches = [max(s0 + 1, t - w) .. t] (Levanter skip semantics:
                      no update, Adam state untouched, the lr schedule advances)
       freeze         mitigation.freeze_groups = [embed, shallow], freeze_from = s0 + 1
       lr_half        optim.lr x 0.5 (the whole schedule)
   Each is a dict of dotted RunConfig keys (`intervention_overrides`); the lane's controls
   come from RunConfig.from_dict(overrides, base) and the registry's StepPlan (per-tensor
   eps, v resets, frozen tensors per step) and OptimSection.lr_at / data.skip_batches, so a
   replay lane computes what simulate.llama_train computes for that config, bit for bit
   (the same compiled step on the same inputs; tests check it).
3. Per (spike, intervention): recurred = the same detector, run over the base trace up to s0
   followed by the replay trace, finds a spike starting within +-W steps of t; height =
   peak replay loss in [t - W, t + W] / the base spike's baseline (the detector's median at
   its start); spiked_any = a spike anywhere in the replay.
   Spikes are counted as incidents: a start within 2 W steps of the previous start of the
   same seed is part of the same burst and is not replayed on its own (the binomial
   counts need independent trials). Table per intervention:
   recurrence k / n with the exact (Clopper-Pearson) 95 % interval
   (scipy.stats.binomtest(k, n).proportion_ci(method="exact")), median height ratio.

Storage (DIR, as simulate.sweep): replay.json (the resolved study; a different one is
refused), cells/ (the one cell store, adamspike.cells): a `replay_base` cell per seed (loss
trace, spikes, the spikes' snapshots) and a `replay_spike` cell per (seed, spike) (each
intervention's loss trace and row), so a killed study resumes at the first missing cell;
then replay.csv and replay.md.
Lanes run one after another through the one step program (`Program.step_fn`, one step per
call): XLA's results change with the vmap width and with lax.scan, and the determinism
control and the trainer identity need the base run's exact program. Cost: the step is
compute-bound on a CPU (~40-70 steps / s on 2 shared cores), so side-by-side lanes
(Program.run) would save little.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from adamspike.cells import Cell, CellStore
from adamspike.config import ConfigError, flatten, load_config, to_dict
from adamspike.rundir import atomic_write_bytes
from adamspike.train_config import RunConfig
from adamspike.spikes import detect_spikes, incidents
from adamspike.tables import md_table
from simulate.llama_train import batch_at, dataset
from simulate.program import Program, program, static_key

INTERVENTIONS = ("none", "eps_shallow", "eps_deep", "v_reset", "skip_window", "freeze",
                 "lr_half")
SHALLOW = ["embed", "shallow"]
CHUNK = 25

@dataclass
class ReplaySpec:
    """A replay study: which config, seeds, detector and windows."""
    config: dict                 # the resolved base RunConfig (to_dict)
    seeds: list[int]
    snapshot_every: int = 25
    min_lead: int = 50
    max_lead: int = 150
    recur_window: int = 10       # W: a replay spike within +-W of t is a recurrence
    horizon: int = 15            # replay to t + horizon (>= recur_window)
    max_spikes: int = 0          # replay at most this many spikes (0: all), in seed order
    min_incidents: int = 0       # run seeds in order until this many incidents (0: all seeds)
    skip_window: int = 20        # w of skip_window: steps [t - w, t]
    det_window: int = 50
    det_k: float = 6.0
    min_rel_jump: float = 0.1
    interventions: tuple = INTERVENTIONS

    def __post_init__(self):
        if self.snapshot_every % CHUNK:
            raise ConfigError(f"snapshot_every: must be a multiple of {CHUNK}, "
                              f"got {self.snapshot_every}")
        if not (self.min_lead + self.snapshot_every <= self.max_lead + 1):
            raise ConfigError("snapshot_every: min_lead + snapshot_every must be <= max_lead + 1 "
                              "(every spike needs a snapshot 50-150 steps before it)")
        bad = [i for i in self.interventions if i not in INTERVENTIONS]
        if bad:
            raise ConfigError(f"interventions: unknown {bad} (known: {list(INTERVENTIONS)})")

    def to_json(self) -> dict:
        d = asdict(self)
        d["interventions"] = list(self.interventions)
        return d

    def detect(self, loss: np.ndarray, steps: np.ndarray) -> pd.DataFrame:
        return detect_spikes(loss, steps, window=self.det_window, k=self.det_k,
                             min_rel_jump=self.min_rel_jump)

    def run_config(self) -> RunConfig:
        return RunConfig.from_dict(flatten(self.config))

    def incidents(self, spikes: pd.DataFrame) -> pd.DataFrame:
        """The spikes (detector rows, one seed, by start) that open an incident
        (adamspike.spikes.incidents with W = recur_window: its replay window covers the
        rest of the burst), so the binomial trials stay independent."""
        return incidents(spikes, self.recur_window)


# ----------------------------------------------------------------------------- interventions

def intervention_overrides(name: str, base: RunConfig, spike_step: int, restart: int,
                           skip_window: int) -> dict[str, Any]:
    """The dotted RunConfig keys of one intervention for a spike starting at `spike_step`,
    replayed from optimizer step `restart` (the first replayed step)."""
    m, eps = base.mitigation, float(base.optim.eps)
    group = lambda v: eps if v is None else float(v)  # noqa: E731
    if name == "none":
        return {}
    if name == "eps_shallow":
        return {"mitigation.eps_embed": 0.1 * group(m.eps_embed),
                "mitigation.eps_shallow": 0.1 * group(m.eps_shallow)}
    if name == "eps_deep":
        out = {"mitigation.eps_deep": 0.1 * group(m.eps_deep)}
        if m.eps_head is not None:
            out["mitigation.eps_head"] = 0.1 * float(m.eps_head)
        return out
    if name == "v_reset":
        return {"mitigation.v_reset_steps": [restart], "mitigation.v_reset_groups": SHALLOW}
    if name == "skip_window":
        return {"data.skip_batches": list(range(max(restart, spike_step - skip_window),
                                                spike_step + 1))}
    if name == "freeze":
        return {"mitigation.freeze_groups": SHALLOW, "mitigation.freeze_from": restart}
    if name == "lr_half":
        return {"optim.lr": 0.5 * float(base.optim.lr)}
    raise ConfigError(f"intervention: unknown {name!r} (known: {list(INTERVENTIONS)})")


def lane_config(base: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """base + overrides, validated; refuses a change of what the program compiles in
    (simulate.program.static_key: the lanes share one program)."""
    cfg = RunConfig.from_dict({**flatten(to_dict(base)), **dict(overrides)})
    cfg.check()
    if static_key(cfg) != static_key(base):
        raise ConfigError(f"{', '.join(sorted(overrides))}: a replay lane cannot change a "
                          "setting compiled into the program (model, train.z_loss, "
                          "train.dtype, model options, mitigation.update_clip, clip on/off, "
                          "optim.weight_decay)")
    return cfg


# ----------------------------------------------------------------------------- program

def run_chunk(prog: Program, params: list, states: list, batches: list, controls: list):
    """CHUNK steps of each lane through the program's one jitted step (the trainer's
    `step_fn`: the same settings on the same inputs give the trainer's bits); returns the
    lanes' (params, states) and losses (lanes, CHUNK), host numpy."""
    out_p, out_s, losses = [], [], []
    for p, st, b, c in zip(params, states, batches, controls):
        trace = []
        for i in range(len(b)):
            p, st, out = prog.step_fn(p, st, jnp.asarray(b[i]), c.at(i))
            trace.append(out["loss"])
        p, st, trace = jax.device_get((p, st, trace))
        out_p.append(p)
        out_s.append(st)
        losses.append(np.asarray(trace, np.float64))
    return out_p, out_s, np.stack(losses)


def chunk_batches(data, cfg: RunConfig, first: int, length: int = CHUNK) -> np.ndarray:
    """Tokens (length, B, T + 1) of steps first .. first + length - 1 (batch_at: a skipped
    step reads its batch and later steps keep theirs)."""
    return np.stack([batch_at(data, cfg, s) for s in range(first, first + length)])


# ----------------------------------------------------------------------------- storage

def _npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _flat_state(params, state) -> dict[str, np.ndarray]:
    leaves = jax.tree.leaves((params, state))
    return {f"leaf{i:04d}": np.asarray(x) for i, x in enumerate(leaves)}


def _unflat_state(prog: Program, seed: int, arrays: Mapping[str, np.ndarray], prefix: str):
    template = prog.init(seed)
    leaves, tree = jax.tree.flatten(template)
    got = [arrays[f"{prefix}leaf{i:04d}"] for i in range(len(leaves))]
    return jax.tree.unflatten(tree, [jax.device_put(np.asarray(g, dtype=t.dtype))
                                     for g, t in zip(got, leaves)])


CODE = "step-fn-1"     # bump when the base run or the replay changes meaning


def base_cell(spec: ReplaySpec, seed: int) -> Cell:
    """Seed `seed`'s base run (its payload `base`: the npz of loss, spikes, snapshots)."""
    return Cell("replay_base", CODE, {"replay": spec.to_json(), "seed": int(seed)})


def spike_cell(spec: ReplaySpec, seed: int, step: int) -> Cell:
    """Every intervention of the spike starting at `step` of seed `seed` (rows, traces).
    Both kinds are computed by run_study, which holds the compiled program and the
    base's snapshot they start from."""
    return Cell("replay_spike", CODE, {"replay": spec.to_json(), "seed": int(seed),
                                       "spike_step": int(step)})


# ----------------------------------------------------------------------------- phase 1

def run_base(spec: ReplaySpec, prog: Program, seeds: Sequence[int],
             bar=None) -> dict[int, bytes]:
    """Train `seeds` as lanes, detect spikes online; per seed an npz (loss trace, spikes,
    the snapshot before each spike)."""
    cfg = spec.run_config()
    num = cfg.train.num_steps
    cfgs = [RunConfig.from_dict({**flatten(to_dict(cfg)), "train.seed": int(k)}) for k in seeds]
    datas = [dataset(c, prog.llama) for c in cfgs]
    states = [prog.init(int(k)) for k in seeds]
    params, opt = [s[0] for s in states], [s[1] for s in states]
    ctrl = {}
    losses = [[] for _ in seeds]
    snaps: list[dict[int, Any]] = [{0: jax.device_get((p, o))} for p, o in zip(params, opt)]
    kept: list[dict[int, tuple[int, Any]]] = [{} for _ in seeds]   # spike start -> (s0, state)
    for first in range(1, num + 1, CHUNK):
        length = min(CHUNK, num - first + 1)
        if length != CHUNK:
            raise ConfigError(f"train.num_steps: must be a multiple of {CHUNK} for replay "
                              f"(got {num})")
        if first not in ctrl:
            ctrl = {first: prog.controls(cfg, range(first, first + CHUNK))}
        batches = [chunk_batches(d, c, first) for d, c in zip(datas, cfgs)]
        params, opt, loss = run_chunk(prog, params, opt, batches, [ctrl[first]] * len(seeds))
        end = first + CHUNK - 1
        for j in range(len(seeds)):
            losses[j].extend(loss[j].tolist())
            if end % spec.snapshot_every == 0:
                snaps[j][end] = (params[j], opt[j])
                for s in [s for s in snaps[j] if s < end - spec.max_lead]:
                    del snaps[j][s]
            trace = np.asarray(losses[j])
            sp = spec.detect(trace, np.arange(1, len(trace) + 1))
            for t in sp["start"].tolist():
                if t in kept[j] or t < first:
                    continue
                s0 = (t - spec.min_lead) // spec.snapshot_every * spec.snapshot_every
                if s0 >= 0 and s0 in snaps[j] and t - s0 <= spec.max_lead:
                    kept[j][t] = (s0, snaps[j][s0])
            if not np.isfinite(loss[j]).all():
                pass   # a diverged lane keeps running; its spike was recorded above
        if bar is not None:
            bar.update(CHUNK * len(seeds))
    done = {}
    for j, k in enumerate(seeds):
        trace = np.asarray(losses[j])
        sp = spec.detect(trace, np.arange(1, len(trace) + 1))
        arrays = {"loss": trace, "spikes": np.frombuffer(sp.to_json(orient="records", double_precision=15).encode(),
                                                         np.uint8)}
        for t, (s0, st) in kept[j].items():
            arrays[f"t{t}_s0"] = np.array(s0)
            arrays.update({f"t{t}_{n}": a for n, a in _flat_state(*st).items()})
        done[int(k)] = _npz_bytes(**arrays)
    return done


def read_base(payload: Mapping[str, Any]) -> tuple[np.ndarray, pd.DataFrame, dict]:
    """A `replay_base` cell's payload as (loss, spikes, the npz of its snapshots)."""
    z = np.load(io.BytesIO(payload["base"].tobytes()))
    spikes = pd.read_json(io.StringIO(bytes(z["spikes"]).decode()), orient="records")
    return z["loss"], spikes, z


# ----------------------------------------------------------------------------- phase 2

def replay_spike(spec: ReplaySpec, prog: Program, seed: int, t: int, base_loss: np.ndarray,
                 base_spike: Mapping[str, Any], z) -> tuple[pd.DataFrame, np.ndarray]:
    """Every intervention of one spike (lanes of one program call per chunk); returns the
    rows and the replay loss traces (interventions, steps s0 + 1 .. t + horizon)."""
    cfg = spec.run_config()
    seed_cfg = RunConfig.from_dict({**flatten(to_dict(cfg)), "train.seed": int(seed)})
    data = dataset(seed_cfg, prog.llama)
    s0 = int(z[f"t{t}_s0"])
    params, state = _unflat_state(prog, seed, z, f"t{t}_")
    restart, end = s0 + 1, t + spec.horizon
    names = list(spec.interventions)
    cfgs = [lane_config(seed_cfg, intervention_overrides(n, seed_cfg, t, restart,
                                                         spec.skip_window)) for n in names]
    lanes_p, lanes_s = [params] * len(names), [state] * len(names)
    traces = [[] for _ in names]
    first = restart
    while first <= end:
        batch = chunk_batches(data, seed_cfg, first)
        ctrls = [prog.controls(c, range(first, first + CHUNK)) for c in cfgs]
        lanes_p, lanes_s, loss = run_chunk(prog, lanes_p, lanes_s, [batch] * len(names), ctrls)
        for i in range(len(names)):
            traces[i].extend(loss[i].tolist())
        first += CHUNK
    n_steps = end - s0
    traces = np.asarray([tr[:n_steps] for tr in traces])
    return measure(spec, "jax", seed_cfg, t, s0, base_loss, base_spike,
                   dict(zip(names, traces))), traces


def measure(spec: ReplaySpec, backend: str, seed_cfg: RunConfig, t: int, s0: int,
            base_loss: np.ndarray, base_spike: Mapping[str, Any],
            traces: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """Rows per intervention of one spike (either backend): traces[name] = losses of steps
    s0 + 1 .. t + horizon; base_loss = the base run's losses from step 1."""
    W, end = spec.recur_window, t + spec.horizon
    baseline = float(base_spike["baseline"])
    steps = np.arange(1, end + 1)
    rows = []
    for name, trace in traces.items():
        trace = np.asarray(trace, np.float64)
        ov = intervention_overrides(name, seed_cfg, t, s0 + 1, spec.skip_window)
        # skipped steps train nothing: their logged loss (of a batch that is not used) is
        # not part of the training trajectory, so the detector and the height leave them out
        trained = ~np.isin(steps, ov.get("data.skip_batches", []))
        full = np.concatenate([base_loss[:s0], trace])
        sp = spec.detect(full[trained], steps[trained])
        after = sp[sp["start"] > s0]
        near = after[(after["start"] >= t - W) & (after["start"] <= t + W)]
        in_win = (steps >= t - W) & (steps <= t + W) & trained
        win = full[in_win]
        peak = (float(np.max(win)) if np.isfinite(win).all() else math.inf) if win.size else math.nan
        rows.append({"backend": backend, "seed": int(seed_cfg.train.seed), "spike_step": int(t),
                     "restart_step": int(s0 + 1), "lead": int(t - s0), "intervention": name,
                     "overrides": json.dumps(ov, sort_keys=True),
                     "recurred": bool(len(near)), "spiked_any": bool(len(after)),
                     "height": peak / baseline if baseline > 0 else math.nan,
                     "base_height": float(base_spike["peak"]) / baseline if baseline > 0
                     else math.nan,
                     "exact_trace": bool(np.array_equal(trace, base_loss[s0:end]))})
    return pd.DataFrame(rows)


def torch_rows(spec: ReplaySpec, found: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """measure() over the torch replays (fullscale.replay.torch_replays' result)."""
    frames = [measure(spec, "torch", f["cfg"], f["t"], f["s0"], f["base_loss"],
                      f["base_spike"], f["traces"]) for f in found]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ----------------------------------------------------------------------------- study

def _check_meta(out: Path, spec: ReplaySpec) -> None:
    meta = out / "replay.json"
    want = {"replay": spec.to_json()}
    if meta.exists():
        try:
            have = json.loads(meta.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{meta}: invalid JSON ({e})") from None
        if have != json.loads(json.dumps(want)):
            raise ConfigError(f"{out}: holds another replay study (replay.json differs); use a "
                              "new --out (nothing was overwritten)")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(meta, json.dumps(want, indent=2).encode())


def run_study(spec: ReplaySpec, out: str | Path, progress: bool = True) -> pd.DataFrame:
    """Run (or resume) the study into `out`; returns the per (spike, intervention) table."""
    from tqdm.auto import tqdm   # progress only

    out = Path(out)
    if (out / "run.json").exists():
        raise ConfigError(f"{out}: is a run directory, not a replay directory")
    _check_meta(out, spec)
    store = CellStore(out / "cells")
    prog = program(spec.run_config())
    num = spec.run_config().train.num_steps
    done = [k for k in spec.seeds if store.path(base_cell(spec, k)).is_file()]
    jobs: list = []

    def add_jobs(k: int, bar) -> None:
        def compute():
            return {"base": np.frombuffer(run_base(spec, prog, [k], bar)[k], np.uint8)}
        loss, spikes, z = read_base(store.compute(base_cell(spec, k), compute))
        for _, sp in spec.incidents(spikes).iterrows():
            t = int(sp["start"])
            if f"t{t}_s0" in z.files:
                jobs.append((k, t, loss, sp, z))

    # seeds in order, one per base run (lanes run one per program call, so grouping seeds
    # saves nothing); with min_incidents, only until that many incidents (the rest of the
    # seed list is a cap), so the study's size follows the spike rate it finds
    with tqdm(total=len(spec.seeds) * num, initial=len(done) * num, desc="replay: base runs",
              unit="step", disable=not progress, file=sys.stderr, mininterval=1.0) as bar:
        for k in spec.seeds:
            if spec.min_incidents and len(jobs) >= spec.min_incidents:
                break
            add_jobs(k, bar)
    if spec.max_spikes:
        jobs = jobs[:spec.max_spikes]
    frames = []
    with tqdm(total=len(jobs), desc="replay: spikes", unit="spike", disable=not progress,
              file=sys.stderr) as bar:
        for k, t, loss, sp, z in jobs:
            def compute():
                rows, traces = replay_spike(spec, prog, k, t, loss, sp, z)
                return {"rows": rows, "traces": np.asarray(traces)}
            frames.append(store.compute(spike_cell(spec, k, t), compute)["rows"])
            bar.update(1)
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[
        "backend", "seed", "spike_step", "intervention", "recurred", "height"])
    return table


# ----------------------------------------------------------------------------- summary

def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of k successes in n (scipy's binomtest)."""
    from scipy.stats import binomtest   # scipy: the summary only
    if n == 0:
        return math.nan, math.nan
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Per (backend, intervention): spikes n, recurred k, rate, CP 95 % CI, median height."""
    rows = []
    if table.empty:
        return pd.DataFrame(columns=["backend", "intervention", "n", "recurred", "rate",
                                     "ci_low", "ci_high", "median_height", "spiked_any"])
    order = {n: i for i, n in enumerate(INTERVENTIONS)}
    for (backend, name), g in table.groupby(["backend", "intervention"], sort=False):
        k, n = int(g["recurred"].sum()), len(g)
        lo, hi = clopper_pearson(k, n)
        rows.append({"backend": backend, "intervention": name, "n": n, "recurred": k,
                     "rate": k / n if n else math.nan, "ci_low": lo, "ci_high": hi,
                     "median_height": float(np.median(g["height"])),
                     "spiked_any": int(g["spiked_any"].sum())})
    df = pd.DataFrame(rows)
    df["_o"] = df["intervention"].map(order)
    return df.sort_values(["backend", "_o"]).drop(columns="_o").reset_index(drop=True)


def report_md(table: pd.DataFrame, spec: Mapping[str, Any], seconds: float | None = None,
              regime: str = "") -> str:
    """replay.md: the regime the spikes come from, the method and the table."""
    summ = summarize(table)
    lines = ["# Causal replay of loss spikes", ""]
    if regime:
        lines += [regime, ""]
    lines += [
        f"Detector: adamspike.spikes.detect_spikes (window {spec['det_window']}, "
        f"{spec['det_k']:g} MAD, >= {spec['min_rel_jump']:.0%} over the median). Each spike start "
        f"t is replayed from the newest snapshot {spec['min_lead']}-{spec['max_lead']} steps "
        f"before it (snapshots every {spec['snapshot_every']} steps) to t + {spec['horizon']}, "
        "on the same batches, with exactly one intervention. Recurred: the same detector over "
        "the base trace up to the snapshot followed by the replay finds a spike starting within "
        f"+-{spec['recur_window']} steps of t. Height: peak replay loss in that window / the base "
        "spike's baseline (median before it). CI: exact binomial (Clopper-Pearson) 95 %.",
        "",
        "Interventions: none (determinism control); eps_shallow (eps of embed + shallow x 0.1); "
        "eps_deep (eps of deep + head x 0.1); v_reset (v <- 0 of embed + shallow at the "
        "restart step); skip_window (no update on steps "
        f"[t - {spec['skip_window']}, t], later steps keep their batches); freeze (embed + "
        "shallow updates zero from the restart step, Adam state accumulating); lr_half "
        "(optim.lr x 0.5).", ""]
    if not summ.empty:
        n_sp = table.groupby("backend").apply(
            lambda g: g[["seed", "spike_step"]].drop_duplicates().shape[0]).to_dict()
        lines += ["Spikes replayed: " + ", ".join(f"{b}: {n}" for b, n in n_sp.items()), ""]
        lines.append(md_table(
            ([r["backend"], r["intervention"], f"{r['recurred']} / {r['n']}", f"{r['rate']:.2f}",
              f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]", f"{r['median_height']:.3f}",
              str(r["spiked_any"])] for _, r in summ.iterrows()),
            headers=["backend", "intervention", "recurred k / n", "rate", "95 % CI",
                     "median height (peak / baseline)", "any spike in replay"], max_rows=None))
        none = table[table["intervention"] == "none"]
        if "exact_trace" in none and len(none):
            ex = none["exact_trace"].astype(bool)
            lines += ["", f"Determinism: the 'none' replay reproduced the base loss trace "
                          f"bit for bit in {int(ex.sum())} / {len(ex)} spikes "
                          f"(per backend: " + ", ".join(
                              f"{b}: {int(g['exact_trace'].astype(bool).sum())} / {len(g)}"
                              for b, g in none.groupby("backend")) + ")."]
        base = table.drop_duplicates(["backend", "seed", "spike_step"])
        lines += [f"Base spikes' median height: {float(np.median(base['base_height'])):.3f}."]
    else:
        lines += ["No spikes were found, so nothing was replayed."]
    if seconds is not None:
        lines += ["", f"Wall time: {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def regime_note(config_name: str, cfg: RunConfig, seeds: int, why_seeds: str) -> str:
    """Where the replayed spikes come from, read off the config (not assumed)."""
    o, t, m = cfg.optim, cfg.train, cfg.model
    sched = (f"constant lr {o.lr:g}" if o.schedule == "constant" else
             f"lr {o.lr:g} ({o.schedule}, warmup {o.warmup_steps})")
    group_eps = [f"{g} {getattr(cfg.mitigation, f'eps_{g}'):.3g}"
                 for g in ("embed", "shallow", "deep", "head")
                 if getattr(cfg.mitigation, f"eps_{g}") is not None]
    return (f"Spikes come from {config_name} (tiny LLaMA dim {m.dim}, {m.num_layers} layers, "
            f"{cfg.data.task} task, {sched}, b2 {o.b2:g}, eps {o.eps:g}"
            + (f" (per group: {', '.join(group_eps)})" if group_eps else "")
            + (f", clip {o.grad_clip:g}" if o.grad_clip else ", no clipping")
            + f", batch {t.global_batch_size} x {t.seq_len} tokens; {seeds} seeds x "
            f"{t.num_steps} steps{why_seeds}).")


def write_outputs(out: Path, table: pd.DataFrame, spec: ReplaySpec, seconds: float,
                  config_name: str, extra: pd.DataFrame | None = None) -> str:
    """replay.csv (every backend's rows) and replay.md."""
    if extra is not None and not extra.empty:
        table = pd.concat([table, extra], ignore_index=True)
    cfg = spec.run_config()
    ran = [k for k in spec.seeds if CellStore(out / "cells").path(base_cell(spec, k)).is_file()]
    why = (f": seeds run in order until {spec.min_incidents} incidents were found, at most "
           f"{len(spec.seeds)}" if spec.min_incidents else "")
    regime = regime_note(config_name, cfg, len(ran), why)
    md = report_md(table, spec.to_json(), seconds, regime)
    atomic_write_bytes(out / "replay.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "replay.md", md.encode())
    return md


# ----------------------------------------------------------------------------- CLI

# the default sizes (the full study's); smaller ones are explicit flags (configs/study.toml)
SIZES = {"seeds": 40, "min_incidents": 20, "max_spikes": 0}


def main(argv: list[str] | None = None, torch_replay=None) -> int:
    """`adamspike replay`; torch_replay(spec, out_dir, num_spikes, progress) -> rows (the
    torch subset, fullscale.replay, handed in by study.cli: simulate never imports
    torch)."""
    ap = argparse.ArgumentParser(
        prog="adamspike replay",
        description="Causal replay of loss spikes: restore a snapshot 50-150 steps before "
                    "each spike and replay the same batches with one intervention each.")
    ap.add_argument("--config", type=Path, default=Path("configs/toy_spike.toml"),
                    help="spiking TOML RunConfig (default configs/toy_spike.toml)")
    ap.add_argument("--out", type=Path, required=True, help="study directory (resumable)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="base seeds 0 .. N-1 (with --min-incidents: the most that are run; "
                         "default 40)")
    ap.add_argument("--min-incidents", type=int, default=None,
                    help="run seeds in order until this many spike incidents are found "
                         "(default 20); 0 runs every seed")
    ap.add_argument("--max-spikes", type=int, default=None,
                    help="replay at most this many spikes, in seed order (default 0: all)")
    ap.add_argument("--torch-spikes", type=int, default=0,
                    help="also replay this many spikes through the torch trainer (its DCP "
                         "checkpoints; adamspike replay only)")
    ap.add_argument("--spike-k", type=float, default=ReplaySpec.det_k,
                    help="the detector's MAD multiple k (default %(default)g; the phase map's "
                         "toys use 4: their loss noise hides every jump below ~45 %% at 6)")
    ap.add_argument("--no-progress", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    try:
        if not args.config.is_file():
            raise ConfigError(f"--config {args.config}: no such file")
        size = {**SIZES, **{k: v for k, v in vars(args).items() if k in SIZES and v is not None}}
        if size["seeds"] < 1:
            raise ConfigError(f"--seeds: must be >= 1, got {size['seeds']}")
        for k in ("min_incidents", "max_spikes"):
            if size[k] < 0:
                raise ConfigError(f"--{k.replace('_', '-')}: must be >= 0, got {size[k]}")
        spec = ReplaySpec(config=to_dict(load_config(RunConfig, args.config, overrides)),
                          seeds=list(range(size["seeds"])), max_spikes=size["max_spikes"],
                          min_incidents=size["min_incidents"], det_k=args.spike_k)
        t0 = time.perf_counter()
        table = run_study(spec, args.out, progress=not args.no_progress)
        extra = None
        if args.torch_spikes:
            if torch_replay is None:
                raise ConfigError("--torch-spikes: needs the torch trainer (run it as "
                                  "`adamspike replay`)")
            extra = torch_replay(spec, args.out / "torch", args.torch_spikes,
                                 not args.no_progress)
        md = write_outputs(args.out, table, spec, time.perf_counter() - t0, str(args.config),
                           extra)
    except ConfigError as e:
        print(f"adamspike replay: error: {e}", file=sys.stderr)
        return 2
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
