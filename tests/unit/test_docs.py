"""The documentation holds together: every relative link in the README, docs/ and
benchmarks/RESULTS.md reaches a file that exists (and a heading of it, when the link names
one), and no path of one particular machine is written into them."""
from __future__ import annotations

import ast
import functools
import re
import subprocess
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


# ---------------------------------------------------------------------------------------
# Names the docs give exist in the code: config keys, stages, presets and other shipped
# options, columns and metrics. One direction only (a name in the docs must exist), so a
# column or key added to the code does not fail this; one renamed or removed does.

PROSE_DOCS = [p for p in DOCS if p.name != "RESULTS.md"]  # RESULTS.md is a dated log of older code too
SOURCES = [*(ROOT / "hostsweep").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
# The dotted names of other libraries that read like config sections (ray.init is Ray's,
# not the `ray` section's), and files whose name starts like a section (fit.json).
NOT_CONFIG = {"ray.init", "ray.shutdown", "ray.cluster_utils", "ray.cluster_utils.Cluster", "ray.get",
              "ray.remote", "ray.util", "ray.kill"}
FILE_SUFFIX = re.compile(r"\.(md|html|json|jsonl|csv|ya?ml|py|png|log|txt|db|toml|gz|env)$")
# Wrong on purpose: the docs show how a typo is refused.
TYPO_EXAMPLES = {"measure.Tt"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# `group=option` (also `+group=`), `models=[a,b]` and the like.
OPTION = re.compile(r"(?<![\w.])\+{0,2}(sku|skus|model|models|mode|modes|experiment|calibration|stage)=([\w.,\[\]-]+)")
DOTTED = re.compile(r"(?<![\w./:@-])\+{0,2}((?:measure|split|linearity|engine|ray|tracking|faults|output|report|select"
                    r"|fit|compare|diff|debug|model|mode|sku|calibration)(?:\.[A-Za-z_][\w]*)+)(?![\w(/-])")
# A name quoted as a column, a metric, a tag or a param: snake_case with at least one underscore.
SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_(?:[A-Za-z0-9]+|<[a-z_]+>|\*))+$")
# Quoted snake_case names that are not hostsweep's: vLLM's, torch's and Python's, or words of
# a sentence written in code style.
NOT_HOSTSWEEP = {
    "enable_prefix_caching", "ignore_eos", "distributed_executor_backend", "worker_extension_cls",
    "speculative_config", "num_speculative_tokens", "compilation_config", "gpu_model_runner",
    "load_format", "record_function", "record_function_or_nullcontext", "start_profile", "stop_profile",
    "shm_allreduce", "static_scaled_fp8_quant", "torch_profiler_dir", "profiler_config", "log_to_driver",
    "include_dashboard", "cuda_graph_sizes", "max_num_batched_tokens", "sample_tokens",
    "process_outputs", "get_output", "update_after_schedule", "allocate_slots", "make_cached_request_data",
    "all_reduce", "set_terminated", "log_batch", "create_run", "search_runs", "delete_run", "log_text",
    "latest_metrics", "filter_string", "workflow_type", "vllm_dist_", "gc_collect", "user_annotation",
    "cpu_op", "kernel_launch", "cuda_runtime", "pr_set_pdeathsig", "sched_idle", "omp_num_threads",
    "get_run", "benchmark_report", "output_json", "psm_*",
}
# The bullets of docs/mlflow.md that list a run's names in plain words.
NAME_LISTS = re.compile(r"^- \*\*(params|metrics|tags)\*\*:")


def code_spans(path: Path) -> list[str]:
    """Inline code of a document, and the lines of its code blocks."""
    spans, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            spans.append(line)
        else:
            spans += CODE_SPAN.findall(line)
    return spans


@functools.lru_cache(maxsize=1)
def names_in_code() -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
    """Every identifier-like string, name, attribute, argument and keyword of hostsweep's
    and the benchmarks' source, and the keys of conf/; f-strings (f"phase_{name}_ms") as
    patterns."""
    names: set[str] = set()
    patterns: list[re.Pattern] = []
    for source in SOURCES:
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"[A-Za-z_][\w]*", node.value))
            elif isinstance(node, ast.JoinedStr):
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else r"[\w.-]+" for v in node.values]
                literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if len(re.sub(r"\W", "", literal)) >= 3:
                    patterns.append(re.compile("".join(parts)))
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    for test in (ROOT / "tests").rglob("test_*.py"):  # the docs name tests too
        names.update(re.findall(r"^\s*def (test_\w+)", test.read_text(encoding="utf-8"), re.M))
    for conf in [*(ROOT / "conf").rglob("*.yaml"), ROOT / "ray_cluster.yaml"]:
        names.update(re.findall(r"^\s*([\w-]+):", conf.read_text(encoding="utf-8"), re.M))
    return frozenset(names), tuple(patterns)


