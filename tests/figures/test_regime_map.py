"""figures.fig_regime_map: data prep (run trajectories, a log's rho_bar, the 70B profile or
clip band) apart from the plot; bad input exits 2."""

import json

import pytest

from analysis.cli import main as analyze
from figures import fig_regime_map as F

LOG = "".join(
    f" iteration {it:8d}/{100:8d} | consumed samples: {it * 8:12d} | learning rate: 1.0E-04 |"
    f" global batch size: 8 | lm loss: {3.0 - 0.01 * it:.6E} | loss scale: 1.0 |"
    f" grad norm: {0.2 + 0.01 * (it % 5):.4f} | number of skipped iterations: 0 |"
    f" number of nan iterations: 0 |\n" for it in range(1, 41))


def _profile(path, source):
    rho = {str(d): (1.0 if d < 8 else 30.0) for d in range(-1, 81)}
    path.write_text(json.dumps({"profile": {"name": "llama2-70b", "num_layers": 80,
                                            "eps_ref": 1e-5, "rho_by_depth": rho,
                                            "source": source}}))
    return path


def test_prepare_and_plot(small_run, tmp_path):
    log = tmp_path / "m.log"
    log.write_text(LOG)
    # the figure reads the regime cards `adamspike analyze` wrote; a log without model
    # arguments: rho_bar needs N (the 70B preset's here)
    assert analyze([str(small_run), "--log", str(log), "--clip", "1.0", "--eps", "1e-8",
                    "--b2", "0.95", "--num-params", "68976648192",
                    "--out", str(tmp_path / "an")]) == 0
    runs = F.analysed_runs(tmp_path / "an")
    data = F.prepare(runs, _profile(tmp_path / "fit.json", "ladder fit (test)"),
                     num_params=68_976_648_192)
    lg, toy = sorted(data["runs"], key=lambda it: not it["log"])
    assert toy["traj"][0].size > 10 and toy["deep_label"] == "deep"
    assert toy["shallow"][0] <= toy["shallow"][1] <= toy["shallow"][2]
    assert data["bands_70b"][1e-5] == pytest.approx((0.0381, 0.381), abs=5e-4)
    assert data["p70"]["rho"]["shallow"] == pytest.approx(1.0)
    assert data["p70"]["rho"]["deep"] == pytest.approx(30.0)
    files = F.plot(data, tmp_path / "out")
    assert sorted(f.name for f in files) == ["regime_map.pdf", "regime_map.png"]
    assert all(f.stat().st_size > 1000 for f in files)
    # the hand-written ("assumed") profile is not drawn as an estimate
    toy_run = [a for a in runs if a.path.name == "small"]
    assert F.prepare(toy_run, _profile(tmp_path / "a.json", "assumed (built-in)"))["p70"] is None
    # the log: rho_bar = min(gn, 1) / (sqrt(N) 1e-8) at its eps, gn 0.20-0.24
    assert lg["log"] and lg["b2"] == 0.95
    assert lg["rho"][1] == pytest.approx(0.22 / (68_976_648_192 ** 0.5 * 1e-8), rel=0.1)


def test_main_bad_input(tmp_path, capsys):
    assert F.main(["--tables", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "error" in capsys.readouterr().err
