"""One S: the calibration between the 70B's estimator of Adam's stability number and the
toys' tracker operator (reads the `one_s` cells of simulate/one_s.py; issue "Science 4"
item 4).

Per checkpoint of a lane: S_P (Lanczos on the tracker's operator P^1/2 H P^1/2 of the
step's minibatch) and S_70 = lr lambda_max(H_full) / (38 min_g eps_g (1 + rho_g)) (the
70B's reading, simulate.predict.mechanism_inputs, applied to the toy). The calibration is
the ratio c = S_P / S_70: its median over checkpoints with both positive, and a 90 %
interval from a bootstrap over LANES (the resampling unit: a lane's checkpoints share its
trajectory). The 70B's S on the toys' scale is c S_70B; the rate model, trained on the
toys' S_P-scale tracker, takes that one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from adamspike.cells import CellStore

KIND = "one_s"


def read_table(store_dir: str | Path, maps: Mapping[str, str | Path]) -> pd.DataFrame:
    """Every verified one_s cell's checkpoints, labelled with the map cell it ran
    (lr_mult, batch_mult; matched on the cell's full config AND its lane seed: two maps may
    run the same cell config on other lanes, e.g. plan v4's new lanes of plan v3's toy)."""
    label = {}
    for name, d in maps.items():
        p = Path(d) / "map.json"
        if p.exists():
            meta = json.loads(p.read_text())
            for c in meta["cells"]:
                for seed in meta["seeds"]:
                    label[(json.dumps(c["config"], sort_keys=True, default=repr), int(seed))] = (
                        name, c["lr_mult"], c["batch_mult"])
    rows = []
    for cfg, got in CellStore(store_dir).verified(KIND):
        name, lr_mult, bm = label.get(
            (json.dumps(cfg["config"], sort_keys=True, default=repr), int(cfg["seed"])),
            ("?", math.nan, math.nan))
        for r in got["checkpoints"]:
            rows.append({"map": name, "lr_mult": lr_mult, "batch_mult": bm,
                         "seed": cfg["seed"], **r})
    return pd.DataFrame(rows)


def calibration(tab: pd.DataFrame, draws: int = 1000, seed: int = 0) -> dict:
    """Median ratio S_P / S_70 with its lane-bootstrap 90 % interval (module doc)."""
    ok = tab[(tab["S_P"] > 0) & (tab["S_70"] > 0)].copy()
    if ok.empty:
        return {"ratio": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "lanes": 0,
                "dropped": int(len(tab))}
    ok["log_ratio"] = np.log10(ok["S_P"] / ok["S_70"])
    ok["lane"] = ok["map"].astype(str) + "/" + ok["lr_mult"].astype(str) + "/" + \
        ok["batch_mult"].astype(str) + "/" + ok["seed"].astype(str)
    lanes = ok["lane"].unique()
    by = {k: ok.loc[ok["lane"] == k, "log_ratio"].to_numpy() for k in lanes}
    rng = np.random.default_rng(seed)
    boots = [np.median(np.concatenate([by[k] for k in rng.choice(lanes, len(lanes))]))
             for _ in range(int(draws))]
    med = float(np.median(ok["log_ratio"]))
    return {"ratio": 10 ** med, "lo": 10 ** float(np.percentile(boots, 5)),
            "hi": 10 ** float(np.percentile(boots, 95)), "n": int(len(ok)),
            "lanes": int(len(lanes)), "dropped": int(len(tab) - len(ok)),
            "spread_decades": float(ok["log_ratio"].std(ddof=1)) if len(ok) > 1 else math.nan}


def per_cell(tab: pd.DataFrame) -> pd.DataFrame:
    """Per map cell and checkpoint step: medians of S_P, S_70, their ratio and lambda."""
    t = tab.assign(ratio=tab["S_P"] / tab["S_70"])
    return (t.groupby(["map", "lr_mult", "batch_mult", "step"])
            .agg(lanes=("seed", "nunique"), S_P=("S_P", "median"), S_70=("S_70", "median"),
                 ratio=("ratio", "median"), lambda_full=("lambda_full", "median"),
                 lambda_batch=("lambda_batch", "median"))
            .reset_index())