def in_code(name: str) -> bool:
    names, patterns = names_in_code()
    if name in names:
        return True
    if "*" in name:  # spec_*: some name of the code starts so
        prefix = name.split("*")[0]
        return any(n.startswith(prefix) and n != prefix for n in names)
    concrete = re.sub(r"<[a-z_]+>", "x", name)  # phase_<name>_ms: an f-string of the code makes it
    return concrete in names or any(p.fullmatch(concrete) for p in patterns)


@functools.lru_cache(maxsize=1)
def flags_in_code() -> frozenset[str]:
    """The command-line flags hostsweep's and the benchmarks' parsers define (`--train-tp`)."""
    flags = set()
    for source in SOURCES:
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"--[a-z][\w-]*", node.value):
                flags.add(node.value)
    return frozenset(flags)


# A command of hostsweep's own: `hostsweep-model ...` or `python benchmarks/<script>.py ...`.
OWN_COMMAND = re.compile(r"hostsweep-model\b|benchmarks/\w+\.py\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def stages() -> set[str]:
    return {p.stem for p in (ROOT / "hostsweep" / "stages").glob("*.py") if p.stem != "__init__"}


def options(group: str) -> set[str]:
    if group == "stage":
        return stages()
    folder = {"skus": "sku", "models": "model", "modes": "mode"}.get(group, group)
    return {p.stem for p in (ROOT / "conf" / folder).glob("*.yaml")}


def unknown_names(path: Path) -> list[str]:
    """The config keys, shipped options, stages and quoted snake_case names of one document
    that the code does not have."""
    from hostsweep.config.keys import unknown_part

    unknown = []
    for span in code_spans(path):
        for group, value in OPTION.findall(span):
            for option in value.strip("[]").split(","):
                placeholder = re.search(r"[<>…]|\.\.\.|^[A-Z_]+$", option)
                if option and not placeholder and option not in options(group):
                    unknown.append(f"{group}={option}")
        for key in DOTTED.findall(span):
            if key in NOT_CONFIG or key in TYPO_EXAMPLES or FILE_SUFFIX.search(key):
                continue
            if unknown_part(key.rstrip(".")) is not None:
                unknown.append(key)
        if OWN_COMMAND.search(span):
            command = span[OWN_COMMAND.search(span).start():].split("#")[0]  # not a comment's words
            unknown += [flag for flag in FLAG.findall(command) if flag not in flags_in_code()]
        name = span.strip()
        if SNAKE.match(name) and name.lower() not in NOT_HOSTSWEEP and not in_code(name):
            unknown.append(name)
    for name in listed_names(path):
        if name.lower() not in NOT_HOSTSWEEP and not in_code(name):
            unknown.append(name)
    return unknown


def listed_names(path: Path) -> list[str]:
    """The snake_case words of the `- **params**:` / `**metrics**:` / `**tags**:` bullets."""
    names, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("- ") or not line.strip():
            inside = bool(NAME_LISTS.match(line))
        if inside:
            prose = re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)|\([^)]*\)", " ", line)
            names += [w for w in re.findall(r"[A-Za-z_][\w*<>]*", prose) if SNAKE.match(w)]
    return names


@pytest.mark.parametrize("path", PROSE_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_name_the_docs_give_exists_in_the_code(path: Path):
    assert unknown_names(path) == []


@pytest.mark.parametrize("text, unknown", [
    ("`measure.reps=20` and `split.enabled` and `+engine.engine_args.block_size=32`", []),
    ("`measure.repz=20`", ["measure.repz"]),
    ("`stage=diff` `stage=fitt`", ["stage=fitt"]),
    ("    python -m hostsweep +experiment=generalize-cpu models=[tiny-llama,huge-llama]", ["models=huge-llama"]),
    ("`+experiment=<name>` `fit.json` `report.html` `ray.init`", []),
    ("`step_ms`, `phase_<name>_ms`, `spec_*`", []),
    ("`step_msec`", ["step_msec"]),
    ("    hostsweep-model fit --cells a.csv --train-tp 2 --trian-sku h100   # --not-a-flag in a comment",
     ["--trian-sku"]),
    ("- **metrics**: step_ms, host_frac and\n  wall_T_ms, step_msec;\n\nnot_listed_here", ["step_msec"]),
])
def test_unknown_names_are_caught(tmp_path: Path, text: str, unknown: list[str]):
    page = tmp_path / "page.md"
    page.write_text(text + "\n", encoding="utf-8")
    assert unknown_names(page) == unknown


# ---------------------------------------------------------------------------------------
# docs/development.md maps every module of the package, one line each, from the first
# sentence of its docstring. Rewrite the table with `python tests/unit/test_docs.py --write`.

DEVELOPMENT = ROOT / "docs" / "development.md"
MAP_ROW = re.compile(r"^\| `(hostsweep/[\w/]+\.py)` \|")


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    doc = re.sub(r"(?<=\w)-\n\s*(?=\w)", "-", doc)  # a word hyphenated across lines
    sentence = re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0]
    head = sentence.split(": ", 1)[0]
    if len(sentence) > 200 and head != sentence and len(head) >= 20:  # a long one: what comes before its colon
        sentence = head + "."
    return sentence.replace("|", "\\|")


