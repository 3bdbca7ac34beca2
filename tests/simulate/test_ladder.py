"""simulate.ladder: the fit recovers a known power law, the 70B profile obeys the clip bound,
cells are cached and resumable, vmapped seeds equal seeds run one after another, and
`predict` takes its llama2-70b / log profiles from a ladder."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from adamspike.config import ConfigError

from adamspike.llama import num_params, preset
from simulate import ladder as LD
from simulate import predict as P

# log10 rms_group = c0 + c_d log d + c_L log L + c_B log tokens (invented ground truth)
TRUE = {"embed": [-1.0, -0.3, -0.2, -0.4], "shallow": [-2.5, 0.5, -0.1, -0.5],
        "deep": [-2.2, 0.3, -0.3, -0.45], "head": [-1.3, 0.0, 0.0, -0.45]}


def _synthetic_res(rung, spec, seeds, rng, noise=0.02, level=0.0):
    """A train_seeds-like result whose group RMS follows TRUE (per-step log-normal noise)."""
    from adamspike.depth_groups import depth_group
    dim, L, B = rung
    cfg = LD.llama_config(dim, L, spec)
    from adamspike.llama import param_specs
    specs = param_specs(cfg)
    depths = sorted({s.depth for s in specs})
    numel = np.array([sum(s.numel for s in specs if s.depth == d) for d in depths])
    steps = np.arange(LD.LOG_EVERY, spec.num_steps + 1, LD.LOG_EVERY)
    x = np.array([1.0, math.log10(dim), math.log10(L), math.log10(B * spec.seq_len)])
    sumsq = np.empty((len(seeds), len(steps), len(depths)))
    for k, d in enumerate(depths):
        c = np.array(TRUE[depth_group(d, L)])
        logr = c @ x + level + noise * rng.standard_normal((len(seeds), len(steps)))
        sumsq[:, :, k] = numel[k] * 10 ** (2 * logr)
    n = spec.num_steps
    return {"loss": np.full((len(seeds), n), 2.0), "grad_norm": np.full((len(seeds), n), 1.0),
            "depth_sumsq": sumsq, "depths": np.array(depths), "depth_numel": numel,
            "log_steps": steps}


@pytest.fixture
def synthetic_ladder(tmp_path, monkeypatch):
    """A ladder directory written by run_ladder with train_seeds replaced by TRUE."""
    rng = np.random.default_rng(0)
    calls = []

    def fake(cfg, spec, tokens, seeds, vmapped=True):
        calls.append((cfg.dim, cfg.num_layers, tokens.shape[2]))
        return _synthetic_res((cfg.dim, cfg.num_layers, tokens.shape[2]), spec, seeds, rng)

    monkeypatch.setattr(LD, "train_seeds", fake)
    monkeypatch.setattr(LD, "batches", lambda spec, b, seeds: np.zeros(
        (spec.num_steps, len(seeds), b, spec.seq_len + 1), np.int32))
    spec = LD.LadderSpec(rungs=[(32, 2, 16), (64, 2, 16), (128, 4, 16), (64, 8, 16),
                                (32, 4, 4), (64, 2, 64)], seeds=3, num_steps=20)
    out = tmp_path / "ladder"
    LD.run_ladder(spec, out, progress=False)
    return out, spec, calls


def test_fit_recovers_known_power_law():
    """Synthetic power laws: estimates close to the truth, and the 90 % bootstrap intervals
    cover the true coefficients at about their nominal rate over replicate data sets."""
    true = np.array([[-2.0, 0.5, -0.25, -0.5], [-1.0, -0.3, 0.1, -0.4]]).T
    covered, total = 0, 0
    for rep in range(30):
        rng = np.random.default_rng(rep)
        d = rng.choice([32, 64, 128, 256], 60)
        L = rng.choice([2, 4, 8], 60)
        B = rng.choice([128, 512, 2048], 60)
        X = LD.design({"dim": d, "num_layers": L, "tokens_per_step": B})
        Y = X @ true + 0.03 * rng.standard_normal((60, 2))
        fits = LD.fit_power_law(X, Y, n_boot=200, seed=rep)
        for k, f in enumerate(fits):
            assert np.all(np.abs(f.coef[1:] - true[1:, k]) < 0.06)   # exponents
            assert np.all(f.coef_hi - f.coef_lo < 0.2)              # informative intervals
            assert f.r2_log > 0.95 and 0.02 < f.resid_sd < 0.04
            covered += int(np.sum((f.coef_lo <= true[:, k]) & (true[:, k] <= f.coef_hi)))
            total += 4
    assert 0.8 <= covered / total <= 0.97, covered / total


def test_cells_cached_and_resumed(synthetic_ladder):
    out, spec, calls = synthetic_ladder
    assert len(calls) == len(spec.rungs)
    cells = sorted((out / "cells" / LD.KIND).glob("*[0-9a-f].json"))
    assert len(cells) == len(spec.rungs)
    cells[0].unlink()                                   # an interrupted ladder
    LD.run_ladder(spec, out, progress=False)
    assert len(calls) == len(spec.rungs) + 1            # only the missing cell re-ran
    other = LD.LadderSpec(rungs=spec.rungs, seeds=3, num_steps=30)
    with pytest.raises(Exception, match="another ladder"):
        LD.run_ladder(other, out, progress=False)


def test_cells_from_another_ladder_directory(synthetic_ladder, tmp_path):
    """--cells-from: the source's cells of the same spec (and its batch-sharpness summary)
    are copied byte for byte, only those missing, and nothing is trained again; a source
    holding another ladder is refused before anything is copied."""
    src, spec, calls = synthetic_ladder
    (src / LD.BATCH_SHARPNESS_FILE).write_text('{"llama2_70b": {}}')
    dst = tmp_path / "copy"
    assert LD.seed_cells(spec, dst, src) == len(spec.rungs)
    LD.run_ladder(spec, dst, progress=False)
    assert len(calls) == len(spec.rungs)                 # nothing trained
    copied = [c for c in (src / "cells" / LD.KIND).iterdir() if not c.name.endswith(".prov.json")]
    assert len(copied) == 2 * len(spec.rungs)
    for c in copied:
        assert (dst / "cells" / LD.KIND / c.name).read_bytes() == c.read_bytes()
    assert (dst / LD.BATCH_SHARPNESS_FILE).read_text() == '{"llama2_70b": {}}'
    assert LD.seed_cells(spec, dst, src) == 0            # all there: none copied again
    other = LD.LadderSpec(rungs=spec.rungs, seeds=3, num_steps=30)
    with pytest.raises(ConfigError, match="another ladder \\(differs in num_steps\\)"):
        LD.seed_cells(other, tmp_path / "third", src)
    assert not (tmp_path / "third").exists()
    with pytest.raises(ConfigError, match="holds another ladder"):
        LD.seed_cells(other, dst, src)


def test_ladder_fit_and_70b_bound(synthetic_ladder):
    out, _, _ = synthetic_ladder
    fit, ext = LD.ladder_70b(out, eps=1e-5, n_boot=300)
    for g, c in TRUE.items():
        got = fit["groups"][g]
        # 6 rungs x 3 seeds: the estimate is close; interval coverage is tested above on a
        # larger design (a case bootstrap over 6 design points is not calibrated)
        np.testing.assert_allclose(got["coef"][1:], c[1:], atol=0.08)      # exponents
        x = LD.design({"dim": 64, "num_layers": 4, "tokens_per_step": 512})[0]
        assert abs(np.dot(got["coef"], x) - np.dot(c, x)) < 0.02           # inside the ladder
        assert got["r2_log"] > 0.9
    N = num_params(preset("llama2-70b"))
    assert ext["num_params"] == N == 68_976_648_192
    bound = 1.0 / (math.sqrt(N) * 1e-5)
    assert ext["mean_rho_bound"] == pytest.approx(bound) and bound == pytest.approx(0.381, abs=1e-3)
    # TRUE extrapolates to a raw norm above the clip: the profile sits on the bound
    assert ext["raw_grad_norm"] > 1.0 and ext["mean_rho"] <= bound * (1 + 1e-12)
    Ng = np.array([ext["group_numel"][g] for g in ext["_groups"]], float)
    draws = np.sqrt((ext["_draws_rho"] ** 2 * Ng).sum(1) / N)
    assert np.all(draws <= bound * (1 + 1e-9))
    rows = LD.profile_by_depth(ext)
    assert [r["depth"] for r in rows] == list(range(-1, 81))
    assert {r["group"] for r in rows[1:9]} == {"shallow"} and rows[9]["group"] == "deep"
    assert all(r["rho_lo"] <= r["rho"] <= r["rho_hi"] for r in rows)


def test_unclipped_profile_below_bound():
    """A gradient scale whose 70B norm is below the clip is not clipped (factor 1)."""
    rng = np.random.default_rng(2)
    wide = []
    for d in (32, 64, 128):
        for L in (2, 4, 8):
            for B in (128, 512):
                wide.append((d, L, B))
    X = LD.design({"dim": [w[0] for w in wide], "num_layers": [w[1] for w in wide],
                   "tokens_per_step": [w[2] for w in wide]})
    Y = np.column_stack([X @ np.array(TRUE[g]) - 4 + 0.01 * rng.standard_normal(len(X))
                         for g in ("embed", "shallow", "deep", "head")])
    fits = LD.fit_power_law(X, Y, n_boot=200)
    fit = {"_fits": dict(zip(("embed", "shallow", "deep", "head"), fits)), "ci": 0.9}
    ext = LD.extrapolate(fit, preset("llama2-70b"), 1024 * 4096, eps=1e-5)
    assert ext["raw_grad_norm"] < 1.0 and ext["clip_factor"] == 1.0
    assert ext["mean_rho"] < ext["mean_rho_bound"]


def test_vmapped_seeds_equal_sequential():
    """One vmapped program over seeds gives each seed's own run (what the bench times)."""
    spec = LD.LadderSpec(rungs=[(16, 1, 2)], seq_len=8, seeds=2, num_steps=5, warmup_steps=1,
                         vocab_size=32)
    cfg = LD.llama_config(16, 1, spec)
    tokens = LD.batches(spec, 2, [0, 1])
    a = LD.train_seeds(cfg, spec, tokens, [0, 1], vmapped=True)
    b = LD.train_seeds(cfg, spec, tokens, [0, 1], vmapped=False)
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(a["depth_sumsq"], b["depth_sumsq"], rtol=1e-4)
    assert not np.allclose(a["loss"][0], a["loss"][1])          # seeds differ
    assert a["depth_sumsq"].shape == (2, 1, 3)                   # depths -1, 0, 1


