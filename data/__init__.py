"""Data pipeline: raw sources -> cleaning and dedup -> sentencepiece -> tokenized documents -> MindRecord
rows -> blended, dp-sharded, resumable batches.

`build_data` is the entry point for training; `python prepare.py data=...` prepares without training.
Modules, in pipeline order: sources (+ work units), cleaning (+ minhash, dedup), tokenizer, documents (stage 1,
streamed in resumable steps), packing (stage 2), cache (prepare: both stages, cached, resumable, in parts),
mixing (the blended order), loader (MindDataset reading); parallel runs the worker processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from base.schema import DataConfig
from data import cache, formats  # noqa: F401  (formats: registers the instruction and preference formats)
from data.cache import PreparedData
from data.errors import DataError
from data.loader import BlendedBatches, validation_batches
from data.mixing import check_weights
from data.packing import PACKED
from data.rows import RowSpec
from data.tokenizer import Tokenizer

__all__ = ["BlendedBatches", "DataBundle", "DataError", "PreparedData", "Tokenizer", "build_data"]


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: BlendedBatches
    val: Dict[str, List[Dict[str, np.ndarray]]]  # per source: up to eval_batches fixed batches (dicts of columns)
    meta: dict  # per source: documents read, removed by each cleaning step, kept; per split docs, tokens, rows


def build_data(cfg: DataConfig, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
               eval_batches: int = 8, spec: RowSpec = PACKED, fit_small_val: bool = True) -> DataBundle:
    """Prepare (or reuse) the cache for `cfg` in the row layout `spec` (the objective's) and open this rank's
    training and validation batches over it (`fit_small_val`: data/loader.py validation_batches' fit_small)."""
    check_weights(cfg.weights, [s.name for s in cfg.sources])  # before the work of preparing
    prepared = cache.prepare(cfg, spec)
    train = BlendedBatches(prepared, cfg.weights, micro_batch_size, dp_rank, dp_size, seed, cfg.allow_weight_change)
    meta = {**prepared.meta, "cache_dir": str(prepared.rows_dir), "weights": train.weights}
    val = validation_batches(prepared, micro_batch_size, eval_batches, fit_small_val)
    return DataBundle(prepared.tokenizer(), train, val, meta)
