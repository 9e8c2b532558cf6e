"""Data pipeline throughput: a cold prepare, re-packing for another seq_len, the loader, and what a
training step consumes. Prints numbers, asserts nothing.

    scripts/venv.sh python -m benchmarks.data_throughput [data=corpora_5dom] [model=small] [data.num_workers=2] ...

Prepares into a fresh temporary cache, so every stage is built. MB are 10^6 bytes of UTF-8 text read from
the sources; tokens are train + val tokens. The training consumption is the forward + backward pass of
`model` at trainer.micro_batch_size x data.seq_len in graph mode, after compilation (the optimizer
update adds a little to a real step): the loader must stay well ahead of it.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import sys
import tempfile
import time

import mindspore as ms
import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.schema import REPO_ROOT
from plugins import register
from data import build_data
from data.cache import prepare
from models import build_model
from objectives import objective
from trainer.module import loss_cell
from trainer.step import ForwardBackward
from benchmarks.results import recorded

DEFAULTS = ["data=corpora_5dom", "model=small", "data.num_workers=2"]


def prepare_throughput(cfg) -> None:
    start = time.perf_counter()
    prepared = prepare(cfg.data)
    seconds = time.perf_counter() - start
    sources = prepared.meta["sources"].values()
    mb = sum(m["bytes_read"] for m in sources) / 1e6
    tokens = sum(m[split]["tokens"] for m in sources for split in ("train", "val"))
    print(f"prepare (cold, {cfg.data.num_workers} workers): {mb:.1f} MB, {tokens / 1e6:.2f} M tokens in "
          f"{seconds:.1f} s = {mb / seconds:.2f} MB/s, {tokens / seconds / 1e3:.0f} k tokens/s")
    steps = prepared.meta["seconds"]
    print("  steps (s): " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    print(f"  tokenize alone: {mb / steps['tokenize']:.2f} MB/s, {tokens / steps['tokenize'] / 1e3:.0f} k tokens/s; "
          f"pack alone: {tokens / steps['pack'] / 1e6:.2f} M tokens/s")
    start = time.perf_counter()
    prepare(cfg.data)
    print(f"prepare again (cached): {time.perf_counter() - start:.2f} s")


def loader_throughput(cfg, n_batches: int = 2000) -> float:
    t = cfg.trainer
    bundle = build_data(cfg.data, t.micro_batch_size, seed=t.seed, eval_batches=t.eval_batches)
    bundle.train.next_batch()  # the first pipeline starts
    start = time.perf_counter()
    for _ in range(n_batches):
        bundle.train.next_batch()
    rate = n_batches * t.micro_batch_size * cfg.data.seq_len / (time.perf_counter() - start)
    print(f"loader: {rate / 1e6:.2f} M tokens/s ({n_batches} batches of {t.micro_batch_size} x "
          f"{cfg.data.seq_len + 1}, MindDataset + SubsetSampler)")
    return rate


def training_consumption(cfg, n_steps: int = 5) -> float:
    t = cfg.trainer
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(cfg.device.target)
    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device, t.seed)
    loss_net = loss_cell(objective(cfg.objective.name).Objective(cfg.objective), model)  # as training builds it
    grad = ForwardBackward(loss_net, ms.ParameterTuple(loss_net.trainable_params()))
    rng = np.random.default_rng(0)
    batch = ms.Tensor(rng.integers(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.data.seq_len + 1), np.int32))
    one = ms.Tensor(1.0, ms.float32)
    for _ in range(2):  # compile
        grad(one, batch, batch)[0].asnumpy()
    start = time.perf_counter()
    for _ in range(n_steps):
        grad(one, batch, batch)[0].asnumpy()
    rate = n_steps * t.micro_batch_size * cfg.data.seq_len / (time.perf_counter() - start)
    print(f"training step (forward + backward, model={cfg.model.name}, {cfg.device.target}): "
          f"{rate / 1e3:.1f} k tokens/s")
    return rate


def main() -> None:
    register()
    with tempfile.TemporaryDirectory() as cache, initialize_config_dir(f"{REPO_ROOT}/conf", version_base="1.3"):
        cfg = compose("config", overrides=DEFAULTS + sys.argv[1:] + [f"data.cache_dir={cache}"])
        print(f"overrides: {' '.join(DEFAULTS + sys.argv[1:])}")
        prepare_throughput(cfg)
        repacked = OmegaConf.merge(cfg, {"data": {"seq_len": 2 * cfg.data.seq_len}})
        start = time.perf_counter()
        prepare(repacked.data)
        print(f"prepare for seq_len={repacked.data.seq_len} (re-pack only): {time.perf_counter() - start:.1f} s")
        loader = loader_throughput(cfg)
    consumed = training_consumption(cfg)
    print(f"loader / training consumption: x{loader / consumed:.0f}")


if __name__ == "__main__":
    with recorded("benchmarks.data_throughput", "Data pipeline throughput"):
        main()
