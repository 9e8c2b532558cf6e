"""builders/instructions.py: the instruction set derived from ../shared/corpora, checked on the real tiny corpora
(and, for man-page options, which no tiny page has, on the real manpages_en shard)."""
import ast
import glob
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from base.paths import corpora_dir
from builders import corpus_parsers as P
from builders import instruction_set as S
from conftest import CORPORA, ROOT, corpus_path

TINY = sorted(glob.glob(os.path.join(CORPORA, "tiny", "*.jsonl")))
pytestmark = pytest.mark.corpora("tiny")


@pytest.fixture(scope="module")
def docs():
    return list(S.read_documents(TINY))


@pytest.fixture(scope="module")
def by_id(docs):
    return {d["id"]: d for d in docs}


def _copied(sample):
    """The text of a sample that was copied from the corpus: the output, or the definition / docstring that a
    reverse question quotes."""
    if sample["task"] == "python_function_for_doc":
        return sample["input"]
    if sample["task"] in ("which_word", "which_term"):
        return re.match(r"^Which (?:word|computing term) means: (.*)\?$", sample["instruction"], re.S).group(1)
    return sample["output"]


@pytest.mark.parametrize("task", [t for t in P.TASKS if t != "manpage_option"])
def test_task_copies_text_from_its_document(task, docs, by_id):
    samples = P.TASKS[task][1](docs)
    assert samples, f"{task}: no samples from the tiny corpora"
    for s in samples:
        text = P.normalize(by_id[s["id"]]["text"])
        assert P.normalize(_copied(s)) in text, s
        assert s["task"] == task and s["source"] == by_id[s["id"]]["source"]
        if task != "bible_verse":  # ('Genesis 1:3' is a chapter heading and a verse number: test_task_specifics)
            assert P.normalize(s["entry"].split(".")[-1] if task.startswith("python") else s["entry"]) in text, s


def test_task_specifics(docs, by_id):
    """What each answer is, beyond occurring in the document."""
    wordnet = [s for s in P.define_word(docs) if s["source"] == "wordnet"]
    assert wordnet and all(re.match(r"^(n|v|adj|adv) 1: \S", s["output"]) for s in wordnet)
    assert all(s["output"] == s["entry"] for s in P.which_word(docs) + P.which_term(docs))
    for s in P.bible_verse(docs):  # 'Quote <Book> <c>:<v> (KJV).' -> the '<v> <text>' line of that chapter
        book, chapter, verse = re.match(r"^Quote (.+) (\d+):(\d+) \(KJV\)\.$", s["instruction"]).groups()
        text = by_id[s["id"]]["text"]
        start = re.search(rf"(?:^|\n){re.escape(book)} {chapter}\n", text).end()
        end = text.find("\n\n", start)
        assert f"{verse} {s['output']}" in text[start:end if end >= 0 else None].split("\n")
    trees = {}
    for s in P.python_docstring(docs):  # the docstring ast reads for that name
        tree = trees.get(s["id"]) or trees.setdefault(s["id"], ast.parse(by_id[s["id"]]["text"]))
        scope = tree.body
        *cls, name = s["entry"].split(".")
        if cls:
            scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls[0]).body
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
        assert ast.get_docstring(node).strip() == s["output"]
        assert 20 <= len(s["output"]) <= 600 and s["input"].startswith(("def ", "async def "))
    for s in P.manpage_name(docs):
        assert f"{s['entry']}" in by_id[s["id"]]["text"].split("\n\n")[0] and s["output"] in by_id[s["id"]]["text"]
    for s in P.wiki_title_paragraph(docs):
        assert by_id[s["id"]]["text"].split("\n")[0] == s["entry"] and len(s["output"]) <= 700


