r"""A preference set derived by rule from the instruction set: `python -m builders.preferences`.

What it measures, plainly: whether a model (a reward model, or a policy through DPO) prefers the faithful,
fluent answer copied from the corpus over a worse one made from it by rule: a wrong entry's answer, a
truncated, reordered or looping answer, or one with a fact swapped in from another entry. It does NOT
measure human helpfulness or harmlessness: nobody wrote or rated these pairs; the preference is the rule.

Input: the instruction set's `train.jsonl` and `val.jsonl` (`python -m builders.instructions`, builders/instructions.py:
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

On-policy pairs, `python -m builders.preferences --on-policy CKPT [--samples 4] [--temperature 1.0]
[--max-prompts N]`: the model's own responses, ranked by how faithful they are to the corpus answer. For each
instruction sample (a checkable prompt: its answer is known), k responses are sampled from CKPT (usually the
SFT checkpoint) through the family's generator (models/generation.py), each scored against the sample's
output with evaluation/tasks.py's scorers: ranked by exact match, then ROUGE-L F. The best and the worst make a
pair `{..., "margin", "corruption": "on_policy", "task", "entry", "exact_match": [chosen, rejected],
"rouge_l": [chosen, rejected]}` when their ROUGE-L differ by at least `--min-gap`; `margin` is that
difference, in (0, 1] like the rules' margins: 1.0 is a verbatim answer against one sharing no word with it.
Empty responses (the preference loader refuses them) and repeats are left out before ranking, so chosen and
rejected always differ. What these pairs measure is, again, faithfulness to the corpus answer among what
the model actually says, not helpfulness. Train pairs come from the instruction set's train split, val pairs
from its val split (held out by entry, as above). The response j of the i-th prompt of a split is drawn from
the random stream (`--seed`, i * k + j), so the output is a function of the checkpoint, the input files and
the options, whatever `--batch-size`. Written to their own `--out` (default
`${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/preferences_on_policy`), not merged into the rule-built set: they
depend on a checkpoint and go stale as the policy trains, while the rule-built set depends on the corpus only.
`data=preferences_on_policy` trains on both sets (two sources); `stats.json` holds, per split, the prompts,
responses, pairs, the mean gap and the responses' mean ROUGE-L and exact-match rate.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from base.errors import ArgumentParser, UsageError, entry_point, number
from base.outputs import check_output_dir, output_dir
from base.paths import data_dir
from data.errors import DataError
from evaluation.tasks import alpaca_item, exact_match, rouge_l

SPLITS = ("train", "val")
TOOL, OWN = "builders.preferences", ("train.jsonl", "val.jsonl", "stats.json")  # what --out holds (base/outputs.py)
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


def make_pairs(samples: List[dict], seed: int, label: str = "") -> List[dict]:
    """One pair per sample that some rule applies to (see the module docstring); a progress bar on stderr (`label`)
    counts the samples."""
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
    for i, s in enumerate(tqdm(samples, desc=f"[preferences] {label}".strip(), unit="sample", mininterval=1.0,
                               disable=not label)):
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
    pairs = {}
    for split in SPLITS:
        samples = read_split(instructions, split)
        pairs[split] = make_pairs(samples, seed, split)[:max_pairs if split == "train" else None]
        counts: Dict[str, Dict[str, int]] = {}
        for p in pairs[split]:
            counts.setdefault(p["corruption"], {}).setdefault(p["task"], 0)
            counts[p["corruption"]][p["task"]] += 1
        stats["splits"][split] = {"samples": len(samples), "pairs": len(pairs[split]), "by_rule": counts}
        print(f"[preferences] {split}: {len(pairs[split]):,} pairs from {len(samples):,} samples; "
              + ", ".join(f"{r} {sum(c.values()):,}" for r, c in counts.items()), flush=True)
    write_set(out, pairs, stats)
    return stats


def read_split(instructions: Path, split: str) -> List[dict]:
    """The samples of the instruction set's `split`.jsonl, each checked (DataError naming file:line)."""
    path = instructions / f"{split}.jsonl"
    if not path.exists():
        raise UsageError(f"{path} does not exist; build the instruction set first: "
                         f"python -m builders.instructions --out {instructions}")
    return [_sample(line, f"{path}:{number}")
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]


def write_set(out: Path, pairs: Dict[str, List[dict]], stats: dict) -> None:
    """`<split>.jsonl` per split and stats.json as `out`, a new directory or this tool's earlier output, replaced
    whole and atomically (base/outputs.py: a directory holding anything else is refused, not replaced)."""
    with output_dir(out, TOOL, OWN) as tmp:
        for split, split_pairs in pairs.items():
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for p in split_pairs:
                    f.write(json.dumps(p, ensure_ascii=False) + "\n")
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")


