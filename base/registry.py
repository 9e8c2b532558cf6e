"""The plug-in registries. Model families, objectives, PEFT methods and data formats add themselves here when their
package is imported (models/__init__.py, objectives/__init__.py, adapters/__init__.py, data/__init__.py); the layers below them (the config
schema and validation, the planner) look a plug-in up by the name the config gives and never import one. So a
new family or objective is its own folder or file: nothing here or in base/ changes.

An entry point imports the plug-in packages before it composes a config (plugins.py `register`).
"""
from typing import Callable, Dict, Iterator, Optional

from base.errors import ConfigError
from base.family import Family
from base.objective import ObjectivePlugin
from base.peft import PeftMethod


class Registry:
    """name -> plug-in (a module, or a data format's Format), for the config key that names it. `contract`: what
    a plug-in is checked and held as when it registers (base/family.py Family: a ContractError naming what is
    missing)."""

    def __init__(self, key: str, where: str, contract: Optional[Callable[[str, object], object]] = None):
        self.key, self.where, self.contract = key, where, contract  # e.g. "model.family", "models/<family>/"
        self._items: Dict[str, object] = {}

    def add(self, name: str, item) -> None:
        self._items[name] = self.contract(name, item) if self.contract else item

    def remove(self, name: str) -> None:
        """Unregister `name` (a plug-in defined for a while only, e.g. inside a test)."""
        del self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __getitem__(self, name: str):
        if not self._items:
            raise RuntimeError(f"no {self.key} plug-in is registered: the entry point must import the plug-in "
                               f"packages first (plugins.py register())")
        if name not in self._items:
            raise ConfigError(self.key, f"got {name!r}; choose one of {', '.join(self._items)} ({self.where})")
        return self._items[name]


FAMILIES = Registry("model.family", "models/<family>/", Family)  # the family packages (contract: base/family.py)
OBJECTIVES = Registry("objective.name", "objectives/<name>.py", ObjectivePlugin)  # contract: base/objective.py
PEFT = Registry("peft.name", "adapters/<name>.py", PeftMethod)  # contract: base/peft.py
# the instruction and preference data formats, by the source kind that names them (data/formats.py), and `auto`
FORMATS = Registry("data.sources[].kind", "data/formats.py")
