"""Twins: a built cell replaced in its parent by an instance of a subclass of its class that shares its
Parameters, primitives, sub-cells and attributes. Converters rewrite a built cell tree this way without touching
the model's code: LoRA (adapters/lora.py: a linear cell plus an adapter branch) and the CPU kernel overlay
(models/llama/kernels.py, objectives/_cross_entropy.py: the same cell computed by a kernels/ library).

    twin = KernelLinear(base)        # its __init__ calls adopt(self, base), then adds what it needs
    replace(root, "model.layers.0.attention.wq", twin)
    drop_compiled(root)

Why a subclass that adopts the cell rather than a new cell: MindSpore names a parameter by the attribute path at
which its cell was attached, once, at construction, so a cell built and attached later would name its weights
wrongly; `insert_child_to_cell` does not rename, and the adopted Parameters keep their names
(`model.layers.0.attention.wq.weight`). Because the twin keeps its path and is an instance of the plain class,
whatever finds cells by path and type (the tensor-parallel plan's `isinstance(cell, Linear)` and
`<path>.matmul` strategies, recompute, LoRA's target matching) still finds it.

The kernel overlay registers its twins here by kernels/ library (`register`), and `overlay(root, libraries)`
swaps every registered cell of `root` whose library is in `libraries`; the model's family decides which
libraries apply (models/llama/__init__.py kernel_libraries), and a loss cell built around the model later takes
the same ones (`libraries_in(model)`: trainer/module.py).
"""
from typing import Dict, Iterable, List, Set

from mindspore import nn

TWINS: Dict[str, Dict[type, type]] = {}  # kernels/ library -> {plain class: its twin}


def register(library: str, plain: type, twin: type) -> None:
    """`twin(cell)` replaces each cell whose class is exactly `plain` when `library` (kernels/<library>.cc) is used."""
    assert issubclass(twin, plain), f"{twin.__name__} must subclass {plain.__name__}"
    TWINS.setdefault(library, {})[plain] = twin


def adopt(cell: nn.Cell, base: nn.Cell) -> None:
    """Make `cell` (a new instance of a subclass of base's class, its own __init__ running) base's twin: nn.Cell's
    set-up, then base's plain attributes (compute_dtype...) and the same Parameter, sub-cell and primitive objects.
    The base class's __init__ is not run: it would build new weights."""
    nn.Cell.__init__(cell)
    fresh = set(vars(cell))  # what nn.Cell.__init__ set up for this cell (its id, compile cache, has_bprop)
    for key, value in vars(base).items():
        if key not in fresh:
            object.__setattr__(cell, key, value)
    for store in ("_params", "_cells", "_primitives", "_buffers"):
        getattr(cell, store).update(getattr(base, store))
    object.__setattr__(cell, "training", base.training)


def replace(root: nn.Cell, path: str, cell: nn.Cell) -> None:
    """Put `cell` at `path` ("model.layers.0.attention.wq") in `root`'s tree, in place of what is there."""
    parent, _, attr = path.rpartition(".")
    (_at(root, parent) if parent else root).insert_child_to_cell(attr, cell)


def drop_compiled(root: nn.Cell) -> None:
    """Forget the graphs MindSpore compiled for `root`'s cells (they would not see a replaced cell): the next call
    compiles again. A cell compiled around `root` (a loss or train-step cell) cannot be reached from here: build
    those after the replacement."""
    for _, cell in root.cells_and_names():
        cell.compile_cache.clear()


def overlay(root: nn.Cell, libraries: Iterable[str]) -> List[str]:
    """Replace every cell below `root` that has a twin registered for one of `libraries` by that twin; returns the
    paths replaced. A cell already replaced (or converted otherwise: LoRA) is not of its plain class any more and
    stays as it is, so the pass can run again over a tree that holds the model (a loss cell)."""
    table = {plain: twin for library in libraries for plain, twin in TWINS.get(library, {}).items()}
    paths = [path for path, cell in root.cells_and_names() if path and type(cell) in table]
    for path in paths:  # top-down: a twin adopts its children as they are, and they are replaced in it after
        replace(root, path, table[type(_at(root, path))](_at(root, path)))
    if paths:
        drop_compiled(root)
    return paths


def libraries_in(root: nn.Cell) -> Set[str]:
    """The kernels/ libraries whose twins `root` holds (a twin converted further, e.g. by LoRA, counts)."""
    cells = [cell for _, cell in root.cells_and_names()]
    return {library for library, table in TWINS.items()
            if any(isinstance(cell, tuple(table.values())) for cell in cells)}


def _at(root: nn.Cell, path: str) -> nn.Cell:
    cell = root
    for name in path.split("."):
        cell = cell._cells[name]  # pylint: disable=protected-access
    return cell
