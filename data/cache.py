"""The prepared-data cache: build each stage once, resumably, and find it again.

Layout, `<data.cache_dir>/<key>/` (one per distinct input, shared by every preset and mix over it):
  tokenizer.model, tokens/, meta.json   stage 1 (data/documents.py): cleaned, split, tokenized documents
  rows-<seq_len>/                       stage 2 (data/packing.py): MindRecord rows for one seq_len, in the
  rows-<spec>-<seq_len>/                objective's row layout (PACKED for pretraining; data/rows.py)
`key` hashes everything stage 1 depends on: the source configs with the path, size and mtime of every
file they read, data.cleaning, data.tokenizer (and its .model file), data.val_fraction, the sentencepiece
version and FORMAT_VERSION. Not data.name, data.weights or data.seq_len: mixes share the cache, and a new
seq_len only re-packs.

While a stage is built its finished parts wait beside it: stage 1's work units in `units/` and `<key>.work/`
(data/documents.py), stage 2's finished shards in `<rows dir>.partial/`. Each part is written in a private
tmp directory and renamed into place when complete, so a killed prepare loses only the parts in flight and
the next one continues from the rest; the result is the same bytes as an uninterrupted build. A build runs
under a file lock, so that concurrent processes (one per rank) build once while the others wait. Across
machines, `prepare_step` runs one step for a part of the work units (prepare.py part=i/n step=...).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import sentencepiece as spm
from omegaconf import OmegaConf

from base.outputs import file_lock
from base.registry import FORMATS
from base.schema import DataConfig
from data import documents
from data.documents import Work, build_documents
from data.errors import DataError
from data.packing import PACKED, pack_sources
from data.parallel import WorkerPool
from data.rows import RowSpec
from data.samples import build_samples, template_parts
from data.sources import fingerprint, source_files
from data.tokenizer import Tokenizer, pretrained_path

FORMAT_VERSION = 3
STEPS = ("clean", "plan", "tokenize")  # what prepare_step runs; the merge and packing follow in prepare()


@dataclass
class PreparedData:
    """Both stages for one data config and seq_len, complete on disk."""

    dir: Path  # stage 1
    rows_dir: Path  # stage 2
    meta: dict  # meta.json, plus seq_len, packing seconds, and per source and split its `rows` and `files`
    reused: bool  # True: nothing was built by this call
    columns: tuple = PACKED.columns  # what a row holds that batches are made of (the RowSpec's columns)

    @property
    def sources(self) -> List[str]:
        return list(self.meta["sources"])

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.dir / "tokenizer.model")

    def tokens(self, source: str, split: str) -> np.ndarray:
        return np.load(self.dir / "tokens" / f"{source}.{split}.npy", mmap_mode="r")

    def doc_offsets(self, source: str, split: str) -> np.ndarray:
        return np.load(self.dir / "tokens" / f"{source}.{split}.offsets.npy")

    def rows(self, split: str) -> Dict[str, int]:
        return {name: m[split]["rows"] for name, m in self.meta["sources"].items()}

    def shard_files(self, source: str, split: str) -> List[str]:
        return [str(self.rows_dir / f) for f in self.meta["sources"][source][split]["files"]]


def prepare(cfg: DataConfig, spec: RowSpec = PACKED) -> PreparedData:
    """Return the prepared data for `cfg` in `spec`'s row layout, building whatever is missing."""
    _check_not_reimported()
    root = Path(cfg.cache_dir) / cache_key(cfg)
    samples = _sample_sources(cfg)
    rows_dir = root / spec.dir_name(cfg.seq_len)
    root.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(root.with_name(root.name + ".lock")), WorkerPool(cfg.num_workers) as pool:
        built = False
        if not root.is_dir():
            if samples:
                _build_once(root, lambda tmp: build_samples(cfg, tmp))
            else:
                work = Work.of(cfg, root.name)
                _build_once(root, lambda tmp: build_documents(cfg, work, tmp, pool))
                work.remove()
            built = True
        meta = json.loads((root / "meta.json").read_text())
        if not rows_dir.is_dir():
            print(f"[data] building {rows_dir}", flush=True)
            pack_sources(root / "tokens", rows_dir, list(meta["sources"]), meta["splits"], cfg.seq_len,
                         cfg.shard_rows, spec, Tokenizer(root / "tokenizer.model"), pool)
            built = True
    index = json.loads((rows_dir / "index.json").read_text())
    meta["seq_len"], meta["seconds"]["pack"] = index["seq_len"], index["seconds"]
    for name, entry in index["sources"].items():
        for split, rows in entry.items():
            meta["sources"][name][split].update(rows)
    print(f"[data] {'reusing' if not built else 'built'} {rows_dir}", flush=True)
    return PreparedData(root, rows_dir, meta, reused=not built, columns=spec.columns)


