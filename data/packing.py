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
Rows stream into the shards; memory holds WRITE_BATCH rows per shard being written, not a split's (a layout's
own build may hold more: keep_documents_whole reorders a split's tokens in memory).
"""
from __future__ import annotations

import itertools
import json
import mmap
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
from mindspore.mindrecord import FileWriter
from tqdm import tqdm

from data.errors import DataError, writing
from data.parallel import WorkerPool, report
from data.rows import RowSpec, Split, best_fit

WRITE_BATCH = 2048  # rows per FileWriter.write_raw_data call
PACK_TOKENS = 1 << 22  # PACKED rows are cut from windows of about this many tokens (16 MB as int32)


def num_rows(n_tokens: int, seq_len: int) -> int:
    return max(n_tokens - 1, 0) // seq_len


def packed_rows(split: Split, seq_len: int, tokenizer=None) -> Iterator[dict]:
    return _packed_range(split, seq_len, 0, num_rows(len(split.tokens), seq_len))


def _packed_range(split: Split, seq_len: int, start: int, stop: int) -> Iterator[dict]:
    """PACKED rows [start, stop): a row is a function of its index alone."""
    chunk = max(PACK_TOKENS // seq_len, 1)
    for lo in range(start, stop, chunk):
        yield from _rows(split.tokens, split.offsets, seq_len, lo, min(lo + chunk, stop))


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
                 shard_rows: int, spec: RowSpec, tokenizer, pool: WorkerPool) -> dict:
    """Write every source's splits as rows of `spec` into `out`, which must not exist; returns the index written.

    Shards are finished in `<out>.partial/`, each written under a tmp directory and renamed there when complete;
    a packing that was killed keeps them, and the next one writes only the shards that are missing (rows are
    deterministic, so the result is the same bytes). index.json is written last, then `<out>.partial` becomes
    `out`. PACKED rows are cut straight from the token stream, so the workers of `pool` write its shards side
    by side; other layouts' rows come from one pass over each split, streamed into one shard after another."""
    start_time = time.perf_counter()
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(exist_ok=True)
    for stale in partial.glob(".tmp-*"):  # a killed packing's shard in progress (callers hold the cache lock)
        shutil.rmtree(stale)
    pack = _pack_side_by_side if spec is PACKED else _pack_in_order
    index = {"seq_len": seq_len, "shard_rows": shard_rows, "rows": spec.name,
             "sources": pack(tokens_dir, partial, sources, splits, seq_len, shard_rows, spec, tokenizer, pool),
             "seconds": round(time.perf_counter() - start_time, 3)}
    with writing(partial / "index.json"):
        (partial / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    os.replace(partial, out)
    return index


def _pack_side_by_side(tokens_dir: Path, partial: Path, sources: List[str], splits: List[str], seq_len: int,
                       shard_rows: int, spec: RowSpec, tokenizer, pool: WorkerPool) -> Dict[str, dict]:
    """PACKED: every missing shard is a task for the pool; per source and split, its rows and files."""
    entries: Dict[str, dict] = {name: {} for name in sources}
    tasks = []
    for name in sources:
        for split in splits:
            n = num_rows(len(np.load(tokens_dir / f"{name}.{split}.npy", mmap_mode="r")), seq_len)
            _check_rows(tokens_dir, name, split, n, spec, seq_len)
            files = [_shard_file(name, split, k) for k in range(-(-n // shard_rows))]
            entries[name][split] = {"rows": n, "files": files}
            tasks += [(tokens_dir, name, split, seq_len, k * shard_rows, min(n, (k + 1) * shard_rows), partial, file)
                      for k, file in enumerate(files) if not (partial / file).is_file()]
    for _ in pool.run(write_packed_shard, tasks, "pack", sum(task[5] - task[4] for task in tasks), unit="row"):
        pass
    return entries


def write_packed_shard(tokens_dir: Path, source: str, split: str, seq_len: int, start: int, stop: int,
                       directory: Path, file: str) -> None:
    """PACKED rows [start, stop) of one source's split as one shard (runs in a worker process)."""
    rows = _packed_range(load_split(tokens_dir, source, split), seq_len, start, stop)
    _write_shard(directory, file, rows, PACKED.schema(seq_len), PACKED.index)


def _pack_in_order(tokens_dir: Path, partial: Path, sources: List[str], splits: List[str], seq_len: int,
                   shard_rows: int, spec: RowSpec, tokenizer, pool: WorkerPool) -> Dict[str, dict]:
    """Any layout: each split's rows from one pass, one shard after another; per source and split, its rows
    and files."""
    entries: Dict[str, dict] = {name: {} for name in sources}
    about = sum(num_rows(len(np.load(tokens_dir / f"{n}.{s}.npy", mmap_mode="r")), seq_len)
                for n in sources for s in splits)  # the number of packed rows: near it for other layouts
    with tqdm(total=about, desc="pack", unit="row", unit_scale=True, leave=False) as bar:
        for name in sources:
            for split in splits:
                rows, files, n = spec.build(load_split(tokens_dir, name, split), seq_len, tokenizer), [], 0
                while True:
                    file = _shard_file(name, split, len(files))
                    shard = itertools.islice(rows, shard_rows)
                    if (partial / file).is_file():
                        done = sum(1 for _ in shard)
                    else:
                        done = _write_shard(partial, file, shard, spec.schema(seq_len), spec.index)
                    bar.update(done)
                    if done:
                        files.append(file)
                        n += done
                    if done < shard_rows:
                        break
                _check_rows(tokens_dir, name, split, n, spec, seq_len)
                entries[name][split] = {"rows": n, "files": files}
    return entries


def _shard_file(source: str, split: str, k: int) -> str:
    return f"{source}.{split}.{k:05d}.mindrecord"


def _check_rows(tokens_dir: Path, source: str, split: str, n: int, spec: RowSpec, seq_len: int) -> None:
    if split == "train" and n == 0:
        tokens = len(np.load(tokens_dir / f"{source}.{split}.npy", mmap_mode="r"))
        raise DataError(f"data source '{source}' has {tokens} training tokens after cleaning, fewer than one row of "
                        f"{spec.name} rows at data.seq_len={seq_len}; lower data.seq_len, add text to the source, "
                        f"or remove it from data.sources")


def load_split(tokens_dir: Path, source: str, split: str) -> Split:
    """What stage 1 wrote for one source's split (the loss mask only for samples, margins only for pairs)."""
    mask, margin = (tokens_dir / f"{source}.{split}.{what}.npy" for what in ("loss_mask", "margin"))
    return Split(f"data source '{source}' ({split})", np.load(tokens_dir / f"{source}.{split}.npy", mmap_mode="r"),
                 np.load(tokens_dir / f"{source}.{split}.offsets.npy"),
                 np.load(mask, mmap_mode="r") if mask.exists() else None,
                 np.load(margin) if margin.exists() else None)


def _write_shard(directory: Path, file: str, rows: Iterator[dict], schema: dict, index_fields) -> int:
    """Write `rows` as `directory/file` (+ .db) through a tmp directory (the file's own name is in its header);
    returns how many rows it held, 0 (and no file) when `rows` is empty."""
    batch = list(itertools.islice(rows, WRITE_BATCH))
    if not batch:
        return 0
    tmp = directory / f".tmp-{socket.gethostname()}-{os.getpid()}"
    tmp.mkdir()
    n = 0
    try:
        with writing(directory / file):
            writer = FileWriter(str(tmp / file), shard_num=1)
            writer.add_schema(schema, "rows")
            if index_fields:
                writer.add_index(list(index_fields))
            while batch:
                writer.write_raw_data(batch)
                n += len(batch)
                report(len(batch))
                batch = list(itertools.islice(rows, WRITE_BATCH))
            writer.commit()
            os.replace(tmp / f"{file}.db", directory / f"{file}.db")
            os.replace(tmp / file, directory / file)  # last: the shard counts as written once this is there
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n


def _window(tokens: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """tokens[lo:hi] as int32. A memory-mapped split is read with plain reads instead: every page of a mapping
    that was touched stays in the process's resident set until it is unmapped, so packing a split through the
    map would hold the whole split by the end."""
    if not (isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap)):  # not a whole file's map
        return np.asarray(tokens[lo:hi], dtype=np.int32)
    with open(tokens.filename, "rb") as f:
        f.seek(tokens.offset + lo * tokens.itemsize)
        return np.fromfile(f, tokens.dtype, min(hi, len(tokens)) - lo).astype(np.int32)


def _rows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, start: int, stop: int) -> Iterator[dict]:
    window = _window(tokens, start * seq_len, stop * seq_len + 1)
    starts = offsets[:-1]  # document starts; the last offset is the stream's end
    for i in range(start, stop):
        first = i * seq_len
        lo, hi = np.searchsorted(starts, [first + 1, first + seq_len + 1])  # starts inside (first, last]
        yield {"input_ids": window[first - start * seq_len:first - start * seq_len + seq_len + 1],
               "segment_starts": np.concatenate([[0], starts[lo:hi] - first]).astype(np.int32),
               "first_doc": int(np.searchsorted(starts, first, side="right") - 1)}
