"""Tokenize every source once into a cache of packed token streams.

Cache layout, `<data.cache_dir>/<data.name>-<key>/`:
  tokenizer.model            sentencepiece model (trained here, or a copy of data.tokenizer.path)
  train.npy, val.npy         1-D token streams, uint16 (uint32 for vocabularies over 65535): every
                             document followed by eos, sources concatenated in config order
  train_docs.npy, val_docs.npy   int64 start offsets of the documents in the stream, plus its length
  meta.json                  per source and split: documents, chars, tokens and where they start;
                             the tokenizer's size and special ids
`key` hashes everything that changes these files (source configs, the size and mtime of every source
file, the tokenizer config, val_fraction, FORMAT_VERSION), not seq_len: rows are cut at load time.
A directory is built as `<dir>.tmp-<pid>` and renamed into place, under a file lock so concurrent
processes (one per rank) build it once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from conf.schema import DataConfig, TokenizerConfig
from data.errors import DataError
from data.sources import read_documents, source_files
from data.tokenizer import Tokenizer, build_tokenizer, pretrained_path

FORMAT_VERSION = 1
SPLITS = ("train", "val")


@dataclass
class PreparedData:
    """A complete cache directory."""

    dir: Path
    meta: dict
    reused: bool  # True: found in the cache, False: built by this call

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.dir / f"{split}.npy", mmap_mode="r")

    def doc_offsets(self, split: str) -> np.ndarray:
        return np.load(self.dir / f"{split}_docs.npy")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.dir / "tokenizer.model")


def prepare(cfg: DataConfig) -> PreparedData:
    """Return the cache directory for `cfg`, building it first if needed."""
    final = Path(cfg.cache_dir) / f"{cfg.name}-{cache_key(cfg)}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.with_name(final.name + ".lock")):
        reused = (final / "meta.json").is_file()
        if reused:
            print(f"[data] reusing {final}", flush=True)
        else:
            for stale in final.parent.glob(final.name + ".tmp-*"):  # left by a killed build
                shutil.rmtree(stale)
            tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
            tmp.mkdir()
            print(f"[data] building {final}", flush=True)
            _build(cfg, tmp)
            os.replace(tmp, final)
    return PreparedData(final, _read_meta(final), reused)


def cache_key(cfg: DataConfig) -> str:
    """12 hex digits of a hash over everything that changes the prepared data."""
    _check_sources(cfg)
    tok = cfg.tokenizer
    tok_path = pretrained_path(tok)
    spec = {
        "format": FORMAT_VERSION,
        "sentencepiece": spm.__version__,
        "val_fraction": cfg.val_fraction,
        "sources": [{"name": s.name, "kind": s.kind, "paths": list(s.paths), "text_field": s.text_field,
                     "max_chars": s.max_chars, "files": [_fingerprint(f) for f in source_files(s)]}
                    for s in cfg.sources],
        "tokenizer": {"model_type": tok.model_type, "vocab_size": tok.vocab_size,
                      "sample_chars": tok.sample_chars, "path": tok.path,
                      "file": _fingerprint(tok_path) if tok_path else None},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def split_documents(docs: Sequence[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """(train, val), each in source order. The round(val_fraction * n) documents with the lowest hash of
    their text are held out, at least one when val_fraction > 0 and at most n - 1."""
    n_val = min(max(round(val_fraction * len(docs)), int(val_fraction > 0)), len(docs) - 1)
    val = set(sorted(range(len(docs)), key=lambda i: _unit_hash(docs[i]))[:n_val])
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


def _build(cfg: DataConfig, out: Path) -> None:
    splits = {}
    for source in cfg.sources:
        docs = list(tqdm(read_documents(source), desc=f"read {source.name}", unit="doc", leave=False))
        splits[source.name] = dict(zip(SPLITS, split_documents(docs, cfg.val_fraction)))
    tokenizer = build_tokenizer(cfg.tokenizer, {name: s["train"] for name, s in splits.items()},
                                out / "tokenizer.model")
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    meta = {"format": FORMAT_VERSION, "name": cfg.name, "dtype": np.dtype(dtype).name,
            "tokenizer": _tokenizer_meta(tokenizer, cfg.tokenizer), "sources": {}, "splits": {}}
    for split in SPLITS:
        split_docs = [doc for name in splits for doc in splits[name][split]]
        stream = _pack(tokenizer, split_docs, dtype, desc=f"tokenize {split}")
        starts = np.concatenate([[0], np.cumsum([len(d) for d in stream])]).astype(np.int64)
        np.save(out / f"{split}.npy", np.concatenate(stream) if stream else np.zeros(0, dtype))
        np.save(out / f"{split}_docs.npy", starts)
        first_doc = 0
        for name in splits:
            n = len(splits[name][split])
            meta["sources"].setdefault(name, {})[split] = {
                "docs": n, "chars": sum(map(len, splits[name][split])),
                "tokens": int(starts[first_doc + n] - starts[first_doc]),
                "first_doc": first_doc, "first_token": int(starts[first_doc])}
            first_doc += n
        meta["splits"][split] = {"docs": len(split_docs), "tokens": int(starts[-1])}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"[data] {meta['splits']['train']['tokens']:,} train and {meta['splits']['val']['tokens']:,} val "
          f"tokens from {len(cfg.sources)} source(s)", flush=True)


def _pack(tokenizer: Tokenizer, docs: List[str], dtype: type, desc: str, chunk: int = 256) -> List[np.ndarray]:
    """Each document's ids followed by eos, one array per document."""
    out = []
    with tqdm(total=sum(map(len, docs)), desc=desc, unit="char", unit_scale=True, leave=False) as bar:
        for i in range(0, len(docs), chunk):
            batch = docs[i:i + chunk]
            out += [np.array(ids + [tokenizer.eos_id], dtype=dtype) for ids in tokenizer.encode_batch(batch)]
            bar.update(sum(map(len, batch)))
    return out


def _tokenizer_meta(tokenizer: Tokenizer, cfg: TokenizerConfig) -> Dict[str, object]:
    return {"vocab_size": tokenizer.vocab_size, "model_type": cfg.model_type,
            "trained_here": cfg.path is None, "pad_id": tokenizer.pad_id, "unk_id": tokenizer.unk_id,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def _check_sources(cfg: DataConfig) -> None:
    names = [s.name for s in cfg.sources]
    if not names:
        raise DataError(f"data '{cfg.name}' has no sources; add some to data.sources")
    if len(set(names)) < len(names):
        raise DataError(f"data.sources names must be unique, got {names}")


def _fingerprint(path: Path) -> List[object]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1) from the text."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
