"""Imports point only down: every module of the project, read with `ast` (imports inside functions too), may
import its own layer or the layers below it, never one above. The README's layout section draws this table.

    0 base        base/ (errors, config schema and validation, plug-in registries, paths, checkpoints), boot.py
    1 pipeline    data/, planner/, kernels/, adapters/
    2 models      models/
    3 objectives  objectives/
    4 evaluation  evaluation/
    5 trainer     trainer/, distributed/
    6 entry       train.py, prepare.py, generate.py, harness.py, plugins.py, builders/, sweeps/, a package's
                  __main__.py (python -m evaluation, python -m recipe),
                  benchmarks/, parity/, recipe/

Inside a layer, no two folders may import each other (a folder-level cycle); inside a folder, no modules import
each other round a circle (a module-level cycle: which one loads first decides what the other sees, so the
circle is hidden by imports inside functions); and the plug-ins are found through base/registry.py, never
imported by the layers below them.
"""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import project_modules

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "base": 0, "boot": 0,
    "data": 1, "planner": 1, "kernels": 1, "adapters": 1,
    "models": 2,
    "objectives": 3,
    "evaluation": 4,
    "trainer": 5, "distributed": 5,
    "train": 6, "prepare": 6, "generate": 6, "harness": 6, "plugins": 6, "builders": 6,
    "sweeps": 6, "benchmarks": 6, "recipe": 6, "parity": 6,
}
NAMES = {layer: name for name, layer in
         {"base": 0, "pipeline": 1, "models": 2, "objectives": 3, "evaluation": 4, "trainer": 5, "entry": 6}.items()}


def family_internals() -> tuple:
    """Every registered family's internals (models.<family>.*, read from base/registry.py FAMILIES): outside its
    folder only entry points reach them (through the family's package and models/common/ otherwise)."""
    import models  # noqa: F401  (registers the families)
    from base.registry import FAMILIES

    return tuple(f"models.{name}." for name in FAMILIES)


def imports_of(path: Path, dotted: str):
    """(imported module, line) for every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from models import llama` imports models.llama
                yield (f"{base}.{alias.name}" if base else alias.name), node.lineno


def module_cycles(root: Path = ROOT) -> list:
    """Every circle of imports between the modules of one top-level folder (its strongly connected components of
    two modules or more), each as its modules sorted; an import names the longest project module it starts with."""
    modules = {dotted: (top, path) for top, dotted, path in project_modules(root)}
    edges = defaultdict(set)
    for dotted, (top, path) in modules.items():
        for module, _ in imports_of(path, dotted):
            parts = module.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules),
                          None)
            if target not in (None, dotted) and target.split(".")[0] == top:
                edges[dotted].add(target)
    order, low, stack, cycles = {}, {}, [], []

    def visit(module):  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(edges[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(modules):
        if module not in order:
            visit(module)
    return cycles


def violations(root: Path = ROOT) -> list:
    """One line per upward import, per same-layer folder cycle, per module cycle inside a folder, per reach into a
    family's internals."""
    out, edges, internals = [], defaultdict(set), family_internals()
    out += [f"{' <-> '.join(cycle)}: modules that import each other (a cycle inside a folder: move what they share "
            "into one of them or a third module)" for cycle in module_cycles(root)]
    for top, dotted, path in project_modules(root):
        if top not in LAYERS:
            out.append(f"{path.relative_to(root)}: {top} is in no layer (add it to tests/test_layers.py LAYERS)")
            continue
        layer = 6 if dotted.endswith(".__main__") else LAYERS[top]  # a package's command line is an entry point
        for module, line in imports_of(path, dotted):
            target = module.split(".")[0]
            if target not in LAYERS or target == top:
                continue
            where = f"{path.relative_to(root)}:{line}"
            if LAYERS[target] > layer:
                out.append(f"{where}: {NAMES[layer]} layer imports {module} ({NAMES[LAYERS[target]]} layer, above)")
            elif LAYERS[target] == layer:
                edges[top].add((target, where))
            if layer < 6 and module.startswith(internals) and not dotted.startswith(
                    module.split(".")[0] + "." + module.split(".")[1]):
                out.append(f"{where}: imports {module}, a family's internals (use the family package's API)")
    for a, targets in edges.items():
        for b, where in targets:
            if any(t == a for t, _ in edges.get(b, ())):
                out.append(f"{where}: {a} imports {b} and {b} imports {a} (a cycle inside the "
                           f"{NAMES[LAYERS[a]]} layer)")
    return sorted(set(out))


