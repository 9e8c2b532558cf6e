"""What a prepared row holds. An objective chooses a RowSpec (objectives/<name>.py `row_spec`); data/packing.py
writes rows of any spec into MindRecord files and data/loader.py reads its columns back by name, so a new
row layout is one spec, not edits to the pipeline.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class Split:
    """One source's split as stage 1 (data/documents.py, data/samples.py) wrote it."""

    where: str  # e.g. "data source 'wiki' (train)", for messages
    tokens: np.ndarray  # the documents (samples), each followed by eos
    offsets: np.ndarray  # int64: start of every document, then the end
    loss_mask: Optional[np.ndarray] = None  # samples only (uint8, like tokens): 1 where the token carries loss
    margin: Optional[np.ndarray] = None  # preference pairs only (float32, one per pair = two samples)


@dataclass(frozen=True)
class RowSpec:
    name: str  # part of the cache directory, rows-<name>-<seq_len> ("packed": rows-<seq_len>); say every option
    columns: Tuple[str, ...]  # the columns batches are made of, in this order
    schema: Callable[[int], dict]  # seq_len -> MindRecord schema of every column written
    # (split, seq_len, tokenizer) -> rows (dicts of the schema's columns) of one source's split
    build: Callable[[Split, int, object], Iterator[dict]]
    index: Tuple[str, ...] = ()  # columns MindRecord indexes

    def dir_name(self, seq_len: int) -> str:
        return f"rows-{seq_len}" if self.name == "packed" else f"rows-{self.name}-{seq_len}"


def best_fit(lengths: Sequence[int], size: int) -> List[List[int]]:
    """Indices of `lengths` grouped into rows of at most `size`: each item, longest first (ties in order), goes
    to the open row with the least room that still holds it (best fit decreasing), else starts a row."""
    rows: List[List[int]] = []
    free: List[Tuple[int, int]] = []  # (room, row index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = size, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, row))
    return rows