def _rate_model_file(tmp_path):
    """A spike-rate GLM (adamspike.spike_rate) fitted on a small seeded sweep-like table."""
    from adamspike import spike_rate as SR
    rng = np.random.default_rng(0)
    rows = [{"num_spikes": rng.poisson(3.0 * (rho < 10) + 0.2), "train.num_steps": 1000,
             "optim.b2": b2, "optim.eps": eps, "optim.lr": 1e-2, "median_rho": rho, "seed": s}
            for rho, eps in ((0.3, 1e-4), (3.0, 1e-5), (300.0, 1e-8)) for b2 in (0.95, 0.999)
            for s in range(4)]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(SR.fit(SR.sweep_rows(pd.DataFrame(rows)), n_boot=20).to_json()))
    return str(path)


def test_predict_profile_from_ladder(synthetic_ladder, tmp_path, capsys):
    out, _, _ = synthetic_ladder
    pred = tmp_path / "p70.json"
    assert P.main(["--profile", "llama2-70b", "--ladder", str(out), "--rate-model",
                   _rate_model_file(tmp_path), "--out", str(pred)]) == 0
    data = json.loads(pred.read_text())
    # eps {1e-5, 1e-6, 1e-8} x b2 {0.95, 0.99} x lr {1.5e-4, 3e-4} x batch {1024, 2048}
    assert len(data["settings"]) == 24
    for s in data["settings"]:
        assert s["rho_bar"] <= s["rho_bar_bound"] * (1 + 1e-9)
        assert s["rate_ci"][0] <= s["rate_per_1k"] <= s["rate_ci"][1]
        assert s["features"]["log10_tokens_per_step"] == pytest.approx(
            np.log10(s["overrides"]["train.global_batch_size"] * 4096))
    assert "extrapolation_note" in data["rate_model"]
    prof = data["profile"]
    assert prof["source"].startswith("ladder fit") and "R^2 (log)" in prof["source"]
    assert "bootstrap prediction interval" in prof["source"]
    rows = prof["by_depth"]
    assert len(rows) == 82 and set(rows[0]) == {"depth", "group", "rho", "rho_lo", "rho_hi"}
    # the features are the GLM's statistic: group_rho over the side's depths with the
    # llama2-70b numel per depth (param_specs), at rho * eps_ref / eps
    from adamspike.depth_groups import group_rho
    numel = {int(d): n for d, n in prof["numel_by_depth"].items()}
    assert sum(numel.values()) == num_params(preset("llama2-70b"))
    s = next(s for s in data["settings"] if s["overrides"]["optim.eps"] == 1e-6)
    for side, keep in (("shallow", lambda d: d < 8), ("deep", lambda d: d >= 8)):
        ds = [r["depth"] for r in rows if keep(r["depth"])]
        want = group_rho([10 * r["rho"] for r in rows if keep(r["depth"])], [numel[d] for d in ds])
        assert 10 ** s["features"][f"log10_rho_{side}"] == pytest.approx(want, rel=1e-9)
    # without a ladder: the one shipped with the package (adamspike.package_data), said so
    assert P.main(["--profile", "llama2-70b", "--rate-model", _rate_model_file(tmp_path),
                   "--out", str(tmp_path / "x.json")]) == 0
    shipped = json.loads((tmp_path / "x.json").read_text())["profile"]["source"]
    assert shipped.startswith("shipped fit v") and "adamspike/data/llama2_70b/ladder" in shipped


