"""The plug-in registries. Model families, objectives, PEFT methods and data formats add themselves here when their
package is imported (models/__init__.py, objectives/__init__.py, adapters/__init__.py, data/__init__.py); the layers below them (the config
schema and validation, the planner) look a plug-in up by the name the config gives and never import one. So a
new family or objective is its own folder or file: nothing here or in base/ changes.

An entry point imports the plug-in packages before it composes a config (plugins.py `register`).
"""
from typing import Dict, Iterator

from base.errors import ConfigError


class Registry:
    """name -> plug-in (a module, or a config class for PEFT), for the config key that names it."""

    def __init__(self, key: str, where: str):
        self.key, self.where = key, where  # e.g. "model.family", "models/<family>/"
        self._items: Dict[str, object] = {}

    def add(self, name: str, item) -> None:
        self._items[name] = item

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


FAMILIES = Registry("model.family", "models/<family>/")  # the family packages (models/__init__.py lists the API)
OBJECTIVES = Registry("objective.name", "objectives/<name>.py")  # the objective modules (objectives/__init__.py)
PEFT = Registry("peft.name", "adapters/")  # the typed config of each PEFT method
# the instruction and preference data formats, by the source kind that names them (data/formats.py), and `auto`
FORMATS = Registry("data.sources[].kind", "data/formats.py")
