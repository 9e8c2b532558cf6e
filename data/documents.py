"""Stage 1 of prepare: raw sources -> cleaned, deduplicated, split and tokenized documents (no seq_len).

Writes into `out`:
  tokenizer.model                       trained here on the train split (or a copy of data.tokenizer.path)
  tokens/<source>.<split>.npy           the split's documents in reading order, each one's ids then eos
                                        (uint16, or uint32 for vocabularies over 65536)
  tokens/<source>.<split>.offsets.npy   int64 start of every document in it, then its length
  meta.json                             per source: documents (chars, UTF-8 bytes) read, removed by each
                                        cleaning step, kept; per split: documents, chars, tokens; the
                                        tokenizer's special ids and what it was trained on; seconds per step

The corpus streams through four steps, so that memory does not grow with it (only a few bytes of keys per
document do, data/dedup.py) and finished work survives a kill. A work unit is ~64 MB of one source's input
(data/sources.py work_units).
  clean     per unit, in worker processes: read, normalize, filter, a batch of data.batch_chars at a time;
            the unit's kept text, digests, MinHash signatures and split hashes go to its directory. A unit
            depends on nothing else, so units can be cleaned anywhere, in any order (prepare.py part=i/n).
  plan      one pass over every unit in order: exact and near dedup over the digests and signatures (never
            the text: near duplicates across units, parts and sources are found here), the validation
            split, and the tokenizer, trained on a bounded sample of the training text; writes what becomes
            of each document of each unit (removed, train or val).
  tokenize  per unit again, in worker processes: the kept documents' ids, per split.
  merge     the units' ids concatenated into tokens/ in source order, and meta.json.
Every step writes into a temporary directory renamed into place when complete. Cleaned units live in
<cache_dir>/units/<hash of their files and the cleaning config>, so they are found again after any change
that leaves them valid (a file fixed elsewhere, another val_fraction); the rest in <cache_dir>/<key>.work/;
both go once the merge is done, but units that another unfinished build has claimed (Work.claim). The output
does not depend on how units were spread over workers, machines or runs: n parts then the plan, tokenize and
merge steps write the same bytes as one prepare. (datatrove splits its MinHash dedup into stages over per-task
signature files the same way, and Megatron's preprocess_data merges per-partition outputs as the merge step does;
here the dedup pass stays sequential so that the first copy in reading order is the one kept, whatever the
partition.)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from base.outputs import file_lock
from base.schema import CleaningConfig, DataConfig, SourceConfig, TokenizerConfig
from data.cleaning import FILTERS, UNICODE_FORMS, clean_batch
from data.dedup import STEPS, Deduplicator
from data.errors import DataError, writing
from data.minhash import NUM_PERM
from data.parallel import WorkerPool, report
from data.sources import Unit, fingerprint, no_documents, read_unit, source_files, work_units
from data.tokenizer import Tokenizer, build_tokenizer, encode_documents

SPLITS = ("train", "val")
FORMAT = 1  # of the cleaned units: bump when what clean_unit writes changes
SIG_BYTES = NUM_PERM * 4
REMOVED, TRAIN, VAL = 0, 1, 2  # what the plan makes of a document that passed the filters


@dataclass
class Work:
    """Where stage 1 of one cache key keeps its steps' outputs until the merge."""

    cache_dir: Path
    key: str
    sources: List[SourceConfig]
    units: List[Unit]  # every source's, in order
    unit_dirs: List[Path]

    @classmethod
    def of(cls, cfg: DataConfig, key: str) -> "Work":
        cleaning = OmegaConf.to_container(OmegaConf.structured(cfg.cleaning))
        units, dirs = [], []
        for source in cfg.sources:
            for unit in work_units(source):
                spec = {"format": FORMAT, "kind": source.kind, "text_field": source.text_field,
                        "max_chars": source.max_chars, "cleaning": cleaning,
                        "pieces": [[fingerprint(Path(p.path)), p.start, p.stop] for p in unit.pieces]}
                digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
                units.append(unit)
                dirs.append(Path(cfg.cache_dir) / "units" / digest)
        return cls(Path(cfg.cache_dir), key, list(cfg.sources), units, dirs)

    @property
    def root(self) -> Path:
        return self.cache_dir / f"{self.key}.work"

    @property
    def plan_dir(self) -> Path:
        return self.root / "plan"

    def tokens_dir(self, i: int) -> Path:
        return self.root / "tokens" / f"{i:06d}"

    def source(self, unit: Unit) -> SourceConfig:
        return next(s for s in self.sources if s.name == unit.source)

    def mine(self, part: Tuple[int, int]) -> List[int]:
        """The units of part i of n: every n-th, from the i-th (units are of similar size)."""
        return list(range(part[0], len(self.units), part[1]))

    @property
    def units_lock(self) -> Path:
        return self.cache_dir / "units.lock"

    def claim(self) -> None:
        """Say that this work reads its cleaned units until it is removed: units are shared by every cache key
        whose sources and cleaning match, and a build of another key that finishes meanwhile keeps them."""
        claim = self.root / "units.json"
        if claim.is_file():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.units_lock), writing(self.root):
            tmp = _tmp(claim)
            tmp.write_text(json.dumps([d.name for d in self.unit_dirs]))
            os.replace(tmp, claim)

    def remove(self) -> None:
        """Drop the work once merged: its own directory, then its cleaned units (with what killed runs left beside
        them) but those another unfinished work has claimed."""
        with file_lock(self.units_lock):
            shutil.rmtree(self.root, ignore_errors=True)
            claimed = {name for claim in self.cache_dir.glob("*.work/units.json")
                       for name in json.loads(claim.read_text())}
            for d in self.unit_dirs:
                if d.name not in claimed:
                    for path in [d, *d.parent.glob(d.name + ".tmp-*")]:
                        shutil.rmtree(path, ignore_errors=True)
            try:
                (self.cache_dir / "units").rmdir()  # unless another build's units are there
            except OSError:
                pass


