"""How many tests assert numbers of training: losses, gradients (and their norms), collective counts, or resumes bit
for bit. The count docs/testing.md lists before and after a change to the suite's structure, taken the same way on
both trees.

    .venv/bin/python scripts/benchmarks/count_number_tests.py [CHECKOUT] [--ids]

A test counts in a kind when an ``assert`` in its body, or in a function or fixture of its module that it calls or
takes (followed through the module, any depth), names it: a name, attribute or string holding ``loss`` (losses),
``grad`` or ``norm`` (gradients), ``collective``, ``comm_plan``, ``all_gather``, ``reduce_scatter``,
``all_reduce`` (collective counts), or a ``==`` of logged losses / a comparison called bitwise or resume
(``bitwise=True``, ``resum``: bitwise resumes); ``assert_parity`` counts as losses and gradients. Parametrized
cases count once per case (pytest's collection, ``--collect-only``). A static reading, not a proof: the same
reading on both trees is what makes the counts comparable.
"""

from __future__ import annotations

import argparse
import ast
import collections
import subprocess
import sys
from pathlib import Path

KINDS = {
    "losses": ("loss",),
    "gradients": ("grad", "norm"),
    "collective counts": ("collective", "comm_plan", "all_gather", "reduce_scatter", "all_reduce"),
    "bitwise resumes": ("bitwise", "resum"),
}


def _words(node: ast.AST) -> set[str]:
    words = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            words.add(child.id.lower())
        elif isinstance(child, ast.Attribute):
            words.add(child.attr.lower())
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            words.add(child.value.lower())
        elif isinstance(child, ast.keyword) and child.arg:
            words.add(child.arg.lower())
    return words


def _kinds_of(words: set[str]) -> set[str]:
    found = {kind for kind, stems in KINDS.items() if any(stem in word for word in words for stem in stems)}
    if "assert_parity" in words:
        found |= {"losses", "gradients"}
    return found


def module_kinds(path: Path) -> dict[str, set[str]]:
    """test function name -> the kinds its asserts (and its module's helpers and fixtures it reaches) compare."""
    tree = ast.parse(path.read_text())
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    own: dict[str, set[str]] = {}
    reaches: dict[str, set[str]] = {}
    for name, node in functions.items():
        asserts = [n for n in ast.walk(node) if isinstance(n, ast.Assert)]
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        words = set().union(*(_words(a) for a in asserts)) if asserts else set()
        words |= {w for c in calls if isinstance(c.func, ast.Name) and c.func.id == "assert_parity"
                  for w in ("assert_parity",)}
        own[name] = _kinds_of(words)
        called = {c.func.id for c in calls if isinstance(c.func, ast.Name)}
        called |= {a.arg for a in node.args.args}  # fixtures it takes
        reaches[name] = {c for c in called if c in functions and c != name}
    result = {}
    for name in functions:
        if not name.startswith("test_"):
            continue
        seen, stack, kinds = set(), [name], set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            kinds |= own[current]
            stack.extend(reaches[current])
        result[name] = kinds
    return result


def collected_ids(checkout: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=checkout, capture_output=True, text=True, check=False)
    return [line for line in done.stdout.splitlines() if "::" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, nargs="?", default=Path(__file__).resolve().parents[2])
    parser.add_argument("--ids", action="store_true", help="list every counted test id with its kinds")
    args = parser.parse_args()
    kinds_by_file = {path.name: module_kinds(path) for path in sorted((args.checkout / "tests").glob("test_*.py"))}
    counts: collections.Counter = collections.Counter()
    ids = collected_ids(args.checkout)
    for test_id in ids:
        file, _, rest = test_id.partition("::")
        function = rest.split("[")[0].split("::")[-1]
        kinds = kinds_by_file.get(Path(file).name, {}).get(function, set())
        counts["any"] += bool(kinds)
        for kind in kinds:
            counts[kind] += 1
        if args.ids and kinds:
            print(f"{test_id}\t{', '.join(sorted(kinds))}")
    print(f"{len(ids)} tests collected; {counts['any']} compare numbers of training: " + ", ".join(
        f"{kind} {counts[kind]}" for kind in KINDS))


if __name__ == "__main__":
    main()
