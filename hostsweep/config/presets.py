"""The study presets shipped in conf/experiment/, each with the one-line summary its file
states (pure): what `--help` lists, read from the files so a new preset is listed by
being there.

A preset file says what it is in one comment line, `# preset: <summary>`, under its
`# @package _global_` line; the longer comment below it stays the file's own.
"""
from __future__ import annotations

from importlib import resources

SUMMARY_MARK = "# preset:"


def preset_summaries() -> list[tuple[str, str]]:
    """(preset name, summary) for every conf/experiment/*.yaml, by name; '' where the file
    has no `# preset:` line."""
    folder = resources.files("hostsweep.conf").joinpath("experiment")
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name.removesuffix(".yaml")):
        if not entry.name.endswith(".yaml"):
            continue
        summary = next((line[len(SUMMARY_MARK):].strip() for line in entry.read_text().splitlines()
                        if line.startswith(SUMMARY_MARK)), "")
        found.append((entry.name[: -len(".yaml")], summary))
    return found


def preset_help() -> str:
    """The presets as --help lists them: one line each, name then summary."""
    presets = preset_summaries()
    width = max((len(name) for name, _ in presets), default=0) + 2
    return "\n".join(f"  {name:<{width}}{summary}".rstrip() for name, summary in presets)
