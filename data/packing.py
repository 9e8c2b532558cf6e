"""Stage 2 of prepare: each source's token stream -> rows of seq_len + 1 tokens in MindRecord files.

Row i of a source and split is tokens[i*seq_len : i*seq_len + seq_len + 1]: consecutive rows share one
token, so every token after the first is a target exactly once per epoch (inputs row[:-1], targets
row[1:]); the last partial row is dropped. Written into `out` (one directory per seq_len):
  <source>.<split>.<k:05d>.mindrecord (+ .db)   rows [k*shard_rows, (k+1)*shard_rows), columns:
      input_ids       int32 [seq_len + 1]
      segment_starts  int32 [n]: 0, then every position where a document starts (after an eos), so a
                      reset_attention_mask / position-id option can keep attention inside documents
      first_doc       int64: index (in the split) of the document row[0] belongs to; indexed
  index.json      seq_len, shard_rows, seconds it took, and per source and split: rows and files in row order
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
from mindspore.mindrecord import FileWriter
from tqdm import tqdm

from data.errors import DataError

WRITE_BATCH = 2048  # rows per FileWriter.write_raw_data call


def num_rows(n_tokens: int, seq_len: int) -> int:
    return max(n_tokens - 1, 0) // seq_len


def pack_sources(tokens_dir: Path, out: Path, sources: List[str], splits: List[str], seq_len: int,
                 shard_rows: int) -> dict:
    """Write every source's splits as rows into the empty directory `out`; returns the index written."""
    streams = {(name, split): (np.load(tokens_dir / f"{name}.{split}.npy", mmap_mode="r"),
                               np.load(tokens_dir / f"{name}.{split}.offsets.npy"))
               for name in sources for split in splits}
    rows = {key: num_rows(len(tokens), seq_len) for key, (tokens, _) in streams.items()}
    for (name, split), n in rows.items():
        if split == "train" and n == 0:
            raise DataError(f"data source '{name}' has {len(streams[name, split][0])} training tokens after "
                            f"cleaning, fewer than one row of data.seq_len + 1 = {seq_len + 1}; lower data.seq_len, "
                            f"add text to the source, or remove it from data.sources")
    start_time = time.perf_counter()
    index: Dict[str, dict] = {"seq_len": seq_len, "shard_rows": shard_rows, "sources": {n: {} for n in sources}}
    with tqdm(total=sum(rows.values()), desc="pack", unit="row", unit_scale=True, leave=False) as bar:
        for (name, split), (tokens, offsets) in streams.items():
            files = []
            for k, start in enumerate(range(0, rows[name, split], shard_rows)):
                files.append(f"{name}.{split}.{k:05d}.mindrecord")
                stop = min(start + shard_rows, rows[name, split])
                _write_shard(out / files[-1], _rows(tokens, offsets, seq_len, start, stop), seq_len)
                bar.update(stop - start)
            index["sources"][name][split] = {"rows": rows[name, split], "files": files}
    index["seconds"] = round(time.perf_counter() - start_time, 3)
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def _write_shard(path: Path, rows: Iterator[dict], seq_len: int) -> None:
    writer = FileWriter(str(path), shard_num=1)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [seq_len + 1]},
                       "segment_starts": {"type": "int32", "shape": [-1]},
                       "first_doc": {"type": "int64"}}, "packed rows")
    writer.add_index(["first_doc"])
    while batch := list(itertools.islice(rows, WRITE_BATCH)):
        writer.write_raw_data(batch)
    writer.commit()


def _rows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, start: int, stop: int) -> Iterator[dict]:
    window = np.asarray(tokens[start * seq_len:stop * seq_len + 1], dtype=np.int32)
    starts = offsets[:-1]  # document starts; the last offset is the stream's end
    for i in range(start, stop):
        first = i * seq_len
        lo, hi = np.searchsorted(starts, [first + 1, first + seq_len + 1])  # starts inside (first, last]
        yield {"input_ids": window[first - start * seq_len:first - start * seq_len + seq_len + 1],
               "segment_starts": np.concatenate([[0], starts[lo:hi] - first]).astype(np.int32),
               "first_doc": int(np.searchsorted(starts, first, side="right") - 1)}
