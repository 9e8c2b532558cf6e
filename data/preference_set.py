r"""A preference set derived by rule from the instruction set: `python -m data.preference_set`.

What it measures, plainly: whether a model (a reward model, or a policy through DPO) prefers the faithful,
fluent answer copied from the corpus over a worse one made from it by rule: a wrong entry's answer, a
truncated, reordered or looping answer, or one with a fact swapped in from another entry. It does NOT
measure human helpfulness or harmlessness: nobody wrote or rated these pairs; the preference is the rule.

Input: the instruction set's `train.jsonl` and `val.jsonl` (`python -m data.instructions`, data/instructions.py:
answers are spans copied from one corpus document, held out by entry). Each split gives the pairs of that
split only, so an entry of val is in no training pair, as a prompt or as a negative.

Every instruction sample gives one pair `{"instruction", "input", "chosen", "rejected", "margin",
"corruption", "task", "entry"}`: chosen is the corpus answer; rejected is made by the first rule that
applies, trying them in turn from rule (i mod 5) for the i-th sample, so all five are represented:

    rule        margin  rejected
    neighbour   1.0     the answer of the neighbouring entry of the same task (entries sorted casefolded: the
                        next one, else the previous one with a different answer): fluent, on-format, wrong.
                        A hard negative, unlike a random entry's answer
    loop        1.0     the answer's first quarter of words (at least 3), then its last 3 words repeated
                        until the answer's length: the degenerate repetition of a weak sampler
    fact_swap   0.5     one "fact" (a number, or a capitalized word that does not start a sentence) replaced
                        by a fact of the same kind from another entry of the task: mostly right, one error
    shuffle     0.5     the answer's sentences in another order (answers of 2+ sentences)
    truncate    0.25    the answer cut mid-sentence after 40-70% of its words (answers of 6+ words)

`margin` grades severity (the reward model's margin loss asks chosen to win by it): a wrong or degenerate
answer is worse than a truncated right one. Writes `train.jsonl`, `val.jsonl` and `stats.json` (pairs per
rule, task and split) to `--out` (default `${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/preferences`),
atomically; output is a function of the input files and `--seed` only.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

from conf.errors import ArgumentParser, UsageError, entry_point
from data.errors import DataError

DATA_DIR = Path(os.environ.get("MINDLAB_DATA_DIR", Path.home() / ".cache" / "mindlab" / "data"))
MARGINS = {"neighbour": 1.0, "loop": 1.0, "fact_swap": 0.5, "shuffle": 0.5, "truncate": 0.25}
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_FACT = re.compile(r"\b(?:\d[\d,.:]*\d|\d|[A-Z][a-z]+(?:[A-Z][a-z]+)*)\b")


def sentences(text: str) -> List[str]:
    return [s for s in _SENTENCE.split(text.strip()) if s]


def neighbour(sample: dict, by_task: Dict[str, List[dict]], rng: random.Random) -> Optional[str]:
    entries = by_task[sample["task"]]
    at = sample["_rank"]
    for j in list(range(at + 1, len(entries))) + list(range(at - 1, -1, -1)):
        if entries[j]["output"] != sample["output"]:
            return entries[j]["output"]
    return None


def loop(sample: dict, by_task, rng: random.Random) -> Optional[str]:
    words = sample["output"].split()
    if len(words) < 4:
        return None
    head = words[:max(3, len(words) // 4)]
    out = list(head)
    while len(out) < len(words):
        out += head[-3:]
    return " ".join(out[:max(len(words), len(head) + 3)])


def facts(text: str) -> List[re.Match]:
    """Numbers, and capitalized words that do not start the text or a sentence."""
    return [m for m in _FACT.finditer(text)
            if m.group()[0].isdigit() or (m.start() > 0 and not re.search(r"[.!?]\s*$", text[:m.start()]))]


def fact_swap(sample: dict, by_task: Dict[str, List[dict]], rng: random.Random) -> Optional[str]:
    mine = facts(sample["output"])
    rng.shuffle(mine)
    others = [s for s in by_task[sample["task"]] if s is not sample]
    for target in mine:  # the first of this answer's facts that another entry has a different one of its kind for
        kind = target.group()[0].isdigit()
        for _ in range(min(20, len(others))):
            other = others[rng.randrange(len(others))]
            choices = [m.group() for m in facts(other["output"])
                       if m.group()[0].isdigit() == kind and m.group() != target.group()]
            if choices:
                out = sample["output"]
                return out[:target.start()] + rng.choice(choices) + out[target.end():]
    return None


def shuffle(sample: dict, by_task, rng: random.Random) -> Optional[str]:
    parts = sentences(sample["output"])
    if len(parts) < 2:
        return None
    order = list(range(len(parts)))
    while order == sorted(order):
        rng.shuffle(order)
    return " ".join(parts[k] for k in order)


def truncate(sample: dict, by_task, rng: random.Random) -> Optional[str]:
    words = sample["output"].split()
    if len(words) < 6:
        return None
    cut = " ".join(words[:int(len(words) * rng.uniform(0.4, 0.7))])
    return cut.rstrip(".!?;:,")


RULES: Dict[str, Callable] = {"neighbour": neighbour, "loop": loop, "fact_swap": fact_swap, "shuffle": shuffle,
                              "truncate": truncate}


def make_pairs(samples: List[dict], seed: int) -> List[dict]:
    """One pair per sample that some rule applies to (see the module docstring)."""
    rng = random.Random(seed)
    by_task: Dict[str, List[dict]] = {}
    for s in samples:
        by_task.setdefault(s["task"], []).append(s)
    for entries in by_task.values():
        entries.sort(key=lambda s: (s["entry"].casefold(), s["output"]))
        for rank, s in enumerate(entries):
            s["_rank"] = rank
    names = list(RULES)
    pairs = []
    for i, s in enumerate(samples):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            rejected = RULES[name](s, by_task, rng)
            if rejected is not None and rejected.strip() and rejected != s["output"]:
                pairs.append({"instruction": s["instruction"], "input": s.get("input", ""), "chosen": s["output"],
                              "rejected": rejected, "margin": MARGINS[name], "corruption": name,
                              "task": s["task"], "entry": s["entry"]})
                break
    return pairs


def build(instructions: Path, out: Path, seed: int, max_pairs: int) -> dict:
    stats = {"seed": seed, "source": str(instructions), "splits": {}}
    tmp = Path(tempfile.mkdtemp(prefix=".preferences-", dir=out.parent))
    try:
        for split in ("train", "val"):
            path = instructions / f"{split}.jsonl"
            if not path.exists():
                raise UsageError(f"{path} does not exist; build the instruction set first: "
                                 f"python -m data.instructions --out {instructions}")
            samples = [_sample(line, f"{path}:{number}")
                       for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
            pairs = make_pairs(samples, seed)[:max_pairs if split == "train" else None]
            with open(tmp / f"{split}.jsonl", "w") as f:
                for p in pairs:
                    f.write(json.dumps(p, ensure_ascii=False) + "\n")
            counts: Dict[str, Dict[str, int]] = {}
            for p in pairs:
                counts.setdefault(p["corruption"], {}).setdefault(p["task"], 0)
                counts[p["corruption"]][p["task"]] += 1
            stats["splits"][split] = {"samples": len(samples), "pairs": len(pairs), "by_rule": counts}
            print(f"[preferences] {split}: {len(pairs):,} pairs from {len(samples):,} samples; "
                  + ", ".join(f"{r} {sum(c.values()):,}" for r, c in counts.items()), flush=True)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


SAMPLE_KEYS = ("instruction", "output", "task", "entry")  # what make_pairs reads of a sample


def _sample(line: str, where: str) -> dict:
    try:
        sample = json.loads(line)
    except ValueError as err:
        raise DataError(f"{where}: invalid JSON ({err}); rebuild the instruction set: python -m data.instructions") \
            from None
    if not isinstance(sample, dict) or not all(isinstance(sample.get(k), str) for k in SAMPLE_KEYS):
        raise DataError(f"{where}: not a sample of the instruction set (needs the strings {', '.join(SAMPLE_KEYS)}); "
                        f"rebuild it: python -m data.instructions")
    return sample


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m data.preference_set", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instructions", type=Path, default=DATA_DIR / "instructions",
                        help="directory with the instruction set's train.jsonl and val.jsonl")
    parser.add_argument("--out", type=Path, default=DATA_DIR / "preferences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-pairs", type=int, default=20000, help="training pairs kept (val: all)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.instructions, args.out, args.seed, args.max_pairs)
    print(f"[preferences] wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
