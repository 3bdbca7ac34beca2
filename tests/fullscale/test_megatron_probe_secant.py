"""The probe's online curvature proxy (MegatronProbe._secant_step, simulate.program's
Secant) on an exact quadratic: loss = 0.5 * sum_i a_i x_i^2 over three float64 tensors,
full batch (no noise), torch.optim.AdamW through the train_step wrapper. For a quadratic
g_t - g_{t-1} = A u_{t-1} exactly, so every `curvature` row must equal, recomputed here
with numpy from the parameters and Adam's v recorded after each step,

    precond = sum_block u' A u / sum_block u' P^-1 u,    raw = sum_block u' A u / |u|^2

(u_{t-1} = p_t - p_{t-1}, P_{t-1}^-1 = (sqrt(v_hat_{t-1}) + eps) / c_{t-1}); a step
whose gradient is unknown (a skipped update, clipping on without a grad norm) and the
step after it count nothing."""

import importlib.util
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from adamspike.rundir import load_run
from fullscale import megatron_probe as mp
from fullscale.probe import wrapper as probe_wrapper

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("steps", "layers", "hists", "curvature")
B1, B2, EPS, LR, WD = 0.9, 0.95, 1e-8, 0.05, 0.1


class Quadratic(torch.nn.Module):
    """0.5 * sum_i a_i x_i^2 over three tensors with different a_i (float64)."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        shapes = {"w_small": (5,), "w_mat": (3, 4), "w_big": (7,)}
        scales = {"w_small": 0.5, "w_mat": 3.0, "w_big": 20.0}
        self.a = {}
        for name, shape in shapes.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)))
            self.a[name] = scales[name] * (0.2 + torch.rand(shape, generator=gen, dtype=torch.float64))

    def forward(self):
        return sum(0.5 * (self.a[n] * p * p).sum() for n, p in self.named_parameters())


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """Megatron's train_step contract; clipping as Megatron's optimizer does it (the
    optimizer's config.clip_grad, the gradient scaled in place, the norm returned)."""
    (m,) = model
    optimizer.zero_grad(set_to_none=True)
    loss = m()
    loss.backward()
    clip = getattr(getattr(optimizer, "config", None), "clip_grad", None)
    gn = float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)) if clip else \
        float(torch.sqrt(sum((p.grad ** 2).sum() for p in m.parameters())))
    if config["iteration"] in config.get("skip", ()):
        return {}, 1, None, None
    optimizer.step()
    if config["iteration"] in config.get("no_grad_norm", ()):
        gn = None
    return {"lm loss": loss.detach()}, 0, gn, None


def _train(out, *, steps=14, every=4, clip=None, skip=(), no_grad_norm=(), plain=False,
           secant=True):
    """Run the probe; returns (run dir, per-step record, grad norms, A per tensor)."""
    model = Quadratic()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    if clip is not None:
        opt.config = types.SimpleNamespace(clip_grad=clip)     # Megatron's OptimizerConfig
    probe = mp.MegatronProbe(str(out), every=every, hist_every=0, precision="float64",
                             plain=plain, flush_every_s=0.0, secant=secant)
    wrapped = mp.make_train_step_wrapper(lambda: probe)(train_step)
    names = [n for n, _ in model.named_parameters()]
    rec = [{"p": {n: p.detach().numpy().copy() for n, p in model.named_parameters()}}]
    gns = []
    for it in range(1, steps + 1):
        ret = wrapped(None, None, [model], opt, None,
                      {"iteration": it, "skip": skip, "no_grad_norm": no_grad_norm})
        gns.append(ret[2])
        rec.append({"p": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                    "v": {n: opt.state[p]["exp_avg_sq"].numpy().copy() for n, p in
                          model.named_parameters() if p in opt.state},
                    "t": {n: int(opt.state[p]["step"]) for n, p in model.named_parameters()
                          if p in opt.state}})
    probe.close()
    assert not probe.disabled, probe.disabled_reason
    return out, rec, gns, {n: model.a[n].numpy() for n in names}


