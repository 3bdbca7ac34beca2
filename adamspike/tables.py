"""The project's one Markdown table writer and its number format.

`md_table` writes every Markdown table of the reports (analysis, sweeps, replication,
study): a DataFrame (with the columns to show and their headers) or a list of rows
(sequences of cells, or dicts keyed by the columns). Cells are written with `fmt`:
3 significant digits, scientific outside [1e-3, 1e5), NaN / None as "-", bools as
yes / no, strings as they are.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd


def fmt(x: Any, digits: int = 3) -> str:
    """One table cell: None / NaN -> "-", bool -> yes / no, int as is, float with `digits`
    significant digits (scientific below 1e-3 or from 1e5), strings unchanged."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def md_table(data: pd.DataFrame | Iterable, cols: Sequence[str] | None = None,
             headers: Sequence[str] | None = None, max_rows: int | None = 40) -> str:
    """A Markdown table. data: a DataFrame (cols: the columns shown, default all), or rows
    (each a sequence of cells, or a dict read at `cols`); headers: the header cells
    (default cols). Beyond max_rows (None: no limit) a last row says how many were left
    out ("see the CSV")."""
    if isinstance(data, pd.DataFrame):
        cols = list(cols or data.columns)
        total = len(data)
        head = data if max_rows is None else data.head(max_rows)
        shown = [[r[c] for c in cols] for _, r in head.iterrows()]
    else:
        rows = [[r[c] for c in cols] if isinstance(r, dict) else list(r) for r in data]
        total = len(rows)
        shown = rows if max_rows is None else rows[:max_rows]
    headers = list(headers or cols or [])
    n = len(headers)
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * n]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in shown]
    if total > len(shown):
        lines.append(f"| ... {total - len(shown)} more rows (see the CSV) |" + " |" * (n - 1))
    return "\n".join(lines)
