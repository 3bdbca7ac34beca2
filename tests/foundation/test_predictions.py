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
