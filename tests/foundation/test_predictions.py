import json

import numpy as np
import pytest

from adamspike.predictions import (AlarmRule, OnlineAlarms, Predictions, PredictionsError,
                                   from_json, load_predictions, save_predictions)


def rule(**kw):
    base = dict(id="r", metric="rms_t", op=">", threshold=2.0, depths=(-1, 0), consecutive=2)
    base.update(kw)
    return AlarmRule(**base)


def cols(values, depth=(-1, 0, 1), kind=("embed", "wq", "wq")):
    return {"depth": np.array(depth), "kind": np.array(kind), "rms_t": np.array(values, float)}


def test_online_consecutive_and_rearm():
    a = OnlineAlarms([rule()])
    seq = [[1, 1, 9], [3, 1, 1], [3, 1, 1], [3, 1, 1], [1, 1, 1], [5, 5, 1], [5, 1, 1]]
    fired = [bool(a.update(s, cols(v))) for s, v in enumerate(seq)]
    # depth 1 (9) is outside the rule; fires on the 2nd consecutive hold, re-arms after a miss
    assert fired == [False, False, True, False, False, False, True]


def test_group_rho_reduce_is_the_glm_statistic():
    """reduce group_rho = adamspike.depth_groups.group_rho: sqrt(sum n v^2 / sum n) over the
    selected tensors (NaN ones left out); it needs numel, online and offline alike."""
    r = rule(metric="rho", op="<", threshold=0.1, reduce="group_rho", consecutive=1)
    depth, kind = np.array([-1, 0, 0, 1]), np.array(["embed", "wq", "w1", "wq"])
    v, n = np.array([0.01, 0.2, np.nan, 50.0]), np.array([100, 4, 8, 4])
    assert r.value(depth, kind, v, n) == pytest.approx(np.sqrt((100 * 0.01 ** 2 + 4 * 0.04) / 104))
    with pytest.raises(PredictionsError, match="numel"):
        r.value(depth, kind, v)
    fired = OnlineAlarms([r]).update(3, {"depth": depth, "kind": kind, "rho": v, "numel": n})
    assert [f["rule"] for f in fired] == ["r"]


def test_roundtrip_and_errors(tmp_path):
    p = Predictions(settings=[{"id": "a", "overrides": {"optim.b2": 0.95, "optim.eps": 1e-8,
                                                        "train.global_batch_size": 8}, "risk": 0.5}],
                    alarm_rules=[rule()], validate=["a"])
    path = tmp_path / "p.json"
    save_predictions(p, path)
    q = load_predictions(path)
    assert q.alarm_rules[0] == rule() and q.validate == ["a"]
    with pytest.raises(PredictionsError, match="exists"):
        save_predictions(p, path)
    bad = json.loads(path.read_text())
    bad["settings"][0]["overrides"]["optim.b2"] = 1.5
    with pytest.raises(PredictionsError, match=r"settings\[0\].overrides: optim.b2: must be < 1.0"):
        from_json(bad)
    bad["settings"][0]["overrides"] = {"optim.beta2": 0.9}
    with pytest.raises(PredictionsError, match="unknown config key: optim.beta2"):
        from_json(bad)
    v1 = json.loads(path.read_text())
    v1["schema_version"] = 1
    with pytest.raises(PredictionsError, match="schema_version 1 .* regenerate it with `adamspike predict`"):
        from_json(v1)
    bad = json.loads(path.read_text())
    bad["alarm_rules"][0]["metric"] = "loss_vibes"
    with pytest.raises(PredictionsError, match="metric"):
        from_json(bad)
    bad = json.loads(path.read_text())
    bad["validate"] = ["zzz"]
    with pytest.raises(PredictionsError, match="zzz"):
        from_json(bad)
    with pytest.raises(PredictionsError, match="schema_version"):
        from_json({**json.loads(path.read_text()), "schema_version": 7})
