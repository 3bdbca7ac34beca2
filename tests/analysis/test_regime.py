"""analysis.regime: the regime card on a run directory with known rho and dormancy, the
curvature comparison, the clip bound on rho_bar (and the 70B number), and `analyze --log`
on a Megatron log with printed model arguments producing the card."""

import math

import numpy as np
import pandas as pd
import pytest

from adamspike.llama import PRESETS, num_params
from adamspike.metrics import METRIC_NAMES, NUM_VHIST_BINS
from adamspike.rundir import RunWriter, _atomic_write_table, load_run
from analysis.regime import (card_for_run, log_arguments, num_params_from_args, rho_bar,
                             rho_bar_bound, snr_from_m_v)

EPS = 1e-5
N70B = 68_976_648_192
B1 = 0.9
C = (1 - B1) / (1 + B1)
# tensor: (depth, numel); L = 2 blocks: embed -1, shallow block 0, deep block 1, head 2
TENSORS = {"tok_embeddings.weight": (-1, 64), "layers.0.w": (0, 100), "layers.0.v": (0, 300),
           "layers.1.w": (1, 50), "output.weight": (2, 64)}
KIND = {"tok_embeddings.weight": "embed", "output.weight": "output"}


def _rho(name, step):
    """Known per-tensor rho: the embedding dormant (0.5) for steps 1-30 and 61-75, awake
    (5) otherwise; block 0: its two tensors at 100 and 300 (group rho = sqrt of the
    numel-weighted mean square); block 1 at 0.05 (frozen) throughout; head at 20."""
    if name == "tok_embeddings.weight":
        return 0.5 if step <= 30 or 61 <= step <= 75 else 5.0
    return {"layers.0.w": 100.0, "layers.0.v": 300.0, "layers.1.w": 0.05,
            "output.weight": 20.0}[name]


