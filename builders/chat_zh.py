r"""Chinese instruction samples and feedback records derived by rule from ../shared/corpora/zh:
`python -m builders.chat_zh`.

What it measures, as the English set (builders/instructions.py) does: faithful recall of text the corpus holds,
in the answer format; not helpfulness. Every answer is copied from one document.

Tasks (name (corpus source): one real example):
- `manpage_name_zh` (manpages_zh): '`ab` 命令是做什么的？' -> 'Apache HTTP 服务器性能测试工具' (the NAME line's
  description, whatever the heading says: NAME, 名称, NAME(名称) ...; descriptions without a CJK character skipped).
- `poem_zh` (tang_song_poems): '写出张九龄的《感遇・其一》。' -> the poem's lines ('《title》\n作者：author\n' then
  the lines, up to the blank line).
- `chapter_lead_zh` (debian_handbook_zh_cn, debian_reference_zh_cn): '《Debian 管理员手册》“第 12 章高级管理”
  的第一段是什么？' -> the first paragraph after the title line that is at least 30 characters, holds CJK, and ends
  with '。'.
- `kernel_doc_lead_zh` (linux_docs_zh_cn): 'Linux 内核文档《PCI主桥的ACPI注意事项》的第一段是什么？' -> the first such
  paragraph after the title (the line between two '=' rules), its wrapped lines joined (no space between CJK
  characters, as the text is written).

The split is held out by entry (the command, the poem's title and author, the document's title): a SHA-256 of
(task, entry) below `--val-fraction` puts every sample of that entry in val.jsonl. Feedback records, in the shape
of the article's reward-model data ({prompt, response1, response2, preference}), pair each sample's answer (the
preferred one) with a worse one made by a rule, drawn with the seed (`rule` says which):
- `neighbour`: the answer of the next entry of its task in the same split (fluent, but to another question);
- `truncate`: the answer's first half (characters), which stops short;
- `loop`: the answer's first clause (up to the first '，', '。' or line end) repeated to the answer's length.
Which of response1 and response2 holds the corpus answer is a seeded coin, and `preference` names it. They are
held out as their samples are. Writes train.jsonl, val.jsonl (alpaca samples), feedback_train.jsonl, feedback_val.jsonl and stats.json to
`--out` (default `${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/chat_zh`), atomically, and tasks/<task>.jsonl: each
task's held-out samples alone, the evaluation tasks of `python -m evaluation CKPT --tasks-dir <out>/tasks
tasks=[poem_zh]` (scored per task, by exact match and ROUGE-L of greedy answers). Pure Python.
"""
from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from base.errors import ArgumentParser, entry_point, number
from base.outputs import check_output_dir, output_dir
from base.paths import corpora_dir, data_dir
from base.text import CJK as CJK_RANGES
from builders.instructions import existing_shards, read_documents, split_of


TOOL = "builders.chat_zh"
OWN = ("train.jsonl", "val.jsonl", "feedback_train.jsonl", "feedback_val.jsonl", "stats.json", "tasks")
SHARDS = {"manpages_zh": "zh/manpages_zh.jsonl.gz", "tang_song_poems": "zh/tang_song_poems.jsonl.gz",
          "debian_handbook_zh_cn": "zh/debian_handbook_zh_cn.jsonl.gz",
          "debian_reference_zh_cn": "zh/debian_reference_zh_cn.jsonl.gz",
          "linux_docs_zh_cn": "zh/linux_docs_zh_cn.jsonl.gz"}
BOOKS = {"debian_handbook_zh_cn": "Debian 管理员手册", "debian_reference_zh_cn": "Debian 参考手册"}
CJK = re.compile(f"[{CJK_RANGES}]")
NAME_HEADING = re.compile(r"^(NAME|名称|名字|命令名)")
MAX_OUTPUT_CHARS = 300  # a longer poem or paragraph would outgrow data.seq_len (512) in rare characters
LEAD_CHARS = 30

