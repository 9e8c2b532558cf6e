r"""Evaluation tasks, lm-evaluation-harness style: the two task file formats, their checks, and their scores.
`python -m evaluation CKPT tasks=[...]` and `trainer.eval_tasks` run them; `python -m builders.tasks build`
derives real ones from ../shared/corpora.

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

A file holds one format; an item that breaks it stops the load with TaskError naming `file:line`. An Alpaca
sample (data=instructions' held-out val.jsonl) is a generation item: its SFT prompt, its output the answer.
A name is <tasks dir>/<name>.jsonl (base/paths.py task_path), a path ending in .jsonl is itself.

The scorers: multiple choice through an objective's per-token NLL (`token_nll(model)`, evaluation/scorer.py
LoglikelihoodScorer), generation through the family's generator (models/generation.py make_generate_fn).
"""
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from base.errors import UserError
from base.paths import default_tasks_dir, task_path
from base.text import CJK

Item = dict
TASK_METRICS = ("acc", "acc_norm", "exact_match", "rouge_l")  # what training logs of each task


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


def alpaca_item(sample: dict, template: Optional[Dict[str, str]] = None) -> dict:
    """An Alpaca sample (instruction, input, output; e.g. data=instructions' held-out val.jsonl) as a generation
    item: the SFT prompt of `template` (the checkpoint's; alpaca's by default), the output as the answer,
    generation stopping at eos."""
    from data.samples import TEMPLATES

    prompt = (template or TEMPLATES["alpaca"])["prompt_input" if sample.get("input") else "prompt_no_input"]
    return {"prompt": prompt.format(instruction=sample["instruction"], input=sample.get("input", "")),
            "answer": sample["output"]}


def load_task(path: os.PathLike, name: Optional[str] = None, template: Optional[Dict[str, str]] = None) -> Task:
    """Read and check a task file (all items of one format; Alpaca samples are generation items)."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file (build the real tasks with `python -m builders.tasks build`)")
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
            if isinstance(item, dict) and "instruction" in item and "output" in item:  # Alpaca (data=instructions)
                item = alpaca_item(item, template)
            kind = _check_item(item, where)
            if kinds and kind not in kinds:
                raise TaskError(f"{where}: a {kind.replace('_', '-')} item in a file of "
                                f"{next(iter(kinds)).replace('_', '-')} items; one format per file")
            kinds.add(kind)
            items.append(item)
    if not items:
        raise TaskError(f"{path}: no items")
    return Task(name or path.stem, str(path), kinds.pop(), items)


def load_tasks(names: Optional[List[str]], tasks_dir: Optional[str], max_items: int,
               template: Optional[Dict[str, str]] = None) -> List[Task]:
    """The named task files (None: every *.jsonl of the tasks dir), loaded and checked before anything runs; Alpaca
    samples among them are prompted in `template` (the checkpoint's)."""
    directory = Path(tasks_dir) if tasks_dir else default_tasks_dir()
    if names is None:
        names = sorted(p.stem for p in directory.glob("*.jsonl")) if directory.is_dir() else []
        if not names:
            print(f"[eval] no task files in {directory}: no tasks (build them with `python -m builders.tasks build`)")
    tasks = [load_task(task_path(name, directory), name=Path(name).stem, template=template) for name in names]
    for task in tasks:
        if max_items:
            task.items = task.items[:max_items]
    return tasks


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


_ROUGE_TOKEN = re.compile(rf"[{CJK}]|[^\s{CJK}]+")  # a CJK character alone (those scripts have no spaces)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (beta = 1) over whitespace tokens, each CJK character a token of its own (Chinese is
    written without spaces, so its ROUGE is by character): LCS / len(prediction) is the precision, LCS /
    len(reference) the recall, F = 2PR / (P + R); 0 when either is empty or nothing is shared."""
    pred, ref = _ROUGE_TOKEN.findall(prediction), _ROUGE_TOKEN.findall(reference)
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


# ------------------------------------------------------------------------------------------------ running

def scorers(objective, model, family_name: str, tokenizer, batch_size: int,
            max_len: int) -> Tuple[Optional[Callable], Optional[Callable], Dict[str, str]]:
    """(loglikelihood, generate_fn, why each kind is skipped): multiple choice through the objective's per-token
    NLL (its `token_nll` hook), generation through the family's generator; None where there is none."""
    from evaluation.scorer import LoglikelihoodScorer
    from models.generation import generator, make_generate_fn

    loglikelihood = generate_fn = None
    skip = {"multiple_choice": "log-likelihood scoring needs an objective with a per-token NLL (token_nll)",
            "generation": f"model.family={family_name} has no generator (models/{family_name}/)"}
    if objective.token_nll is not None:
        loglikelihood = LoglikelihoodScorer(objective.token_nll(model), tokenizer, batch_size, max_len)
    gen = generator(family_name, model)
    if gen is not None:
        generate_fn = make_generate_fn(gen, tokenizer)
    return loglikelihood, generate_fn, skip


def run_tasks(tasks: Sequence[Task], loglikelihood: Optional[Callable], generate_fn: Optional[Callable],
              max_new_tokens: int, skip_reason: Dict[str, str], log=print) -> dict:
    """Score `tasks`: multiple choice through `loglikelihood`, generation through `generate_fn`; a task whose
    scorer is None is reported as skipped with skip_reason[kind]."""
    out = {}
    for task in tasks:
        start = time.perf_counter()
        if task.kind == "multiple_choice" and loglikelihood is not None:
            result = score_multiple_choice(task.items, loglikelihood)
        elif task.kind == "generation" and generate_fn is not None:
            result = score_generation(task.items, generate_fn, max_new_tokens)
        else:
            out[task.name] = {"kind": task.kind, "n": len(task.items), "path": task.path,
                              "skipped": skip_reason[task.kind]}
            log(f"[eval] task {task.name} skipped: {skip_reason[task.kind]}")
            continue
        out[task.name] = {"kind": task.kind, "path": task.path, **result,
                          "seconds": round(time.perf_counter() - start, 1)}
        log(f"[eval] task {task.name}: " + ", ".join(f"{k} {result[k]:.4f}" for k in
                                                      ("acc", "acc_norm", "chance", "exact_match", "rouge_l")
                                                      if k in result) + f" (n={result['n']})")
    return out


def task_scorer(names: Sequence[str], max_items: int, objective, model, family_name: str, tokenizer,
                batch_size: int, max_len: int, max_new_tokens: int = 64,
                template: Optional[Dict[str, str]] = None) -> Callable[[], dict]:
    """The task files `names` (loaded and checked now: a bad one fails before training starts) ->
    score() -> {"<task>/<metric>": value}, with the scorers `python -m evaluation` uses (training's
    trainer.eval_tasks); Alpaca samples among them are prompted in `template` (the run's, which its checkpoints
    keep)."""
    tasks = load_tasks(list(names), None, max_items, template)
    loglikelihood, generate_fn, skip = scorers(objective, model, family_name, tokenizer, batch_size, max_len)

    def score() -> dict:
        results = run_tasks(tasks, loglikelihood, generate_fn, max_new_tokens, skip, log=lambda *_: None)
        return {f"{name}/{key}": r[key] for name, r in results.items() for key in TASK_METRICS if key in r}

    return score