# --- on-policy pairs (see the module docstring) ---------------------------------------------------------------

def score(response: str, answer: str) -> Tuple[bool, float]:
    """(exact match, ROUGE-L F) of a response against the corpus answer: the key responses are ranked by."""
    return exact_match(response, answer), rouge_l(response.strip(), answer.strip())


def on_policy_pair(sample: dict, responses: Sequence[str], min_gap: float) -> Optional[dict]:
    """The best against the worst of `responses` to the sample's prompt, or None when fewer than two distinct
    non-empty responses remain or their ROUGE-L differ by less than `min_gap`. An exact match has ROUGE-L 1,
    so the best also has the highest ROUGE-L and the margin is never negative."""
    # by score, ties broken by the text, so the same every run
    ranked = sorted((score(r, sample["output"]), r) for r in {r.strip() for r in responses} - {""})
    if len(ranked) < 2:
        return None
    ((best_em, best_rl), best), ((worst_em, worst_rl), worst) = ranked[-1], ranked[0]
    if best_rl - worst_rl < min_gap:
        return None
    return {"instruction": sample["instruction"], "input": sample.get("input", ""), "chosen": best,
            "rejected": worst, "margin": round(best_rl - worst_rl, 4), "corruption": "on_policy",
            "task": sample["task"], "entry": sample["entry"], "exact_match": [best_em, worst_em],
            "rouge_l": [round(best_rl, 4), round(worst_rl, 4)]}


def sample_responses(generate_fn: Callable, prompts: Sequence[str], ids: Sequence[int], k: int,
                     max_new_tokens: int, **options) -> List[List[str]]:
    """k responses per prompt; prompt i's j-th comes from the random stream (seed, ids[i] * k + j), so it does not
    depend on the batch it was drawn in (generate_fn batches: models/generation.py make_generate_fn)."""
    rows = [(prompt, at * k + j) for prompt, at in zip(prompts, ids) for j in range(k)]
    texts = generate_fn([p for p, _ in rows], max_new_tokens, rows=[r for _, r in rows], **options)
    return [texts[i * k:(i + 1) * k] for i in range(len(prompts))]


