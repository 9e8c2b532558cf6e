"""Process set-up: MindSpore execution mode, device, seeds, and which rank of how many this process is."""
import os
import random
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from omegaconf import DictConfig


@dataclass
class Runtime:
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """Processes started by msrun (MS_WORKER_NUM), or 1 for a plain `python train.py`."""
    return int(os.environ.get("MS_WORKER_NUM", "1"))


def init_runtime(cfg: DictConfig) -> Runtime:
    ms.set_context(mode=ms.GRAPH_MODE if cfg.trainer.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device(cfg.device.target)
    seed = cfg.trainer.seed
    ms.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    return Runtime(rank=int(os.environ.get("MS_NODE_ID", "0")), world_size=launched_world_size())