def prepare_step(cfg: DataConfig, step: str, part: Tuple[int, int] = (0, 1)) -> str:
    """One step of stage 1 for part i of n of the work units (clean, tokenize) or for all of them (plan),
    for a fan-out over machines that share data.cache_dir; `prepare` then merges. Returns what it did."""
    _check_not_reimported()
    if _sample_sources(cfg):
        raise DataError(f"data '{cfg.name}' holds instruction samples, which prepare in one step: run prepare "
                        f"without step= and part=")
    key = cache_key(cfg)
    root = Path(cfg.cache_dir) / key
    if root.is_dir():
        return f"{root} is already prepared"
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Work.of(cfg, key)
    if step == "plan":
        with file_lock(root.with_name(root.name + ".lock")):
            counts = documents.plan(cfg, work)["sources"]
        return f"planned {len(work.units)} work units: " + ", ".join(
            f"{name} {c['docs_kept']:,} of {c['docs_read']:,} documents kept" for name, c in counts.items())
    run = {"clean": documents.clean, "tokenize": documents.tokenize}[step]
    with WorkerPool(cfg.num_workers) as pool:
        done = run(cfg, work, part, pool)
    mine = len(work.mine(part))
    did = {"clean": "cleaned", "tokenize": "tokenized"}[step]
    return f"part {part[0]}/{part[1]}: {did} {done} of its {mine} work units ({mine - done} already done)"


def cache_key(cfg: DataConfig) -> str:
    """12 hex digits of a hash over everything stage 1 depends on."""
    names = [s.name for s in cfg.sources]
    if not names:
        raise DataError(f"data '{cfg.name}' has no sources; add some to data.sources")
    if len(set(names)) < len(names):
        raise DataError(f"data.sources names must be unique, got {names}")
    tok = cfg.tokenizer
    tok_path = pretrained_path(tok)
    spec = {
        **({"template": template_parts(cfg.template), "ties": [s.ties for s in cfg.sources],
            "val_files": [[fingerprint(Path(f)) for f in s.val_paths] for s in cfg.sources]}
           if _sample_sources(cfg) else {}),
        "format": FORMAT_VERSION,
        "sentencepiece": spm.__version__,
        "val_fraction": cfg.val_fraction,
        "cleaning": OmegaConf.to_container(OmegaConf.structured(cfg.cleaning)),
        "sources": [{"name": s.name, "kind": s.kind, "paths": list(s.paths), "text_field": s.text_field,
                     "max_chars": s.max_chars, "files": [fingerprint(f) for f in source_files(s)]}
                    for s in cfg.sources],
        # a given tokenizer by its bytes, not its path: every run of a sweep carries its own copy of the same file
        "tokenizer": {"model_type": tok.model_type, "vocab_size": tok.vocab_size, "sample_chars": tok.sample_chars,
                      "character_coverage": tok.character_coverage,
                      **({"user_symbols": list(tok.user_symbols)} if tok.user_symbols else {}),
                      "file": hashlib.sha256(tok_path.read_bytes()).hexdigest() if tok_path else None},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _check_not_reimported() -> None:
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own test for this
        raise DataError("prepare() was called while a worker process re-imported the main script: put the code "
                        "that calls build_data/prepare under `if __name__ == \"__main__\":` (workers are spawned)")


def _sample_sources(cfg: DataConfig) -> bool:
    """True when every source holds instruction samples, False when all hold documents; a mix is an error."""
    kinds = {s.kind in FORMATS for s in cfg.sources}
    if len(kinds) > 1:
        raise DataError(f"data '{cfg.name}' mixes instruction samples ({', '.join(FORMATS)}) with documents; "
                        f"prepare them as two data configs")
    return kinds == {True}


def _build_once(final: Path, build) -> None:
    """Build `final` through a tmp sibling renamed into place. Call under the lock: tmp siblings left by a
    killed build are removed first, and a failed build removes its own."""
    for stale in final.parent.glob(final.name + ".tmp-*"):
        shutil.rmtree(stale)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    print(f"[data] building {final}", flush=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp)
        raise
    os.replace(tmp, final)

