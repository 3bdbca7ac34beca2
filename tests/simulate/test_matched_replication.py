"""simulate.matched_replication: claims file checks and arm configs (no training here;
the stage itself runs in tests/study)."""

import json

import pytest

from adamspike.config import ConfigError
from simulate import matched_replication as mr


def test_the_shipped_claims_are_valid_and_quick_keeps_a_closed_subset():
    arms, claims = mr.read_claims()
    assert len(claims) >= 8 and {a["name"] for a in arms} >= {"base", "eps_div1000"}
    qa, qc = mr.read_claims(quick=True)
    names = {a["name"] for a in qa}
    assert qc and all(c["control"] in names and c["treatment"] in names for c in qc)


@pytest.mark.parametrize("text, match", [
    ('[[arm]]\nname = "a"\n[[claim]]\nid = "x"\nsource = "s"\nclaim = "c"\ncontrol = "a"\ntreatment = "b"\nrule = "decrease"\n', "unknown arm 'b'"),
    ('[[arm]]\nname = "a"\nbogus = 1\n[[claim]]\nid = "x"\n', "unknown field 'bogus'"),
    ('[[arm]]\nname = "a"\n[[claim]]\nid = "x"\nsource = "s"\nclaim = "c"\ncontrol = "a"\ntreatment = "a"\nrule = "removes"\n', "rule: unknown"),
    ('[[arm]]\nname = "a"\nscale_groups = ["middle"]\n[[claim]]\nid = "x"\n', "unknown group 'middle'"),
])
def test_bad_claims_files_name_the_problem(tmp_path, text, match):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        mr.read_claims(p)


def test_arm_configs_scale_the_calibrated_eps_and_apply_overrides():
    base = mr.base_flat(mr.study_spec(quick=True))
    eps = {"embed": 1e-3, "shallow": 2e-3, "deep": 4e-3, "head": 5e-4}
    a = mr.arm_flat(base, eps, {"name": "s", "scale_eps": 1e-3, "scale_groups": ["embed", "shallow"],
                                "overrides": {"optim.b2": 0.99}})
    assert a["mitigation.eps_embed"] == pytest.approx(1e-6)
    assert a["mitigation.eps_shallow"] == pytest.approx(2e-6) == a["optim.eps"]
    assert a["mitigation.eps_deep"] == pytest.approx(4e-3)
    assert a["optim.b2"] == 0.99
    with pytest.raises(ConfigError, match="optim.bogus"):
        mr.arm_flat(base, eps, {"name": "x", "overrides": {"optim.bogus": 1}})
    with pytest.raises(ConfigError, match="b2"):
        mr.arm_flat(base, eps, {"name": "x", "overrides": {"optim.b2": 1.5}})


def test_ladder_targets_need_a_ladder_fit_at_eps_1e5(tmp_path):
    with pytest.raises(ConfigError, match="not a ladder fit"):
        mr.ladder_targets(tmp_path)
    (tmp_path / "fit.json").write_text(json.dumps({"llama2_70b": {"eps": 1e-8, "rho": {"deep": 1}}}))
    with pytest.raises(ConfigError, match="expected 1e-5"):
        mr.ladder_targets(tmp_path)


def test_calibration_secant_finds_eps_when_the_gradient_grows_as_eps_shrinks():
    # rho = c eps^-2 (the gradient RMS grows as eps shrinks, as the embedding's does): the
    # rms-held-fixed step alone would overshoot by 4x; the secant lands on sqrt(c / target)
    from simulate.matched_replication import next_eps
    c, target = 4e-6, 1.0
    rounds = [{"eps": {"embed": 1e-3}, "rho": {"embed": c / 1e-3 ** 2}}]
    for _ in range(3):
        e = next_eps("embed", rounds, target)
        rounds.append({"eps": {"embed": e}, "rho": {"embed": c / e ** 2}})
    assert rounds[1]["eps"]["embed"] == pytest.approx(4e-3)       # first step: eps rho / target
    assert rounds[-1]["rho"]["embed"] == pytest.approx(target, rel=1e-6)
    # a flat response cannot send eps away by more than 1.5 decades per pilot
    flat = [{"eps": {"g": 1e-3}, "rho": {"g": 1e3}}, {"eps": {"g": 2e-3}, "rho": {"g": 1e3}}]
    assert next_eps("g", flat, 1.0) == pytest.approx(2e-3 * 10 ** 1.5)
