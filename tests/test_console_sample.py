"""The README's sample console keeps the shape of the console a sweep really prints: the
same line formats in the same order. A default-shaped sweep on the fake engine (instant,
through the real command line, Ray and MLflow) is run once; each line of the README's
sample, reduced to its shape (numbers, times, paths, ids and the words a run chooses among
made placeholders), must appear among the real console's shapes, in order. The design
line, whose clauses come and go with the run, is checked clause by clause against every
clause the code prints. The same run's hostsweep.log must hold every line its console showed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hostsweep.report.summary import design_line
from tests.conftest import run_hostsweep

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_START = re.compile(r"^    \d\d:\d\d:\d\d INFO ")

# what differs between two runs of one command (and the fake engine's run from the README's)
SHAPES = [
    (re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING) +"), r"\1 "),  # the log line's time
    (re.compile(r"<checkout>|(?<![\w<])/[^\s,)]+"), "PATH"),  # paths (the sample writes <checkout>)
    (re.compile(r"PATH(/PATH|PATH)+"), "PATH"),
    (re.compile(r"sqlite:///+PATH"), "STORE"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "RUN"),
    (re.compile(r"\b(host-bound|device-bound|undetermined)\b"), "REGIME"),
    (re.compile(r"largest host phase \w+"), "largest host phase PHASE"),
    (re.compile(r"\b\d+m\d+s\b"), "T"),
    (re.compile(r"…"), "#"),  # a number the sample's run did not print (a clause added since)
    (re.compile(r"\d+(\.\d+)?"), "#"),
    (re.compile(r"\s+"), " "),
]
# What a run's own numbers decide, kept to its form: the table's hostname and verdict
# columns, a cell line's UNSTABLE tail, the stability line's count and the design line past
# its first clause (its notes come and go with the run).
VERDICTS = [
    (re.compile(r"^(cpu .* )\S+ FINISHED .*$"), r"\1HOST FINISHED VERDICT"),
    (re.compile(r", UNSTABLE: .*$"), ""),
    (re.compile(r"^stability: .*$"), "stability: VERDICT"),
    (re.compile(r"^(design: )(no cell re-measured|re-measured).*$"), r"\1CLAUSES"),  # clause by clause: below
    (re.compile(r"^(.*# cells on # engine\(s\), dtype )\S+: .*$"), r"\1DTYPE: WHY"),
    (re.compile(r"^machine: .+, vLLM \S+; engine dtype \S+: .+$"), "machine: DEVICE, vLLM VERSION; engine dtype DTYPE: WHY"),
    (re.compile(r" \(# periods pooled: #, # ms\)"), ""),
]


def shape(line: str) -> str:
    for pattern, replacement in SHAPES:
        line = pattern.sub(replacement, line)
    line = line.strip()
    for pattern, replacement in VERDICTS:
        line = pattern.sub(replacement, line)
    return line


def readme_sample() -> list[str]:
    """The README's sample console: the indented block that opens with a log line, without
    the progress bar (redrawn in place, not a line of the log)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if SAMPLE_START.match(line))
    block = []
    for line in lines[start:]:
        if not line.startswith("    ") and line.strip():
            break
        block.append(line[4:])
    return [line for line in block if line.strip() and not line.startswith("[")]


# Ray's start runs beside the sweep's planning (stages/sweep.py): which ends first is the
# machine's to decide, so its line is looked for anywhere, not in order.
ANY_ORDER = re.compile(r"Ray: started a local cluster")


def unmatched(sample: list[str], real: list[str]) -> list[str]:
    """The sample's lines whose shape is not found, in order, among the real lines' shapes."""
    shapes, at, missing = [shape(r) for r in real], 0, []
    for line in sample:
        wanted = shape(line)
        if ANY_ORDER.search(line):
            if wanted not in shapes:
                missing.append(f"{line!r} (shape {wanted!r})")
            continue
        found = next((i for i in range(at, len(shapes)) if shapes[i] == wanted), None)
        if found is None:
            missing.append(f"{line!r} (shape {wanted!r})")
        else:
            at = found + 1
    return missing


