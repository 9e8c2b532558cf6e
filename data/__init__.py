"""Data pipeline: text sources -> sentencepiece tokenizer -> cached packed token streams -> batches.

`build_data` is the entry point for training; the pieces live in sources, tokenizer, packed, loader.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conf.schema import DataConfig
from data.errors import DataError
from data.loader import PackedBatches, eval_batches
from data.packed import PreparedData, prepare
from data.tokenizer import Tokenizer

__all__ = ["DataBundle", "DataError", "PackedBatches", "PreparedData", "Tokenizer", "build_data",
           "eval_batches", "prepare"]


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: PackedBatches
    val_tokens: np.ndarray  # 1-D stream for eval_batches
    meta: dict  # the cache's meta.json


def build_data(cfg: DataConfig, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
               seed: int = 0) -> DataBundle:
    """Prepare (or reuse) the cache for `cfg` and open this rank's training batches over it."""
    prepared = prepare(cfg)
    train = PackedBatches(prepared.tokens("train"), cfg.seq_len, micro_batch_size, dp_rank, dp_size, seed)
    return DataBundle(prepared.tokenizer(), train, prepared.tokens("val"), prepared.meta)