def test_manpage_options_on_real_pages():
    shard = Path(corpus_path(P.SHARDS["manpages_en"]))
    pages = [d for d in S.read_documents([shard]) if "\nOPTIONS\n" in d["text"]]
    samples = P.manpage_option(pages)
    by_id = {d["id"]: d for d in pages}
    assert len({s["entry"] for s in samples}) >= 5
    for s in samples:  # the option's line(s), then its description, as a paragraph of the page
        option = re.match(r"^What does the `(.+)` option of `(.+)` do\?$", s["instruction"]).group(1)
        text = by_id[s["id"]]["text"]
        at = text.index("\n" + s["output"] + "\n")
        assert ", ".join(text[:at].rsplit("\n\n", 1)[-1].split("\n")) == option
    assert {"instruction": "What does the `-v, --verbose` option of `ldd` do?", "output": "Print all information, "
            "including, for example, symbol versioning information.", "entry": "ldd"}.items() <= next(
        s for s in samples if "`-v, --verbose` option of `ldd`" in s["instruction"]).items()


def test_split_is_by_entry(docs):
    train, val, stats = S.build(docs, val_fraction=0.3)
    assert train and val
    keys = {name: {(P.TASKS[s["task"]][0], s["entry"].casefold()) for s in split}
            for name, split in (("train", train), ("val", val))}
    assert not keys["train"] & keys["val"]
    assert len({P.TASKS[s["task"]][0] for s in val}) >= 3
    assert all(S.split_of(P.TASKS[s["task"]][0], s["entry"], 0.3) == "val" for s in val)
    # a headword with both a definition and a reverse question keeps them together
    entries = lambda task: {s["entry"] for s in val if s["task"] == task}  # noqa: E731
    assert entries("which_word") & entries("define_word")


def test_deterministic_capped_deduplicated_with_provenance(docs):
    first = S.build(docs, max_per_task=25, seed=3)
    assert first == S.build(docs, max_per_task=25, seed=3)
    train, val, stats = first
    other = S.build(docs, max_per_task=25, seed=4)
    assert {json.dumps(s, sort_keys=True) for s in train} != {json.dumps(s, sort_keys=True) for s in other[0]}
    for task, counts in stats["tasks"].items():
        assert counts["train"] + counts["val"] == min(25, counts["eligible"])
    samples = train + val
    assert len({(s["instruction"], s["input"]) for s in samples}) == len(samples)
    for s in samples:
        assert tuple(s) == S.FIELDS
        assert all(isinstance(s[k], str) for k in S.FIELDS)
        assert s["task"] in P.TASKS and s["entry"] and 0 < len(s["output"]) <= 1000
        assert s["id"].startswith(s["source"] + "-")


def _shards(docs, root: Path) -> Path:
    """A corpora dir whose shards hold the tiny documents of each source (the layout the CLI reads)."""
    for source, shard in P.SHARDS.items():
        (root / shard).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(root / shard, "wt", encoding="utf-8") as f:
            for d in docs:
                if d["source"] == source:
                    f.write(json.dumps(d) + "\n")
    return root


def test_cli_writes_files_and_stats_without_mindspore(docs, tmp_path):
    corpora = _shards(docs, tmp_path / "corpora")
    out = tmp_path / "out"
    script = ("import sys\n"
              "from builders.instructions import main\n"
              "rc = main(sys.argv[1:])\n"
              "assert not [m for m in sys.modules if m.startswith('mindspore')], 'imported MindSpore'\n"
              "sys.exit(rc)\n")
    cmd = [sys.executable, "-c", script, "--corpora", str(corpora), "--out", str(out), "--max-per-task", "40",
           "--seed", "1"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "bible_verse" in run.stdout
    stats = json.loads((out / "stats.json").read_text())
    lines = {split: [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
             for split in ("train", "val")}
    for split, samples in lines.items():
        assert stats["total"][split] == len(samples)
        for task, counts in stats["tasks"].items():
            assert counts[split] == sum(s["task"] == task for s in samples)
    assert (stats["seed"], stats["max_per_task"], stats["val_fraction"]) == (1, 40, 0.05)
    assert (lines["train"], lines["val"]) == S.build(docs, max_per_task=40, seed=1)[:2]


def test_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("MINDLAB_DATA_DIR", str(tmp_path))
    assert S.default_out_dir() == tmp_path / "instructions"
    monkeypatch.delenv("MINDLAB_DATA_DIR")
    assert S.default_out_dir() == Path.home() / ".cache" / "mindlab" / "data" / "instructions"
    monkeypatch.setenv("MINDLAB_CORPORA", str(tmp_path))
    assert corpora_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="MINDLAB_CORPORA"):
        S.shard_paths(tmp_path)