def test_the_shape_rule_keeps_the_format_and_drops_the_numbers():
    a = "05:46:58 INFO    [1/6] cpu/tiny-llama/eager/tp1 b1 ctx128: 7.787 ms/step, device 4.415 ms, host_frac 0.433"
    b = "11:02:13 INFO    [3/6] cpu/tiny-llama/eager/tp1 b2 ctx512: 3.1 ms/step, device 1.4 ms, host_frac 0.61"
    assert shape(a) == shape(b)
    assert shape(a) != shape(a.replace("host_frac", "host fraction"))
    assert shape(a + ", UNSTABLE: ci_width") == shape(a)  # the run decides the verdict, not the format
    assert unmatched(["x 1", "y 2"], ["y 3", "x 4"]) == ["'y 2' (shape 'y #')"]  # order counts


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, new_store):
    """The default study on the fake engine through the real command line: its console lines
    and its run directory."""
    tmp_path = tmp_path_factory.mktemp("console")
    uri = new_store(tmp_path / "mlflow.db")
    # the fake engine sleeps its modelled time (about 10 s in all): instant, its steps are 0
    result = run_hostsweep(["+sku=cpu", "engine.name=fake", "engine.dtype=float32", f"tracking.uri={uri}",
                            f"hydra.run.dir={tmp_path / 'run'}", "ray.exclusive=false"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines, tmp_path / "run"


def test_the_readme_sample_console_has_the_shape_of_a_real_run(real_run):
    sample = readme_sample()
    assert len(sample) > 15, "the README's sample console was not found"
    assert unmatched(sample, real_run[0]) == []


# Rows whose design line holds every clause design_line prints (report/summary.py): periods,
# warm-up, the canary with its tracking, a group note, a prefill-bound cell; and a re-measured group.
DESIGN_ROWS = [
    [{"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 4, "ctx": 512, "status": "FINISHED",
      "T": 33, "wall_1_ms": 300.0, "step_ms": 4.0, "periods": 1, "warmup_rounds": 2, "canary_ms": 1.647,
      "canary_shift_pct": 1.0, "canary_explains_pct": 30.0, "group_annotations": "machine_speed",
      "common_shift_pct": 18.0}],
    [{"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 1, "ctx": 128, "status": "FINISHED",
      "T": 33, "wall_1_ms": 10.0, "step_ms": 4.0, "periods": 2, "remeasured_for": "foreign_cpu",
      "warmup_rounds": 3, "canary_ms": 1.7, "canary_shift_pct": 12.0, "canary_explains_pct": 20.0}],
]


def clause_shapes(line: str) -> list[str]:
    return [shape(clause) for clause in line.removeprefix("design: ").split("; ")]


def test_every_clause_of_the_readme_design_line_is_one_the_code_prints_in_its_order(real_run):
    (readme_design,) = [line for line in readme_sample() if line.startswith("design: ")]
    printed = [clause_shapes(design_line(rows)) for rows in DESIGN_ROWS]
    printed += [clause_shapes(line) for line in real_run[0] if line.startswith("design: ")]
    order = printed[0]  # every kind of clause, in the order design_line writes them
    known = {clause for line in printed for clause in line}
    wanted = clause_shapes(readme_design)
    assert [clause for clause in wanted if clause not in known] == []
    at = [order.index(clause) for clause in wanted if clause in order]
    assert at == sorted(at)


def log_messages(path: Path) -> set[str]:
    """The messages of a run's hostsweep.log ('[time][logger][LEVEL] - message')."""
    return {line.split("] - ", 1)[1].strip() for line in path.read_text().splitlines() if "] - " in line}


CONSOLE_RECORD = re.compile(r"^\d\d:\d\d:\d\d \w+ +")  # the console's short log format (conf/config.yaml)


def test_hostsweep_log_holds_every_line_the_console_showed(real_run):
    lines, run_dir = real_run
    logged = log_messages(run_dir / "hostsweep.log")
    shown = [CONSOLE_RECORD.sub("", line).strip() for line in lines]
    assert any(line.startswith("design: ") for line in shown) and any(line.startswith("sku ") for line in shown)
    assert [line for line in shown if line not in logged] == []