def build_documents(cfg: DataConfig, work: Work, out: Path, pool: WorkerPool) -> dict:
    """Every step of stage 1 not done yet, then the merge into the empty directory `out`; returns the meta."""
    clean(cfg, work, (0, 1), pool)
    plan(cfg, work)
    tokenize(cfg, work, (0, 1), pool)
    return merge(cfg, work, out)


# --- clean ----------------------------------------------------------------------------------------------

def clean(cfg: DataConfig, work: Work, part: Tuple[int, int], pool: WorkerPool) -> int:
    """Clean part i of n's units that are not cleaned yet; returns how many it cleaned."""
    if cfg.cleaning.unicode_form not in UNICODE_FORMS:
        raise DataError(f"data.cleaning.unicode_form: got {cfg.cleaning.unicode_form!r}; choose one of "
                        f"{', '.join(UNICODE_FORMS)}")
    work.claim()
    todo = [i for i in work.mine(part) if not work.unit_dirs[i].is_dir()]
    if not todo:
        return 0
    start = time.perf_counter()
    cleaning = OmegaConf.to_object(OmegaConf.structured(cfg.cleaning))
    tasks = [(work.source(work.units[i]), work.units[i], cleaning, work.unit_dirs[i], cfg.batch_chars) for i in todo]
    for _ in pool.run(clean_unit, tasks, "clean", sum(work.units[i].size for i in todo)):
        pass
    _record_seconds(work, "clean", time.perf_counter() - start)
    return len(todo)


