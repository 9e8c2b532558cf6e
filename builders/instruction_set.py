"""The instruction set built from the corpus parsers' samples (builders/corpus_parsers.py): the checks, the
per-task caps, the held-out split by entry and the files (`python -m builders.instructions` is the CLI).

Rules. Every sample is `{"instruction", "input", "output", "task", "source", "entry", "id"}`: `entry` is
the key it was derived from (headword, command, qualified function name, article title, verse reference)
and `id` the corpus document's id. A sample is kept only when its copied text (the output; for the reverse
tasks the definition or docstring in the prompt) occurs in its document once whitespace runs are
collapsed, its output is non-empty and at most 1000 characters, and its (instruction, input) pair was not
seen before (the first stays; tasks in the order above). Each task is capped at `--max-per-task` samples
drawn with `--seed` (corpus order kept). The split is held out by entry: a sample is in val when a SHA-256
of (task family, entry key casefolded) falls below `--val-fraction`, so a headword, command, function,
article or verse is in one split only, for every task of its family (define_word and which_word of a word
go together); the split does not depend on the seed. Both files are shuffled with the seed. Output is a
function of the corpus files, the seed and the options only.
"""
import gzip
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from tqdm import tqdm

from base.errors import UserError
from base.outputs import output_dir
from base.paths import data_dir
from builders.corpus_parsers import SHARDS, TASKS, Doc, normalize

TOOL, OWN = "builders.instructions", ("train.jsonl", "val.jsonl", "stats.json")  # what --out holds (base/outputs.py)
MAX_OUTPUT_CHARS = 1000
FIELDS = ("instruction", "input", "output", "task", "source", "entry", "id")


def split_of(family: str, entry: str, val_fraction: float) -> str:
    """'val' or 'train', from a SHA-256 of (family, casefolded entry): stable across runs, seeds and machines."""
    digest = hashlib.sha256(f"{family}\x00{entry.casefold()}".encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2.0 ** 64 < val_fraction else "train"


def read_documents(paths: Iterable[os.PathLike]) -> Iterator[Doc]:
    """The documents of JSONL files (`.gz` through gzip), in order: the small helper that points the builder at
    arbitrary files (the tiny corpora in tests, the full shards in the CLI)."""
    for path in paths:
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    doc = json.loads(line)
                    yield {"text": doc["text"], "source": doc["source"], "id": doc["id"]}


def default_out_dir() -> Path:
    """<data dir>/instructions: ${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/instructions."""
    return data_dir() / "instructions"


class MissingCorpora(UserError, FileNotFoundError):
    """The corpora directory, or shards in it, are not there (a command-line setting: exit code 2)."""

    exit_code = 2


def existing_shards(corpora: os.PathLike, shards: Iterable[str]) -> List[Path]:
    """The paths of `shards` (relative to `corpora`), all present, or MissingCorpora naming what is not."""
    if not Path(corpora).is_dir():
        raise MissingCorpora(f"{corpora}: no such corpora directory; set --corpora or MINDLAB_CORPORA")
    paths = [Path(corpora) / shard for shard in shards]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise MissingCorpora(f"corpus shards not found: {', '.join(missing)} (set --corpora or MINDLAB_CORPORA)")
    return paths


def shard_paths(corpora: os.PathLike) -> List[Path]:
    return existing_shards(corpora, SHARDS.values())


def build(documents: Iterable[Doc], max_per_task: int = 4000, seed: int = 0, val_fraction: float = 0.05,
          tasks: Optional[Sequence[str]] = None) -> Tuple[List[dict], List[dict], dict]:
    """(train, val, stats) from corpus documents (any order of sources; each task reads the ones it knows)."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    docs = list(documents)
    by_id = {doc["id"]: doc for doc in docs}
    normalized: Dict[str, str] = {}
    seen = set()
    splits: Dict[str, List[dict]] = {"train": [], "val": []}
    stats: dict = {"seed": seed, "max_per_task": max_per_task, "val_fraction": val_fraction, "tasks": {},
                   "documents": {}}
    for doc in docs:
        stats["documents"][doc["source"]] = stats["documents"].get(doc["source"], 0) + 1
    for task in tqdm(list(tasks or TASKS), desc="[instructions] tasks", unit="task", mininterval=1.0):
        family, function = TASKS[task]
        dropped = {"empty_or_long": 0, "not_verbatim": 0, "duplicate": 0}
        kept = []
        raw = function(docs)
        for s in raw:
            if not s["output"].strip() or len(s["output"]) > MAX_OUTPUT_CHARS:
                dropped["empty_or_long"] += 1
                continue
            if s["id"] not in normalized:
                normalized[s["id"]] = normalize(by_id[s["id"]]["text"])
            if normalize(s["_check"]) not in normalized[s["id"]]:
                dropped["not_verbatim"] += 1
                continue
            key = (s["instruction"], s["input"])
            if key in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(key)
            kept.append({k: s[k] for k in FIELDS})
        if len(kept) > max_per_task:
            chosen = sorted(random.Random(f"{seed}/{task}").sample(range(len(kept)), max_per_task))
            kept = [kept[i] for i in chosen]
        counts = {"candidates": len(raw), **{f"dropped_{k}": v for k, v in dropped.items()},
                  "eligible": len(raw) - sum(dropped.values()), "train": 0, "val": 0}
        for s in kept:
            split = split_of(family, s["entry"], val_fraction)
            splits[split].append(s)
            counts[split] += 1
        stats["tasks"][task] = {"family": family, **counts}
    for name, samples in splits.items():
        random.Random(f"{seed}/shuffle/{name}").shuffle(samples)
    stats["total"] = {name: len(samples) for name, samples in splits.items()}
    return splits["train"], splits["val"], stats


def write(out_dir: os.PathLike, train: List[dict], val: List[dict], stats: dict) -> Path:
    """train.jsonl, val.jsonl and stats.json as `out_dir`, a new directory or this tool's earlier output, replaced
    atomically (base/outputs.py: a directory holding anything else is refused, not replaced)."""
    with output_dir(out_dir, TOOL, OWN) as tmp:
        for name, samples in (("train", train), ("val", val)):
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps(s, ensure_ascii=False) + "\n")
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return Path(out_dir)
