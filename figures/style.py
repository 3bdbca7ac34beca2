"""The one shared figure style, and saving as PNG + PDF."""

from __future__ import annotations

import argparse
import contextlib
import textwrap
from pathlib import Path

import matplotlib

from adamspike.config import ConfigError, cli_main, parse_set

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"shallow": "#c0392b", "deep": "#2471a3", "theory": "#222222", "eps": "#7d3c98",
          "spike": "#f5b041", "mc": "#17a589"}

_RC = {
    "figure.figsize": (6.4, 4.0), "figure.dpi": 110, "savefig.dpi": 150,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
    "axes.spines.right": False, "font.size": 9, "axes.titlesize": 10,
    "legend.fontsize": 8, "legend.frameon": False, "lines.linewidth": 1.3,
}


def apply() -> None:
    """Apply the shared matplotlib style (Agg backend, no screen needed)."""
    plt.rcParams.update(_RC)


FORMATS = ("png", "pdf")   # what save() writes (only_formats narrows it for a block)


@contextlib.contextmanager
def only_formats(*formats: str):
    """save() writes only these formats inside the block (the analysis report embeds PNGs;
    the PDFs are the figures stage's job)."""
    global FORMATS
    old, FORMATS = FORMATS, tuple(formats)
    try:
        yield
    finally:
        FORMATS = old


def wrap_titles(fig) -> None:
    """Break every axes title (and the suptitle) wider than the room it has (its axes plus
    a margin; the figure for a suptitle) into lines, so no title is cut at the figure's
    edge (long run names)."""
    width_in = fig.get_size_inches()[0]
    texts = [(ax.title, min(width_in, 1.2 * ax.get_position().width * width_in))
             for ax in fig.axes]
    if getattr(fig, "_suptitle", None) is not None:
        texts.append((fig._suptitle, width_in))
    for t, room_in in texts:
        s = t.get_text()
        chars = max(20, int(room_in * 72 / (0.55 * t.get_fontsize())))
        if s and "\n" not in s and len(s) > chars:
            t.set_text(textwrap.fill(s, chars, break_long_words=True, break_on_hyphens=False))


def save(fig, out_dir: str | Path, name: str) -> list[Path]:
    """Write `name`.png and `name`.pdf (FORMATS) into out_dir; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in FORMATS]
    wrap_titles(fig)
    fig.tight_layout()
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


def computed_figure_main(doc: str, prepare, plot, argv=None, sizes: dict | None = None) -> int:
    """`main` of a figure computed from theory / Monte-Carlo: --out DIR, --set KEY=VALUE.
    prepare(sizes) gets the figure's Monte-Carlo sizes, each `--set` replacing one of them
    (the study's size table, configs/study.toml, gives smaller ones this way)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default="figures_out")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help=f"replace a Monte-Carlo size ({', '.join(sizes or {})}; repeatable)")
    args = ap.parse_args(argv)
    sizes = dict(sizes or {})
    for text in args.set:
        try:
            key, value = parse_set(text)
        except ConfigError as e:
            ap.error(str(e))
        if key not in sizes:
            ap.error(f"--set {text!r}: unknown size {key!r} (known: {', '.join(sizes)})")
        sizes[key] = value
    for p in plot(prepare(sizes), args.out):
        print(p)
    return 0


def table_figure_main(prog: str, doc: str, load, prepare, plot, argv=None,
                      table_help: str = "input table", option: str = "--table") -> int:
    """`main` of a figure drawn from one input: --table PATH (or `option`) --out DIR; bad
    input (missing, malformed: OSError, ValueError, KeyError, JSON errors) -> 2."""

    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument(option, dest="table", required=True, help=table_help)
    ap.add_argument("--out", required=True, help="output directory")
    def body(args) -> int:
        for p in plot(prepare(load(args.table)), args.out):
            print(p)
        return 0
    # json.JSONDecodeError is a ValueError
    return cli_main(ap, argv, body, prog, (OSError, ValueError, KeyError))