def clean_unit(source: SourceConfig, unit: Unit, cfg: CleaningConfig, out: Path, batch_chars: int) -> None:
    """Read, normalize and filter one unit into `out` (runs in a worker process). Per document read:
    status.npy (uint8: 0 kept, else 1 + the index of the filter removing it), chars.npy and bytes.npy (of the
    raw text). Per kept one: its normalized text (texts.bin, UTF-8, at offsets.npy), text_chars.npy,
    digests.npy (S16), split_hashes.npy (float64 in [0, 1)) and its MinHash signature (signatures.bin, uint32
    x NUM_PERM each; only with near_dedup). Reading stops at the first document that would take the unit past
    the source's max_chars (later ones cannot be in the source's prefix); capped.npy says whether it did."""
    tmp = _tmp(out)
    capped, n_chars = False, 0
    columns: Dict[str, list] = {k: [] for k in ("status", "chars", "bytes", "lengths", "text_chars", "digests",
                                                 "split_hashes")}
    try:
        with writing(out.parent.parent, f"the cleaned text of {unit.pieces[0].path}"), _made(tmp), \
                open(tmp / "texts.bin", "wb") as texts, \
                open(tmp / "signatures.bin", "wb") as sigs:
            for batch in _batches(read_unit(source, unit), batch_chars):
                if source.max_chars:
                    fits = _within_max_chars(np.array([len(d) for d in batch]), source.max_chars - n_chars)
                    capped, batch = fits < len(batch), batch[:fits]
                    n_chars += sum(map(len, batch))
                for raw, doc in zip(batch, clean_batch(batch, cfg)):
                    _record(columns, raw, doc, texts, sigs if cfg.near_dedup else None)
                if capped:
                    break
            _save_columns(tmp, columns, capped)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise



def _record(columns: Dict[str, list], raw: str, doc, texts, sigs) -> None:
    """One read document's columns; a kept one's text into `texts` and, with near_dedup (`sigs` not None), its
    MinHash signature into `sigs`."""
    columns["status"].append(0 if doc.removed_by is None else 1 + FILTERS.index(doc.removed_by))
    columns["chars"].append(len(raw))
    columns["bytes"].append(len(raw.encode()))
    if doc.removed_by is not None:
        return
    data = doc.text.encode()
    texts.write(data)
    columns["lengths"].append(len(data))
    columns["text_chars"].append(len(doc.text))
    columns["digests"].append(doc.digest)
    columns["split_hashes"].append(split_hash(data))
    if sigs is not None:
        sigs.write(doc.signature.tobytes())


def _save_columns(tmp: Path, columns: Dict[str, list], capped: bool) -> None:
    """clean_unit's .npy files from its columns."""
    np.save(tmp / "status.npy", np.array(columns["status"], np.uint8))
    np.save(tmp / "chars.npy", np.array(columns["chars"], np.int64))
    np.save(tmp / "bytes.npy", np.array(columns["bytes"], np.int64))
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(columns["lengths"], dtype=np.int64)]))
    np.save(tmp / "text_chars.npy", np.array(columns["text_chars"], np.int64))
    np.save(tmp / "digests.npy", np.array(columns["digests"], "S16"))
    np.save(tmp / "split_hashes.npy", np.array(columns["split_hashes"], np.float64))
    np.save(tmp / "capped.npy", np.array(capped))


