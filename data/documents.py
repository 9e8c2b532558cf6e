"""Stage 1 of prepare: raw sources -> cleaned, deduplicated, split and tokenized documents (no seq_len).

Writes into `out`:
  tokenizer.model                       trained here on the train split (or a copy of data.tokenizer.path)
  tokens/<source>.<split>.npy           the split's documents in reading order, each one's ids then eos
                                        (uint16, or uint32 for vocabularies over 65536)
  tokens/<source>.<split>.offsets.npy   int64 start of every document in it, then its length
  meta.json                             per source: documents (chars, UTF-8 bytes) read, removed by each
                                        cleaning step, kept; per split: documents, chars, tokens; the
                                        tokenizer's special ids; seconds per step
Cleaning and tokenizing run in `data.num_workers` processes.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from base.schema import CleaningConfig, DataConfig, TokenizerConfig
from data.cleaning import FILTERS, UNICODE_FORMS, clean_batch
from data.dedup import STEPS, Deduplicator
from data.errors import DataError
from data.parallel import WorkerPool, chunk_by_size
from data.sources import read_documents
from data.tokenizer import Tokenizer, build_tokenizer, encode_documents

SPLITS = ("train", "val")
CHUNK_CHARS = 1_000_000  # text sent to a worker at a time


def build_documents(cfg: DataConfig, out: Path) -> dict:
    """Run stage 1 for `cfg` into the empty directory `out`; returns the meta it wrote."""
    lap = _Laps()
    raw = {s.name: list(tqdm(read_documents(s), desc=f"read {s.name}", unit="doc", leave=False))
           for s in cfg.sources}
    lap("read")
    cleaning_node = OmegaConf.structured(cfg.cleaning)
    with WorkerPool(cfg.num_workers) as pool:
        kept, counts = clean_and_dedup(raw, OmegaConf.to_object(cleaning_node), pool)
        lap("clean_and_dedup")
        splits = {(name, split): docs for name in kept
                  for split, docs in zip(SPLITS, split_documents(kept[name], cfg.val_fraction))}
        tokenizer = build_tokenizer(cfg.tokenizer, {name: splits[name, "train"] for name in kept},
                                    out / "tokenizer.model")
        lap("tokenizer")
        (out / "tokens").mkdir()
        for (name, split), (tokens, offsets) in zip(splits, tokenize(tokenizer, list(splits.values()), pool)):
            np.save(out / "tokens" / f"{name}.{split}.npy", tokens)
            np.save(out / "tokens" / f"{name}.{split}.offsets.npy", offsets)
            counts[name][split] = {"docs": len(splits[name, split]), "chars": sum(map(len, splits[name, split])),
                                   "tokens": int(offsets[-1])}
        lap("tokenize")
    meta = {"name": cfg.name, "dtype": tokenizer.token_dtype.name, "splits": list(SPLITS),
            "tokenizer": _tokenizer_meta(tokenizer, cfg.tokenizer),
            "cleaning": OmegaConf.to_container(cleaning_node), "sources": counts, "seconds": lap.seconds}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def clean_and_dedup(raw: Dict[str, List[str]], cfg: CleaningConfig,
                    pool: WorkerPool) -> Tuple[Dict[str, List[str]], Dict[str, dict]]:
    """(kept documents per source, counts per source): the filters run in `pool`, dedup here, in order."""
    if cfg.unicode_form not in UNICODE_FORMS:
        raise DataError(f"data.cleaning.unicode_form: got {cfg.unicode_form!r}; choose one of "
                        f"{', '.join(UNICODE_FORMS)}")
    chunks = [(name, chunk) for name, docs in raw.items() for chunk in chunk_by_size(docs, len, CHUNK_CHARS)]
    results = pool.map(clean_batch, [(chunk, cfg) for _, chunk in chunks], "clean",
                       [sum(map(len, chunk)) for _, chunk in chunks])
    dedup = Deduplicator(cfg)
    kept: Dict[str, List[str]] = {name: [] for name in raw}
    removed = {name: dict.fromkeys(FILTERS + STEPS, 0) for name in raw}
    for (name, _), batch in zip(chunks, results):
        for doc in batch:
            step = doc.removed_by or dedup.duplicate_of_earlier(doc)
            if step:
                removed[name][step] += 1
            else:
                kept[name].append(doc.text)
    counts = {}
    for name, docs in raw.items():
        counts[name] = {"docs_read": len(docs), "chars_read": sum(map(len, docs)),
                        "bytes_read": sum(len(d.encode()) for d in docs), "removed": removed[name],
                        "docs_kept": len(kept[name])}
        print(f"[data] {name}: {len(docs):,} documents read, {len(kept[name]):,} kept; removed "
              + ", ".join(f"{k} {v:,}" for k, v in removed[name].items()), flush=True)
        if not kept[name]:
            raise DataError(f"data source '{name}': cleaning removed all {len(docs)} documents ("
                            + ", ".join(f"{k}: {v}" for k, v in removed[name].items() if v)
                            + "); relax the data.cleaning keys named here, or check the source's text")
    return kept, counts


def split_documents(docs: Sequence[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """(train, val), each in source order. The round(val_fraction * n) documents with the lowest hash of
    their text are held out, at least one when val_fraction > 0 and at most n - 1."""
    n_val = min(max(round(val_fraction * len(docs)), int(val_fraction > 0)), len(docs) - 1)
    val = set(sorted(range(len(docs)), key=lambda i: _unit_hash(docs[i]))[:n_val])
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


def tokenize(tokenizer: Tokenizer, doc_lists: List[List[str]],
             pool: WorkerPool) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per list of documents: (their ids, each document's followed by eos, concatenated; int64 start of
    every document, then the total)."""
    chunks = [(i, chunk) for i, docs in enumerate(doc_lists) for chunk in chunk_by_size(docs, len, CHUNK_CHARS)]
    results = pool.map(encode_documents, [(str(tokenizer.path), chunk) for _, chunk in chunks], "tokenize",
                       [sum(map(len, chunk)) for _, chunk in chunks])
    arrays: List[List[np.ndarray]] = [[] for _ in doc_lists]
    for (i, _), batch in zip(chunks, results):
        arrays[i] += batch
    out = []
    for docs in arrays:
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in docs])]).astype(np.int64)
        out.append((np.concatenate(docs) if docs else np.zeros(0, tokenizer.token_dtype), offsets))
    return out


class _Laps:
    """Wall-clock seconds of consecutive steps, for meta.json."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = round(now - self._last, 3)
        self._last = now


def _tokenizer_meta(tokenizer: Tokenizer, cfg: TokenizerConfig) -> Dict[str, object]:
    return {"vocab_size": tokenizer.vocab_size, "model_type": cfg.model_type,
            "trained_here": cfg.path is None, "pad_id": tokenizer.pad_id, "unk_id": tokenizer.unk_id,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1) from the text."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64
