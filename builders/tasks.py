r"""Evaluation tasks derived by rule from ../shared/corpora: `python -m builders.tasks build [--corpora DIR]
[--out DIR] [--items 500] [--seed 0]`, written to `--out` (default `${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks`)
as `<name>.jsonl` + `stats.json`, in evaluation/tasks.py's formats (`python -m evaluation CKPT tasks=[...]` and
trainer.eval_tasks score them):

  definitions_mc  A WordNet or GCIDE definition (the first sense's gloss, as builders/instructions.py's
                  reverse question takes it: no examples, synonym list or citations; >= 15 characters; not
                  naming its own headword) -> its headword among 4 headwords of the same dictionary: the gold
                  and 3 others drawn with the seed (different words, not among the gold's WordNet synonyms,
                  not sharing its gloss). Context 'Definition: <gloss>\nWord:', choices ' <headword>'.
  cloze_code      5 lines of a CPython standard library file (inside a function or method) -> the line that
                  follows, among 4: the true one and 3 lines from other places of the same file (>= 10
                  characters, different text, at least 6 lines away, not inside a multi-line string), re-indented
                  like the true line so that indentation gives nothing away. Up to two windows per function
                  (their target lines > 5 apart), drawn with the seed.
  verse_mc        The first half of a KJV verse, as the corpus writes it ('<n> <words>') -> its second half
                  among 4: the true one and the second halves of 3 other verses.
  verse_complete  (generation) the same first half -> the second half, with until=["\n"].

Held out from instruction tuning: an item exists only for an entry that builders/instructions.py puts in its
validation split (its `split_of(family, entry, 0.05)`: the headword for definitions_mc, the qualified
function name for cloze_code, the verse reference for the verse tasks), and distractors are drawn from such
entries too, so no task text is a training target of `data=instructions`. Each task keeps `--items` items
(all there are if fewer), drawn with the seed; the output depends only on the corpus files, the seed and
the options.
"""
from __future__ import annotations

import ast
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from tqdm import tqdm

from base.errors import ArgumentParser, entry_point, number
from base.outputs import check_owned_files, owned_files
from base.paths import corpora_dir, default_tasks_dir
from builders import corpus_parsers as P
from builders import instruction_set as S

VAL_FRACTION = 0.05  # builders/instructions.py's default --val-fraction: items come from its val split only
CHOICES = 4
CODE_CONTEXT_LINES = 5
CODE_MIN_CHARS = 10  # a target or distractor line has at least this many non-blank characters
CODE_MIN_DISTANCE = 6  # distractor lines are at least this many lines away from the true one
CODE_WINDOWS = 2  # items per function at most (their target lines more than CODE_CONTEXT_LINES apart)
VERSE_MIN_WORDS = 8
TASK_SHARDS = ("wordnet", "gcide", "cpython311_stdlib", "kjv_bible")  # the corpus sources the builders read

Item = dict


def _is_val(family: str, entry: str) -> bool:
    return S.split_of(family, entry, VAL_FRACTION) == "val"


def _mentions(text: str, word: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(word.casefold()) + r"(?!\w)", text.casefold()) is not None


def _choices(rng: random.Random, gold: str, distractors: List[str]) -> Tuple[List[str], int]:
    """The gold and the distractors in a random order; (choices, index of the gold)."""
    choices = [gold] + distractors
    rng.shuffle(choices)
    return choices, choices.index(gold)


def _draw(rng: random.Random, pool: Sequence, k: int, ok: Callable[[object], bool],
          text: Callable[[object], str], tries: int = 200) -> list:
    """Up to `k` members of `pool` that pass `ok` and whose choice `text`s differ (whitespace and case aside),
    drawn at random (fewer if `tries` draws do not find them)."""
    chosen, texts = [], set()
    for _ in range(tries):
        if len(chosen) == k or not pool:
            break
        candidate = pool[rng.randrange(len(pool))]
        key = " ".join(text(candidate).split()).casefold()
        if key not in texts and ok(candidate):
            texts.add(key)
            chosen.append(candidate)
    return chosen


_HEADWORD = re.compile(r"^[A-Za-z][A-Za-z'. -]*[A-Za-z.]$|^[A-Za-z]$")