def split_hash(text: bytes) -> float:
    """A stable number in [0, 1) from the text (UTF-8): the documents with the lowest are held out."""
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _batches(docs: Iterator[str], batch_chars: int) -> Iterator[List[str]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- plan -----------------------------------------------------------------------------------------------

def plan(cfg: DataConfig, work: Work) -> dict:
    """Dedup, split and the tokenizer over every cleaned unit, in order (cleaning any unit that is not);
    written atomically to work.plan_dir. Returns plan.json's content."""
    if (work.plan_dir / "plan.json").is_file():
        return json.loads((work.plan_dir / "plan.json").read_text())
    work.claim()
    missing = [str(work.units[i].pieces[0].path) for i, d in enumerate(work.unit_dirs) if not d.is_dir()]
    if missing:
        print(f"[data] cleaning the {len(missing)} work units no part has cleaned yet (from {missing[0]})", flush=True)
        with WorkerPool(cfg.num_workers) as pool:
            clean(cfg, work, (0, 1), pool)
    start = time.perf_counter()
    tmp = _tmp(work.plan_dir)
    try:
        with writing(work.plan_dir), _made(tmp / "assign"):
            counts, train_docs = _dedup_and_split(cfg, work, tmp / "assign")
            lap = time.perf_counter()
            tokenizer = build_tokenizer(cfg.tokenizer, train_docs, tmp / "tokenizer.model",
                                        {name: counts[name]["train"]["chars"] for name in counts})
            result = {"sources": counts, "tokenizer_sample": tokenizer.sample,
                      "seconds": {"dedup": round(lap - start, 3), "tokenizer": round(time.perf_counter() - lap, 3)}}
            (tmp / "plan.json").write_text(json.dumps(result, indent=2) + "\n")
        _publish(tmp, work.plan_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _dedup_and_split(cfg: DataConfig, work: Work, assign_dir: Path) -> Tuple[Dict[str, dict], Dict[str, "Texts"]]:
    """Per source: its counts, and its training documents (read back from the units on demand); writes each
    unit's assignment (uint8 per document that passed the filters, up to max_chars: REMOVED, TRAIN or VAL)."""
    cleaning = OmegaConf.to_object(OmegaConf.structured(cfg.cleaning))
    offered: List[Tuple[int, int]] = []  # per unit, in order: (its first document's dedup id, documents offered)
    dedup = Deduplicator(cleaning, lambda doc_id: _signature(work, offered, doc_id))
    counts: Dict[str, dict] = {}
    train_docs: Dict[str, Texts] = {}
    with tqdm(total=len(work.units), desc="dedup", unit="unit", leave=False) as bar:
        for source in cfg.sources:
            mine = [i for i, u in enumerate(work.units) if u.source == source.name]
            dirs = [work.unit_dirs[i] for i in mine]
            counts[source.name], kept = _dedup_source(source, dirs, dedup, offered, bar)
            assigned = _split(dirs, kept, cfg.val_fraction)
            for split, code in zip(SPLITS, (TRAIN, VAL)):
                counts[source.name][split] = {"docs": 0, "chars": 0}
            for i, d, assign in zip(mine, dirs, assigned):
                np.save(assign_dir / f"{i:06d}.npy", assign)
                text_chars = np.load(d / "text_chars.npy")[:len(assign)]
                for split, code in zip(SPLITS, (TRAIN, VAL)):
                    counts[source.name][split]["docs"] += int((assign == code).sum())
                    counts[source.name][split]["chars"] += int(text_chars[assign == code].sum())
            train_docs[source.name] = Texts(dirs, [np.flatnonzero(a == TRAIN) for a in assigned])
    n = sum(m for _, m in offered)
    print(f"[data] dedup held the keys of {n:,} documents in {dedup.nbytes / 1e6:.1f} MB", flush=True)
    return counts, train_docs


def _dedup_source(source: SourceConfig, dirs: List[Path], dedup: Deduplicator, offered: List[Tuple[int, int]],
                  bar: tqdm) -> Tuple[dict, List[np.ndarray]]:
    """Offer one source's units to dedup in order, up to its max_chars; (its counts, which of each unit's
    offered documents were kept)."""
    removed = dict.fromkeys(FILTERS + STEPS, 0)
    read = {"docs_read": 0, "chars_read": 0, "bytes_read": 0}
    kept: List[np.ndarray] = []
    capped = False  # max_chars reached: nothing of the later units is read
    for d in dirs:
        status, chars = np.load(d / "status.npy"), np.load(d / "chars.npy")
        n = len(chars)
        if source.max_chars:
            n = 0 if capped else _within_max_chars(chars, source.max_chars - read["chars_read"])
            capped = capped or n < len(chars) or bool(np.load(d / "capped.npy"))
        read["docs_read"] += n
        read["chars_read"] += int(chars[:n].sum())
        read["bytes_read"] += int(np.load(d / "bytes.npy")[:n].sum())
        for f, k in enumerate(np.bincount(status[:n], minlength=1 + len(FILTERS))[1:]):
            removed[FILTERS[f]] += int(k)
        m = int((status[:n] == 0).sum())  # the unit's first m kept documents are within max_chars
        sigs = (np.fromfile(d / "signatures.bin", np.uint32, m * NUM_PERM).reshape(m, NUM_PERM)
                if dedup.near else None)
        steps = dedup.offer(np.load(d / "digests.npy")[:m], sigs)
        offered.append((offered[-1][0] + offered[-1][1] if offered else 0, m))
        for s, k in enumerate(np.bincount(steps, minlength=1 + len(STEPS))[1:]):
            removed[STEPS[s]] += int(k)
        kept.append(steps == 0)
        bar.update(1)
    if read["docs_read"] == 0:
        raise no_documents(source, source_files(source))
    n_kept = sum(int(k.sum()) for k in kept)
    print(f"[data] {source.name}: {read['docs_read']:,} documents read, {n_kept:,} kept; removed "
          + ", ".join(f"{k} {v:,}" for k, v in removed.items()), flush=True)
    if n_kept == 0:
        raise DataError(f"data source '{source.name}': cleaning removed all {read['docs_read']} documents ("
                        + ", ".join(f"{k}: {v}" for k, v in removed.items() if v)
                        + "); relax the data.cleaning keys named here, or check the source's text")
    return {**read, "removed": removed, "docs_kept": n_kept}, kept


def _within_max_chars(chars: np.ndarray, budget: int) -> int:
    """How many of the documents (their lengths, in order) fit in `budget` characters: up to the first that
    does not."""
    return int(np.searchsorted(np.cumsum(chars), budget, side="right"))


def _split(dirs: List[Path], kept: List[np.ndarray], val_fraction: float) -> List[np.ndarray]:
    """Per unit, each offered document's fate. Of the n kept documents of the source, the round(val_fraction *
    n) with the lowest split hash are held out (ties: the earlier), at least one when val_fraction > 0 and at
    most n - 1. Holds 8 bytes per kept document of the source (16 while choosing)."""
    flat = np.concatenate([np.load(d / "split_hashes.npy")[:len(k)][k] for d, k in zip(dirs, kept)])
    n = len(flat)
    n_val = min(max(round(val_fraction * n), int(val_fraction > 0)), n - 1)
    val = np.zeros(n, bool)
    if n_val:
        cut = np.partition(flat, n_val - 1)[n_val - 1]
        val[flat < cut] = True
        val[np.flatnonzero(flat == cut)[:n_val - int(val.sum())]] = True
    out, at = [], 0
    for k in kept:
        assign = np.where(k, TRAIN, REMOVED).astype(np.uint8)
        assign[np.flatnonzero(k)[val[at:at + int(k.sum())]]] = VAL
        at += int(k.sum())
        out.append(assign)
    return out


def _signature(work: Work, offered: List[Tuple[int, int]], doc_id: int) -> np.ndarray:
    """The signature of the `doc_id`-th document offered to dedup, read back from its unit."""
    unit = int(np.searchsorted([first for first, _ in offered], doc_id, side="right")) - 1
    row = doc_id - offered[unit][0]
    with open(work.unit_dirs[unit] / "signatures.bin", "rb") as f:
        f.seek(row * SIG_BYTES)
        return np.frombuffer(f.read(SIG_BYTES), np.uint32)


class Texts(Sequence[str]):
    """Some of the cleaned documents of a few units, in order, read from disk when asked for (the tokenizer's
    sample visits a few thousand of them, whatever the corpus size)."""

    def __init__(self, unit_dirs: List[Path], rows: List[np.ndarray]):
        self.unit_dirs, self.rows = unit_dirs, rows
        self._ends = np.cumsum([len(r) for r in rows])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, i) -> str:
        unit = int(np.searchsorted(self._ends, i, side="right"))
        row = self.rows[unit][i - (self._ends[unit - 1] if unit else 0)]
        offsets = np.load(self.unit_dirs[unit] / "offsets.npy", mmap_mode="r")
        with open(self.unit_dirs[unit] / "texts.bin", "rb") as f:
            f.seek(int(offsets[row]))
            return f.read(int(offsets[row + 1] - offsets[row])).decode()


# --- tokenize -------------------------------------------------------------------------------------------

def tokenize(cfg: DataConfig, work: Work, part: Tuple[int, int], pool: WorkerPool) -> int:
    """Tokenize part i of n's units that are not tokenized yet (the plan must exist); returns how many."""
    if not (work.plan_dir / "plan.json").is_file():
        raise DataError(f"the tokenize step needs the plan of {work.root}: run `python prepare.py step=plan` "
                        f"(with the same data overrides) after every clean part has finished")
    work.claim()
    todo = [i for i in work.mine(part) if not work.tokens_dir(i).is_dir()]
    if not todo:
        return 0
    start = time.perf_counter()
    model = str(work.plan_dir / "tokenizer.model")
    tasks = [(work.unit_dirs[i], work.plan_dir / "assign" / f"{i:06d}.npy", model, work.tokens_dir(i),
              cfg.batch_chars) for i in todo]
    total = sum(int(np.load(work.unit_dirs[i] / "offsets.npy", mmap_mode="r")[-1]) for i in todo)
    for _ in pool.run(tokenize_unit, tasks, "tokenize", total):
        pass
    _record_seconds(work, "tokenize", time.perf_counter() - start)
    return len(todo)


def tokenize_unit(unit_dir: Path, assign_path: Path, model: str, out: Path, batch_chars: int) -> None:
    """One unit's kept documents as ids, each followed by eos, per split: <split>.bin (the token dtype) and
    <split>.lengths.npy (int64 per document); runs in a worker process."""
    assign = np.load(assign_path)
    offsets = np.load(unit_dir / "offsets.npy")
    tmp = _tmp(out)
    lengths: Dict[int, List[int]] = {TRAIN: [], VAL: []}
    try:
        with writing(out), _made(tmp), open(unit_dir / "texts.bin", "rb") as texts, \
                open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val:
            files = {TRAIN: train, VAL: val}
            for first, stop in _byte_batches(offsets[:len(assign) + 1], batch_chars):
                texts.seek(int(offsets[first]))
                data = texts.read(int(offsets[stop] - offsets[first]))
                rows = [r for r in range(first, stop) if assign[r] != REMOVED]
                cut = [data[offsets[r] - offsets[first]:offsets[r + 1] - offsets[first]].decode() for r in rows]
                for r, ids in zip(rows, encode_documents(model, cut)):
                    files[assign[r]].write(ids.tobytes())
                    lengths[assign[r]].append(len(ids))
                report(len(data))
            for code, split in ((TRAIN, "train"), (VAL, "val")):
                np.save(tmp / f"{split}.lengths.npy", np.array(lengths[code], np.int64))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _byte_batches(offsets: np.ndarray, batch_bytes: int) -> Iterator[Tuple[int, int]]:
    """Consecutive [first, stop) ranges of documents of about `batch_bytes` (at least one document each)."""
    first, n = 0, len(offsets) - 1
    while first < n:
        stop = max(int(np.searchsorted(offsets, offsets[first] + batch_bytes, side="left")), first + 1)
        stop = min(stop, n)
        yield first, stop
        first = stop


# --- merge ----------------------------------------------------------------------------------------------

def merge(cfg: DataConfig, work: Work, out: Path) -> dict:
    """tokens/, tokenizer.model and meta.json into the empty directory `out` from the plan and every unit's
    ids (build_documents has tokenized the units no part has); returns the meta written."""
    start = time.perf_counter()
    result = json.loads((work.plan_dir / "plan.json").read_text())
    counts = result["sources"]
    shutil.copyfile(work.plan_dir / "tokenizer.model", out / "tokenizer.model")
    tokenizer = Tokenizer(out / "tokenizer.model")
    (out / "tokens").mkdir()
    total = sum((work.tokens_dir(i) / f"{s}.bin").stat().st_size for i in range(len(work.units)) for s in SPLITS)
    with tqdm(total=total, desc="merge", unit="B", unit_scale=True, leave=False) as bar:
        for source in cfg.sources:
            mine = [i for i, u in enumerate(work.units) if u.source == source.name]
            for split in SPLITS:
                parts = [work.tokens_dir(i) / f"{split}.bin" for i in mine]
                lengths = [np.load(work.tokens_dir(i) / f"{split}.lengths.npy") for i in mine]
                offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
                path = out / "tokens" / f"{source.name}.{split}.npy"
                with writing(path):
                    _concatenate(parts, path, tokenizer.token_dtype, int(offsets[-1]), bar)
                    np.save(out / "tokens" / f"{source.name}.{split}.offsets.npy", offsets)
                counts[source.name][split]["tokens"] = int(offsets[-1])
    seconds = _recorded_seconds(work)
    meta = {"name": cfg.name, "dtype": tokenizer.token_dtype.name, "splits": list(SPLITS),
            "tokenizer": {**_tokenizer_meta(tokenizer, cfg.tokenizer),
                          **({"sample_chars": cfg.tokenizer.sample_chars, "sample": result["tokenizer_sample"]}
                             if result["tokenizer_sample"] else {})},
            "cleaning": OmegaConf.to_container(OmegaConf.structured(cfg.cleaning)), "sources": counts,
            "seconds": {"clean": seconds.get("clean", 0.0), **result["seconds"],
                        "tokenize": seconds.get("tokenize", 0.0), "merge": round(time.perf_counter() - start, 3)}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _concatenate(parts: List[Path], path: Path, dtype: np.dtype, n: int, bar: tqdm) -> None:
    """The raw arrays in `parts`, one after the other, as one .npy file (the bytes np.save would write)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (n,)})
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 24)
            bar.update(part.stat().st_size)


def _tokenizer_meta(tokenizer: Tokenizer, cfg: TokenizerConfig) -> Dict[str, object]:
    return {"vocab_size": tokenizer.vocab_size, "model_type": cfg.model_type,
            "trained_here": cfg.path is None, "pad_id": tokenizer.pad_id, "unk_id": tokenizer.unk_id,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


# --- the documents' split, as one list (instruction samples split this way too) ------------------------

def split_documents(docs: Sequence[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """(train, val), each in source order. The round(val_fraction * n) documents with the lowest split_hash
    of their text are held out, at least one when val_fraction > 0 and at most n - 1 (as the plan does)."""
    n_val = min(max(round(val_fraction * len(docs)), int(val_fraction > 0)), len(docs) - 1)
    val = set(sorted(range(len(docs)), key=lambda i: split_hash(docs[i].encode()))[:n_val])
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


# --- atomic directories and timings ---------------------------------------------------------------------

def _tmp(final: Path) -> Path:
    """A sibling of `final` private to this process, on any machine sharing the cache."""
    return final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")


@contextmanager
def _made(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True)
    yield


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` into place; if another process got there first, its copy (the same) stays."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp)


def _record_seconds(work: Work, step: str, seconds: float) -> None:
    path = work.root / "seconds" / f"{step}-{socket.gethostname()}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({step: seconds}))


def _recorded_seconds(work: Work) -> Dict[str, float]:
    """Wall seconds per step, summed over the processes that ran part of it."""
    total: Dict[str, float] = {}
    for path in sorted((work.root / "seconds").glob("*.json")):
        for step, seconds in json.loads(path.read_text()).items():
            total[step] = round(total.get(step, 0.0) + seconds, 3)
    return total