Sample = Tuple[str, str, str]  # (entry, instruction, output)


def man_name(text: str) -> Optional[Tuple[str, str]]:
    """(command names, description) of a man page's NAME line: 'ab - Apache HTTP 服务器性能测试工具'."""
    lines = text.split("\n")
    if len(lines) < 2 or not NAME_HEADING.match(lines[0].strip()):
        return None
    names, dash, description = lines[1].partition(" - ")
    names, description = " ".join(names.split()), description.strip()
    return (names, description) if dash and names and CJK.search(description) else None


def manpage_name_zh(docs: Iterable[dict]) -> Iterator[Sample]:
    for doc in docs:
        found = man_name(doc["text"]) if doc["source"] == "manpages_zh" else None
        if found:
            yield found[0], f"`{found[0]}` 命令是做什么的？", found[1]


def poems(text: str) -> Iterator[Tuple[str, str, str]]:
    """(title, author, lines) of each '《title》\\n作者：author\\n...' block."""
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.strip().split("\n")]
        if len(lines) >= 3 and lines[0].startswith("《") and lines[0].endswith("》") and lines[1].startswith("作者："):
            yield lines[0][1:-1], lines[1][3:], "\n".join(lines[2:])


def poem_zh(docs: Iterable[dict]) -> Iterator[Sample]:
    for doc in docs:
        if doc["source"] == "tang_song_poems":
            for title, author, body in poems(doc["text"]):
                yield f"{author}《{title}》", f"写出{author}的《{title}》。", body


def _join_wrapped(lines: Sequence[str]) -> str:
    """Wrapped lines as one paragraph: no space where both sides are CJK (Chinese is written without), else one."""
    out = ""
    for line in (line.strip() for line in lines):
        out += ("" if not out or (CJK.match(out[-1]) and CJK.match(line[:1] or " ")) else " ") + line
    return out


def _lead(paragraphs: Iterable[str]) -> Optional[str]:
    for paragraph in paragraphs:
        text = _join_wrapped(paragraph.split("\n"))
        if len(text) >= LEAD_CHARS and CJK.search(text) and text.endswith("。") and not text.startswith((":", "..")):
            return text
    return None


def chapter_lead_zh(docs: Iterable[dict]) -> Iterator[Sample]:
    for doc in docs:
        if doc["source"] in BOOKS:
            title, _, rest = doc["text"].partition("\n\n")
            lead = _lead(rest.split("\n\n"))
            if lead:
                yield f"{doc['source']}/{title}", f"《{BOOKS[doc['source']]}》“{title.strip()}”的第一段是什么？", lead


def kernel_title(text: str) -> Optional[Tuple[str, int]]:
    """(title, where its block ends) of an rst document: the first line between two '=' rule lines."""
    lines = text.split("\n")
    for i in range(1, len(lines) - 1):
        if re.fullmatch(r"=+", lines[i - 1]) and re.fullmatch(r"=+", lines[i + 1]) and lines[i].strip():
            return lines[i].strip(), len("\n".join(lines[:i + 2]))
    return None


def kernel_doc_lead_zh(docs: Iterable[dict]) -> Iterator[Sample]:
    for doc in docs:
        found = kernel_title(doc["text"]) if doc["source"] == "linux_docs_zh_cn" else None
        lead = _lead(doc["text"][found[1]:].split("\n\n")) if found else None
        if lead:
            yield found[0], f"Linux 内核文档《{found[0]}》的第一段是什么？", lead


RULES = ("neighbour", "truncate", "loop")


