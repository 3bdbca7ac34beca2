"""Cached cell files verify their content on read (issue 40, defect 7): single-bit flips
anywhere in a cell file are either harmless (the same table) or refused; none is read back
as different numbers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from adamspike.rundir import CorruptCellFile, atomic_write_frame, cached_cell, read_cell_frame


def _frame() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"seed": np.arange(12), "loss": rng.random(12),
                         "rho": rng.random(12) * 1e-6, "cell_id": ["c0"] * 12})


def test_every_bit_flip_is_caught_or_harmless(tmp_path):
    df = _frame()
    path = tmp_path / "c.parquet"
    atomic_write_frame(path, df)
    pd.testing.assert_frame_equal(read_cell_frame(path), df)
    data = path.read_bytes()
    silent = caught = 0
    for bit in np.random.default_rng(1).choice(len(data) * 8, 500, replace=False):  # seeded
        bit = int(bit)
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(b))
        try:
            got = read_cell_frame(path)
        except CorruptCellFile:
            caught += 1
            continue
        silent += not (got.shape == df.shape and got.equals(df))
    assert silent == 0 and caught > 150, (silent, caught)


def test_cached_cell_sets_a_corrupt_one_aside(tmp_path, capsys):
    path = tmp_path / "c.parquet"
    assert cached_cell(path) is None                   # absent: compute it
    atomic_write_frame(path, _frame())
    assert cached_cell(path).equals(_frame())
    path.write_bytes(path.read_bytes()[:-40])          # torn
    assert cached_cell(path) is None and not path.exists()
    assert (tmp_path / "c.parquet.corrupt").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c.parquet" in err[0] and "computing it again" in err[0]


def test_files_without_a_hash_still_read(tmp_path):
    """Cells written before the hash (the shipped ladder's) read as they are."""
    path = tmp_path / "old.parquet"
    _frame().to_parquet(path, index=False)
    assert read_cell_frame(path).equals(_frame())