@pytest.fixture(scope="module")
def known_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("regime") / "known"
    cfg = {"model": {"num_layers": 2},
           "optim": {"lr": 1e-3, "b1": B1, "b2": 0.95, "eps": EPS, "grad_clip": 1.0}}
    with RunWriter(path, backend="jax", config=cfg, env={}) as w:
        for step in range(1, 101):
            w.log_step(step=step, tokens=step, loss=1.0, lr=1e-3, grad_norm=1.0,
                       clipped=False, update_norm=0.1, step_time_s=0.0, skipped=False)
            rows = []
            for n, (d, numel) in TENSORS.items():
                r = _rho(n, step)
                row = {m: 0.5 for m in METRIC_NAMES}
                # m_v^2 = a + (1 - a) c with a = 1/2: snr = 1 in the embedding, 0 elsewhere
                mv = math.sqrt(0.5 + 0.5 * C) if d == -1 else math.sqrt(C)
                row.update(name=n, depth=d, kind=KIND.get(n, "param"), numel=numel,
                           grad_rms=r * EPS, rho=r, eps_frac=float(r < 1), m_v_ratio=mv,
                           rms_t=1.0 + (r > 1 and step in (31, 76)))
                rows.append(row)
            w.log_layers(step, rows=rows)
            if step % 10 == 0:   # |g| < eps: half the embedding, none of block 0
                for n, (d, numel) in TENSORS.items():
                    counts = np.zeros(NUM_VHIST_BINS, int)
                    counts[40] = numel
                    w.log_vhist(step, n, d, KIND.get(n, "param"), counts,
                                numel // 2 if d == -1 else 0)
    # a curvature table as the JAX toys write it (analysis reads whatever is there)
    import pyarrow as pa
    (path / "curvature").mkdir(exist_ok=True)
    steps = np.arange(10, 101, 10)
    tbl = pa.table({"step": np.repeat(steps, 2), "group": ["shallow", "deep"] * len(steps),
                    "precond_curvature": np.tile([3000.0, 500.0], len(steps)),
                    "raw_curvature": np.tile([1e-3, 2e-3], len(steps)),
                    "lr": np.full(2 * len(steps), 1e-3)})
    _atomic_write_table(path / "curvature" / "part-000000.parquet", tbl)
    return path


def test_card_groups_dormancy_and_wakeups(known_run):
    card = card_for_run(load_run(known_run))
    g = card.groups.set_index("group")
    assert list(card.groups["group"]) == ["embed", "shallow", "deep", "head"]
    np.testing.assert_allclose(g.loc["shallow", "rho_median"],
                               math.sqrt((100 * 100 ** 2 + 300 * 300 ** 2) / 400), rtol=1e-6)
    assert g.loc["deep", "rho_median"] == pytest.approx(0.05, rel=1e-6)
    assert g.loc["deep", "regime"] == "frozen" and g.loc["shallow", "regime"] == "scale_invariant"
    assert g.loc["embed", "frac_time_below_1"] == pytest.approx(45 / 100)
    assert g.loc["deep", "frac_time_below_1"] == 1.0 and g.loc["head", "frac_time_below_1"] == 0
    assert g.loc["embed", "eps_frac_median"] == 0.0 and g.loc["deep", "eps_frac_median"] == 1.0
    assert g.loc["embed", "g_below_eps_median"] == 0.5
    assert g.loc["shallow", "g_below_eps_median"] == 0.0
    # snr from m_v_ratio: 1 where m_v^2 = (1 + c) / 2, 0 at the zero-mean value c
    assert g.loc["embed", "snr_median"] == pytest.approx(1.0, rel=1e-5)
    assert g.loc["shallow", "snr_median"] == pytest.approx(0.0, abs=1e-3)
    # the deep block never wakes (100 steps dormant); the embedding wakes twice
    t = card.tensors.set_index("name")
    assert t.loc["layers.1.w", "max_dormancy"] == 100 and t.loc["layers.1.w", "num_wakeups"] == 0
    w = card.wakeups
    assert list(w["step"]) == [31, 76] and list(w["dormant_steps"]) == [30, 15]
    assert list(w["dormant_since"]) == [1, 61]
    assert (w["rho_at_wake"] == 5.0).all() and (w["rho_dormant_median"] == 0.5).all()
    assert (w["rms_t_at_wake"] == 2.0).all()
    tr = card.trajectory[card.trajectory["group"] == "embed"].set_index("step")
    assert tr.loc[30, "max_dormancy"] == 30 and tr.loc[31, "max_dormancy"] == 0
    assert card.lr_over_eps == pytest.approx(1e-3 / EPS)


def test_card_stability_numbers_dormancy_in_b2_memories_and_update_size(known_run):
    """Issue Science 3's stability numbers: Pi_eps = (lr/eps) lambda_raw against 38, Pi_adam =
    lr lambda_precond against 2, per group and per curvature step; dormancy in units of the
    b2 memory 1/(1-b2) = 20 steps; warmup progress lr / lr_peak; lr rms(r) / rms(p)."""
    card = card_for_run(load_run(known_run))
    g = card.groups.set_index("group")
    assert g.loc["shallow", "pi_adam_median"] == pytest.approx(1e-3 * 3000)     # 3 > 2
    assert g.loc["deep", "pi_eps_median"] == pytest.approx(1e-3 / EPS * 2e-3)   # 0.2 < 38
    assert math.isnan(g.loc["embed", "pi_eps_median"])                          # no curvature rows
    w = card.wakeups
    assert list(w["dormant_memories"]) == pytest.approx([30 / 20, 15 / 20])
    assert g.loc["deep", "max_dormancy_memories"] == pytest.approx(100 / 20)
    assert g.loc["shallow", "rel_update_median"] == pytest.approx(1e-3 * 0.5 / 0.5)
    tr = card.trajectory
    assert (tr["warmup_progress"] == 1.0).all()                                # constant lr
    at = tr[(tr["step"] == 50) & (tr["group"] == "deep")].iloc[0]
    assert at["pi_eps"] == pytest.approx(0.2) and at["pi_eps_threshold"] == pytest.approx(38.0)
    assert at["pi_adam"] == pytest.approx(0.5)
    assert tr[(tr["step"] == 51) & (tr["group"] == "deep")]["pi_eps"].isna().all()


def test_analyze_report_carries_the_card(known_run, tmp_path):
    from analysis.report import analyze_run, write_run_report
    ra = analyze_run(known_run)
    write_run_report(ra, tmp_path / "r")
    card = pd.read_csv(tmp_path / "r" / "regime_card.csv").set_index("group")
    assert card.loc["deep", "eps_frac_median"] == 1.0 and card.loc["embed", "num_wakeups"] == 2
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Regime card" in md and "**2 wake-up(s)**" in md
    assert (tmp_path / "r" / "regime_wakeups.csv").is_file()


def test_card_curvature_against_bai_and_eps_band(known_run):
    cv = card_for_run(load_run(known_run)).curvature.set_index("group")
    # 2 / lr = 2000: the shallow 3000 is above, the deep 500 below
    assert cv.loc["shallow", "bai_threshold_median"] == pytest.approx(2000.0)
    assert cv.loc["shallow", "frac_above_bai"] == 1.0 and cv.loc["deep", "frac_above_bai"] == 0
    # eps band: 2 (1 + b1) / ((1 - b1) lr / eps) = 2 * 1.9 / (0.1 * 100) = 0.38
    assert cv.loc["deep", "eps_band_threshold_median"] == pytest.approx(0.38)
    assert cv.loc["deep", "frac_raw_above_eps_band"] == 0.0


def test_rho_bar_is_the_mean_rho_under_clipping_and_obeys_the_bound():
    rng = np.random.default_rng(3)
    numel = rng.integers(10, 10_000, 50).astype(float)
    clip, eps, n = 1.0, 1e-5, numel.sum()
    for scale in (1e-4, 1e-3, 0.1):           # gn below and above the clip
        rms = scale * 10.0 ** rng.uniform(-2, 1, 50)
        gn = math.sqrt(np.sum(numel * rms ** 2))
        rms_consumed = rms * min(1.0, clip / gn)   # what Adam sees after the clip
        mean_rho = math.sqrt(np.sum(numel * rms_consumed ** 2) / n) / eps
        assert float(rho_bar(gn, clip, int(n), eps)) == pytest.approx(mean_rho, rel=1e-12)
        assert mean_rho <= rho_bar_bound(clip, int(n), eps) * (1 + 1e-12)
    assert num_params(PRESETS["llama2-70b"]) == N70B
    assert rho_bar_bound(1.0, N70B, 1e-5) == pytest.approx(0.381, abs=5e-4)
    assert rho_bar_bound(1.0, N70B, 1e-8) == pytest.approx(381, abs=0.5)


def test_snr_inversion_round_trip():
    snr = np.array([0.0, 0.3, 1.0, 3.0])
    a = snr ** 2 / (1 + snr ** 2)
    np.testing.assert_allclose(snr_from_m_v(np.sqrt(a + (1 - a) * C), B1), snr, atol=1e-6)


ARGS_70B = """------------------------ arguments ------------------------
  adam_beta1 ...................................... 0.9
  adam_beta2 ...................................... 0.95
  adam_eps ........................................ 1e-05
  clip_grad ....................................... 1.0
  ffn_hidden_size ................................. 28672
  group_query_attention ........................... True
  hidden_size ..................................... 8192
  num_attention_heads ............................. 64
  num_layers ...................................... 80
  num_query_groups ................................ 8
  padded_vocab_size ............................... 32000
  untie_embeddings_and_output_weights ............. True
-------------------- end of arguments ---------------------
"""


def _log_text(num=120, seed=0):
    rng = np.random.default_rng(seed)
    lines = [ARGS_70B]
    for it in range(1, num + 1):
        gn = float(np.exp(rng.normal(np.log(0.2), 0.3))) if it != 60 else 3.0
        lines.append(f" [2024-06-01 12:00:{it % 60:02d}] iteration {it:8d}/{500:8d} | consumed "
                     f"samples: {it * 1024:12d} | elapsed time per iteration (ms): 15234.5 | "
                     f"learning rate: 1.500000E-04 | global batch size:  1024 | lm loss: "
                     f"{2.5 - 0.001 * it:.6E} | loss scale: 1.0 | grad norm: {gn:.4f} | "
                     "number of skipped iterations:   0 | number of nan iterations:   0 |")
    return "\n".join(lines) + "\n", gn


def test_log_arguments_give_the_70b_parameter_count(tmp_path):
    p = tmp_path / "train.log"
    p.write_text(_log_text(5)[0])
    args = log_arguments(p)
    assert args["adam_eps"] == "1e-05" and args["num_layers"] == "80"
    n, src = num_params_from_args(args)
    assert n == N70B and "arguments" in src
    n, why = num_params_from_args({"num_layers": "80"})
    assert n is None and "hidden_size" in why


def test_analyze_log_writes_the_regime_card(tmp_path, capsys):
    from analysis.cli import main

    p = tmp_path / "megatron.log"
    text, _ = _log_text()
    p.write_text(text)
    out = tmp_path / "an"
    rc = main(["--log", str(p), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    md = (out / "megatron.log.run" / "report.md").read_text()
    assert "## Regime card" in md and "rho_bar" in md and "68976648192" in md
    card = pd.read_csv(out / "megatron.log.run" / "regime_card.csv").set_index("eps")
    assert set(card.index) == {1e-5, 1e-8}
    assert card.loc[1e-5, "is_run_eps"]          # adam_eps from the log's arguments
    assert card.loc[1e-5, "bound"] == pytest.approx(0.381, abs=5e-4)
    # the one clipped step (gn 3.0) sits at the bound; all others below it
    assert card.loc[1e-5, "rho_bar_max"] == pytest.approx(card.loc[1e-5, "bound"])
    assert card.loc[1e-5, "frac_time_below_1"] == 1.0
    assert card.loc[1e-8, "frac_time_below_1"] == 0.0
    # median gn 0.2: rho_bar = 0.2 / (sqrt(N) 1e-5) = 0.076, the frozen band
    assert card.loc[1e-5, "rho_bar_median"] == pytest.approx(0.076, rel=0.15)
    assert card.loc[1e-5, "regime"] == "frozen"
    idx = (out / "report.md").read_text()
    assert "## Regime overview" in idx and "| log |" in idx


def test_analyze_log_without_architecture_needs_num_params(tmp_path, capsys):
    from analysis.cli import main

    p = tmp_path / "bare.log"
    p.write_text(_log_text()[0].split("-------------------- end of arguments")[1])
    out = tmp_path / "an"
    assert main(["--log", str(p), "--out", str(out), "--eps", "1e-8",
                 "--clip", "1.0"]) == 0
    assert "parameter count unknown" in (out / "bare.log.run" / "report.md").read_text()
    out2 = tmp_path / "an2"
    assert main(["--log", str(p), "--out", str(out2), "--eps", "1e-8",
                 "--clip", "1.0", "--model", "llama2-70b"]) == 0
    card = pd.read_csv(out2 / "bare.log.run" / "regime_card.csv").set_index("eps")
    assert card.loc[1e-8, "is_run_eps"] and card.loc[1e-8, "bound"] == pytest.approx(381, abs=.5)
    assert main(["--log", str(p), "--out", str(tmp_path / "x"), "--model", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
