"""Stage 2 of prepare: each source's token stream -> rows in MindRecord files, in the layout of a RowSpec
(data/rows.py). PACKED, below, is the pretraining layout; objectives may bring their own (e.g. BERT's
sentence pairs, objectives/_sentence_pairs.py).

PACKED: row i of a source and split is tokens[i*seq_len : i*seq_len + seq_len + 1]: consecutive rows share
one token, so every token after the first is a target exactly once per epoch (inputs row[:-1], targets
row[1:]); the last partial row is dropped. Columns:
      input_ids       int32 [seq_len + 1]
      segment_starts  int32 [n]: 0, then every position where a document starts (after an eos), so a
                      reset_attention_mask / position-id option can keep attention inside documents
      first_doc       int64: index (in the split) of the document row[0] belongs to; indexed

Written into `out` (one directory per spec and seq_len):
  <source>.<split>.<k:05d>.mindrecord (+ .db)   rows [k*shard_rows, (k+1)*shard_rows)
  index.json      seq_len, shard_rows, rows spec, seconds it took, and per source and split: rows and files
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
from data.rows import RowSpec, Split, best_fit

WRITE_BATCH = 2048  # rows per FileWriter.write_raw_data call
PACK_CHUNK = 65536  # PACKED rows materialized at a time


def num_rows(n_tokens: int, seq_len: int) -> int:
    return max(n_tokens - 1, 0) // seq_len


def packed_rows(split: Split, seq_len: int, tokenizer=None) -> Iterator[dict]:
    n = num_rows(len(split.tokens), seq_len)
    for start in range(0, n, PACK_CHUNK):
        yield from _rows(split.tokens, split.offsets, seq_len, start, min(start + PACK_CHUNK, n))


def _packed_schema(seq_len: int) -> dict:
    return {"input_ids": {"type": "int32", "shape": [seq_len + 1]}, "segment_starts": {"type": "int32", "shape": [-1]},
            "first_doc": {"type": "int64"}}


PACKED = RowSpec(name="packed", columns=("input_ids",), build=packed_rows, index=("first_doc",), schema=_packed_schema)


def keep_documents_whole(tokens: np.ndarray, offsets: np.ndarray, seq_len: int):
    """The documents reordered so that PACKED cutting splits none that fits in a row (`objective.packing=documents`).

    Documents of <= seq_len tokens (eos included) go whole into rows by best-fit decreasing; each row's gap is
    filled with the next tokens of the documents longer than seq_len (split anyway), whose rest follows as
    whole rows. Only if the long documents run out before the gaps do are the short documents of the rows
    left unfilled appended as a plain stream (where the cutting may split them: no padding exists in PACKED
    rows). Returns (tokens, offsets of the pieces, number of documents that fit but may be split)."""
    starts, lengths = offsets[:-1], np.diff(offsets)
    short = np.flatnonzero(lengths <= seq_len)
    rows = [[int(short[i]) for i in row] for row in best_fit(lengths[short], seq_len)]  # document ids per row
    gaps = {row: seq_len - int(lengths[docs].sum()) for row, docs in enumerate(rows)
            if lengths[docs].sum() < seq_len}
    long_docs = [(starts[d], starts[d] + lengths[d]) for d in np.flatnonzero(lengths > seq_len)]
    pieces, leftover, at_risk = [], [], 0  # (start, stop) ranges of `tokens`, in the new order
    for row, docs in enumerate(rows):
        row_pieces = [(starts[d], starts[d] + lengths[d]) for d in docs]
        need = gaps.get(row, 0)
        while need and long_docs:
            lo, hi = long_docs[0]
            take = min(need, hi - lo)
            row_pieces.append((lo, lo + take))
            long_docs[0] = (lo + take, hi)
            if lo + take == hi:
                long_docs.pop(0)
            need -= take
        (leftover if need else pieces).extend(row_pieces)
        at_risk += len(docs) if need else 0
    pieces += long_docs + leftover
    sizes = np.array([hi - lo for lo, hi in pieces], np.int64)
    order = np.concatenate([np.arange(lo, hi) for lo, hi in pieces]) if pieces else np.zeros(0, np.int64)
    new_offsets = np.concatenate([[0], np.cumsum(sizes)])
    return np.asarray(tokens)[order], new_offsets, at_risk


def document_rows(split: Split, seq_len: int, tokenizer=None) -> Iterator[dict]:
    tokens, offsets, _ = keep_documents_whole(split.tokens, split.offsets, seq_len)
    yield from packed_rows(Split(split.where, tokens, offsets), seq_len)


# PACKED's layout over keep_documents_whole's order (objective.packing=documents; stage=long_context sets it)
DOCUMENT_PACKED = RowSpec(name="packed-docs", columns=("input_ids",), build=document_rows, index=("first_doc",),
                          schema=_packed_schema)


def pack_sources(tokens_dir: Path, out: Path, sources: List[str], splits: List[str], seq_len: int,
                 shard_rows: int, spec: RowSpec = PACKED, tokenizer=None) -> dict:
    """Write every source's splits as rows of `spec` into the empty directory `out`; returns the index written."""
    start_time = time.perf_counter()
    index: Dict[str, dict] = {"seq_len": seq_len, "shard_rows": shard_rows, "rows": spec.name,
                              "sources": {n: {} for n in sources}}
    with tqdm(desc="pack", unit="row", unit_scale=True, leave=False) as bar:
        for name in sources:
            for split in splits:
                stream = load_split(tokens_dir, name, split)
                tokens = stream.tokens
                rows, files = spec.build(stream, seq_len, tokenizer), []
                n = 0
                while shard := list(itertools.islice(rows, shard_rows)):
                    files.append(f"{name}.{split}.{len(files):05d}.mindrecord")
                    _write_shard(out / files[-1], shard, spec.schema(seq_len), spec.index)
                    n += len(shard)
                    bar.update(len(shard))
                if split == "train" and n == 0:
                    raise DataError(f"data source '{name}' has {len(tokens)} training tokens after cleaning, fewer "
                                    f"than one row of {spec.name} rows at data.seq_len={seq_len}; lower "
                                    f"data.seq_len, add text to the source, or remove it from data.sources")
                index["sources"][name][split] = {"rows": n, "files": files}
    index["seconds"] = round(time.perf_counter() - start_time, 3)
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def load_split(tokens_dir: Path, source: str, split: str) -> Split:
    """What stage 1 wrote for one source's split (the loss mask only for samples, margins only for pairs)."""
    mask, margin = (tokens_dir / f"{source}.{split}.{what}.npy" for what in ("loss_mask", "margin"))
    return Split(f"data source '{source}' ({split})", np.load(tokens_dir / f"{source}.{split}.npy", mmap_mode="r"),
                 np.load(tokens_dir / f"{source}.{split}.offsets.npy"),
                 np.load(mask, mmap_mode="r") if mask.exists() else None,
                 np.load(margin) if margin.exists() else None)


def _write_shard(path: Path, rows: List[dict], schema: dict, index_fields) -> None:
    writer = FileWriter(str(path), shard_num=1)
    writer.add_schema(schema, "rows")
    if index_fields:
        writer.add_index(list(index_fields))
    for start in range(0, len(rows), WRITE_BATCH):
        writer.write_raw_data(rows[start:start + WRITE_BATCH])
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
