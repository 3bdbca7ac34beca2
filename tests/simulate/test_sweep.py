"""simulate.sweep: grid validation, resume without recomputation, shards == unsharded, CLI errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pytest

from adamspike.config import param
from adamspike.train_config import OptimSection, TrainSection
from simulate import sweep as S
from simulate.sweep_problems import PROBLEMS

CALLS = {"runs": 0, "calls": 0}


def _toy_run(static, scalars, seeds):
    """A cheap batched 'problem': loss decays, with a spike at step 100 when eps < 1e-4
    (height grows with b2), plus noise from the seed; rms_t jumps 3 steps before."""
    CALLS["calls"] += 1
    CALLS["runs"] += len(seeds)
    steps = static["train.num_steps"]
    t = np.arange(1, steps + 1)
    out_loss, out_rms = [], []
    for eps, b2, seed in zip(scalars["optim.eps"], scalars["optim.b2"], seeds):
        rng = np.random.default_rng(int(seed))
        loss = 1.0 / np.sqrt(t) * (1 + 0.01 * rng.standard_normal(steps))
        rms = np.ones(steps)
        if eps < 1e-4:
            loss[99:104] *= 1 + 10 * b2
            rms[96] = 4.0
        out_loss.append(loss)
        out_rms.append(rms)
    return {"loss": np.asarray(out_loss), "rms_t": np.asarray(out_rms)}


@dataclass
class ToySection:
    batch: int = param(8, lo=1)


@dataclass
class ToyConfig:
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    toy: ToySection = field(default_factory=ToySection)


TOY = S.Problem("toy", ToyConfig, {"train.num_steps": True, "optim.eps": False,
                                   "optim.b2": False, "toy.batch": True},
                _toy_run, base={"train.num_steps": 200},
                spikes={"window": 20, "k": 6.0, "min_rel_jump": 0.2}, max_vmap=8)
ALL = {**PROBLEMS, "toy": TOY}


def main(argv):
    return S.main(argv, ALL)


def load_grid(path, sets=()):
    return S.load_grid(path, ALL, sets)


GRID = """
[sweep]
problem = "toy"
seeds = 3
[fixed]
train.num_steps = 200
[grid]
optim.eps = [1e-8, 1e-6, 1e-3]
optim.b2 = [0.9, 0.99]
toy.batch = [4, 8]
"""
SMALLER = ["grid.optim.eps=[1e-8, 1e-3]"]       # a caller's explicit size (configs/study.toml)


@pytest.fixture
def grid_file(tmp_path):
    p = tmp_path / "grid.toml"
    p.write_text(GRID)
    return p


def test_cells_ids_stable_and_unique(grid_file):
    g = load_grid(grid_file)
    cells = g.cells()
    assert len(cells) == 3 * 2 * 2
    ids = [S.cell_id("toy", c) for c in cells]
    assert len(set(ids)) == len(ids)
    assert ids == [S.cell_id("toy", c) for c in load_grid(grid_file).cells()]
    small = load_grid(grid_file, SMALLER)
    assert len(small.cells()) == 2 * 2 * 2 and small.axes["optim.eps"] == [1e-8, 1e-3]
    assert list(small.axes) == list(g.axes)                  # the grid's own axis order
    with pytest.raises(S.ConfigError, match="SECTION.KEY"):
        load_grid(grid_file, ["nope.x=1"])


def test_run_table_and_spike_summary(grid_file, tmp_path):
    table = S.run_sweep(load_grid(grid_file), tmp_path / "out", progress=False)
    assert len(table) == 12 * 3
    assert set(table.seed) == {0, 1, 2}
    assert (tmp_path / "out" / "runs.parquet").is_file() and (tmp_path / "out" / "runs.csv").is_file()
    spiky = table[table["optim.eps"] < 1e-4]
    calm = table[table["optim.eps"] >= 1e-4]
    assert (spiky.num_spikes == 1).all() and (calm.num_spikes == 0).all()
    # the injected spike is 1 + 10*b2 times the baseline: height ~ 10*b2
    np.testing.assert_allclose(spiky.max_spike_height, 10 * spiky["optim.b2"], rtol=0.1)
    assert (spiky.recovered_frac == 1.0).all()
    # rms_t peaks at step 97, the spike starts at step 100: lead 3 steps, pre-spike max 4
    assert (spiky.pre_rms_t == 4.0).all() and (spiky.lead_rms_t == 3.0).all()
    assert calm.pre_rms_t.isna().all()
    assert not table.diverged.any()


def test_resume_skips_finished_cells(grid_file, tmp_path):
    out = tmp_path / "out"
    g = load_grid(grid_file)
    CALLS.update(runs=0, calls=0)
    first = S.run_sweep(g, out, shard=(1, 2), progress=False)
    done_runs = CALLS["runs"]
    assert done_runs >= len(first)
    CALLS.update(runs=0, calls=0)
    again = S.run_sweep(g, out, shard=(1, 2), progress=False)
    assert CALLS["calls"] == 0                       # nothing recomputed
    pd.testing.assert_frame_equal(first, again)
    CALLS.update(runs=0, calls=0)
    full = S.run_sweep(g, out, progress=False)       # the rest of the grid only
    num_padded = CALLS["runs"]
    assert len(full) == 36
    assert CALLS["calls"] >= 1 and num_padded < 36 + 8 * 2  # only the other shard's cells ran


def test_a_corrupt_cell_is_set_aside_and_recomputed(grid_file, tmp_path, capsys):
    """Cells live in the one store (adamspike.cells) and carry their content sha256 (issue
    40, defect 7): a flipped bit in a stored cell's numbers is caught on read, the cell
    kept as .corrupt, recomputed (one line), and the table is the uncorrupted one."""
    out, g = tmp_path / "out", load_grid(grid_file)
    first = S.run_sweep(g, out, progress=False)
    cell = sorted((out / "cells" / S.KIND).glob("*.rows.parquet"))[0]
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells" / S.KIND).glob("*.json")}
    good = cell.read_bytes()
    # a flip inside the first float column's data page: decodes fine, different numbers
    df = pd.read_parquet(cell)
    col = next(c for c in df.columns if df[c].dtype == np.float64 and df[c].notna().all()
               and df[c].nunique() > 1)
    needle = np.float64(df[col].iloc[0]).tobytes()
    at = good.index(needle)
    bad = bytearray(good)
    bad[at + 2] ^= 0x10
    cell.write_bytes(bytes(bad))
    assert not pd.read_parquet(cell).equals(df)           # silently different without the hash
    capsys.readouterr()
    CALLS.update(runs=0, calls=0)
    again = S.run_sweep(g, out, progress=False)
    err = [l for l in capsys.readouterr().err.splitlines() if "set aside" in l]
    key = cell.name.split(".")[0]
    assert len(err) == 1 and key in err[0] and "computing it again" in err[0]
    assert CALLS["calls"] >= 1 and cell.with_name(cell.name + ".corrupt").read_bytes() == bytes(bad)
    pd.testing.assert_frame_equal(first, again)
    assert cell.read_bytes() == good                      # the same computation, the same bytes
    after = {p.name: p.stat().st_mtime_ns for p in (out / "cells" / S.KIND).glob("*.json")}
    assert {k for k in stamps if after.get(k) != stamps[k]} <= {f"{key}.json", f"{key}.prov.json"}
    cell.write_bytes(bytes(bad))                          # a reader alone refuses it in one line
    with pytest.raises(S.ConfigError, match="content hash mismatch"):
        S.read_cells(out)


def test_shards_merge_to_unsharded_table(grid_file, tmp_path):
    g = load_grid(grid_file)
    whole = S.run_sweep(g, tmp_path / "whole", progress=False)
    parts = [S.run_sweep(g, tmp_path / f"s{k}", shard=(k, 3), progress=False) for k in (1, 2, 3)]
    assert sum(len(p) for p in parts) == len(whole)
    assert not set.intersection(*(set(p.cell_id) for p in parts))
    assert main(["merge", *(str(tmp_path / f"s{k}") for k in (1, 2, 3)),
                   "--out", str(tmp_path / "merged")]) == 0
    merged = pd.read_parquet(tmp_path / "merged" / "runs.parquet")
    pd.testing.assert_frame_equal(merged, whole)
    # merging again into the same place refuses to overwrite
    assert main(["merge", str(tmp_path / "s1"), "--out", str(tmp_path / "merged")]) == 2


@pytest.mark.parametrize("text,needle", [
    (GRID.replace("optim.b2 = [0.9, 0.99]", "optim.beta2 = [0.9]"), "grid.optim.beta2"),
    (GRID.replace("[fixed]\ntrain.num_steps = 200", "[fixed]\nsteps = 200"), "fixed.steps"),
    (GRID.replace("optim.b2 = [0.9, 0.99]", "optim.b2 = []"), "grid.optim.b2"),
    ("[sweep]\nproblem = 'toy'\n[grid]\n", "grid: empty"),
    (GRID.replace("optim.b2 = [0.9, 0.99]", "optim.b2 = [1.5]"), "grid.optim.b2[0]: must be < 1.0"),
    (GRID.replace("[fixed]\ntrain.num_steps = 200", "[fixed]\ntrain.num_steps = 0"),
     "fixed.train.num_steps: must be >= 1"),
    (GRID.replace('problem = "toy"', 'problem = "cnn"'), "unknown problem"),
    (GRID.replace("seeds = 3", "seeds = 0"), "sweep.seeds"),
])
def test_bad_grid_exits_2(tmp_path, capsys, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    assert main(["run", "--grid", str(p), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o" / "cells").exists()


@pytest.mark.parametrize("spec", ["3/2", "0/2", "a/b", "2", "1/0"])
def test_bad_shard_exits_2(grid_file, tmp_path, capsys, spec):
    assert main(["run", "--grid", str(grid_file), "--out", str(tmp_path / "o"),
                   "--shard", spec, "--no-progress"]) == 2
    assert "--shard" in capsys.readouterr().err


def test_other_grid_into_same_dir_refused(grid_file, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["run", "--grid", str(grid_file), "--out", str(out), "--set", SMALLER[0],
                 "--no-progress"]) == 0
    before = sorted(p.name for p in (out / "cells").rglob("*"))
    assert main(["run", "--grid", str(grid_file), "--out", str(out), "--no-progress"]) == 2
    assert "another grid" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "cells").rglob("*")) == before


def test_shard_assignment_is_a_partition():
    ids = [S.cell_id("toy", {"optim.eps": e}) for e in np.logspace(-9, -2, 50)]
    for n in (1, 2, 5):
        owners = [[k for k in range(1, n + 1) if S.in_shard(c, (k, n))] for c in ids]
        assert all(len(o) == 1 for o in owners)


def test_mlp_problem_matches_simulate_mlp_train():
    """The vmapped sweep MLP reproduces simulate.mlp.train (same optax pieces) per seed."""
    from simulate.mlp import MLPSpec, train
    from simulate.sweep_problems import MLP

    from adamspike.mitigations import StepPlan

    static = {k: v for k, v in MLP.values({"train.num_steps": 30, "mlp.width": 8,
                                           "mlp.num_points": 32, "optim.grad_clip": 1.0,
                                           "mitigation.update_clip": True}).items()
              if MLP.knobs[k]}
    scalars = {"optim.lr": np.array([1e-2, 3e-3]), "optim.eps": np.array([1e-8, 1e-3]),
               "optim.b1": np.array([0.9, 0.9]), "optim.b2": np.array([0.999, 0.95])}
    seeds = np.array([0, 1])
    out = MLP.run(static, scalars, seeds)
    for i in range(2):
        optim = OptimSection(lr=float(scalars["optim.lr"][i]), schedule="constant", b1=0.9,
                             b2=float(scalars["optim.b2"][i]), eps=float(scalars["optim.eps"][i]),
                             weight_decay=0.0, grad_clip=1.0)
        ref = train(MLPSpec(kind="sin", width=8, num_points=32, seed=int(seeds[i])), optim, 30,
                    plan=StepPlan(update_clip=True), progress=False)
        np.testing.assert_allclose(out["loss"][i], ref["loss"], rtol=2e-4, atol=1e-6)
    assert out["rms_t"].shape == (2, 30) and np.isfinite(out["rms_t"]).all()


def test_save_runs_writes_loadable_run_dirs(tmp_path, capsys, grid_file):
    from adamspike.rundir import load_run

    g = tmp_path / "q.toml"
    g.write_text("[sweep]\nproblem = 'quadratic'\nseeds = 2\n[fixed]\ntrain.num_steps = 300\n"
                 "[grid]\noptim.eps = [1e-8, 1e-3]\n")
    out = tmp_path / "o"
    assert main(["run", "--grid", str(g), "--out", str(out), "--save-runs", "1",
                   "--no-progress"]) == 0
    (run_dir,) = (out / "runs").iterdir()
    run = load_run(run_dir)
    assert len(run.steps) == 300 and set(run.layers["name"]) == {"theta"}
    table = pd.read_parquet(out / "runs.parquet")
    assert run_dir.name == f"{table.cell_id[0]}-s0"
    # the toy problem cannot write run directories: a clear error, exit 2
    assert main(["run", "--grid", str(grid_file), "--out", str(tmp_path / "t"), "--save-runs", "1",
                   "--no-progress"]) == 2
    assert "--save-runs" in capsys.readouterr().err


def test_phase_diagram_from_a_sweep_table(grid_file, tmp_path):
    from figures import fig_phase_diagram as F

    table = S.run_sweep(load_grid(grid_file), tmp_path / "out", progress=False)
    data = F.prepare(table)
    (panel,) = [p for p in data["panels"] if (p["x"], p["y"]) == ("optim.eps", "optim.b2")]
    # toy: spikes iff eps < 1e-4, at every b2 and batch
    np.testing.assert_array_equal(panel["rate"], [[1, 1, 0], [1, 1, 0]])
    assert (panel["count"] == 6).all() and panel["eps_star"] is None
    assert F.main(["--table", str(tmp_path / "out"), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "phase_diagram.png").is_file()
    assert F.main(["--table", str(tmp_path / "missing"), "--out", str(tmp_path / "fig")]) == 2


def test_llama_grid_takes_every_registry_key_and_validates_it_by_the_schema(tmp_path):
    """A llama grid may vary any mitigation of the registry (dotted RunConfig keys) without
    the problem naming it; RunConfig's own checks reject a bad value, naming the key."""
    from adamspike.mitigations import all_keys

    assert all_keys() <= set(PROBLEMS["llama"].knobs)
    p = tmp_path / "g.toml"
    p.write_text("[sweep]\nproblem = 'llama'\n[grid]\nmitigation.eps_embed = [1e-6, 1e-4]\n"
                 "mitigation.v_reset_steps = [[], [100, 200]]\n")
    cells = load_grid(p).cells()
    assert len(cells) == 4 and {c["mitigation.eps_embed"] for c in cells} == {1e-6, 1e-4}
    cfg = PROBLEMS["llama"].config(cells[-1])
    assert cfg.mitigation.v_reset_steps == [100, 200] and cfg.optim.b2 == 0.999
    p.write_text("[sweep]\nproblem = 'llama'\n[grid]\nmitigation.v_reset_groups = [['middle']]\n")
    with pytest.raises(S.ConfigError, match="mitigation.v_reset_groups"):
        load_grid(p)