def _expected(rec, A, steps, every, unusable):
    """{telemetry step: (precond, raw)} from the recorded parameters and state; step t's
    terms are those of u_{t-1} = p_t - p_{t-1} (rec[t - 1] is the state after step t - 1,
    rec[0] the initial parameters)."""
    out = {}
    for end in range(every, steps + 1, every):
        num = den = uu = 0.0
        used = 0
        for t in range(end - every + 1, end + 1):
            if t < 2 or t in unusable:
                continue
            used += 1
            for n, a in A.items():
                u = rec[t - 1]["p"][n] - rec[t - 2]["p"][n]
                k = rec[t - 1]["t"][n]
                c = (1 - B1) / ((1 + B1) * (1 - B1 ** k))
                pinv = (np.sqrt(rec[t - 1]["v"][n] / (1 - B2 ** k)) + EPS) / c
                num += float(np.sum(a * u * u))
                den += float(np.sum(pinv * u * u))
                uu += float(np.sum(u * u))
        if used:
            out[end] = (num / den if den > 0 else math.nan, num / uu if uu > 0 else math.nan)
    return out


@pytest.mark.parametrize("case", ["no_clip", "clip", "clip_plain_skip_no_grad_norm"])
def test_secant_rows_equal_the_quadratic_along_the_updates(tmp_path, case):
    steps, every = 14, 4
    kw = {"no_clip": {}, "clip": {"clip": 25.0},
          "clip_plain_skip_no_grad_norm": {"clip": 25.0, "plain": True, "skip": (6,),
                                           "no_grad_norm": (10,)}}[case]
    run_dir, rec, gns, A = _train(tmp_path / "run", steps=steps, every=every, **kw)
    if "clip" in kw:
        finite = [g for g in gns if g is not None]
        assert max(finite) > kw["clip"] > min(finite)      # clipping active on some steps only
    # a skipped step s: its gradient is not the one applied (nothing is), s and s + 1 out;
    # a missing grad norm with clipping on: that step's gradient is unknown, s and s + 1 out
    unusable = {x for s in kw.get("skip", ()) + kw.get("no_grad_norm", ()) for x in (s, s + 1)}
    want = _expected(rec, A, steps, every, unusable)
    run = load_run(run_dir, tables=TABLES)
    cur = run.curvature
    parts = {p.suffix for p in (Path(run_dir) / "curvature").iterdir()}
    assert parts == ({".jsonl"} if kw.get("plain") else {".parquet"})
    assert list(cur["group"].astype(str).unique()) == ["update"]
    assert list(cur["step"]) == sorted(want) == list(range(every, steps + 1, every))
    assert np.allclose(cur["lr"], LR)
    # float64 throughout: the probe's num is g_t . u - g_{t-1} . u, whose cancellation
    # costs at most |g| |u| / (u' A u) ~ 1e3 here times the 1e-16 rounding of the dot
    # products (~1e-13); 1e-9 leaves a wide margin and still fails any wrong term (an
    # off-by-one step count, P_t for P_{t-1}, an unclipped gradient: >= 1e-3)
    worst = 0.0
    for _, row in cur.iterrows():
        q, raw = want[int(row["step"])]
        for got, ref in ((row["precond_curvature"], q), (row["raw_curvature"], raw)):
            assert got == pytest.approx(ref, rel=1e-9), (case, int(row["step"]), got, ref)
            worst = max(worst, abs(got - ref) / abs(ref))
    print(f"{case}: worst relative difference {worst:.3g} over {len(cur)} rows")
    # the quadratic's curvature along any direction lies within A's range
    amin, amax = min(a.min() for a in A.values()), max(a.max() for a in A.values())
    assert ((cur["raw_curvature"] >= amin) & (cur["raw_curvature"] <= amax)).all()


def test_secant_off_writes_no_curvature_rows_and_the_directory_loads(tmp_path):
    run_dir, *_ = _train(tmp_path / "off", steps=8, every=2, clip=2.0, plain=True, secant=False)
    run = load_run(run_dir, tables=TABLES)
    assert run.curvature.empty and list(run.curvature.columns) == [
        "step", "group", "precond_curvature", "raw_curvature", "lr"]
    assert len(run.layers) and run.config["telemetry"]["secant"] is False
    # an older plain run directory without a curvature folder loads too
    (Path(run_dir) / "curvature").rmdir()
    assert load_run(run_dir, tables=TABLES).curvature.empty


def _fake_megatron(monkeypatch):
    mod = types.ModuleType("megatron.training.training")
    # a function of its own: install() repoints every module holding the original
    mod.train_step = lambda *a, **k: train_step(*a, **k)
    monkeypatch.setitem(sys.modules, "megatron.training.training", mod)
    monkeypatch.setitem(sys.modules, "mindspeed", None)
    monkeypatch.setattr(probe_wrapper, "_train_step_module", lambda: mod)
    monkeypatch.setattr(probe_wrapper, "_PROBE", None)
    return mod