def dictionary_glosses(docs: Iterable[P.Doc]) -> Dict[str, List[Tuple[str, str, List[str], str]]]:
    """Per dictionary (wordnet, gcide): (headword, gloss, synonyms, doc id) of every val-split entry whose first
    sense has a usable gloss; the first entry of a headword (casefolded) stays."""
    out: Dict[str, List[Tuple[str, str, List[str], str]]] = {"wordnet": [], "gcide": []}
    seen = set()
    for doc in docs:
        source = doc["source"]
        if source == "wordnet":
            entries = ((h, P.wordnet_gloss(s[0]), P.wordnet_synonyms(s[0])) for h, s in P.wordnet_entries(doc["text"])
                       if s)
        elif source == "gcide":
            entries = ((h, P.gcide_gloss(s), []) for h, s in P.gcide_entries(doc["text"])
                       if not re.match(r"^See\b[^.]*\.?$", s))
        else:
            continue
        for headword, gloss, synonyms in entries:
            key = (source, headword.casefold())
            if key in seen or not _HEADWORD.match(headword) or len(gloss) < 15 or _mentions(gloss, headword) \
                    or not _is_val("dict", headword):
                continue
            seen.add(key)
            out[source].append((headword, gloss, synonyms, doc["id"]))
    return out


def definitions_mc(docs: Iterable[P.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
    rng = random.Random(f"{seed}/definitions_mc")
    pools = dictionary_glosses(docs)
    items = []
    for source, pool in pools.items():
        for headword, gloss, synonyms, doc_id in pool:
            banned = {headword.casefold(), *(s.casefold() for s in synonyms)}
            picked = _draw(rng, pool, CHOICES - 1,
                           lambda e: e[0].casefold() not in banned and e[1].casefold() != gloss.casefold(),
                           lambda e: e[0])
            if len(picked) < CHOICES - 1:
                continue
            choices, gold = _choices(rng, " " + headword, [" " + e[0] for e in picked])
            items.append({"context": f"Definition: {gloss}\nWord:", "choices": choices, "gold": gold,
                          "source": source, "entry": headword, "id": doc_id})
    return _keep(items, n_items, rng)


def _functions(tree: ast.Module) -> Iterable[Tuple[str, ast.AST]]:
    """(qualified name, node) of top-level functions and methods of top-level classes: builders/instructions.py's
    python entries."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{sub.name}", sub


def _code_line_ok(line: str) -> bool:
    return len(line.strip()) >= CODE_MIN_CHARS


def _string_lines(tree: ast.Module) -> set:
    """0-based indices of the lines after the first of every multi-line string literal (docstrings, text
    blocks): prose, not code, so neither targets nor distractors."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and node.end_lineno > node.lineno:
            out.update(range(node.lineno, node.end_lineno))
    return out


def cloze_code(docs: Iterable[P.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
    rng = random.Random(f"{seed}/cloze_code")
    items = []
    for doc in docs:
        if doc["source"] != "cpython311_stdlib":
            continue
        try:
            tree = ast.parse(doc["text"])
        except (SyntaxError, ValueError):
            continue
        lines = doc["text"].split("\n")
        in_string = _string_lines(tree)
        usable = [i for i, line in enumerate(lines) if _code_line_ok(line) and i not in in_string]
        for qualname, node in _functions(tree):
            if not _is_val("python", qualname):
                continue
            body = node.body
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):  # after the docstring
                start = first.end_lineno
            else:
                start = first.lineno - 1
            # target line index t (0-based): its context lines[t-5:t] lie inside the function, after the def line
            lo = max(start, node.lineno - 1 + CODE_CONTEXT_LINES)
            targets = [t for t in range(lo, node.end_lineno) if _code_line_ok(lines[t]) and t not in in_string
                       and t - CODE_CONTEXT_LINES >= node.lineno - 1]
            if not targets:
                continue
            chosen = [rng.choice(targets)]
            far = [t for t in targets if abs(t - chosen[0]) > CODE_CONTEXT_LINES]
            chosen += [rng.choice(far)] if far and CODE_WINDOWS > 1 else []
            for t in sorted(chosen):
                gold = lines[t]
                indent = gold[:len(gold) - len(gold.lstrip())]
                pool = [i for i in usable if abs(i - t) >= CODE_MIN_DISTANCE]
                picked = _draw(rng, pool, CHOICES - 1, lambda i: lines[i].strip() != gold.strip(), lambda i: lines[i])
                if len(picked) < CHOICES - 1:
                    continue
                choices, gold_index = _choices(rng, gold, [indent + lines[i].strip() for i in picked])
                items.append({"context": "\n".join(lines[t - CODE_CONTEXT_LINES:t]) + "\n", "choices": choices,
                              "gold": gold_index, "source": doc["source"], "entry": qualname, "id": doc["id"],
                              "line": t + 1})
    return _keep(items, n_items, rng)


def _val_verses(docs: Iterable[P.Doc]) -> List[Tuple[str, str, str, str]]:
    """(reference, first half as the corpus writes it '<n> <words>', ' <second half>', doc id) of every val
    verse of at least VERSE_MIN_WORDS words."""
    out = []
    for doc in docs:
        if doc["source"] != "kjv_bible":
            continue
        for ref, text in P.bible_verses(doc["text"]):
            words = text.split()
            if len(words) < VERSE_MIN_WORDS or not _is_val("bible", ref):
                continue
            cut = len(words) // 2
            out.append((ref, f"{ref.rsplit(':', 1)[1]} {' '.join(words[:cut])}", " " + " ".join(words[cut:]),
                        doc["id"]))
    return out


def verse_mc(docs: Iterable[P.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
    rng = random.Random(f"{seed}/verse_mc")
    verses = _val_verses(docs)
    items = []
    for ref, first, second, doc_id in verses:
        picked = _draw(rng, verses, CHOICES - 1, lambda v: v[2].strip() != second.strip(), lambda v: v[2])
        if len(picked) < CHOICES - 1:
            continue
        choices, gold = _choices(rng, second, [v[2] for v in picked])
        items.append({"context": first, "choices": choices, "gold": gold, "source": "kjv_bible", "entry": ref,
                      "id": doc_id})
    return _keep(items, n_items, rng)


def verse_complete(docs: Iterable[P.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
    rng = random.Random(f"{seed}/verse_complete")
    items = [{"prompt": first, "answer": second.strip(), "until": ["\n"], "source": "kjv_bible", "entry": ref,
              "id": doc_id} for ref, first, second, doc_id in _val_verses(docs)]
    return _keep(items, n_items, rng)


def _keep(items: List[Item], n: int, rng: random.Random) -> List[Item]:
    """`n` items drawn with `rng`, in corpus order (all of them if there are fewer)."""
    if len(items) <= n:
        return items
    return [items[i] for i in sorted(rng.sample(range(len(items)), n))]


BUILDERS: Dict[str, Callable[..., List[Item]]] = {
    "definitions_mc": definitions_mc,
    "cloze_code": cloze_code,
    "verse_mc": verse_mc,
    "verse_complete": verse_complete,
}


def build(documents: Iterable[P.Doc], n_items: int = 500, seed: int = 0,
          tasks: Optional[Sequence[str]] = None) -> Dict[str, List[Item]]:
    docs = list(documents)
    return {name: BUILDERS[name](docs, n_items, seed)
            for name in tqdm(list(tasks or BUILDERS), desc="[tasks] building", unit="task", mininterval=1.0)}


def write_tasks(out_dir: os.PathLike, tasks: Dict[str, List[Item]], stats: dict) -> Path:
    """<name>.jsonl per task and stats.json into `out_dir`, which may hold the user's own task files too: each file
    replaced atomically, and only one this tool wrote there (base/outputs.py owned_files)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {f"{name}.jsonl": "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
             for name, items in tasks.items()}
    files["stats.json"] = json.dumps(stats, indent=1) + "\n"
    with owned_files(out, "builders.tasks", list(files), written_files(None)):
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out / name)
    return out


def written_files(tasks: Optional[Sequence[str]]) -> List[str]:
    """What `write_tasks` writes of these tasks (all: None)."""
    return [f"{name}.jsonl" for name in (tasks or BUILDERS)] + ["stats.json"]


def task_shards(corpora: os.PathLike) -> List[Path]:
    return S.existing_shards(corpora, [P.SHARDS[source] for source in TASK_SHARDS])


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m builders.tasks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="derive the evaluation tasks from the corpora")
    b.add_argument("--corpora", type=Path, default=None, help="corpora dir (default: $MINDLAB_CORPORA, else "
                   "../shared/corpora beside the checkout)")
    b.add_argument("--out", type=Path, default=None, help="output dir (default: "
                   "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks)")
    b.add_argument("--items", type=number(int, 1), default=500, help="items per task (default 500)")
    b.add_argument("--seed", type=number(int, 0), default=0)
    b.add_argument("--tasks", nargs="*", choices=list(BUILDERS), default=None)
    args = parser.parse_args(argv)
    start = time.time()
    out = Path(args.out or default_tasks_dir())
    check_owned_files(out, "builders.tasks", written_files(args.tasks), written_files(None))  # before the build
    corpora = args.corpora or corpora_dir()
    paths = task_shards(corpora)
    tasks = build(S.read_documents(paths), args.items, args.seed, args.tasks)
    stats = {"seed": args.seed, "items": args.items, "val_fraction": VAL_FRACTION,
             "corpora": {s: P.SHARDS[s] for s in TASK_SHARDS}, "tasks": {name: len(v) for name, v in tasks.items()}}
    write_tasks(out, tasks, stats)
    for name, items in tasks.items():
        kind = "generation" if "prompt" in (items[0] if items else {}) else "multiple choice"
        print(f"{name:<16} {len(items):>5} items  ({kind})")
    print(f"wrote {out}/{{{','.join(tasks)}}}.jsonl, stats.json from {corpora} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
