"""Process set-up: MindSpore execution mode, device, seeds, and which rank of how many this process is."""
import os
import random
import signal
from dataclasses import dataclass
from typing import Optional

import numpy as np

import mindspore as ms
from omegaconf import DictConfig

from conf.schema import is_sharded


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


def launched_rank() -> int:
    return int(os.environ.get("MS_NODE_ID", "0"))


def init_runtime(cfg: DictConfig) -> Runtime:
    ms.set_context(mode=ms.GRAPH_MODE if cfg.trainer.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device(cfg.device.target)
    seed = cfg.trainer.seed
    ms.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    world_size = launched_world_size()
    if world_size == 1:
        return Runtime(rank=0, world_size=1)
    if is_sharded(cfg.parallel):  # the parallel mode is set by distributed/semi_auto.py
        from mindspore.communication import get_rank, init

        init()
        return Runtime(rank=get_rank(), world_size=world_size)
    from distributed.data_parallel import init_data_parallel

    return Runtime(rank=init_data_parallel(world_size), world_size=world_size)


class Preemption:
    """Turns SIGTERM/SIGINT into a request the loop honours after the current step (save, then exit 0)."""

    def __init__(self):
        self.signal: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name


def rng_state() -> dict:
    """Python, NumPy and MindSpore RNG states, JSON-serialisable."""
    np_state = np.random.get_state()
    return {"python": random.getstate()[1], "numpy": np_state[1].tolist(), "numpy_pos": int(np_state[2]),
            "mindspore": ms.get_rng_state().asnumpy().tolist()}


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), None))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    ms.set_rng_state(ms.Tensor(np.array(state["mindspore"], dtype=np.uint8)))
