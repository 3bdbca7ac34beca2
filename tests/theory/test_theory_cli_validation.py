"""theory CLI (--json contract, exit codes) and bad-parameter errors naming the parameter."""

import json
import math
import subprocess
import sys

import pytest

from theory import adam_moments as A
from theory import bimodality as B
from theory import eps_regime as E
from theory import galton as Gt
from theory import quadratic as Q
from theory import transients as T
from theory.cli import main


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_sections(capsys):
    g = _json(capsys, ["galton", "--n", "20", "--icc", "0.4", "--json"])
    assert abs(sum(g["exchangeable"]["pmf"]) - 1) < 1e-9 and g["exchangeable"]["u_shaped"] is True
    assert g["exchangeable"]["icc_u_threshold"] == pytest.approx(1 / 3)
    u = _json(capsys, ["update", "--b1", "0.9", "--b2", "0.95", "--eps", "0", "--sigma", "1", "--mu", "0",
                       "--phi", "0", "--json"])
    assert u["r_std"] == pytest.approx(0.22606, abs=1e-5) and u["params"]["t"] is None
    u5 = _json(capsys, ["update", "--t", "5", "--json"])
    assert u5["params"]["t"] == 5
    e = _json(capsys, ["eps-regime", "--rho", "100", "0.01", "--json"])
    assert e["regime"] == ["scale_invariant", "frozen"]
    tr = _json(capsys, ["transient", "--b2", "0.99", "--k", "10", "--steps", "5", "--json"])
    assert len(tr["rms_t"]) == 5 and tr["const_peaks_by_b2"]["0.999"]["step"] == 12
    q = _json(capsys, ["quadratic", "--lr", "1e-2", "--lam", "1", "--b1", "0.9", "--eps", "1e-8", "--json"])
    assert q["eps_star"] == pytest.approx(2.6316e-4, rel=1e-4) and q["safe"] is False


def test_cli_all_and_table(capsys):
    a = _json(capsys, ["all", "--json"])
    assert set(a) == {"galton", "update", "eps_regime", "transient", "quadratic"}
    assert main(["quadratic"]) == 0
    assert "eps_star" in capsys.readouterr().out


@pytest.mark.parametrize("argv,name", [
    (["update", "--b2", "1.0"], "b2"), (["update", "--b1", "-0.1"], "b1"),
    (["update", "--eps", "-1"], "eps"), (["update", "--phi", "1.0"], "phi"),
    (["update", "--sigma", "nan"], "sigma"), (["galton", "--n", "0"], "n"),
    (["galton", "--icc", "1.5"], "icc"), (["transient", "--steps", "0"], "steps"),
    (["quadratic", "--lr", "0"], "lr"), (["eps-regime", "--rho", "-1"], "rho"),
    (["update", "--t", "0"], "t")])
def test_cli_bad_values_exit_2(capsys, argv, name):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{name}:" in err


def test_python_m_theory():
    out = subprocess.run([sys.executable, "-m", "theory", "quadratic", "--json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout)["threshold"] == 200.0


@pytest.mark.parametrize("fn,name", [
    (lambda: A.update_stats(1.0, 0.9, 0.0), "b1"), (lambda: A.update_stats(0.9, -0.1, 0.0), "b2"),
    (lambda: A.update_stats(0.9, 0.9, -1e-9), "eps"), (lambda: A.update_stats(0.9, 0.9, 0, phi=-1), "phi"),
    (lambda: A.update_stats(0.9, 0.9, 0, sigma=0), "sigma"), (lambda: A.update_stats(0.9, 0.9, 0, mu=math.inf), "mu"),
    (lambda: A.update_stats(0.9, 0.9, 0, t=0), "t"), (lambda: A.update_stats(0.9, 0.9, 0, t=2.5), "t"),
    (lambda: A.update_stats(0.9, 0.9, 0, method="x"), "method"),
    (lambda: A.grad_mom_cos(0.9, t=1), "t"), (lambda: Gt.binomial_pmf(0), "n"),
    (lambda: Gt.binomial_pmf(5, 1.0), "p"), (lambda: Gt.betabinom_pmf(5, -0.1), "icc"),
    (lambda: Gt.markov_pmf(5, 1.1), "persist"), (lambda: Gt.binomial_pmf(True), "n"),
    (lambda: B.bc_sample([1, 2, 3]), "x"), (lambda: B.bc_population(float("nan"), 0), "skew"),
    (lambda: B.r_bimodality(0.9, 0.9, 0, -1), "snr"), (lambda: E.regime(0), "rho"),
    (lambda: E.update_rms_curve([1, math.nan], 0.9, 0.9), "rho"),
    (lambda: T.step_up(0.9, 0.9, 0.0), "kappa"), (lambda: T.constant_after_dormancy(0.9, 0.9, [0]), "k"),
    (lambda: Q.critical_eps(-1, 1, 0.9), "lr"), (lambda: Q.is_unstable(1, 1, 0.9, -1, 1), "eps"),
    (lambda: Q.effective_lr(1, -1, 0), "v_hat"), (lambda: Q.critical_eps(1, 1, 1.0), "b1")])
def test_bad_parameters_name_the_parameter(fn, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        fn()


def test_theory_imports_nothing_else_of_the_project():
    code = ("import sys, theory, theory.cli, theory.risk, theory.transients;"
            "bad=[m for m in sys.modules if m.split('.')[0] in "
            "('adamspike','simulate','fullscale','analysis','figures','jax','torch','pandas')];"
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