def test_predict_profile_from_log(synthetic_ladder, tmp_path):
    out, _, _ = synthetic_ladder
    log = tmp_path / "train.log"
    gns = [0.5, 0.2, 0.3, 0.25, 0.2, 0.3, 2.0, 0.25]
    log.write_text("".join(
        f" iteration {i + 1:8d}/ 100 | consumed samples: {1024 * (i + 1)} | learning rate: "
        f"1.5E-04 | global batch size: 1024 | lm loss: 2.5E+00 | loss scale: 1.0 | grad norm: "
        f"{g} | number of skipped iterations: 0 | number of nan iterations: 0 |\n"
        for i, g in enumerate(gns)))
    pred = tmp_path / "plog.json"
    assert P.main(["--profile-from-log", str(log), "--ladder", str(out), "--rate-model",
                   _rate_model_file(tmp_path), "--out", str(pred)]) == 0
    prof = json.loads(pred.read_text())["profile"]
    N = num_params(preset("llama2-70b"))
    rho_bar = float(np.median(np.minimum(gns[4:], 1.0))) / (math.sqrt(N) * 1e-5)
    assert prof["rho_bar"] == pytest.approx(rho_bar)
    assert prof["source"].startswith("measured log")
    rho = {int(d): v for d, v in prof["rho_by_depth"].items()}
    spec = LD.group_numel(preset("llama2-70b"))
    from adamspike.depth_groups import depth_group
    # the N-weighted rms of the per-group values is rho_bar (the shape is normalised)
    per_group = {depth_group(d, 80): r for d, r in rho.items()}
    ms = sum(spec[g] * per_group[g] ** 2 for g in per_group) / N
    assert math.sqrt(ms) == pytest.approx(rho_bar, rel=1e-9)


