"""Process set-up: MindSpore execution mode, device, seeds, the compile cache, and which rank of how many this
process is."""
import hashlib
import json
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

import mindspore as ms
from omegaconf import DictConfig, OmegaConf

import kernels
from base.schema import is_sharded


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


def is_scheduler() -> bool:
    """msrun's scheduler: msrun starts the training script for it too (MS_ROLE=MS_SCHED, no MS_NODE_ID), only to
    host the cluster from inside init(). It is no rank: read as rank 0 it would write the run's status.json and
    train.log beside rank 0 (and race it for status.json)."""
    return os.environ.get("MS_ROLE") == "MS_SCHED"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_ENV = ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH")


def compile_cache_dir(cfg: DictConfig) -> str:
    """Where `trainer.compile_cache` keeps this process's graphs: <trainer.compile_cache_dir>/<key>.

    MindSpore's compile cache stores a process's graphs by the order they are compiled in (compile_cache_0,
    1, ...) and checks only a hash of the Python files the entry script imports at its top: a graph of
    another shape is loaded without complaint (measured: model=small after model=tiny crashes in a Gather
    kernel). So the key covers everything that shapes the graphs: the whole config but the logger, every
    mindlab .py file (train.py imports the model lazily, which MindSpore's hash does not see), the entry
    script, MindSpore's version and the compiled kernels in use (kernels/: a graph names its library's path, which
    follows the C++ source and the CPU). Same key, same sequence of graphs."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("logger", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"{os.path.basename(sys.argv[0])} {ms.__version__}".encode())
    digest.update(kernels.fingerprint().encode())
    for folder, dirs, files in os.walk(ROOT):  # top-down, in the order of the sorted dirs
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("tests", "outputs", "multirun"))
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(f.read())
    return os.path.join(cfg.trainer.compile_cache_dir, digest.hexdigest()[:16])


def init_runtime(cfg: DictConfig) -> Runtime:
    ms.set_context(mode=ms.GRAPH_MODE if cfg.trainer.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device(cfg.device.target)
    if cfg.trainer.get("compile_cache"):
        path = compile_cache_dir(cfg)
        os.environ.update(zip(CACHE_ENV, ("1", path)))  # MindSpore reads them when it compiles
        print(f"[runtime] compile cache: {path}", flush=True)
    elif os.environ.get(CACHE_ENV[1], "").startswith(cfg.trainer.compile_cache_dir):
        for key in CACHE_ENV:  # set by an earlier run in this process, for another config
            os.environ.pop(key)
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