def modules() -> list[Path]:
    """The package's modules: those git tracks in a checkout (a module being written and not
    yet added is not mapped yet), else every one on disk."""
    try:
        listed = subprocess.run(["git", "ls-files", "hostsweep"], cwd=ROOT, capture_output=True, text=True,
                                check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    paths = [ROOT / name for name in listed if name.endswith(".py")] or list((ROOT / "hostsweep").rglob("*.py"))
    return sorted(p for p in paths if p.exists() and "__pycache__" not in p.parts)


def module_map() -> str:
    """The module map's table, as docs/development.md holds it."""
    rows = ["| module | what it is for |", "|---|---|"]
    rows += [f"| `{p.relative_to(ROOT).as_posix()}` | {first_sentence(p)} |" for p in modules()]
    return "\n".join(rows) + "\n"


def test_every_module_is_in_the_module_map():
    mapped = [m.group(1) for line in DEVELOPMENT.read_text(encoding="utf-8").splitlines()
              if (m := MAP_ROW.match(line))]
    on_disk = [p.relative_to(ROOT).as_posix() for p in modules()]
    missing, gone = sorted(set(on_disk) - set(mapped)), sorted(set(mapped) - set(on_disk))
    assert (missing, gone) == ([], []), "regenerate the table: python tests/unit/test_docs.py --write"


def write_module_map() -> None:
    """Rewrite the module map's table in docs/development.md from the docstrings."""
    text = DEVELOPMENT.read_text(encoding="utf-8")
    start = text.index("| module | what it is for |")
    end = text.index("\n\n", start) + 1
    DEVELOPMENT.write_text(text[:start] + module_map() + text[end:], encoding="utf-8")


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv[1:]:
        write_module_map()
    else:
        print(module_map(), end="")


# ---------------------------------------------------------------------------------------
# The README quotes measurements from benchmarks/RESULTS.md by linking the entry's section
# in the sentence that quotes it: every number of that sentence is in that section.

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
NUMBER = re.compile(r"\d{4}-\d{2}-\d{2}|\d+(?:,\d{3})*(?:\.\d+)?")
SENTENCE_END = re.compile(r"[.!?]\s+(?=[A-Z(*])")


def section(path: Path, anchor: str) -> str:
    """The text under the heading with this anchor, down to the next heading of its level or above."""
    lines, taken, level, seen = path.read_text(encoding="utf-8").splitlines(), [], None, {}
    for line in lines:
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            name = base if base not in seen else f"{base}-{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
            if level is not None and len(match.group(1)) <= level:
                break
            if name == anchor:
                level = len(match.group(1))
        if level is not None:
            taken.append(line)
    return "\n".join(taken)


def numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def quotes(path: Path) -> list[tuple[str, str]]:
    """(sentence, RESULTS.md anchor) for each sentence of a paragraph that links an entry."""
    found = []
    prose = "\n".join(prose_lines(path.read_text(encoding="utf-8")))
    for paragraph in re.split(r"\n\n|\n(?=[-*] |\d+\. )", prose):  # list items are paragraphs of their own
        text = " ".join(paragraph.split())
        for match in LINK.finditer(text):
            file_part, _, anchor = match.group(2).partition("#")
            if file_part.endswith("RESULTS.md") and anchor:
                begin = max([0, *(m.end() for m in SENTENCE_END.finditer(text, 0, match.start()))])
                found.append((LINK.sub(" ", text[begin:match.start()]), anchor))
    return found


def unquoted_numbers(path: Path) -> list[str]:
    missing = []
    for sentence, anchor in quotes(path):
        entry = numbers(section(RESULTS, anchor))
        missing += [f"{n} (#{anchor})" for n in sorted(numbers(sentence) - entry)]
    return missing


def test_the_readme_quotes_results_as_they_stand():
    assert quotes(ROOT / "README.md"), "the README quotes no entry of benchmarks/RESULTS.md"
    assert unquoted_numbers(ROOT / "README.md") == []


def test_a_misquoted_number_is_caught(tmp_path: Path):
    page = tmp_path / "README.md"
    page.write_text("Intro 99. The suite took 19 min 32 s for 1,090 tests and 7.5 more "
                    "([measured](benchmarks/RESULTS.md#test-suite)).\n", encoding="utf-8")
    assert unquoted_numbers(page) == ["7.5 (#test-suite)"]
