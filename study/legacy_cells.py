"""Adopt the cells of folders written before the one cell store, computing nothing.

    python -m study.legacy_cells DIR...

Before adamspike.cells held every experiment's cells, each experiment kept its own files;
folders that took hours (the Science 4 phase maps, claims studies, ladders) are adopted
into the store instead of being recomputed:

    phase map      map.json + cells/<id>.parquet: each cell's table becomes its
                   `phase_map_cell`, each (lr_mult, batch_mult) calibration in map.json its
                   `calibration` cell; map.json gets every cell's {kind, key}
    claims study   replication.json + arms/<arm>.parquet: each arm's table becomes its
                   `claims_arm` cell (a toy problem's arm: its `sweep_cell`), each calibrated
                   base its `calibration` cell; replication.json gets every arm's cell
    ladder         ladder.json + cells/<cell_id>.parquet: `ladder_rung` cells

Each legacy table is verified against the content sha256 its file carries (files from
before that hash are taken as they are) and moved to DIR/legacy/ once adopted (nothing is
deleted). The keys are those the current drivers compute, so running the experiment again
on DIR finds every adopted cell and recomputes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd
import pyarrow.parquet as pq

from adamspike.cells import Cell, CellStore
from adamspike.config import ConfigError
from adamspike.rundir import atomic_write_bytes
from simulate import claims as C
from simulate import ladder as LD
from simulate import phase_map as PM
from simulate import sweep as S
from simulate.sweep_problems import PROBLEMS

LEGACY_SHA_KEY = b"adamspike.content_sha256"   # the legacy cell files' table hash


def read_legacy_table(path: Path) -> pd.DataFrame:
    """A legacy cell file, checked against the sha256 of its content it carries."""
    table = pq.read_table(path)
    df = table.to_pandas()
    want = (table.schema.metadata or {}).get(LEGACY_SHA_KEY)
    if want is not None:
        h = hashlib.sha256(json.dumps([[str(c), str(t)] for c, t in df.dtypes.items()]).encode())
        try:
            h.update(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes())
        except TypeError:        # unhashable values (lists): their text
            h.update(df.to_csv(index=False).encode())
        if h.hexdigest() != want.decode(errors="replace"):
            raise ConfigError(f"{path}: does not match its content sha256 (corrupt); not adopted")
    return df.reset_index(drop=True)


def _adopt(store: CellStore, cell: Cell, legacy: Path, folder: Path) -> bool:
    """Store the legacy table as the cell's `rows` (when the store lacks it) and move the
    legacy file to folder/legacy/."""
    if not legacy.is_file():
        return False
    if store.get(cell) is None:
        store.put(cell, {"rows": read_legacy_table(legacy)})
    dest = folder / "legacy" / legacy.relative_to(folder)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(legacy, dest)
    return True


def _calibration(store: CellStore, pilot: dict, have: dict, rounds: int, seeds: int,
                 history_key: str, eps_raw: dict, rho_key: str) -> None:
    cell = C.calibration_cell(pilot, have["targets"], rounds, seeds)
    if store.get(cell) is None:
        store.put(cell, {"targets": have["targets"], "rounds": have[history_key],
                         "eps": eps_raw, "rho": have[rho_key]})


def adopt_phase_map(folder: Path) -> int:
    meta_path = folder / "map.json"
    meta = json.loads(meta_path.read_text())
    store, n = CellStore(folder / "cells"), 0
    for have in meta.get("calibration", {}).values():
        # a pair whose pilots all diverged kept the previous lr's eps (its note says so)
        _calibration(store, have["pilot"], have, have["rounds"], have["seeds"],
                     "rounds_done", {} if have.get("note") else have["eps"], "pilot_rho")
    for c in meta["cells"]:
        cell = PM.store_cell(c["config"], meta["seeds"], meta["curvature_every"])
        n += _adopt(store, cell, folder / "cells" / f"{c['id']}.parquet", folder)
        if store.get(cell) is not None:
            c["cell"] = {"kind": cell.kind, "key": cell.key}
    meta["sets"] = meta.pop("sets", [])
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2, default=repr).encode())
    return n


def adopt_claims(folder: Path) -> int:
    meta_path = folder / "replication.json"
    meta = json.loads(meta_path.read_text())
    store, seeds, n = CellStore(folder / "cells"), meta["seeds"], 0
    for have in meta.get("calibration", {}).values():
        cal = have["calibrate"]
        _calibration(store, have["base"], have, int(cal["rounds"]), int(cal["seeds"]),
                     "rounds", have["eps"], "rho")
    for aid, m in meta["arms"].items():
        legacy = folder / "arms" / f"{aid}.parquet"
        if aid in meta.get("arm_configs", {}):
            cell = C.arm_cell(m["config"], seeds)
        elif legacy.is_file():       # a toy problem's arm: its sweep cell (rows name it)
            prob = PROBLEMS[str(read_legacy_table(legacy)["problem"].iloc[0])]
            cell = S.store_cell(prob, m["config"], seeds, prob.spikes)
        else:
            continue
        n += _adopt(store, cell, legacy, folder)
        if store.get(cell) is not None:
            m["cell"] = {"kind": cell.kind, "key": cell.key}
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2, default=repr).encode())
    return n


def adopt_ladder(folder: Path) -> int:
    spec, store, n = LD.stored_spec(folder), CellStore(folder / "cells"), 0
    for r in spec.rungs:
        n += _adopt(store, LD.store_cell(spec, r),
                    folder / "cells" / f"{LD.cell_id(spec, r)}.parquet", folder)
    return n


KINDS = {"map.json": adopt_phase_map, "replication.json": adopt_claims,
         "ladder.json": adopt_ladder}


def adopt(folder: str | Path) -> int:
    """Adopt one folder's legacy cells (module doc); the number adopted."""
    folder = Path(folder)
    for name, fn in KINDS.items():
        if (folder / name).is_file():
            return fn(folder)
    raise ConfigError(f"{folder}: not a phase map, claims study or ladder folder "
                      f"(none of {', '.join(KINDS)})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.legacy_cells",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    a = ap.parse_args(argv)
    try:
        for f in a.folders:
            print(f"{f}: {adopt(f)} legacy cell(s) adopted into {f / 'cells'}")
    except (ConfigError, OSError, KeyError, ValueError) as e:
        print(f"legacy_cells: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
