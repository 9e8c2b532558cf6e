"""No function of the project outside tests/ nests its blocks deeper than 5 levels (read with `ast`): each `if`,
`for`, `while`, `with`, `try`, `except`, `match` and nested `def` or `class` inside a function is one level, an
`elif` is at its `if`'s level. Deeper code is a function waiting to be extracted (or an early return). The
exceptions are listed below, each with its reason; one that has become shallow fails too, so the list cannot go
stale."""
import ast
from pathlib import Path

from helpers import REPO as ROOT, parsed_code

LIMIT = 5
EXCEPTIONS = {
}
BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.ExceptHandler, ast.Match,
          ast.match_case, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def depth(node: ast.AST, level: int = 0) -> int:
    """The deepest block level under `node`, which is at `level`."""
    deepest = level
    for child in ast.iter_child_nodes(node):
        is_elif = isinstance(child, ast.If) and isinstance(node, ast.If) and node.orelse == [child]
        deeper = isinstance(child, BLOCKS) and not is_elif
        deepest = max(deepest, depth(child, level + deeper))
    return deepest


def deep_functions(root: Path = ROOT) -> dict:
    """{"path:function": depth} of every top-level function and method nested deeper than LIMIT; scripts/ is
    read too, tests/ is not."""
    out = {}
    for path, tree in parsed_code(root):
        functions = [node for top in tree.body for node in ([top] + (top.body if isinstance(top, ast.ClassDef) else []))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in functions:
            levels = depth(node)
            if levels > LIMIT:
                out[f"{path.relative_to(root)}:{node.name}"] = levels
    return out


def test_no_function_nests_deeper_than_5_levels():
    found = deep_functions()
    new = {name: levels for name, levels in found.items() if name not in EXCEPTIONS}
    assert not new, f"functions nested deeper than {LIMIT} levels (extract a function, return early, or list one " \
                    f"in EXCEPTIONS with its reason): {new}"
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"EXCEPTIONS lists functions no longer nested deeper than {LIMIT} levels: {stale}"


def test_a_deep_function_is_caught(tmp_path):
    """Six levels are caught, five are not; an elif chain is one level."""
    (tmp_path / "data").mkdir()
    five = "def fine(x):\n" + "".join("    " * (i + 1) + f"for a{i} in x:\n" for i in range(4)) + \
        "    " * 5 + "if a0:\n" + "    " * 6 + "pass\n" + "    " * 5 + "elif a1:\n" + "    " * 6 + "pass\n"
    six = "def deep(x):\n" + "".join("    " * (i + 1) + f"for a{i} in x:\n" for i in range(6)) + "    " * 7 + "pass\n"
    (tmp_path / "data" / "nest.py").write_text(five + "\n\n" + six)
    assert deep_functions(tmp_path) == {"data/nest.py:deep": 6}
