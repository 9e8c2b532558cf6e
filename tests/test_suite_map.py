"""A newcomer finds the test of a module: tests/README.md maps every source module to its test files, and the
test modules share code through conftest.py and helpers.py only, never by importing one another."""
import ast
import re

from helpers import REPO, project_modules

TESTS = REPO / "tests"
ROW = re.compile(r"^\| `([^`]+)` \| (.+) \|$")


def table() -> tuple:
    """(module path -> the test files its row names, none for a row that says why: `— (...)`; the files of the
    list of tests of the project as a whole)."""
    rows, whole = {}, set()
    for line in (TESTS / "README.md").read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            cell = match.group(2)
            rows[match.group(1)] = [] if cell.startswith("— (") else [t.strip() for t in cell.split(",")]
        elif line.startswith("- test_"):
            whole.add(line[2:].split(":")[0])
    return rows, whole


def test_every_source_module_has_a_row_and_every_named_test_file_exists():
    rows, whole = table()
    modules = {str(path.relative_to(REPO)) for _, _, path in project_modules()}
    assert sorted(modules - set(rows)) == [], "add these modules to the table in tests/README.md"
    assert sorted(set(rows) - modules) == [], "tests/README.md names modules that are gone"
    named = {t for tests in rows.values() for t in tests} | whole
    assert sorted(t for t in named if not (TESTS / t).is_file()) == []
    assert sorted({p.name for p in TESTS.glob("test_*.py")} - named) == [], "test files tests/README.md does not name"


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[-1].startswith("test_") and n.split(".")[-1] != path.stem]  # itself: fine
    assert found == []


def test_the_files_make_test_starts_first_exist():
    from conftest import HEAVY_FIRST

    assert sorted(name for name in HEAVY_FIRST if not (TESTS / name).is_file()) == []
