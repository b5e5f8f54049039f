"""The docs and --help say what the code does, where the fact is the code's: every
`docs/<page>.md#<anchor>` the code, the config and the README's console sample point to is
a heading of that page; docs/benchmarks.md names every script in benchmarks/;
docs/configuring.md names every preset and every key of conf/config.yaml; --help names the
keys a newcomer needs, each one the schema has, the exit codes the code returns, and the
stages in pipeline order."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.unit.test_docs import anchors

ROOT = Path(__file__).resolve().parents[2]
# A page and an anchor as code, config comments and console lines write them
# ("see docs/measurement.md#stability"); docs/*.md write "../README.md#references".
REFERENCE = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:docs/)?[\w-]+\.md)#([\w-]+)")
POINTING = [*sorted((ROOT / "hostsweep").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
            *sorted((ROOT / "conf").rglob("*.yaml")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_of(source: Path, name: str) -> Path:
    """The Markdown file a reference in `source` names: docs/X.md from the checkout's root;
    a bare X.md beside a page of docs/, or README.md."""
    if name.startswith("docs/") or name == "README.md":
        return ROOT / name
    return (source.parent if source.parent.name == "docs" else ROOT / "docs") / name


def dangling_references(source: Path) -> list[str]:
    found = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        for name, anchor in REFERENCE.findall(line):
            page = page_of(source, name)
            if not page.is_file():
                found.append(f"line {number}: {name}#{anchor}: no such page")
            elif anchor not in anchors(page):
                found.append(f"line {number}: {name}#{anchor}: no such heading in {page.relative_to(ROOT)}")
    return found


@pytest.mark.parametrize("source", POINTING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_page_anchor_the_code_and_the_docs_point_to_is_a_heading(source: Path):
    assert dangling_references(source) == []


def test_a_dangling_anchor_in_code_is_caught(tmp_path: Path):
    source = tmp_path / "module.py"
    source.write_text('HINT = "see docs/measurement.md#stability and docs/measurement.md#choosing-tee"\n')
    assert dangling_references(source) == [
        "line 1: docs/measurement.md#choosing-tee: no such heading in docs/measurement.md"]


# ---------------------------------------------------------------------------------------

def test_the_benchmarks_page_names_every_script_in_benchmarks():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert scripts and [name for name in scripts if name not in page] == []


def raw_config() -> dict:
    """conf/config.yaml as written (its interpolations, such as --help's lists, unresolved)."""
    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"), resolve=False)


def config_keys(node: dict, prefix: str = "") -> list[str]:
    """The dotted keys of conf/config.yaml, sections and leaves, without Hydra's own."""
    keys = []
    for key, value in node.items():
        if not prefix and key in ("hydra", "defaults"):
            continue
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, dict) and value:
            keys += config_keys(value, f"{dotted}.")
    return keys


def unnamed_keys(keys: list[str], page: str) -> list[str]:
    """The keys a page does not name: a top-level key as `key` or key=; a section's key in
    full (measure.T), by its last name in code style after its section's first (`measure.T` /
    `reps`), or under the section's wildcard (`split.*`)."""
    missing = []
    for key in keys:
        section, _, leaf = key.partition(".")
        if not leaf:
            named = f"`{key}" in page or f"{key}=" in page
        else:
            named = key in page or f"`{section}.*`" in page or f"`{leaf}`" in page or f"/ `{leaf}" in page
        if not named:
            missing.append(key)
    return missing


def test_the_configuring_page_names_every_key_and_every_preset():
    page = (ROOT / "docs" / "configuring.md").read_text(encoding="utf-8")
    config = raw_config()
    leaves = [k for k in config_keys(config) if "." in k or not isinstance(config[k], dict)]
    sections = [k for k in config_keys(config) if "." not in k]
    assert unnamed_keys(leaves + sections, page) == []
    presets = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert presets and [p for p in presets if f"experiment={p}" not in page and f"`{p}`" not in page] == []


def test_an_unnamed_key_is_caught():
    page = "- `measure.T`, `measure.reps` / `warmups`, `split.*`; `study`, verbose=true"
    keys = ["measure.T", "measure.warmups", "measure.seed", "split.reps", "ray.connect_timeout_s", "study",
            "verbose", "resume"]
    assert unnamed_keys(keys, page) == ["measure.seed", "ray.connect_timeout_s", "resume"]


# ---------------------------------------------------------------------------------------
# --help is conf/config.yaml's help template with the stage and preset lists filled in
# (hostsweep/__main__.py registers the resolvers).

def help_template() -> str:
    return raw_config()["hydra"]["help"]["template"]


HELP_KEY = re.compile(r"(?<![\w.$/-])\+?([a-z_]+(?:\.[A-Za-z_]+)+|[a-z_]+(?==))")
# the usage line's placeholders (key=value, group=option) and words that read like keys
NOT_KEYS = {"key", "group", "vllm.LLM", "e.g"}
# what a newcomer is told to look up in --help (issue 54): each must be named there
NEEDED = ("pair.against", "pair.enabled", "pair.design", "pair.python", "diff.base", "diff.head", "diff.fail_on",
          "skus", "models", "engine.dtype", "split.reps", "measure.replicates", "stage", "study")


def help_keys(text: str) -> set[str]:
    """The config keys a help text names: dotted keys and `key=` words (file names left out)."""
    return {k for k in HELP_KEY.findall(text) if not re.search(r"\.(md|csv|json|log|yaml|py)$", k)} - NOT_KEYS


def test_every_key_the_help_names_is_in_the_schema():
    from hostsweep.config.keys import unknown_part

    keys = help_keys(help_template())
    groups = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir()}  # +experiment=NAME and the like
    assert len(keys) > 20
    assert sorted(k for k in keys if unknown_part(k) is not None and k not in groups) == []


def test_the_help_names_what_a_newcomer_looks_up_and_points_to_the_docs():
    text = help_template()
    named = help_keys(text)
    assert [k for k in NEEDED if not any(n == k or n.startswith(f"{k}.") for n in named)] == []
    assert "docs/" in text and "first-run.md" in text and (ROOT / "docs" / "first-run.md").is_file()


def constants(path: Path) -> dict[str, object]:
    """The module-level NAME = literal assignments of a module, read without importing it."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def test_the_help_states_the_exit_codes_the_code_returns():
    text = " ".join(help_template().split())
    gate = constants(ROOT / "hostsweep" / "stages" / "diff.py")
    main = (ROOT / "hostsweep" / "__main__.py").read_text()
    assert gate["GATE_FAILED"] == 1 and f"{gate['GATE_FAILED']} a gate failed (diff.fail_on)" in text
    assert gate["GATE_REFUSED"] == 2 and "or a gate that cannot state its false-alarm rate" in text
    assert "_exit_codes.append(2)" in main and "sys.exit(2)" in main and "2 bad config" in text
    assert "sys.exit(128 + signum)" in main and "128+N stopped by signal N" in text
    assert text.index("Exit codes: 0 done") < text.index("Results:")


def test_the_stages_are_listed_in_pipeline_order():
    from hostsweep.config.stages import stage_help, stage_table

    listed = [line.split()[0] for line in stage_help().splitlines()]
    assert listed == ["sweep", "fit", "compare", "all", "diff", "noise"]
    assert [row.split("`")[1] for row in stage_table().splitlines()[2:]] == listed
    assert "in pipeline order" in help_template()
