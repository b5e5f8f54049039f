"""The stages of the main command (`stage=`), as each hostsweep/stages/<name>.py declares
them (pure).

A stage module declares itself in one statement, `STAGE = StageInfo(name=..., help=...,
sections=(...), docs=...)`; this module reads it from the module's source with `ast`,
never by importing it: the config layer comes first in the data flow, and a stage
module imports Ray, MLflow or the report. `STAGES` (config/schema.py), validation, the
`--help` text and the docs' stage table all come from here, so a new stage is its
module, its config section, its docs page and its tests, nothing else.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

STAGE_FOLDER = Path(__file__).resolve().parents[1] / "stages"
DEFAULT_STAGE = "sweep"


@dataclass(frozen=True)
class StageInfo:
    """What `stage=<name>` is, for the user: its one-line help, the config sections that
    configure it beyond the grid (measure, fit, diff, ...) and its page under docs/."""

    name: str
    help: str
    sections: tuple[str, ...] = ()
    docs: str = ""


class StageDeclarationError(ValueError):
    """A stage module whose STAGE line cannot be read as literal StageInfo arguments."""


def read_declaration(path: Path) -> StageInfo | None:
    """The module's `STAGE = StageInfo(...)`, its arguments literals; None when it has none."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["STAGE"]):
            continue
        call = node.value
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "StageInfo" and not call.args):
            raise StageDeclarationError(f"{path.name}: STAGE must be StageInfo(name=..., help=..., sections=...)")
        try:
            info = StageInfo(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg})
        except (ValueError, TypeError) as exc:
            raise StageDeclarationError(f"{path.name}: STAGE's arguments must be literals ({exc})") from None
        if info.name != path.stem:  # stages/__init__.py imports hostsweep.stages.<name>
            raise StageDeclarationError(f"{path.name}: STAGE.name is {info.name!r}, not the module's name")
        return info
    return None


# The order the stages' data flows in (measure, fit, judge; all three; then two studies
# compared; the noise calibration the diff and TP verdicts use): how --help and the docs list them. A stage not named here comes after, by name.
PIPELINE = (DEFAULT_STAGE, "fit", "compare", "all", "diff", "noise")


def ordered(infos: list[StageInfo]) -> tuple[StageInfo, ...]:
    """The stages in pipeline order (PIPELINE), then any other by name: the order --help
    and the docs list them in."""
    def rank(info: StageInfo) -> tuple[int, str]:
        return (PIPELINE.index(info.name) if info.name in PIPELINE else len(PIPELINE), info.name)

    return tuple(sorted(infos, key=rank))


@cache
def declared_stages(folder: Path = STAGE_FOLDER) -> tuple[StageInfo, ...]:
    """Every stage the stage modules in `folder` declare."""
    found = [read_declaration(path) for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]
    return ordered([info for info in found if info is not None])


def stage_names(folder: Path = STAGE_FOLDER) -> tuple[str, ...]:
    return tuple(info.name for info in declared_stages(folder))


def stage_help(width: int = 10) -> str:
    """The stages as --help lists them: one line each, name then help."""
    lines = []
    for info in declared_stages():
        default = " (the default)" if info.name == DEFAULT_STAGE else ""
        lines.append(f"  {info.name:<{width}}{info.help}{default}")
    return "\n".join(lines)


def stage_table() -> str:
    """The stages as docs/configuring.md's table (a test keeps the two equal)."""
    rows = ["| stage | what it does | configured by | docs |", "|---|---|---|---|"]
    for info in declared_stages():
        name = f"`{info.name}`" + (" (default)" if info.name == DEFAULT_STAGE else "")
        sections = ", ".join(f"`{s}`" for s in info.sections)
        docs = f"[{info.docs}]({info.docs})" if info.docs else ""
        rows.append(f"| {name} | {info.help} | {sections} | {docs} |")
    return "\n".join(rows)
