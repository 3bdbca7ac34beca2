"""A report's Markdown as one self-contained HTML file (standard library only): every image
it links is inlined as base64 PNG data, so the file reads offline, mailed or archived alone.

The Markdown is the subset the project's reports write (analysis.report, adamspike.tables
.md_table): `#` headings, paragraphs, `- ` lists, pipe tables, `**bold**`, `` `code` ``,
`[text](link)` and `![alt](figure.png)`. `analysis.report` writes report.html beside every
report.md; `adamspike figures --analysis DIR` rewrites a run's report.html with the run
figures it drew (both read files only: the floor is where they meet).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Iterable

_IMG = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;
max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#f3f3f3}code{background:#f5f5f5;padding:0 .2em}
img{max-width:100%;height:auto;display:block;margin:.5em 0}
figure{margin:1em 0}figcaption{font-size:.85em;color:#555}
.missing{color:#a00}"""


def png_data_uri(path: Path) -> str | None:
    """data:image/png;base64,... of a PNG file; None when it is missing or not a PNG."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _inline(text: str, base_dir: Path) -> str:
    """Inline Markdown of one line (escaped first; images become inline data)."""
    out, pos = [], 0
    for m in _IMG.finditer(text):
        out.append(_inline_text(text[pos:m.start()]))
        out.append(_figure(m.group(1), base_dir / m.group(2), m.group(2)))
        pos = m.end()
    out.append(_inline_text(text[pos:]))
    return "".join(out)


def _inline_text(text: str) -> str:
    s = html.escape(text, quote=False)
    s = _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", s)
    s = _BOLD.sub(lambda m: f"<strong>{m.group(1)}</strong>", s)
    # links to other reports stay relative (a report.md link points at its report.html)
    return _LINK.sub(_anchor, s)


def _anchor(m: re.Match) -> str:
    """A link, or its text alone when the target's scheme could run code (javascript:,
    data:, vbscript: ...: a link's target can come from a log's file name)."""
    target = _html_link(m.group(2))
    if target is None:
        return m.group(1)
    return f'<a href="{html.escape(target)}">{m.group(1)}</a>'


_SAFE_SCHEMES = ("http", "https", "mailto")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def _html_link(target: str) -> str | None:
    # browsers drop ASCII whitespace and control characters inside a scheme ("java\tscript:")
    bare = re.sub(r"[\x00-\x20\x7f]", "", html.unescape(target))
    scheme = _SCHEME.match(bare)
    if scheme and scheme.group(1).lower() not in _SAFE_SCHEMES:
        return None
    return target[:-3] + ".html" if target.endswith("report.md") else target


def _figure(alt: str, path: Path, shown: str) -> str:
    uri = png_data_uri(path)
    if uri is None:
        return (f'<p class="missing">figure {html.escape(shown)}: missing or not a PNG'
                "</p>")
    a = html.escape(alt)
    return f'<figure><img alt="{a}" src="{uri}"><figcaption>{a}</figcaption></figure>'


def _table(rows: list[str], base_dir: Path) -> str:
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    head, body = cells[0], [c for c in cells[1:] if not all(set(x) <= set("-: ") for x in c)]
    out = ["<table><thead><tr>"] + [f"<th>{_inline(c, base_dir)}</th>" for c in head]
    out.append("</tr></thead><tbody>")
    for r in body:
        out.append("<tr>" + "".join(f"<td>{_inline(c, base_dir)}</td>" for c in r) + "</tr>")
    return "".join(out) + "</tbody></table>"


def markdown_to_html(markdown: str, base_dir: str | Path, title: str,
                     figures: Iterable[str | Path] = ()) -> str:
    """The self-contained HTML page of a report. base_dir: where its relative image links
    point from; figures: PNGs to append in a 'Figures' section (absolute or relative to
    base_dir), for those the Markdown does not link already."""
    base = Path(base_dir)
    lines = markdown.splitlines()
    linked = {str((base / m.group(2)).resolve()) for m in _IMG.finditer(markdown)}
    extra = [f for f in figures if str((base / f).resolve()) not in linked]
    if extra:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in extra]
    out: list[str] = []
    para: list[str] = []
    i = 0

    def flush_para() -> None:
        if para:
            out.append("<p>" + " ".join(_inline(x, base) for x in para) + "</p>")
            para.clear()

    while i < len(lines):
        ln = lines[i]
        st = ln.strip()
        if not st:
            flush_para()
        elif st.startswith("#"):
            flush_para()
            level = min(len(st) - len(st.lstrip("#")), 6)
            out.append(f"<h{level}>{_inline(st[level:].strip(), base)}</h{level}>")
        elif st.startswith("|"):
            flush_para()
            rows = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(lines[i])
                i += 1
            out.append(_table(rows, base))
            continue
        elif st.startswith("- "):
            flush_para()
            items = []
            while i < len(lines) and lines[i].strip().startswith("- "):
                items.append(f"<li>{_inline(lines[i].strip()[2:], base)}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif _IMG.fullmatch(st):
            flush_para()
            out.append(_inline(st, base))
        else:
            para.append(st)
        i += 1
    flush_para()
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(out) + "\n</body></html>\n")
