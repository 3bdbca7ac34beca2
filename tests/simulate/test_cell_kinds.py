"""Every experiment kind stores its cells in the one cell store (adamspike.cells): a
resumed driver recomputes nothing that was complete, and a torn cell is set aside with one
line and computed again, to the same bytes. The computations themselves are stubbed with
cheap deterministic stand-ins (each module's own tests run them for real); what is tested
here is each driver's keying, resume and recovery, which is the store's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from adamspike.config import to_dict

REPO = Path(__file__).resolve().parents[2]


def _stamps(root: Path, kind: str) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (root / kind).iterdir()}


def check_kind(run, root: Path, kind: str, capsys, same=None) -> None:
    """run() twice (the second recomputes nothing), then again after tearing one stored
    cell of `kind`: one line, only that cell recomputed, the same bytes, the same result."""
    same = same or (lambda a, b: pd.testing.assert_frame_equal(a, b))
    first = run()
    cells = sorted(p for p in (root / kind).glob("*.json") if not p.name.endswith(".prov.json"))
    assert cells, f"no {kind} cell stored under {root}"
    before = _stamps(root, kind)
    same(run(), first)
    assert _stamps(root, kind) == before                   # resumed: nothing recomputed
    victim = cells[0]
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])             # torn
    capsys.readouterr()
    same(run(), first)
    err = [line for line in capsys.readouterr().err.splitlines() if "set aside" in line]
    assert len(err) == 1 and victim.name in err[0] and "computing it again" in err[0], err
    after = _stamps(root, kind)
    key = victim.name[: -len(".json")]
    changed = {k for k in after if before.get(k) != after[k]}
    assert changed and all(k.startswith(key + ".") for k in changed), changed
    assert (root / kind / f"{victim.name}.corrupt").exists()
    assert victim.read_bytes() == good                     # the same computation, the same bytes


def test_ladder_rungs(tmp_path, monkeypatch, capsys):
    from simulate import ladder as LD

    def fake(cfg, spec, tokens, seeds, vmapped=True):
        rng = np.random.default_rng(cfg.dim * 100 + cfg.num_layers)
        depths = list(range(-1, cfg.num_layers + 1))
        n, steps = spec.num_steps, np.arange(LD.LOG_EVERY, spec.num_steps + 1, LD.LOG_EVERY)
        return {"loss": np.full((len(seeds), n), 2.0), "grad_norm": np.ones((len(seeds), n)),
                "depth_sumsq": rng.random((len(seeds), len(steps), len(depths))),
                "depths": np.array(depths), "depth_numel": np.full(len(depths), 100),
                "log_steps": steps}
    monkeypatch.setattr(LD, "train_seeds", fake)
    monkeypatch.setattr(LD, "batches", lambda spec, b, seeds: np.zeros(
        (spec.num_steps, len(seeds), b, spec.seq_len + 1), np.int32))
    monkeypatch.setattr(LD.time, "perf_counter", lambda: 0.0)     # the table's `seconds`
    spec = LD.LadderSpec(rungs=[(32, 2, 16), (64, 2, 16), (32, 4, 4)], seeds=2, num_steps=10)
    out = tmp_path / "ladder"
    check_kind(lambda: LD.run_ladder(spec, out, progress=False), out / "cells", LD.KIND, capsys)


def test_batch_sharpness_cells(tmp_path, monkeypatch, capsys):
    from simulate import batch_sharpness as BS

    def fake(rung, seed, spec, eval_tokens):
        return {"dim": rung[0], "layers": rung[1], "seed": int(seed), "lr": spec.lr_for(rung[0]),
                "num_steps": spec.num_steps, "train_tokens": 512, "final_loss": 1.0 + seed,
                "eval": [{"tokens": int(n), "lambda": 1.0 + 100.0 / n, "change": 0.0}
                         for n in eval_tokens], "seconds": 0.0}
    monkeypatch.setattr(BS, "measure", fake)
    out = tmp_path / "bs"

    def run():
        BS.run(out, progress=False, rungs=[(32, 2), (64, 2)], seeds=2, eval_tokens=[512, 2048],
               num_steps=60, warmup_steps=6)
        return pd.read_csv(out / "batch_sharpness.csv")
    check_kind(run, out / "cells", BS.KIND, capsys)


def _arm_result(cfg, seeds):
    T = cfg.train.num_steps
    rng = np.random.default_rng(int(cfg.optim.lr * 1e6) + len(seeds))
    groups = ["embed", "shallow", "deep", "head"]
    return {"loss": rng.random((len(seeds), T)), "grad_norm": np.ones((len(seeds), T)),
            "update_norm": np.ones((len(seeds), T)), "groups": groups,
            "rho": rng.random((len(seeds), T, len(groups))),
            "stability": rng.random((len(seeds), T // 10)),
            "S_secant": rng.random((len(seeds), T // 10))}


def _calibrated(flat, targets, rounds, seeds, progress=True):
    eps = {"embed": 1e-3, "shallow": 2e-3, "deep": 4e-3, "head": 5e-4}
    return {"targets": dict(targets), "rounds": [{"eps": eps, "rho": dict(targets)}],
            "eps": eps, "rho": dict(targets)}


def test_claims_arms_and_calibrations(tmp_path, monkeypatch, capsys):
    from adamspike.claims import read_study
    from simulate import claims as C
    monkeypatch.setattr(C, "calibrate", _calibrated)
    monkeypatch.setattr(C, "run_arm", _arm_result)
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "fit.json").write_text(json.dumps(
        {"llama2_70b": {"eps": 1e-5, "rho": {"embed": 1, "shallow": 1, "deep": 1, "head": 1}}}))
    st = read_study(REPO / "configs" / "claims_matched.toml")
    st.claims = [c for c in st.claims if c.id in ("seed.lower_eps", "seed.eps_lower_b2")]
    out = tmp_path / "o"

    def run():
        from analysis.claims import load
        C.run_study(st, out, ladder=tmp_path / "ladder", progress=False)
        _, arms = load(out)
        return pd.concat([arms[a].assign(arm=a) for a in sorted(arms)], ignore_index=True)
    check_kind(run, out / "cells", C.ARM_KIND, capsys)
    check_kind(run, out / "cells", C.CAL_KIND, capsys)


def test_phase_map_cells(tmp_path, monkeypatch, capsys):
    from simulate import claims as C
    from simulate import phase_map as PM
    monkeypatch.setattr(C, "calibrate", _calibrated)
    monkeypatch.setattr(PM, "run_cell", lambda cfg, seeds, every, tokens: C.arm_table(
        _arm_result(cfg, seeds), seeds))
    monkeypatch.setattr("simulate.seeds.arm_tokens", lambda cfg, seeds: None)
    cfg = tmp_path / "map.toml"
    cfg.write_text("[map]\nbase = 'configs/matched_replication.toml'\nseeds = 2\n"
                   "lr_mult = [1, 4]\nb2 = [0.95]\nbatch_mult = [1]\ncurvature_every = 10\n"
                   "overrides = { train = { num_steps = 20 }, optim = { warmup_steps = 5 } }\n"
                   "calibrate = { rounds = 1, seeds = 2, steps = 20 }\n"
                   "[targets]\nembed = 0.7\nshallow = 0.9\ndeep = 0.2\nhead = 2.8\n")
    out = tmp_path / "map"

    def run():
        from analysis.phase_map import read_cell
        PM.run_map(PM.read_map(cfg), out, progress=False)
        meta = json.loads((out / "map.json").read_text())
        return pd.concat([read_cell(out, c).assign(id=c["id"]) for c in meta["cells"]],
                         ignore_index=True)
    check_kind(run, out / "cells", PM.KIND, capsys)


def test_replay_base_runs_and_spikes(tmp_path, monkeypatch, capsys):
    from simulate import replay as R
    from adamspike.train_config import RunConfig

    def base(spec, prog, seeds, bar=None):
        out = {}
        for k in seeds:
            loss = np.linspace(3, 2, 200) + 0.01 * k
            loss[120:123] *= 3
            sp = spec.detect(loss, np.arange(1, 201))
            out[int(k)] = R._npz_bytes(loss=loss, spikes=np.frombuffer(
                sp.to_json(orient="records", double_precision=15).encode(), np.uint8),
                **{f"t{t}_s0": np.array(50) for t in sp["start"]})
        return out

    def replay(spec, prog, seed, t, loss, sp, z):
        rows = pd.DataFrame({"backend": "jax", "seed": seed, "spike_step": t,
                             "intervention": list(spec.interventions), "recurred": True,
                             "height": 2.5})
        return rows, np.zeros((len(spec.interventions), 10))
    monkeypatch.setattr(R, "run_base", base)
    monkeypatch.setattr(R, "replay_spike", replay)
    cfg = RunConfig.from_dict({"model.preset": "tiny", "train.num_steps": 200,
                               "train.global_batch_size": 4, "train.seq_len": 16})
    spec = R.ReplaySpec(config=to_dict(cfg), seeds=[0, 1], interventions=("none", "lr_half"))
    out = tmp_path / "r"
    run = lambda: R.run_study(spec, out, progress=False)     # noqa: E731
    check_kind(run, out / "cells", "replay_base", capsys)
    check_kind(run, out / "cells", "replay_spike", capsys)
