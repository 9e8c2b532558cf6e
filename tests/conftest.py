import boot  # noqa: F401  (MindSpore first, as in train.py)

import os
import sys

import pytest
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conf.schema import register  # noqa: E402

register()  # the ConfigStore schema and the ${repo:} resolver, as train.py does
CORPORA = os.environ.get("MINDLAB_CORPORA", os.path.join(ROOT, "..", "shared", "corpora"))


def load_preset(group: str, name: str):
    """A preset merged onto its schema, as Hydra would compose it."""
    from conf import schema

    node = {"model": schema.ModelConfig, "parallel": schema.ParallelConfig}[group]
    raw = OmegaConf.load(os.path.join(ROOT, "conf", group, f"{name}.yaml"))
    return OmegaConf.merge(OmegaConf.structured(node), {k: v for k, v in raw.items() if k != "defaults"})


@pytest.fixture(scope="session", autouse=True)
def graph_mode_cpu():
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")


@pytest.fixture
def pynative():
    """Eager mode for checks of a step or two, which would spend most of their time compiling graphs."""
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)
