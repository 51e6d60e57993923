"""The docs name what exists, and nothing cites what a reader of the repository cannot open.

- Every repository path (``tests/...``, ``amp_patch/...``, ``docs/...``, ...), every
  relative link and every ``amp_patch.*`` dotted name in README.md, docs/*.md and the
  requirements files exists.
- docs/design.md's layer table is the one ``tools/layers_doc.py`` generates from
  ``LAYERS`` in tools/check_imports.py, and each module it names exists.
- No code, test or doc cites an issue or task number of this project, or a document
  outside the repository: the docs are the reference (cite ``docs/`` files).

Each checker is also run on a made-up broken text, so that none can pass vacuously.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted(ROOT.glob("requirements*.txt"))]

#: The top-level folders whose paths the docs may name.
_TOP = ("tests", "amp_patch", "benchmarks", "tools", "docs", "csrc", "examples")
_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(_TOP) + r")/[\w./*{},-]*)")
_DOTTED = re.compile(r"(?<![\w./-])amp_patch(?:\.\w+)+")
#: Paths the docs name that are, rightly, not in the repository: what each stands for.
NOT_IN_THE_REPOSITORY = {
    "amp_patch/_csrc": "csrc/ as an installed package ships it (setup.py)",
    "amp_patch/optim/fused/foo.py": "the file a contributor adds for a new fused optimizer",
    "examples/dcgan/main_amp.py": "a script of Apex's repository",
    "examples/imagenet/main_amp.py": "a script of Apex's repository",
}
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A citation of this project's issues or tasks, or of a document outside the repository.
_CITATION = re.compile(
    r"\b(?:issue|task)s?\s*(?:#|no\.?\s*)?\d+"  # issue 24, Issue #12, tasks 3
    r"|(?<![\w&/])#\d{1,5}\b(?![\w.])"  # a bare #123
    r"|\bshared/docs\b|\.\./shared\b",
    re.IGNORECASE)
#: Where the citation check looks: code, tests, docs, build files.
_SCANNED_DIRS = ("amp_patch", "tests", "tools", "benchmarks", "docs", "examples", "csrc")
_SCANNED_SUFFIXES = {".py", ".pyi", ".md", ".txt", ".toml", ".cfg", ".sh", ".cpp", ".h",
                     ".cu", ".cuh", ".yml", ".yaml"}
_SCANNED_TOP = ("README.md", "CHANGELOG.md", "Makefile", "setup.py", "pyproject.toml",
                "conftest.py", *(p.name for p in ROOT.glob("requirements*.txt")))


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` as ``a/b.py`` and ``a/c.py``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [out for part in match.group(1).split(",")
            for out in _expand(path[:match.start()] + part + path[match.end():])]


def _path_exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    # A module path without its suffix (`distributed/teardown`, as a table writes it).
    return any((ROOT / path).with_suffix(s).exists() or (ROOT / path).exists()
               for s in ("", ".py", ".pyi", ".md"))


def _dotted_exists(name: str) -> bool:
    """``amp_patch.a.b.Name.attr``: the longest prefix that is a module, then attributes."""
    parts = name.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        if base.is_dir() or base.with_suffix(".py").is_file() or base.with_suffix(".pyi").is_file():
            break
    else:
        return False
    if cut == len(parts):
        return True
    try:
        obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
        return False
    for attr in parts[cut:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def missing_names(text: str, page: Path) -> list[str]:
    """The paths, relative links and ``amp_patch.*`` names in ``text`` that do not exist."""
    problems = []
    for match in _PATH.finditer(text):
        for path in _expand(match.group(1).rstrip(".,:;")):
            if path not in NOT_IN_THE_REPOSITORY and not _path_exists(path):
                problems.append(f"path {path}")
    for match in _LINK.finditer(text):
        target = match.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            problems.append(f"link {target}")
    for match in _DOTTED.finditer(text):
        if not _dotted_exists(match.group(0)):
            problems.append(f"name {match.group(0)}")
    return problems


def citations(text: str) -> list[str]:
    """The citations of an issue or task number, or of an outside document, in ``text``."""
    return [m.group(0) for m in _CITATION.finditer(text)]


def _scanned_files() -> list[Path]:
    files = [ROOT / name for name in _SCANNED_TOP if (ROOT / name).is_file()]
    for top in _SCANNED_DIRS:
        files += [p for p in sorted((ROOT / top).rglob("*"))
                  if p.suffix in _SCANNED_SUFFIXES and p.is_file()
                  and "__pycache__" not in p.parts and p != Path(__file__).resolve()]
    return files


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_named_in_the_docs_exists(page: Path):
    assert missing_names(page.read_text(encoding="utf-8"), page) == []


def test_the_paths_outside_the_repository_are_named_in_the_docs():
    text = "".join(page.read_text(encoding="utf-8") for page in PAGES)
    assert [p for p in NOT_IN_THE_REPOSITORY if p not in text] == []


def test_the_checks_catch_a_broken_path_link_and_module():
    page = ROOT / "docs" / "design.md"
    text = ("See tests/no_such_test.py, [this](no_such_page.md), `amp_patch.no_such_module` "
            "and `amp_patch.scaler.NoSuchClass`; tests/test_docs.py and [api](api.md) exist, "
            "and so do `amp_patch.scaler.AmpScaler` and csrc/{cpu,cuda}.")
    assert missing_names(text, page) == [
        "path tests/no_such_test.py", "link no_such_page.md", "name amp_patch.no_such_module",
        "name amp_patch.scaler.NoSuchClass"]


def test_nothing_cites_an_issue_number_or_an_outside_document():
    found = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for line_no, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{line_no}: {c}" for c in citations(line)]
    assert found == []


@pytest.mark.parametrize("text", [
    "The lean state (issue 24) trains.", "see Issue #12", "after task 7", "fixed in #123",
    "as ../shared/docs/SPEC.md says", "per shared/docs/ARCHITECTURE.md"])
def test_the_citation_check_catches(text: str):
    assert citations(text)


@pytest.mark.parametrize("text", [
    "#include <ATen/ATen.h>", "the issue's tolerance", "color #fff", "x = y  # 2 ranks",
    "docs/design.md, Loss scaling", "sm_90 #pragma unroll 4"])
def test_the_citation_check_passes(text: str):
    assert citations(text) == []


def _layers_doc():
    tool = ROOT / "tools" / "layers_doc.py"
    spec = importlib.util.spec_from_file_location("layers_doc", tool)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_design_layer_table_is_generated_from_layers():
    tool = _layers_doc()
    page = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert tool.splice(page, tool.render()) == page, "run python tools/layers_doc.py"


def test_every_module_of_the_layer_table_exists():
    tool = _layers_doc()
    assert tool.missing() == []
    assert tool.missing(ROOT / "tests") != []  # the check can fail
