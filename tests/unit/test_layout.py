"""The package layout keeps the data flow: imports run one way, and the pure core imports
no Ray, MLflow, vLLM or torch (it is what notebooks reuse and what runs without a cluster)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hostsweep"
# The order the data flows through; a module may import only from its own package or
# from packages before it.
ORDER = ["config", "measure", "engines", "run", "record", "model", "calibrate", "compare", "report", "stages", "__main__"]
PURE_PACKAGES = ("config", "measure", "model", "compare", "report")
POISON = "raise ImportError('{name} must not be imported by the pure core')\n"


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def package_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def hostsweep_imports(path: Path) -> set[str]:
    """The hostsweep packages a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hostsweep" and len(parts) > 1 and parts[1] in ORDER:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down_the_data_flow_only(path):
    own = ORDER.index(package_of(path))
    later = {pkg for pkg in hostsweep_imports(path) if ORDER.index(pkg) > own}
    assert not later, f"{path.relative_to(PACKAGE)} imports {sorted(later)}, which come after {ORDER[own]}"


def test_the_rule_catches_an_import_against_the_flow(tmp_path):
    offender = tmp_path / "bad.py"
    offender.write_text("def f():\n    from hostsweep.record.tracking import SweepTracker\n")
    assert hostsweep_imports(offender) == {"record"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "model").glob("*.py")), ids=lambda p: p.name)
def test_the_model_imports_only_the_pure_core(path):
    """The TP model reaches Ray, torch and MLflow only through the calibrate package."""
    assert hostsweep_imports(path) <= {"config", "measure", "model"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "report").glob("*.py")), ids=lambda p: p.name)
def test_the_report_draws_what_it_is_handed_and_imports_no_model(path):
    """Masks, decompositions and term paths come in fit.json or from the stage; a report that
    imported model/ could recompute them and disagree with what the fit logged."""
    assert "model" not in hostsweep_imports(path)


@pytest.mark.parametrize("path", [p for p in modules() if package_of(p) in PURE_PACKAGES],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_pure_core_imports_only_the_pure_core(path):
    """config, measure, model, compare and report import none of engines, run, record or calibrate,
    not even their MLflow-free modules: what a report writes to MLflow goes through an object
    the stage hands it (report/sweep_outputs.RecordedSweep)."""
    assert hostsweep_imports(path) <= set(PURE_PACKAGES)


def pure_modules() -> list[str]:
    names = []
    for path in modules():
        dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if package_of(path) in PURE_PACKAGES and path.name != "__init__.py":
            names.append(f"hostsweep.{dotted}")
    return names


def test_the_pure_core_imports_without_ray_mlflow_vllm_or_torch(tmp_path):
    for name in ("ray", "mlflow", "vllm", "torch"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(POISON.format(name=name))
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    pure = pure_modules()
    assert "hostsweep.model.fit" in pure and "hostsweep.model.host_calibration" in pure
    assert "hostsweep.config.grid" in pure and "hostsweep.report.sweep_outputs" in pure
    assert "hostsweep.compare.cellwise" in pure
    proc = subprocess.run([sys.executable, "-c", script, *pure], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("path", sorted((PACKAGE / "compare").glob("*.py")), ids=lambda p: p.name)
def test_the_comparison_engine_keeps_one_module_per_job_and_each_small(path):
    """compare/ holds one module per job (matching, each design, verdicts, the gate, summaries),
    each short enough to read whole; report/ renders what it returns and computes nothing of it."""
    assert len(path.read_text().splitlines()) <= 450


# Entry points every stage or CLI defines by protocol: the stage registry calls run(), the
# console scripts main().
PROTOCOL_NAMES = {"run", "main"}


def test_no_two_modules_define_the_same_public_name():
    """One name, one thing: two public functions or classes of one name in the package make a
    reader (and an import) guess which is meant."""
    where: dict[str, list[str]] = {}
    for path in modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    twins = {name: paths for name, paths in where.items() if len(paths) > 1 and name not in PROTOCOL_NAMES}
    assert not twins, twins
