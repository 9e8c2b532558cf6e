r"""Evaluation tasks, lm-evaluation-harness style: the two task file formats, builders that derive real tasks
from ../shared/corpora by rule, and the scoring helpers. `python -m evaluate CKPT tasks=[...]` runs them
(the model side: evaluate.py); `python -m data.tasks build` writes them.

Formats: JSONL, one item per line (other keys, such as "entry" or "source", are kept and ignored):

  multiple choice   {"context": str, "choices": [str, ...], "gold": int}
      Scored by the log-likelihood of each choice's tokens given the context, summed over its tokens
      (`score_multiple_choice`): `acc` is the share of items whose highest-scoring choice is the gold one,
      `acc_norm` the same with each score divided by the choice's UTF-8 byte length (lm-eval's acc_norm, which
      divides by len(str); the same for ASCII). `chance` is the mean of 1 / number of choices. Choices carry
      their own leading space (" apple"), as in lm-eval.
  generation        {"prompt": str, "answer": str[, "until": [str, ...]]}
      A `generate_fn(prompts, max_new_tokens) -> list[str]` continues each prompt; the continuation is cut at
      the first of the item's `until` strings (stop sequences, e.g. "\n"), and compared with the answer, both
      stripped: `exact_match`, and `rouge_l` (ROUGE-L F-measure over whitespace tokens, `rouge_l`).

A file holds one format; an item that breaks it stops the load with TaskError naming `file:line`.

Real tasks (`python -m data.tasks build [--corpora DIR] [--out DIR] [--items 500] [--seed 0]`), written to
`--out` (default `${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks`) as `<name>.jsonl` + `stats.json`:

  definitions_mc  A WordNet or GCIDE definition (the first sense's gloss, as data/instructions.py's
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

Held out from instruction tuning: an item exists only for an entry that data/instructions.py puts in its
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from base.errors import ArgumentParser, UserError, entry_point
from base.paths import default_tasks_dir, task_path
from data import instructions as I

VAL_FRACTION = 0.05  # data/instructions.py's default --val-fraction: items come from its val split only
CHOICES = 4
CODE_CONTEXT_LINES = 5
CODE_MIN_CHARS = 10  # a target or distractor line has at least this many non-blank characters
CODE_MIN_DISTANCE = 6  # distractor lines are at least this many lines away from the true one
CODE_WINDOWS = 2  # items per function at most (their target lines more than CODE_CONTEXT_LINES apart)
VERSE_MIN_WORDS = 8
TASK_SHARDS = ("wordnet", "gcide", "cpython311_stdlib", "kjv_bible")  # the corpus sources the builders read

Item = dict


class TaskError(UserError, ValueError):
    """A task file that breaks its format; the message names file:line."""

    exit_code = 2  # a task named on the command line


@dataclass
class Task:
    name: str
    path: str
    kind: str  # "multiple_choice" | "generation"
    items: List[Item]


# ------------------------------------------------------------------------------------------------ loading

def _check_item(item, where: str) -> str:
    """The item's kind, after checking its fields; TaskError naming `where` (file:line) otherwise."""
    if not isinstance(item, dict):
        raise TaskError(f"{where}: an item must be a JSON object, got {type(item).__name__}")
    if "prompt" in item or "answer" in item:
        for key in ("prompt", "answer"):
            if not isinstance(item.get(key), str):
                raise TaskError(f"{where}: generation item: '{key}' " + ("is missing" if key not in item else
                                f"must be a string, got {type(item[key]).__name__}"))
        until = item.get("until", [])
        if not isinstance(until, list) or not all(isinstance(u, str) and u for u in until):
            raise TaskError(f"{where}: 'until' must be a list of non-empty strings, got {until!r}")
        return "generation"
    if "context" not in item:
        raise TaskError(f"{where}: the item has neither 'context' (multiple choice) nor 'prompt' (generation); "
                        f"its keys: {', '.join(item) or 'none'}")
    if not isinstance(item["context"], str):
        raise TaskError(f"{where}: 'context' must be a string, got {type(item['context']).__name__}")
    choices = item.get("choices")
    if choices is None:
        raise TaskError(f"{where}: multiple-choice item: 'choices' is missing")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise TaskError(f"{where}: 'choices' must be a list of at least 2 non-empty strings, got {choices!r}")
    gold = item.get("gold")
    if gold is None:
        raise TaskError(f"{where}: multiple-choice item: 'gold' is missing")
    if not isinstance(gold, int) or isinstance(gold, bool):
        raise TaskError(f"{where}: 'gold' must be an integer index into 'choices', got {gold!r}")
    if not 0 <= gold < len(choices):
        raise TaskError(f"{where}: gold {gold} is out of range for {len(choices)} choices (0..{len(choices) - 1})")
    return "multiple_choice"


