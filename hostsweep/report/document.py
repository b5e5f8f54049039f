"""A report as a list of blocks, written as Markdown and as one self-contained HTML file
(pure). Figures are PNG files: the Markdown links them by relative path, the HTML embeds
them as base64 data: URIs, because MLflow's artifact viewer shows an .html artifact in a
sandboxed blob frame where relative links do not load.

Inline markup in text is limited to **bold** and `code`, the same in both outputs.
"""
from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import pandas as pd


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame
    caption: str = ""
    digits: int = 3


@dataclass(frozen=True)
class Figure:
    path: Path  # a PNG
    caption: str


Block = Union[Heading, Text, Bullets, Table, Figure]


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, *blocks: Block) -> "Document":
        self.blocks.extend(blocks)
        return self


def _cell(value: object, digits: int) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _rows(table: Table) -> tuple[list[str], list[list[str]]]:
    header = [str(c) for c in table.frame.columns]
    rows = [[_cell(v, table.digits) for v in row] for row in table.frame.itertuples(index=False)]
    return header, rows


def _md_table(table: Table) -> str:
    if table.frame.empty:
        return "(none)"
    header, rows = _rows(table)
    escape = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(escape, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(escape, row)) + " |" for row in rows]
    return "\n".join(lines) + (f"\n\n*{table.caption}*" if table.caption else "")


def to_markdown(doc: Document, base: Path) -> str:
    """Markdown with figures linked relative to `base` (the folder the .md is written to)."""
    out = [f"# {doc.title}"]
    for block in doc.blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Text):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            out.append(_md_table(block))
        else:
            out.append(f"![{block.caption}]({block.path.relative_to(base).as_posix()})\n\n*{block.caption}*")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


def _html_table(table: Table) -> str:
    if table.frame.empty:
        return "<p>(none)</p>"
    header, rows = _rows(table)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_inline(v)}</td>" for v in row) + "</tr>" for row in rows)
    caption = f"<caption>{_inline(table.caption)}</caption>" if table.caption else ""
    return (f"<div class='wide'><table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            "</div>")


def _html_figure(figure: Figure) -> str:
    data = base64.b64encode(figure.path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(figure.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_inline(figure.caption)}</figcaption></figure>")


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:13px}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}caption{caption-side:bottom;
font-size:12px;color:#555;text-align:left}img{max-width:100%}figcaption{font-size:13px;color:#444}
code{background:#f3f3f3;padding:0 3px}.wide{overflow-x:auto}"""


def to_html(doc: Document) -> str:
    """One HTML file with every figure embedded: it renders from anywhere, alone."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(doc.title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{_inline(doc.title)}</h1>"]
    for block in doc.blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Text):
            parts.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            parts.append(_html_table(block))
        else:
            parts.append(_html_figure(block))
    return "".join(parts) + "</body></html>\n"
