"""The README's sample console keeps the shape of the console a sweep really prints: the
same line formats in the same order. A default-shaped sweep on the fake engine (instant,
through the real command line, Ray and MLflow) is run once; each line of the README's
sample, reduced to its shape (numbers, times, paths, ids and the words a run chooses among
made placeholders), must appear among the real console's shapes, in order."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    (re.compile(r"^(design: [^;]*);.*$"), r"\1"),
    (re.compile(r"^(design: )(no cell re-measured|re-measured).*$"), r"\1PERIODS"),
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


def unmatched(sample: list[str], real: list[str]) -> list[str]:
    """The sample's lines whose shape is not found, in order, among the real lines' shapes."""
    shapes, at, missing = [shape(r) for r in real], 0, []
    for line in sample:
        wanted = shape(line)
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


def test_the_readme_sample_console_has_the_shape_of_a_real_run(tmp_path, new_store):
    sample = readme_sample()
    assert len(sample) > 15, "the README's sample console was not found"
    uri = new_store(tmp_path / "mlflow.db")
    # the fake engine sleeps its modelled time (about 10 s in all): instant, its steps are 0
    result = run_hostsweep(["+sku=cpu", "engine.name=fake", "engine.dtype=float32", f"tracking.uri={uri}",
                            f"hydra.run.dir={tmp_path / 'run'}", "ray.exclusive=false"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    real = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert unmatched(sample, real) == []
