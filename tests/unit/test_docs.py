"""The documentation holds together: every relative link in the README, docs/ and
benchmarks/RESULTS.md reaches a file that exists (and a heading of it, when the link names
one), and no path of one particular machine is written into them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "benchmarks" / "RESULTS.md"])

# [text](target "title"); the text may hold one level of brackets, as in [[1]](README.md#references).
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...

# Paths of a particular machine: home and work folders, absolute sqlite stores, and the
# system temp folder, except the temp paths hostsweep itself uses (worker logs on remote
# nodes, a worker's scratch folder), which the docs describe.
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])(?:/work/|/root/|/home/[A-Za-z0-9_.-]+/|/Users/[A-Za-z0-9_.-]+/|/scratch/|/mnt/[A-Za-z0-9_.-]+/)"
    r"|sqlite:////"
    r"|(?<![\w.~-])/tmp/(?!hostsweep-logs/|hostsweep-<pid>-)[A-Za-z0-9_.-]+")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced and indented code blocks, with inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") or line.startswith("\t"):
            continue
        lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors as its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced or line.startswith("    ") else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        targets += [m.group(2) for m in LINK.finditer(line) if not EXTERNAL.match(m.group(2))]
    return targets


def shown(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with anchor #{anchor} in {shown(destination)}")
    return broken


def test_the_documents_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/measurement.md", "benchmarks/RESULTS.md"} <= names
    assert all(p.exists() for p in DOCS)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_path_of_one_machine(path: Path):
    found = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in MACHINE_PATH.finditer(line)]
    assert found == []


@pytest.mark.parametrize("text, expected", [
    ("fit.json and predictions.csv", "fitjson-and-predictionscsv"),
    ("The stages: `stage=fit`, `stage=compare`, `stage=all`", "the-stages-stagefit-stagecompare-stageall"),
    ("The TP study's table from its own numbers", "the-tp-studys-table-from-its-own-numbers"),
    ("Faults, resume and what survives what", "faults-resume-and-what-survives-what"),
    ("Why Adding GPUs Should — But Doesn't — Halve Decode", "why-adding-gpus-should--but-doesnt--halve-decode"),
])
def test_anchors_are_githubs(text: str, expected: str):
    assert slug(text) == expected


@pytest.mark.parametrize("text, bad", [
    ("results: /work/scratch/run  (cells.csv)", True),
    ("--backend-store-uri sqlite:////abs/outputs/mlflow.db", True),
    ("python at /root/.pyenv/versions/3.11.7/bin", True),
    ("a checkout in /home/alice/src/hostsweep", True),
    ("scratch files in /tmp/pytest-of-alice/", True),
    ("a worker writes to its node's /tmp/hostsweep-logs/ instead", False),
    ("its scratch folder (`/tmp/hostsweep-<pid>-*`)", False),
    ("results: <checkout>/outputs/2026-11-30/19-19-22-12345", False),
    ("sqlite:///outputs/mlflow.db and the shared memory in /dev/shm", False),
])
def test_machine_paths_are_recognised(text: str, bad: bool):
    assert bool(MACHINE_PATH.search(text)) is bad


def test_a_broken_link_and_a_missing_anchor_are_caught(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [[1]](other.md#title) [gone](missing.md) [no](other.md#nope)\n"
                    "    [in code](missing-too.md)\n[web](https://example.org/x)\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file",
                                  f"other.md#nope: no heading with anchor #nope in {(tmp_path / 'other.md').resolve()}"]