def alpaca_item(sample: dict) -> dict:
    """An Alpaca sample (instruction, input, output; e.g. data=instructions' held-out val.jsonl) as a generation
    item: the SFT prompt of the default template, the output as the answer, generation stopping at eos."""
    from data.samples import TEMPLATES

    template = TEMPLATES["alpaca"]["prompt_input" if sample.get("input") else "prompt_no_input"]
    return {"prompt": template.format(instruction=sample["instruction"], input=sample.get("input", "")),
            "answer": sample["output"]}


def load_task(path: os.PathLike, name: Optional[str] = None) -> Task:
    """Read and check a task file (all items of one format; Alpaca samples are generation items)."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file (build the real tasks with `python -m data.tasks build`)")
    items, kinds = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
            if isinstance(item, dict) and "instruction" in item and "output" in item:  # Alpaca (data/instructions)
                item = alpaca_item(item)
            kind = _check_item(item, where)
            if kinds and kind not in kinds:
                raise TaskError(f"{where}: a {kind.replace('_', '-')} item in a file of "
                                f"{next(iter(kinds)).replace('_', '-')} items; one format per file")
            kinds.add(kind)
            items.append(item)
    if not items:
        raise TaskError(f"{path}: no items")
    return Task(name or path.stem, str(path), kinds.pop(), items)


# ------------------------------------------------------------------------------------------------ scoring

Loglikelihood = Callable[[List[Tuple[str, str]]], List[float]]  # (context, continuation) pairs -> sum logprob


def score_multiple_choice(items: Sequence[Item], loglikelihood: Loglikelihood) -> dict:
    """acc, acc_norm and chance over `items`. `loglikelihood` gets every (context, choice) pair of every item in
    one call (so the caller can batch them) and returns the summed log-probability of each choice's tokens."""
    requests = [(item["context"], choice) for item in items for choice in item["choices"]]
    scores = list(loglikelihood(requests))
    if len(scores) != len(requests):
        raise ValueError(f"loglikelihood returned {len(scores)} scores for {len(requests)} requests")
    correct = correct_norm = 0
    predictions = []
    at = 0
    for item in items:
        k = len(item["choices"])
        ll = scores[at:at + k]
        at += k
        norm = [s / max(len(c.encode("utf-8")), 1) for s, c in zip(ll, item["choices"])]
        best, best_norm = _argmax(ll), _argmax(norm)
        correct += best == item["gold"]
        correct_norm += best_norm == item["gold"]
        predictions.append({"pred": best, "pred_norm": best_norm, "loglikelihoods": ll})
    n = len(items)
    return {"n": n, "acc": correct / n, "acc_norm": correct_norm / n,
            "chance": sum(1.0 / len(item["choices"]) for item in items) / n, "predictions": predictions}


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (ties go to the earlier choice, as numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists (dynamic programming, O(len(a) * len(b)))."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (beta = 1) over whitespace tokens: LCS / len(prediction) is the precision, LCS /
    len(reference) the recall, F = 2PR / (P + R); 0 when either is empty or nothing is shared."""
    pred, ref = prediction.split(), reference.split()
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def cut_at(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    ends = [text.find(u) for u in until if u in text]
    return text[:min(ends)] if ends else text


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip() == answer.strip()


def score_generation(items: Sequence[Item], generate_fn: Callable[[List[str], int], List[str]],
                     max_new_tokens: int) -> dict:
    """exact_match and rouge_l (means over items) of `generate_fn`'s continuations, called once for all
    prompts (it batches)."""
    outputs = list(generate_fn([item["prompt"] for item in items], max_new_tokens))
    if len(outputs) != len(items):
        raise ValueError(f"generate_fn returned {len(outputs)} texts for {len(items)} prompts")
    em = rl = 0.0
    predictions = []
    for item, output in zip(items, outputs):
        prediction = cut_at(output, item.get("until", [])).strip()
        em += exact_match(prediction, item["answer"])
        rl += rouge_l(prediction, item["answer"].strip())
        predictions.append(prediction)
    n = len(items)
    return {"n": n, "exact_match": em / n, "rouge_l": rl / n, "predictions": predictions}


def encode_pair(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair`: whitespace ending the context moves to the
    continuation, the pair is encoded as one text and the continuation is what follows the context's own
    encoding (so the tokens are those the model sees in running text, not a separately encoded fragment)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n = len(tokenizer.encode(context)) if context else 0
    return whole[:n], whole[n:]


# ----------------------------------------------------------------------------------------------- building

def _is_val(family: str, entry: str) -> bool:
    return I.split_of(family, entry, VAL_FRACTION) == "val"


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


def dictionary_glosses(docs: Iterable[I.Doc]) -> Dict[str, List[Tuple[str, str, List[str], str]]]:
    """Per dictionary (wordnet, gcide): (headword, gloss, synonyms, doc id) of every val-split entry whose first
    sense has a usable gloss; the first entry of a headword (casefolded) stays."""
    out: Dict[str, List[Tuple[str, str, List[str], str]]] = {"wordnet": [], "gcide": []}
    seen = set()
    for doc in docs:
        source = doc["source"]
        if source == "wordnet":
            entries = ((h, I.wordnet_gloss(s[0]), I.wordnet_synonyms(s[0])) for h, s in I.wordnet_entries(doc["text"])
                       if s)
        elif source == "gcide":
            entries = ((h, I.gcide_gloss(s), []) for h, s in I.gcide_entries(doc["text"])
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


def definitions_mc(docs: Iterable[I.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
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
    """(qualified name, node) of top-level functions and methods of top-level classes: data/instructions.py's
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


def cloze_code(docs: Iterable[I.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
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


def _val_verses(docs: Iterable[I.Doc]) -> List[Tuple[str, str, str, str]]:
    """(reference, first half as the corpus writes it '<n> <words>', ' <second half>', doc id) of every val
    verse of at least VERSE_MIN_WORDS words."""
    out = []
    for doc in docs:
        if doc["source"] != "kjv_bible":
            continue
        for ref, text in I.bible_verses(doc["text"]):
            words = text.split()
            if len(words) < VERSE_MIN_WORDS or not _is_val("bible", ref):
                continue
            cut = len(words) // 2
            out.append((ref, f"{ref.rsplit(':', 1)[1]} {' '.join(words[:cut])}", " " + " ".join(words[cut:]),
                        doc["id"]))
    return out


def verse_mc(docs: Iterable[I.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
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


def verse_complete(docs: Iterable[I.Doc], n_items: int = 500, seed: int = 0) -> List[Item]:
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


def build(documents: Iterable[I.Doc], n_items: int = 500, seed: int = 0,
          tasks: Optional[Sequence[str]] = None) -> Dict[str, List[Item]]:
    docs = list(documents)
    return {name: BUILDERS[name](docs, n_items, seed) for name in tasks or BUILDERS}


def write_tasks(out_dir: os.PathLike, tasks: Dict[str, List[Item]], stats: dict) -> Path:
    """<name>.jsonl per task and stats.json into `out_dir`; each file replaced atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {f"{name}.jsonl": "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
             for name, items in tasks.items()}
    files["stats.json"] = json.dumps(stats, indent=1) + "\n"
    for name, text in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / name)
    return out


def task_shards(corpora: os.PathLike) -> List[Path]:
    return I.existing_shards(corpora, [I.SHARDS[source] for source in TASK_SHARDS])


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m data.tasks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="derive the evaluation tasks from the corpora")
    b.add_argument("--corpora", type=Path, default=None, help="corpora dir (default: $MINDLAB_CORPORA, else "
                   "../shared/corpora beside the checkout)")
    b.add_argument("--out", type=Path, default=None, help="output dir (default: "
                   "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks)")
    b.add_argument("--items", type=int, default=500, help="items per task (default 500)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--tasks", nargs="*", choices=list(BUILDERS), default=None)
    args = parser.parse_args(argv)
    start = time.time()
    corpora = args.corpora or I.corpora_dir()
    paths = task_shards(corpora)
    tasks = build(I.read_documents(paths), args.items, args.seed, args.tasks)
    stats = {"seed": args.seed, "items": args.items, "val_fraction": VAL_FRACTION,
             "corpora": {s: I.SHARDS[s] for s in TASK_SHARDS}, "tasks": {name: len(v) for name, v in tasks.items()}}
    out = write_tasks(args.out or default_tasks_dir(), tasks, stats)
    for name, items in tasks.items():
        kind = "generation" if "prompt" in (items[0] if items else {}) else "multiple choice"
        print(f"{name:<16} {len(items):>5} items  ({kind})")
    print(f"wrote {out}/{{{','.join(tasks)}}}.jsonl, stats.json from {corpora} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
