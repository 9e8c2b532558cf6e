"""Every plug-in package imported, so that each registers itself (base/registry.py), then the config schema
registered with Hydra. Every entry point calls `register()` before it composes a config: the config layer below
never imports a plug-in."""
import adapters  # noqa: F401  (registers the PEFT methods)
import models  # noqa: F401  (registers the model families)
import objectives  # noqa: F401  (registers the objectives)
from base.schema import register as _register_schema


def register() -> None:
    """The plug-ins' schemas and the core schema in Hydra's ConfigStore, and the `${repo:}` resolvers."""
    _register_schema()
