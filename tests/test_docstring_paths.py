"""Every file or module path a docstring or comment of ours names exists: a renamed or moved module leaves no
reference behind, and a ``module.name`` reference names something the module defines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.harness import REPO

PACKAGE = REPO / "titan_simple"
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"train"}
TOP_FOLDERS = {"tests", "scripts", "docs", "configs", "assets"}
# ``core/step.py``, ``compile/regions.run_in_regions``, ``docs/benchmarks.md``: a folder of ours, then a path
SLASHED = re.compile(r"(?<![\w./-])(?:titan_simple/)?([a-z_]+)/([A-Za-z_0-9/]+)(\.(?:py|md|toml|sh|slurm|json))?"
                     r"(?:\.([A-Za-z_]\w*))?")
DOTTED = re.compile(r"\btitan_simple(?:\.[a-z_0-9]+)+")


def _comments_and_docstrings(path: Path) -> Iterator[str]:
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if docstring := ast.get_docstring(node, clean=False):
                yield docstring
    yield from (line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


def _slashed_exists(folder: str, rest: str, extension: str | None, name: str | None) -> bool:
    if folder in SUBPACKAGES:
        module = (PACKAGE / folder / rest).with_suffix(".py")
        if not module.exists():
            return (PACKAGE / folder / rest).is_dir()
        return name is None or extension is not None or _defines(module, name)
    if folder in TOP_FOLDERS:
        path = REPO / folder / rest
        return path.with_suffix(extension).exists() if extension else path.exists() or path.with_suffix(".py").exists()
    return True  # not ours (torch/..., a URL's path)


def _defines(module: Path, name: str) -> bool:
    """``module`` defines ``name`` (a function, class, method or module-level name)."""
    return re.search(rf"^\s*(?:def|class) {name}\b|^{name}\s*[:=]", module.read_text(), re.MULTILINE) is not None


def _dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    return any(REPO.joinpath(*parts[:k]).with_suffix(".py").exists() or (REPO.joinpath(*parts[:k]) / "__init__.py")
               .exists() for k in range(len(parts), 1, -1))


def test_every_path_a_docstring_or_comment_names_exists():
    files = [*PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py"), *(REPO / "tests").glob("*.py"),
             REPO / "train.py"]
    missing = set()
    for path in files:
        for text in _comments_and_docstrings(path):
            for match in SLASHED.finditer(text):
                if "TorchTitan" in text[max(0, match.start() - 20):match.start()]:  # TorchTitan's own files
                    continue
                if not _slashed_exists(*match.groups()):
                    missing.add(f"{path.relative_to(REPO)}: {match.group(0)}")
            missing |= {f"{path.relative_to(REPO)}: {d}" for d in DOTTED.findall(text) if not _dotted_exists(d)}
    assert sorted(missing) == []