@pytest.mark.parametrize("env", ["0", "1"])
def test_install_reads_ADAMSPIKE_PROBE_SECANT(monkeypatch, tmp_path, env):
    mod = _fake_megatron(monkeypatch)
    monkeypatch.setenv("ADAMSPIKE_PROBE_SECANT", env)
    monkeypatch.setenv("ADAMSPIKE_PROBE_RULES", "0")
    mp.install(str(tmp_path / "run"), every=2, hist_every=0)
    model = Quadratic()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for it in range(1, 7):
        mod.train_step(None, None, [model], opt, None, {"iteration": it})
    probe = probe_wrapper._PROBE
    probe.close()
    assert probe.secant is (env == "1") and not probe.disabled
    cur = load_run(tmp_path / "run", tables=TABLES).curvature
    assert list(cur["step"]) == ([2, 4, 6] if env == "1" else [])
    assert np.isfinite(cur["precond_curvature"]).all()


def test_install_refuses_a_bad_ADAMSPIKE_PROBE_SECANT(monkeypatch, tmp_path):
    _fake_megatron(monkeypatch)
    monkeypatch.setenv("ADAMSPIKE_PROBE_SECANT", "maybe")
    with pytest.raises(mp.ProbeError, match="ADAMSPIKE_PROBE_SECANT must be 0 or 1"):
        mp.install(str(tmp_path / "run"))


def test_secant_before_the_optimizer_state_exists_and_after_a_failure(tmp_path):
    """The first step skipped (no Adam state yet): no error, no row for a block without a
    usable step; an error inside the secant turns the probe off at the next collective."""
    run_dir, rec, _, A = _train(tmp_path / "r", steps=6, every=2, skip=(1,))
    cur = load_run(run_dir, tables=TABLES).curvature
    want = _expected(rec, A, 6, 2, {1, 2})
    assert list(cur["step"]) == sorted(want) == [4, 6]
    model = Quadratic()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    probe = mp.MegatronProbe(str(tmp_path / "f"), every=3, hist_every=0, plain=True,
                             flush_every_s=0.0)
    wrapped = mp.make_train_step_wrapper(lambda: probe)(train_step)
    wrapped(None, None, [model], opt, None, {"iteration": 1})
    probe._sec_u = None          # a bug inside the secant
    wrapped(None, None, [model], opt, None, {"iteration": 2})
    assert not probe.disabled and probe._error
    wrapped(None, None, [model], opt, None, {"iteration": 3})
    assert probe.disabled and "TypeError" in probe.disabled_reason
    probe.close()


def test_probe_adamw_harness_writes_update_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("probe_adamw", ROOT / "tests/compat/probe_adamw.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    run = load_run(demo.run(str(tmp_path), steps=6, plain=True, skip=3), tables=TABLES)
    cur = run.curvature
    # step 1 records u_1 only; skipped step 3 and step 4 count nothing
    assert list(cur["step"]) == [2, 5, 6] and (cur["group"].astype(str) == "update").all()
    assert np.isfinite(cur[["precond_curvature", "raw_curvature"]].to_numpy()).all()


def test_the_regime_card_reads_the_probes_stability_number(tmp_path):
    """`analyze` on a probe run: the card's curvature table has the `update` row, its
    S = lr precond / 2 and the estimate scaled by the toys' ratio (analysis.regime)."""
    from analysis.cli import main as analyze
    from analysis.regime import SECANT_TO_S

    spec = importlib.util.spec_from_file_location("probe_adamw", ROOT / "tests/compat/probe_adamw.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    run_dir = demo.run(str(tmp_path), steps=12, plain=True)
    cur = load_run(run_dir, tables=TABLES).curvature
    assert analyze([str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / Path(run_dir).name / "report.md").read_text()
    assert "Group `update` is the online proxy" in report
    card = __import__("pandas").read_csv(tmp_path / "rep" / Path(run_dir).name / "regime_curvature.csv")
    row = card[card["group"] == "update"].iloc[0]
    S = (cur["lr"] * cur["precond_curvature"] / 2).median()
    assert np.isclose(row["S_median"], S, rtol=1e-9)
    assert np.isclose(row["S_estimate"], S / SECANT_TO_S, rtol=1e-9)
