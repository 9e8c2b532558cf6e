"""No function of the project outside tests/ is longer than 80 lines (read with `ast`, from its `def` to its last
line, docstring included): a longer one does several things a reader has to hold at once. The exceptions are
listed below, each with its reason; one that has become short fails too, so the list cannot go stale."""
import ast
from pathlib import Path

from helpers import REPO as ROOT, parsed_code

LIMIT = 80
EXCEPTIONS = {
}


def long_functions(root: Path = ROOT) -> dict:
    """{"path:function": lines} of every function (methods and nested ones too) over LIMIT lines; scripts/ is
    read too, tests/ is not."""
    out = {}
    for path, tree in parsed_code(root):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    out[f"{path.relative_to(root)}:{node.name}"] = lines
    return out


def test_no_function_is_over_80_lines():
    found = long_functions()
    new = {name: lines for name, lines in found.items() if name not in EXCEPTIONS}
    assert not new, f"functions over {LIMIT} lines (split them, or list one in EXCEPTIONS with its reason): {new}"
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"EXCEPTIONS lists functions that are no longer over {LIMIT} lines: {stale}"


def test_a_long_function_is_caught(tmp_path):
    """An 81-line function is caught, an 80-line one is not."""
    (tmp_path / "data").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (tmp_path / "data" / "long.py").write_text(f"def fine():\n{body}\n\ndef long():\n{body}    return 0\n")
    assert long_functions(tmp_path) == {"data/long.py:long": 81}
