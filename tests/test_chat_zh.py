"""The Chinese instruction samples and feedback records of builders/chat_zh.py: each rule on a hand example, then
on ../shared/corpora/zh: held out by entry, every feedback record preferring the corpus answer, and both files
read by the data formats they are written in (alpaca, the article's feedback shape)."""
import glob
import os

import pytest
from omegaconf import OmegaConf

from base.schema import SourceConfig
from builders import chat_zh as Z
from conftest import CORPORA, absent

ZH = sorted(glob.glob(os.path.join(CORPORA, "zh", "*.jsonl.gz")))


def test_each_rule_on_a_hand_example():
    assert Z.man_name("NAME(名称)\naccess - 确定文件是否可以存取访问\n\n...") == ("access", "确定文件是否可以存取访问")
    assert Z.man_name("名称\nat, batch,  atq - 排队、检查或删除以后要执行的作业。") == ("at, batch, atq",
                                                                             "排队、检查或删除以后要执行的作业。")
    assert Z.man_name("NAME\nls - list directory contents") is None  # no Chinese in the answer
    text = "《静夜思》\n作者：李白\n床前明月光，疑是地上霜。\n举头望明月，低头思故乡。\n\n《春晓》\n作者：孟浩然\n春眠不觉晓。"
    assert list(Z.poems(text)) == [("静夜思", "李白", "床前明月光，疑是地上霜。\n举头望明月，低头思故乡。"),
                                   ("春晓", "孟浩然", "春眠不觉晓。")]
    doc = ".. SPDX\n\n=====\nMSI驱动指南\n=====\n\n:作者: x\n\n本指南介绍了消息标记中断（MSI）的基本知识，如何\n改变你的驱动程序以使用 MSI\nor MSI-X 的方法。"
    title, end = Z.kernel_title(doc)
    assert title == "MSI驱动指南"
    assert Z.worse("truncate", "卸载文件系统", []) == "卸载文"
    assert Z.worse("loop", "清时有味是无能，闲爱孤云静爱僧。", []) == "清时有味是无能，清时有味是无能，"
    assert Z.worse("neighbour", "a", ["a", "b"]) == "b" and Z.worse("truncate", "短", []) is None
    assert Z._lead(doc[end:].split("\n\n")) == "本指南介绍了消息标记中断（MSI）的基本知识，如何改变你的驱动程序以使用 MSI or MSI-X 的方法。"


@pytest.fixture(scope="module")
def built():
    if not ZH:
        absent(f"no Chinese corpus under {CORPORA}/zh")
    return Z.build(Z.read_documents(Z.existing_shards(CORPORA, Z.SHARDS.values())), seed=0, val_fraction=0.1)


def test_the_corpus_set_is_held_out_by_entry_and_its_feedback_prefers_the_corpus_answer(built, tmp_path):
    records, stats = built
    assert set(stats["tasks"]) == set(Z.TASKS) and all(c["train"] > 0 and c["val"] > 0 for c in stats["tasks"].values())
    entries = {split: {(s["task"], s["entry"]) for s in records[split]} for split in ("train", "val")}
    assert not entries["train"] & entries["val"]
    for split in ("train", "val"):
        answers = {s["instruction"]: s["output"] for s in records[split]}
        for r in records[f"feedback_{split}"]:
            chosen, other = r[f"response{r['preference']}"], r[f"response{3 - r['preference']}"]
            assert chosen == answers[r["prompt"]] and other != chosen
            assert other == Z.worse(r["rule"], chosen, [a for a in answers.values() if a == other])
        assert {r["preference"] for r in records[f"feedback_{split}"]} == {1, 2}
        assert {r["rule"] for r in records[f"feedback_{split}"]} == set(Z.RULES)
    from data.samples import read_samples

    Z.write(tmp_path / "chat_zh", records, stats)
    for name, kind in (("train", "alpaca"), ("feedback_train", "feedback")):
        source = OmegaConf.merge(OmegaConf.structured(SourceConfig),
                                 {"name": name, "kind": "auto", "paths": [str(tmp_path / "chat_zh" / f"{name}.jsonl")]})
        read = read_samples(source)
        assert read.format.name == kind and len(read.samples) == len(records[name])


def test_each_tasks_held_out_samples_are_an_evaluation_task_prompted_in_the_checkpoints_template(built, tmp_path):
    """tasks/<task>.jsonl: the task's val samples alone, which `python -m evaluation --tasks-dir` (the recipe's
    evaluate stage) loads as generation tasks in the article's template, the corpus answer as the reference."""
    from data.samples import TEMPLATES
    from evaluation.tasks import load_tasks

    records, stats = built
    Z.write(tmp_path / "chat_zh", records, stats)
    tasks = load_tasks(list(Z.TASKS), str(tmp_path / "chat_zh" / "tasks"), 0, TEMPLATES["alpaca_zh"])
    assert [t.name for t in tasks] == list(Z.TASKS) and {t.kind for t in tasks} == {"generation"}
    for task in tasks:
        val = [s for s in records["val"] if s["task"] == task.name]
        assert len(task.items) == len(val) == stats["tasks"][task.name]["val"]
        assert [i["answer"] for i in task.items] == [s["output"] for s in val]
        assert task.items[0]["prompt"] == f"### 指令: {val[0]['instruction']}\n### 输出: "