def test_lr_scaling():
    spec = LD.full_spec("inverse_width")
    assert spec.lr_for(64) == spec.lr and spec.lr_for(256) == pytest.approx(spec.lr / 4)
    const = LD.full_spec("constant")
    assert const.lr_for(256) == const.lr and LD.full_spec().lr_scaling == "inverse_width"
    # the knob is part of a cell's id (a constant-lr cell is never reused for the other)
    assert LD.cell_id(const, (32, 2, 16)) != LD.cell_id(spec, (32, 2, 16))


def test_outputs_report_and_figure(synthetic_ladder, tmp_path):
    from figures import fig_ladder
    out, _, _ = synthetic_ladder
    df = LD.read_ladder(out)
    fit, ext = LD.ladder_70b(out, n_boot=200)
    LD.write_outputs(out, df, fit, ext, seconds=1.0)
    rep = (out / "report.md").read_text()
    assert "| shallow |" in rep and "bound clip/(sqrt(N) eps) = 0.3808" in rep
    band = __import__("pandas").read_csv(out / "band.csv")
    assert set(band["group"]) == {"embed", "shallow", "deep", "head"}
    assert (band["rms_lo"] <= band["rms"]).all() and (band["rms"] <= band["rms_hi"]).all()
    assert fig_ladder.main(["--ladder", str(out), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "ladder.png").stat().st_size > 0
    assert fig_ladder.main(["--ladder", str(tmp_path / "nope"), "--out", str(tmp_path / "f2")]) == 2


# log10 lambda_max(H) = c0 + c_d log d + c_L log L + c_B log tokens (invented ground truth)
TRUE_SHARP = [0.5, 0.4, 0.2, -0.3]


def test_sharpness_ladder_fit_and_the_70b_pi(tmp_path, monkeypatch):
    """With curvature on, the cells carry sharpness and S; the fit recovers the sharpness
    power law and the 70B's Pi_eps is (lr / eps) lambda at the extrapolated lambda."""
    rng = np.random.default_rng(3)
    spec = LD.LadderSpec(rungs=[(32, 2, 16), (64, 2, 16), (128, 4, 16), (64, 8, 16),
                                (32, 4, 4), (64, 2, 64)], seeds=3, num_steps=20,
                         curvature_every=10)

    def fake(cfg, spec_, tokens, seeds, vmapped=True):
        rung = (cfg.dim, cfg.num_layers, tokens.shape[2])
        res = _synthetic_res(rung, spec_, seeds, rng)
        x = np.array([1.0, math.log10(rung[0]), math.log10(rung[1]),
                      math.log10(rung[2] * spec_.seq_len)])
        n = spec_.num_steps // spec_.curvature_every
        res["sharpness"] = 10 ** (np.dot(TRUE_SHARP, x) + 0.01 * rng.standard_normal((len(seeds), n)))
        res["stability"] = np.full((len(seeds), n), 0.5)
        return res

    monkeypatch.setattr(LD, "train_seeds", fake)
    monkeypatch.setattr(LD, "batches", lambda spec_, b, seeds: np.zeros(
        (spec_.num_steps, len(seeds), b, spec_.seq_len + 1), np.int32))
    out = tmp_path / "ladder"
    df = LD.run_ladder(spec, out, progress=False)
    assert df["sharpness"].notna().any() and df.loc[df["step"] % 10 != 0, "sharpness"].isna().all()
    fit, ext = LD.ladder_70b(out, eps=1e-5, n_boot=200)
    sf = fit["sharpness"]
    np.testing.assert_allclose(sf["coef"][1:], TRUE_SHARP[1:], atol=0.05)
    assert all(r["stability"] == 0.5 for r in sf["by_rung"])
    sh = ext["sharpness"]
    x = LD.design(LD.TARGET_70B)[0]
    assert sh["lambda_max"] == pytest.approx(10 ** (np.dot(sf["coef"], x)))
    assert sh["lambda_max_lo"] <= sh["lambda_max"] <= sh["lambda_max_hi"]
    pk = sh["pi"]["peak"]
    assert pk["pi_eps"] == pytest.approx(LD.LR_70B / 1e-5 * sh["lambda_max"])
    assert pk["over_threshold"] == pytest.approx(pk["pi_eps"] / 38.0)
    assert sh["pi"]["warmup_step_1000"]["pi_eps"] == pytest.approx(pk["pi_eps"] / 2)
    # the other reading: no fall of the minibatch sharpness beyond the ladder's batches
    fl = sh["at_ladder_tokens"]
    assert fl["tokens_per_step"] == pytest.approx(64 * 32)      # the largest rung's batch
    x_fl = LD.design({**LD.TARGET_70B, "tokens_per_step": 64 * 32})[0]
    assert fl["lambda_max"] == pytest.approx(10 ** np.dot(sf["coef"], x_fl))
    assert fl["lambda_max"] > sh["lambda_max"]                  # TRUE_SHARP falls with tokens
    LD.write_outputs(out, df, fit, ext, seconds=1.0)
    assert "Sharpness ladder" in (out / "report.md").read_text()
    # a ladder from before the sharpness ladder (no curvature fields in its ladder.json)
    # keeps its cell ids: the shipped one still loads, every cell found
    from adamspike import package_data
    shipped = package_data.ladder_dir("llama2-70b")
    old = json.loads((shipped / "ladder.json").read_text())["ladder"]
    assert len(LD.read_ladder(shipped)["cell_id"].unique()) == len(old["rungs"])
    with pytest.raises(Exception, match="curvature_every"):
        LD.run_ladder(LD.LadderSpec(rungs=[(32, 2, 16)], num_steps=20, curvature_every=7),
                      tmp_path / "bad", progress=False)


def test_a_smaller_ladder_is_explicit_sizes_over_the_full_one():
    """No named reduced ladder: a caller (the study's size table) gives explicit sizes; the
    rest is the full ladder's."""
    small = LD.sized_spec(rungs=[(32, 2, 16), (64, 2, 16)], seeds=2, num_steps=60,
                          curvature_every=20, curvature_iters=None)
    full = LD.full_spec()
    assert small.rungs == [(32, 2, 16), (64, 2, 16)] and small.seeds == 2
    assert small.num_steps == 60 and small.curvature_every == 20
    assert small.curvature_iters == full.curvature_iters and small.lr == full.lr
    assert LD.sized_spec() == full
    assert LD.rung_arg("64x4x16") == (64, 4, 16)
    with pytest.raises(Exception, match="DIMxLAYERS"):
        LD.rung_arg("64x")
