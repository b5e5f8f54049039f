"""One stage registry: each hostsweep/stages/<name>.py declares its stage, and STAGES, the
--help text and docs/configuring.md's stage table come from those declarations; the
presets --help lists come from conf/experiment/."""
from __future__ import annotations

import importlib
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from hostsweep.config.presets import preset_summaries
from hostsweep.config.schema import STAGES, SweepConfig
from hostsweep.config.stages import (
    STAGE_FOLDER, StageDeclarationError, StageInfo, declared_stages, read_declaration, stage_names, stage_table,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_module_declares_the_stage_it_is_named_for():
    modules = sorted(p for p in STAGE_FOLDER.glob("*.py") if p.name != "__init__.py")
    assert [read_declaration(p).name for p in modules] == [p.stem for p in modules]
    assert set(STAGES) == {p.stem for p in modules} and STAGES[0] == "sweep"


def test_the_declarations_read_from_source_are_the_ones_the_modules_hold():
    for info in declared_stages():
        assert importlib.import_module(f"hostsweep.stages.{info.name}").STAGE == info


def test_a_stages_sections_and_docs_page_exist():
    keys = {f.name for f in fields(SweepConfig)}
    for info in declared_stages():
        assert info.help and "\n" not in info.help and "$" not in info.help  # one line; Hydra's template
        assert set(info.sections) <= keys, info.name
        assert (ROOT / "docs" / info.docs).is_file(), info.name


def test_a_new_stage_module_is_a_stage_with_nothing_else_edited(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "sweep.py").write_text('STAGE = StageInfo(name="sweep", help="measure")\n')
    (tmp_path / "replay.py").write_text('from hostsweep.config.stages import StageInfo\n\n'
                                        'STAGE = StageInfo(name="replay", help="replay a journal",\n'
                                        '                  sections=("measure",), docs="faults.md")\n')
    assert stage_names(tmp_path) == ("sweep", "replay")
    assert declared_stages(tmp_path)[1] == StageInfo("replay", "replay a journal", ("measure",), "faults.md")


@pytest.mark.parametrize("source, error", [
    ('STAGE = StageInfo(name="other", help="x")\n', "STAGE.name is 'other', not the module's name"),
    ('STAGE = StageInfo(name="bad", help=HELP)\n', "STAGE's arguments must be literals"),
    ('STAGE = dict(name="bad")\n', "STAGE must be StageInfo(name=..., help=..., sections=...)"),
])
def test_a_stage_declaration_that_cannot_be_read_is_refused_naming_the_file(tmp_path, source, error):
    (tmp_path / "bad.py").write_text(source)
    with pytest.raises(StageDeclarationError, match="^bad.py: ") as caught:
        read_declaration(tmp_path / "bad.py")
    assert error in str(caught.value)


def test_the_docs_stage_table_is_the_registrys():
    text = (ROOT / "docs" / "configuring.md").read_text()
    assert stage_table() in text, "docs/configuring.md's stage table differs from the registry; it should be:\n" \
        + stage_table()


def test_every_preset_file_states_its_summary():
    presets = preset_summaries()
    assert {name for name, _ in presets} == {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert all(summary for _, summary in presets), [name for name, summary in presets if not summary]


def test_help_lists_every_stage_and_every_preset():
    import hostsweep.__main__  # noqa: F401 - registers the help template's resolvers

    with initialize_config_module(version_base="1.3", config_module="hostsweep.conf"):
        cfg = compose("config", return_hydra_config=True)
    template = cfg.hydra.help.template
    for info in declared_stages():
        assert f"  {info.name}" in template and info.help in template
    for name, summary in preset_summaries():
        assert f"  {name} " in template and summary in template
    assert "diff-cpu" in template and "generalize-cpu" in template
