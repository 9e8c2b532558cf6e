"""Training objectives as plug-ins: one module each (objectives/<name>.py), found by `objective.name`.
OBJECTIVES lists the modules, so adding one is that module plus conf/objective/<name>.yaml; nothing else
changes.

An objective module exposes:
  Config                 its typed `objective` group (presets start from `base_objective_<name>`)
  check(cfg)             its config rules, e.g. which model families it trains (ConfigError naming the key)
  row_spec(cfg)          data/rows.RowSpec: the prepared rows it reads (columns written to MindRecord)
  Objective(cfg, tokenizer, seed), with
    inputs               names of the step's inputs, in the order its loss cell's construct takes them
    metrics              names of the scalars the loss cell returns after the loss (means over its loss tokens)
    batch(rows, sample)  host side: a batch of rows (dict of columns) whose first sample has global index
                         `sample` -> the step's inputs (numpy arrays, in `inputs` order)
    loss_tokens(inputs)  how many tokens of the batch carry loss (the step normalizes by the global count)
    loss_cell(model)     nn.Cell: construct(*inputs) -> (loss, *metrics), loss the mean over its loss tokens
"""
import importlib
import pkgutil
from types import ModuleType

OBJECTIVES = {m.name: f"objectives.{m.name}" for m in pkgutil.iter_modules(__path__)}


def objective(name: str) -> ModuleType:
    if name not in OBJECTIVES:
        raise ValueError(f"objective={name!r} is unknown; available: {', '.join(OBJECTIVES)}")
    return importlib.import_module(OBJECTIVES[name])