def worse(rule: str, answer: str, others: Sequence[str]) -> Optional[str]:
    """A worse answer than `answer` by `rule` (see the module docstring); `others`: the task's other answers, from
    the next one on. None when the rule has nothing to offer (a one-character answer, no other answer)."""
    if rule == "neighbour":
        return next((o for o in others if o != answer), None)
    if rule == "truncate":
        return answer[:len(answer) // 2] if len(answer) >= 4 else None
    clause = re.split(r"(?<=[，。\n])", answer, maxsplit=1)[0]
    looped = (clause * (len(answer) // max(len(clause), 1) + 1))[:max(len(answer), 2 * len(clause))]
    return looped if looped != answer else None


TASKS = {"manpage_name_zh": manpage_name_zh, "poem_zh": poem_zh, "chapter_lead_zh": chapter_lead_zh,
         "kernel_doc_lead_zh": kernel_doc_lead_zh}


def build(documents: Iterable[dict], seed: int = 0, val_fraction: float = 0.1) -> Tuple[Dict[str, list], dict]:
    """{train, val, feedback_train, feedback_val} records and stats, from the corpus documents."""
    docs = list(documents)
    out: Dict[str, list] = {"train": [], "val": [], "feedback_train": [], "feedback_val": []}
    stats: dict = {"seed": seed, "val_fraction": val_fraction, "tasks": {}}
    seen = set()
    for task, rule in TASKS.items():
        by_split: Dict[str, List[dict]] = {"train": [], "val": []}
        candidates = 0
        for entry, instruction, output in rule(docs):
            candidates += 1
            if instruction in seen or not output.strip() or len(output) > MAX_OUTPUT_CHARS:
                continue
            seen.add(instruction)
            by_split[split_of(task, entry, val_fraction)].append(
                {"instruction": instruction, "input": "", "output": output, "task": task, "entry": entry})
        for split, samples in by_split.items():
            out[split] += samples
            coin = random.Random(f"{seed}/{task}/{split}")
            for i, sample in enumerate(samples):
                rule = coin.choice(RULES)
                other = worse(rule, sample["output"], [s["output"] for s in samples[i + 1:] + samples[:i]])
                if other is None or other == sample["output"]:
                    continue
                first = coin.random() < 0.5
                out[f"feedback_{split}"].append({
                    "prompt": sample["instruction"], "response1": sample["output"] if first else other,
                    "response2": other if first else sample["output"], "preference": 1 if first else 2,
                    "task": task, "entry": sample["entry"], "rule": rule})
        stats["tasks"][task] = {"candidates": candidates, **{k: len(v) for k, v in by_split.items()}}
    for name, records in out.items():
        random.Random(f"{seed}/shuffle/{name}").shuffle(records)
    stats["total"] = {name: len(records) for name, records in out.items()}
    return out, stats


def write(out_dir: Path, records: Dict[str, list], stats: dict) -> Path:
    with output_dir(out_dir, TOOL, OWN) as tmp:
        for name, rows in records.items():
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / "tasks").mkdir()
        for task in TASKS:
            with open(tmp / "tasks" / f"{task}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records["val"] if r["task"] == task)
    return out_dir


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m builders.chat_zh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", type=Path, default=None, help="corpora dir (default: $MINDLAB_CORPORA, "
                        "else ../shared/corpora beside the checkout)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: "
                        "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/chat_zh)")
    parser.add_argument("--seed", type=number(int, 0), default=0)
    parser.add_argument("--val-fraction", type=number(float, 0.0, 1.0, high_open=True), default=0.1)
    args = parser.parse_args(argv)
    start, out = time.time(), args.out or data_dir() / "chat_zh"
    check_output_dir(out, TOOL, OWN)
    corpora = args.corpora or corpora_dir()
    records, stats = build(read_documents(existing_shards(corpora, SHARDS.values())), args.seed, args.val_fraction)
    write(out, records, stats)
    for task, counts in stats["tasks"].items():
        print(f"{task:<20} {counts['candidates']:>6} candidates  {counts['train']:>5} train  {counts['val']:>4} val")
    print(f"wrote {out}: {', '.join(f'{k} {v}' for k, v in stats['total'].items())} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
