"""The documents keep their promises: links, anchors, cited Notes and files resolve, and the README stays short.

A document that cites a file, a heading or a Note makes sure it exists (STYLE.md, "Keep doing" 4): modules move, Notes
are renamed, headings are reworded, and a dead reference is found here rather than by a reader. Notes are the blocks
that hold an invariant spanning several files: defined once in runtime/ or tierstore/, at the start of a comment or
docstring line (the Note's name in square brackets after "Note:", then the text), and cited by name elsewhere.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
# What a user reads: no run labels, commit hashes or test-run history here (the notebook keeps those).
USER_DOCS = [README] + [DOCS / name for name in ("user-guide.md", "design.md", "benchmarks.md", "testing.md")]
NOTEBOOK = DOCS / "measurements-history.md"
GENERATED = DOCS / "config.md"  # written by runtime.config.loader.config_reference_markdown; checked in tests/unit/runtime/config
MAX_README_LINES = 250
SOURCE_DIRS = ("runtime", "tierstore", "tests", "examples")

NOTE = re.compile(r"\[Note:\s+([^\]]+?)\]")  # a name may wrap onto a comment's next line: see note_name
PLACEHOLDERS = {"...", "name"}  # how the documents write the syntax itself, no Note's name
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
RUN_LABEL = re.compile(r"\b[A-Z]\d{1,2}\b|\bcalls? [A-Z]\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
CITED_MD = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
BACKTICK_PATH = re.compile(r"`((?:runtime|tierstore|tests|examples)/[\w./-]*)`")
BACKTICK_MODULE = re.compile(r"`((?:runtime|tierstore)(?:\.\w+)+)`")


def markdown_files() -> list[Path]:
    """README.md and every docs/*.md."""
    return [README] + sorted(DOCS.glob("*.md"))


def source_files() -> list[Path]:
    """Python and YAML files of the code, the tests and the examples, this test excepted."""
    files = [p for d in SOURCE_DIRS for ext in ("*.py", "*.yaml") for p in (REPO / d).rglob(ext)]
    return sorted(p for p in files if p.resolve() != Path(__file__).resolve())


def note_name(raw: str) -> str:
    """A cited Note's name as one line: a name wrapped in a comment or docstring continues on the next line."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", raw).strip()


def notes_cited(text: str) -> set[str]:
    """The names of every Note the text mentions (cited or defined)."""
    return {note_name(m.group(1)) for m in NOTE.finditer(text)} - PLACEHOLDERS


def note_definitions() -> dict[str, list[Path]]:
    """Each Note's defining files: in runtime/ or tierstore/, a Note at the start of a comment or docstring line, then
    the end of the line or a sentence (a citation there would go on with lowercase words or a parenthesis)."""
    start = re.compile(r'^\s*(?:#\s*|[rR]?"""\s*)?\[Note:\s+([^\]]+)\](?:\s*$|\s+[A-Z])')
    found: dict[str, list[Path]] = {}
    for path in source_files():
        if path.parts[len(REPO.parts)] not in ("runtime", "tierstore"):
            continue
        for line in path.read_text().splitlines():
            m = start.match(line)
            if m:
                found.setdefault(m.group(1).strip(), []).append(path)
    return found


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are code, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, inline markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file whose target file or heading does not exist."""
    bad = []
    for m in LINK.finditer(prose(path.read_text())):
        target = m.group(1)
        if SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{path.name}: {target} (no such heading)")
    return bad


def test_readme_is_short() -> None:
    """The README is for a user deciding in five minutes; the rest lives in docs/."""
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, more than {MAX_README_LINES}: move the rest to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path) -> None:
    """Every relative link names a file that exists, and a heading of it where an anchor is given."""
    assert broken_links(path) == []


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    """The check itself: a missing file, a missing heading and a good link, told apart."""
    (tmp_path / "other.md").write_text("# Title\n\n## A `code` heading, with punctuation!\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-with-punctuation) [gone](missing.md) [bad](other.md#nowhere)\n"
                    "`[code](not-a-link.md)` [web](https://example.org/x.md) [self](#top)\n\n# Top\n")
    assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#nowhere (no such heading)"]


def test_every_cited_note_is_defined_once() -> None:
    """Every Note cited in the docs or the code is defined in runtime/ or tierstore/, and only once."""
    defined = note_definitions()
    twice = {name: [str(p.relative_to(REPO)) for p in paths] for name, paths in defined.items() if len(paths) > 1}
    assert twice == {}, f"Notes defined more than once: {twice}"
    undefined: dict[str, list[str]] = {}
    for path in markdown_files() + source_files():
        for name in notes_cited(path.read_text()) - set(defined):
            undefined.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert undefined == {}, f"Notes cited but defined nowhere: {undefined}"


def test_design_indexes_every_note_with_its_file() -> None:
    """docs/design.md's Note index has a row per Note naming the file that defines it."""
    rows = {}
    for line in (DOCS / "design.md").read_text().splitlines():
        m = re.match(r"\|\s*\[Note:\s+([^\]]+)\]\s*\|\s*`([^`]+)`\s*\|", line)
        if m:
            rows[m.group(1).strip()] = m.group(2)
    expected = {name: str(paths[0].relative_to(REPO)) for name, paths in note_definitions().items()}
    assert rows == expected


def test_design_maps_every_layer_of_the_import_contract() -> None:
    """docs/design.md's package map has a row for each layer of pyproject.toml's import-linter contract, and for
    every package under runtime/: the map and the checked contract stay one picture."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    modules = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    modules |= {f"runtime.{d.name}" for d in (REPO / "runtime").iterdir() if (d / "__init__.py").exists()}
    first_cells = re.findall(r"^\|([^|]*)\|", (DOCS / "design.md").read_text(), re.M)
    table = {path for cell in first_cells for path in re.findall(r"`(runtime/\w+(?:/|\.py))`", cell)}
    missing = sorted(m for m in modules
                     if f"{m.replace('.', '/')}/" not in table and f"{m.replace('.', '/')}.py" not in table)
    assert missing == []


def test_code_cites_only_documents_that_exist() -> None:
    """A comment or docstring that points at a .md file points at one in the repository (docs/design.md, not a
    DESIGN.md that lives outside it)."""
    missing = []
    for path in source_files():
        for m in CITED_MD.finditer(path.read_text()):
            cited = m.group(1)
            if not any((base / cited).exists() for base in (REPO, DOCS, path.parent)):
                missing.append(f"{path.relative_to(REPO)}: {cited}")
    assert missing == []


def _module_names(path: Path) -> set[str]:
    """The top-level names a module defines or imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _resolves(dotted: str) -> bool:
    """runtime.engine.kept_grads (a module or package) or runtime.checkpoint.state.save_checkpoint (a name in one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            rest = parts[cut:]
            return not rest or (len(rest) <= 2 and rest[0] in _module_names(module))
    return False


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_name_files_and_modules_that_exist(path: Path) -> None:
    """Paths (`runtime/engine/step_phase.py`) and modules (`runtime.planning.measured_placement`) the user documents
    name exist in the package layout of today."""
    text = path.read_text()
    missing = [p for p in BACKTICK_PATH.findall(text) if not (REPO / p.split(":")[0]).exists()]
    missing += [m for m in BACKTICK_MODULE.findall(text) if not _resolves(m)]
    assert missing == []


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_carry_no_run_labels_or_commit_hashes(path: Path) -> None:
    """Run labels (F1, Z8, call S) and commit hashes belong in docs/measurements-history.md, the notebook."""
    text = path.read_text()
    found = sorted({m.group(0) for m in RUN_LABEL.finditer(text)} | {m.group(0) for m in COMMIT.finditer(text)})
    assert found == [], f"{path.name}: {found} (move run-by-run material to {NOTEBOOK.name})"


def test_readme_sample_runs_on_this_machine(tmp_path: Path) -> None:
    """The README's offload() sample runs as written, here on the CPU when there is no GPU, with its own loop clipping."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    assert blocks, "README.md has no python sample"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