def test_imports_point_down():
    found = violations()
    assert not found, "imports that break the layers:\n" + "\n".join(found)


COMMANDS = ("train", "prepare", "generate", "harness")  # the top-level command lines


def command_imports(root: Path = ROOT) -> list:
    """Every import of a top-level command line (train.py, prepare.py, generate.py, harness.py) by the project: a
    command is a thin CLI over libraries, which is what the others import."""
    return [f"{path.relative_to(root)}:{line}: imports {module} (a command line; import the library it calls)"
            for _, dotted, path in project_modules(root) for module, line in imports_of(path, dotted)
            if module.split(".")[0] in COMMANDS and dotted not in COMMANDS]


def test_no_module_imports_a_command_line():
    found = command_imports()
    assert not found, "\n".join(found)


def test_an_import_of_a_command_line_is_caught(tmp_path):
    (tmp_path / "builders").mkdir()
    (tmp_path / "builders" / "pairs.py").write_text("def f():\n    from generate import build\n")
    assert command_imports(tmp_path) == ["builders/pairs.py:2: imports generate.build (a command line; import the "
                                         "library it calls)"]


def test_an_upward_import_is_caught(tmp_path):
    """The check fails when a lower layer imports a higher one: a copy of base/ with one import added."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "__init__.py").write_text("")
    (tmp_path / "base" / "schema.py").write_text("def f():\n    from trainer.loop import train\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("from base import schema\n")
    found = violations(tmp_path)
    assert found == ["base/schema.py:2: base layer imports trainer.loop.train (trainer layer, above)"]


def test_a_folder_cycle_is_caught(tmp_path):
    for name, other in (("data", "planner"), ("planner", "data")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"import {other}\n")
    assert len(violations(tmp_path)) == 2


def test_a_module_cycle_inside_a_folder_is_caught(tmp_path):
    """Two modules of trainer/ importing each other (one of them inside a function) are a cycle; a third module
    importing both is not."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "a.py").write_text("def f():\n    from trainer import b\n")
    (tmp_path / "trainer" / "b.py").write_text("from trainer.a import f\n")
    (tmp_path / "trainer" / "c.py").write_text("from trainer import a, b\n")
    assert violations(tmp_path) == ["trainer.a <-> trainer.b: modules that import each other (a cycle inside a "
                                    "folder: move what they share into one of them or a third module)"]


@pytest.mark.parametrize("layer", ["base", "data", "planner", "models"])
def test_lower_layers_import_without_the_plugins(layer):
    """The config layer and the planner work from base/registry.py: importing them loads no plug-in package."""
    code = (f"import sys, {layer}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('objectives', 'trainer', 'evaluation')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_no_top_level_module_shadows_an_installed_distribution():
    """Run from the repository root (as `python -m ...` is), the root comes first on sys.path: a top-level module of
    the repository named like a package of the environment would be imported in its place by any library asking for
    that package (lm_eval imports Hugging Face's `evaluate`, which `python -m evaluation` once shadowed as
    evaluate.py). So no top-level name of the repository is a top-level module of an installed distribution."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    tops = {top for top, _, _ in project_modules()} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    shadowing = {top: installed[top] for top in tops if top in installed}
    assert not shadowing, f"top-level names of the repository that installed distributions provide: {shadowing}"