def build_on_policy(ckpt: str, instructions: Path, out: Path, args) -> dict:
    """Samples, ranks and pairs every split of `args.splits`; writes them and stats.json to `out`."""
    from models.generation import SamplingOptions, generator, make_generate_fn
    from models.pretrained import build, graph_mode, load

    samples = {split: read_split(instructions, split)[:args.max_prompts or None] for split in args.splits}
    with tempfile.TemporaryDirectory(prefix="mindlab-on-policy-") as workdir:
        model_cfg, path, tokenizer = load(ckpt, workdir)
        graph_mode(args.device)
        model = build(model_cfg, path, args.device)  # reads the weights: the temporary directory may go
    gen = generator(model_cfg.family, model)
    bucket = gen.prompt_bucket
    width = -(-args.max_prompt_len // bucket) * bucket  # one padded prompt length: two graphs
    if width + args.max_new_tokens > model_cfg.max_position_embeddings:
        raise UsageError(f"--max-new-tokens: {args.max_new_tokens} new tokens after prompts of up to {width} tokens "
                         f"(--max-prompt-len rounded up to {bucket}) overflow the model's context "
                         f"(max_position_embeddings={model_cfg.max_position_embeddings})")
    generate_fn = make_generate_fn(gen, tokenizer, batch_size=args.batch_size)
    stats = {"checkpoint": str(Path(path).resolve()), "source": str(instructions), "samples": args.samples,
             "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "min_gap": args.min_gap,
             "seed": args.seed, "splits": {}}
    pairs = {}
    for split, split_samples in samples.items():
        start = time.perf_counter()
        prompts = [alpaca_item(s)["prompt"] for s in split_samples]
        ids = [i for i, p in enumerate(prompts) if len(tokenizer.encode(p)) <= args.max_prompt_len]
        responses = sample_responses(generate_fn, [prompts[i] for i in ids], ids, args.samples, args.max_new_tokens,
                                     sampling=SamplingOptions(temperature=args.temperature, seed=args.seed),
                                     prompt_len=width) if ids else []
        scores = [score(r, split_samples[i]["output"]) for i, rs in zip(ids, responses) for r in rs]
        made = [on_policy_pair(split_samples[i], rs, args.min_gap) for i, rs in zip(ids, responses)]
        pairs[split] = [p for p in made if p is not None]
        gaps = [p["margin"] for p in pairs[split]]
        stats["splits"][split] = {
            "prompts": len(ids), "too_long": len(prompts) - len(ids), "responses": len(scores),
            "empty": sum(not r.strip() for rs in responses for r in rs), "pairs": len(pairs[split]),
            "mean_gap": round(sum(gaps) / len(gaps), 4) if gaps else None,
            "mean_rouge_l": round(sum(rl for _, rl in scores) / len(scores), 4) if scores else None,
            "exact_match": round(sum(em for em, _ in scores) / len(scores), 4) if scores else None,
            "seconds": round(time.perf_counter() - start, 1)}
        s = stats["splits"][split]
        print(f"[preferences] {split}: {s['pairs']:,} on-policy pairs from {s['prompts']:,} prompts x {args.samples} "
              f"samples ({s['too_long']:,} prompts longer than --max-prompt-len left out); mean gap "
              f"{s['mean_gap']}, responses' ROUGE-L {s['mean_rouge_l']}, exact match {s['exact_match']}; "
              f"{s['seconds']} s", flush=True)
    write_set(out, pairs, stats)
    return stats


SAMPLE_KEYS = ("instruction", "output", "task", "entry")  # what make_pairs reads of a sample


def _sample(line: str, where: str) -> dict:
    try:
        sample = json.loads(line)
    except ValueError as err:
        raise DataError(f"{where}: invalid JSON ({err}); rebuild the instruction set: "
                        f"python -m builders.instructions") from None
    if not isinstance(sample, dict) or not all(isinstance(sample.get(k), str) for k in SAMPLE_KEYS):
        raise DataError(f"{where}: not a sample of the instruction set (needs the strings {', '.join(SAMPLE_KEYS)}); "
                        f"rebuild it: python -m builders.instructions")
    return sample


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m builders.preferences", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instructions", type=Path, default=data_dir() / "instructions",
                        help="directory with the instruction set's train.jsonl and val.jsonl")
    parser.add_argument("--out", type=Path, help="default: <data dir>/preferences, or preferences_on_policy")
    parser.add_argument("--seed", type=number(int, 0), default=0)
    parser.add_argument("--max-pairs", type=number(int, 1), default=20000, help="training pairs kept (val: all)")
    on_policy = parser.add_argument_group("on-policy pairs (sampled from a checkpoint)")
    on_policy.add_argument("--on-policy", metavar="CKPT", help="sample the responses from this checkpoint")
    on_policy.add_argument("--samples", type=number(int, 2), default=4, help="responses per prompt (k >= 2)")
    on_policy.add_argument("--temperature", type=number(float, 0.0), default=1.0)
    on_policy.add_argument("--max-new-tokens", type=number(int, 1), default=64)
    on_policy.add_argument("--max-prompt-len", type=number(int, 1), default=256, help="longer prompts (tokens) are left out")
    on_policy.add_argument("--max-prompts", type=number(int, 0), default=0, help="the first N samples of each split (0: all)")
    on_policy.add_argument("--min-gap", type=number(float, 0.0, 1.0), default=0.1, help="least ROUGE-L difference that makes a pair")
    on_policy.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    on_policy.add_argument("--batch-size", type=number(int, 1), default=16, help="sequences per generation batch")
    on_policy.add_argument("--device", default="CPU", help="MindSpore device target (CPU, Ascend, GPU)")
    args = parser.parse_args(argv)
    if args.on_policy is None:
        out = args.out or data_dir() / "preferences"
        check_output_dir(out, TOOL, OWN)  # before the build, not after it
        build(args.instructions, out, args.seed, args.max_pairs)
    else:
        # the parser checks the ranges; what it cannot say: both ends open, and a directory
        checks = [(args.temperature > 0, "--temperature", f"must be > 0 (at 0 every sample is the greedy response), "
                                                          f"got {args.temperature}"),
                  (args.min_gap > 0, "--min-gap", f"must be in (0, 1] (a ROUGE-L difference), got {args.min_gap}"),
                  (os.path.isdir(args.on_policy), "--on-policy", f"no such checkpoint directory: {args.on_policy}")]
        for ok, name, message in checks:
            if not ok:
                raise UsageError(f"{name}: {message}")
        out = args.out or data_dir() / "preferences_on_policy"
        check_output_dir(out, TOOL, OWN)  # before minutes of sampling, not after them
        build_on_policy(args.on_policy, args.instructions, out, args)
    print(f"[preferences] wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
