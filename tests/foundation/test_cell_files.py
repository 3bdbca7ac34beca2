"""Stored cells verify their content on read (issue 40, defect 7): single-bit flips
anywhere in a cell's table file or its JSON are either harmless (the same payload) or
refused and set aside; none is read back as different numbers (adamspike.cells)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from adamspike.cells import Cell, CellStore


def _frame() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"seed": np.arange(12), "loss": rng.random(12),
                         "rho": rng.random(12) * 1e-6, "cell_id": ["c0"] * 12})


def _flips(path, store, cell, want, n, rng):
    data = path.read_bytes()
    silent = caught = 0
    for bit in rng.choice(len(data) * 8, n, replace=False):  # seeded
        bit = int(bit)
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(b))
        got = store.get(cell)
        if got is None:                  # refused: set aside; put the good cell back
            caught += 1
            store.put(cell, want)
            continue
        silent += not (got["rows"].equals(want["rows"]) and got["mean"] == want["mean"])
    return silent, caught


def test_every_bit_flip_is_caught_or_harmless(tmp_path, capsys):
    store, cell = CellStore(tmp_path), Cell("test", "1", {"n": 12})
    want = {"rows": _frame(), "mean": 0.25}
    store.put(cell, want)
    rng = np.random.default_rng(1)
    table = store.path(cell).with_name(f"{cell.key}.rows.parquet")
    silent, caught = _flips(table, store, cell, want, 80, rng)
    assert silent == 0 and caught == 80, (silent, caught)     # the file's sha256: every flip
    silent, caught = _flips(store.path(cell), store, cell, want, 80, rng)
    assert silent == 0 and caught > 60, (silent, caught)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == caught + 80 and all("set aside" in e for e in err)


def test_a_torn_cell_is_set_aside_with_one_line_and_recomputed(tmp_path, capsys):
    store, cell = CellStore(tmp_path), Cell("test", "1", {"n": 12})
    assert store.get(cell) is None                     # absent: compute it
    store.put(cell, {"rows": _frame()})
    p = store.path(cell)
    p.write_bytes(p.read_bytes()[:-40])                # torn
    assert store.compute(cell, lambda: {"rows": _frame()})["rows"].equals(_frame())
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(p) in err[0] and "computing it again" in err[0]
    assert (tmp_path / "test" / f"{cell.key}.json.corrupt").exists()
    assert (tmp_path / "test" / f"{cell.key}.rows.parquet.corrupt").exists()
