"""Instruction and preference formats (data/formats.py): every format read back into the canonical sample it was
written from (JSON lines and a JSON list, by its kind and by kind auto), the conversions TRL's data_utils makes,
the article's feedback records, the binarising rule of rated completions, and a bad record of each format refused
in one line naming its file and line."""
import json

import pytest
from omegaconf import OmegaConf

from base.schema import SourceConfig
from data import DataError
from data.samples import read_samples

# canonical samples and pairs, one per shape data/samples.py renders
SAMPLES = {
    "alpaca": {"instruction": "写一首关于春天的诗。", "input": "五言", "output": "春眠不觉晓，处处闻啼鸟。"},
    "prompt_completion": {"prompt": "2 + 3 =", "completion": " 5"},
    "chat": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "你好"},
                          {"role": "assistant", "content": "你好！"}]},
}
PAIR_TEXT = {"instruction": "天空是什么颜色？", "input": "", "chosen": "蓝色。", "rejected": "绿色。", "margin": 0.0}
PAIR_CHAT = {"chosen": [{"role": "user", "content": "What color is the sky?"},
                        {"role": "assistant", "content": "It is blue."}],
             "rejected": [{"role": "user", "content": "What color is the sky?"},
                          {"role": "assistant", "content": "It is green."}], "margin": 0.0}
FROM = {"system": "system", "user": "human", "assistant": "gpt"}  # ShareGPT's speakers


def hh_transcript(messages):
    return "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages)


# format -> (its writer: canonical -> the record as that format holds it, the canonical it is written from)
WRITERS = {
    "alpaca": (lambda s: dict(s), SAMPLES["alpaca"]),
    "prompt_completion": (lambda s: dict(s), SAMPLES["prompt_completion"]),
    "chat": (lambda s: dict(s), SAMPLES["chat"]),
    "sharegpt": (lambda s: {"conversations": [{"from": FROM[m["role"]], "value": m["content"]}
                                              for m in s["messages"]]}, SAMPLES["chat"]),
    "feedback": (lambda p: {"prompt": p["instruction"], "response1": p["rejected"], "response2": p["chosen"],
                            "preference": 2}, PAIR_TEXT),
    "rated": (lambda p: {"instruction": p["instruction"], "completions": [
        {"response": "灰色。", "overall_score": 5}, {"response": p["chosen"], "overall_score": 9},
        {"response": p["rejected"], "overall_score": 2}]}, {**PAIR_TEXT}),
    "hh": (lambda p: {"chosen": hh_transcript(p["chosen"]), "rejected": hh_transcript(p["rejected"])}, PAIR_CHAT),
    "preference": (lambda p: dict(p), PAIR_TEXT),
}


def source(kind, *paths, **options):
    return OmegaConf.merge(OmegaConf.structured(SourceConfig), {"name": "s", "kind": kind, "paths": list(paths),
                                                                **options})


def write(path, records, array=False):
    path.write_text(json.dumps(records, ensure_ascii=False) if array else
                    "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", list(WRITERS))
def test_every_format_reads_back_the_canonical_sample_it_was_written_from(tmp_path, name):
    writer, canonical = WRITERS[name]
    lines = write(tmp_path / "a.jsonl", [writer(canonical)] * 2)
    array = write(tmp_path / "a.json", [writer(canonical)], array=True)
    for kind in (name, "auto"):
        read = read_samples(source(kind, lines, array))
        assert read.format.name == name
        assert [s for s, _ in read.samples] == [canonical] * 3
        assert [w for _, w in read.samples] == [f"{lines}:1", f"{lines}:2", f"{array}: sample 1"]


def test_trl_formats_become_what_trl_makes_of_them(tmp_path):
    """TRL's maybe_convert_to_chatml (from/value -> role/content), its conversational prompt-completion and
    explicit-prompt preference (the prompt's turns lead both sides), and extract_prompt on text (its docstring's
    example: the space before the first differing character goes with the responses)."""
    turns = [{"role": "user", "content": "What color is the sky?"}]
    records = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
               {"chosen": "The sky is blue.", "rejected": "The sky is green."},
               {"prompt": turns, "chosen": [{"role": "assistant", "content": "It is blue."}],
                "rejected": [{"role": "assistant", "content": "It is green."}]}]
    pairs = [s for s, _ in read_samples(source("preference", write(tmp_path / "p.jsonl", records))).samples]
    assert pairs[0] == pairs[1] == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 0.0}
    assert pairs[2] == PAIR_CHAT
    completion = {"prompt": turns, "completion": [{"role": "assistant", "content": "It is blue."}]}
    sample, = [s for s, _ in read_samples(source("auto", write(tmp_path / "c.jsonl", [completion]))).samples]
    assert sample == {"messages": turns + completion["completion"]}
    sharegpt = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"},
                                                         {"from": "gpt", "value": "Hello."}]}
    sample, = [s for s, _ in read_samples(source("sharegpt", write(tmp_path / "g.jsonl", [sharegpt]))).samples]
    assert sample["messages"] == SAMPLES["chat"]["messages"][:3]


def test_the_articles_feedback_records_and_their_ties(tmp_path):
    """preference 1 keeps response1 as chosen, 2 swaps them; any other value is refused, or under ties=drop left
    out and counted in the data's meta."""
    records = [{"prompt": "p1", "response1": "a", "response2": "b", "preference": 1},
               {"prompt": "p2", "response1": "a", "response2": "b", "preference": 2},
               {"prompt": "p3", "response1": "a", "response2": "b", "preference": 0},
               {"prompt": "p4", "response1": "a", "response2": "b", "preference": None}]
    path = write(tmp_path / "human_feedback.jsonl", records)
    with pytest.raises(DataError, match=r"human_feedback.jsonl:3: 'preference' is 0; it says which response is "
                                        r"better, 1 or 2 .*ties=drop"):
        read_samples(source("feedback", path))
    read = read_samples(source("feedback", path, ties="drop"))
    assert [(s["instruction"], s["chosen"], s["rejected"]) for s, _ in read.samples] == [("p1", "a", "b"),
                                                                                       ("p2", "b", "a")]
    assert read.ties_dropped == 2


def test_rated_completions_are_the_best_against_the_worst(tmp_path):
    """The first of the highest scores is chosen, the last of the lowest rejected; all equal: a tie."""
    scores = [("a", 3), ("b", 7), ("c", 7), ("d", 1), ("e", 1)]
    record = {"prompt": "q", "completions": [{"response": r, "score": s} for r, s in scores]}
    tie = {"prompt": "q", "completions": [{"response": r, "overall_score": 4} for r in "xy"]}
    read = read_samples(source("rated", write(tmp_path / "r.jsonl", [record, tie]), ties="drop"))
    assert [s for s, _ in read.samples] == [{"prompt": "q", "chosen": "b", "rejected": "e", "margin": 0.0}]
    assert read.ties_dropped == 1


def test_a_json_list_saved_as_jsonl_is_named_as_such(tmp_path):
    """On one line, or indented as Alpaca's alpaca_data.json is."""
    path = write(tmp_path / "alpaca_data.jsonl", [SAMPLES["alpaca"]] * 2, array=True)
    with pytest.raises(DataError, match=r"alpaca_data.jsonl:1: a JSON list; the file holds one JSON list, not a "
                                        r"record per line: name it \.json"):
        read_samples(source("alpaca", path))
    (tmp_path / "alpaca_data.jsonl").write_text(json.dumps([SAMPLES["alpaca"]] * 2, indent=4))
    with pytest.raises(DataError, match=r"alpaca_data.jsonl:1: invalid JSON .*one JSON list, not a record per "
                                        r"line: name it \.json"):
        read_samples(source("alpaca", path))


BAD = [  # (kind, a bad second record, what the line says after "<file>:2: ")
    ("alpaca", {"instruction": "x", "input": ""}, r"no field 'output' \(keys: input, instruction\); a record of kind alpaca holds"),
    ("alpaca", {"prompt": "p", "response1": "a", "response2": "b", "preference": 1},
     r"no field 'instruction' .* it looks like a feedback record: set kind: feedback \(or kind: auto\)"),
    ("sharegpt", {"conversations": [{"from": "bot", "value": "x"}]}, r"'from' is 'bot'"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, r"empty response"),
    ("prompt_completion", {"prompt": "p", "completion": 3}, r"field 'completion' is int, expected a string"),
    ("feedback", {"prompt": "p", "response1": "a", "response2": "b", "preference": "1"}, r"'preference' is '1'"),
    ("rated", {"prompt": "p", "completions": [{"response": "a", "overall_score": 1}]}, r"'completions' must be a list of at least two"),
    ("hh", {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: ho\n\nAssistant: b"},
     r"chosen and rejected differ before their last Assistant turn"),
    ("preference", {"instruction": "x", "chosen": "same", "rejected": "same"}, r"chosen and rejected are identical"),
    ("preference", {"chosen": "abc", "rejected": "xyz"}, r"no prompt; chosen and rejected share no beginning"),
]


@pytest.mark.parametrize("kind,record,message", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_a_bad_record_is_one_line_naming_its_file_and_line(tmp_path, kind, record, message):
    good = WRITERS[kind][0](WRITERS[kind][1])
    path = write(tmp_path / "data.jsonl", [good, record])
    with pytest.raises(DataError, match=f"data.jsonl:2: {message}") as err:
        read_samples(source(kind, path))
    assert "\n" not in str(err.value)


def test_auto_names_the_formats_when_none_fits(tmp_path):
    with pytest.raises(DataError, match=r"x.jsonl:1: kind auto found no format for keys answer, question; the "
                                        r"formats: alpaca, sharegpt, chat, prompt_completion, preference, feedback, "
                                        r"rated, hh \(docs/sft.md"):
        read_samples(source("auto", write(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])))


def test_feedback_records_give_the_tokens_of_the_same_pairs_written_as_preference(tmp_path, tokenizer_file):
    """Stage 1 of stage=rm / stage=dpo on the article's feedback file: the same tokens, masks and margins as the
    pairs written as TRL-style preference records, and the dropped tie in the meta."""
    import numpy as np

    from base.schema import DataConfig
    from data.samples import build_samples

    feedback = [{"prompt": f"问题{i}", "response1": f"答{i}", "response2": f"错{i}", "preference": 1 + i % 2}
                for i in range(6)] + [{"prompt": "平", "response1": "a", "response2": "b", "preference": 0}]
    pairs = [{"instruction": r["prompt"], "chosen": r[f"response{r['preference']}"],
              "rejected": r[f"response{3 - r['preference']}"]} for r in feedback[:-1]]
    built = {}
    for kind, records, extra in (("feedback", feedback, {"ties": "drop"}), ("preference", pairs, {})):
        cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {
            "name": kind, "tokenizer": {"path": tokenizer_file, "vocab_size": 4096}, "val_fraction": 0.0,
            "sources": [{"name": "s", "kind": kind, "paths": [write(tmp_path / f"{kind}.json", records, True)],
                         **extra}]})
        out = tmp_path / kind
        out.mkdir()
        built[kind] = (build_samples(cfg, out), {f.name: np.load(f) for f in (out / "tokens").glob("s.train.*")})
    (meta, arrays), (_, expected) = built["feedback"], built["preference"]
    assert meta["sources"]["s"]["removed"] == {"ties": 1} and meta["sources"]["s"]["train"]["docs"] == 12
    assert arrays.keys() == expected.keys() and all(np.array_equal(arrays[k], expected[k]) for k in arrays)


def test_a_tokenizer_too_small_for_the_texts_characters_names_the_vocab_size_that_fits(tmp_path):
    """Chinese text needs a piece per character within the coverage: the refusal's size trains."""
    import re

    from base.schema import TokenizerConfig
    from data.tokenizer import train_tokenizer

    chars = [chr(0x4E00 + i) for i in range(700)]  # 700 distinct CJK characters, each common enough to be covered
    docs = {"zh": ["".join(chars[(i * 7 + j) % 700] for j in range(40)) for i in range(2000)]}
    cfg = OmegaConf.merge(OmegaConf.structured(TokenizerConfig), {"vocab_size": 512, "character_coverage": 1.0})
    with pytest.raises(DataError, match=r"data.tokenizer: the text's characters need (\d+) pieces at "
                                        r"character_coverage=1.0 .* more than model.vocab_size=512; set "
                                        r"model.vocab_size=1024") as err:
        train_tokenizer(docs, cfg, tmp_path / "small.model")
    needed = int(re.search(r"need ([\d,]+) pieces", str(err.value)).group(1).replace(",", ""))
    assert needed == 700 + 1 + 256 + 4  # the characters, sentencepiece's word mark, the bytes, pad/unk/bos/eos
    assert train_tokenizer(docs, OmegaConf.merge(cfg, {"vocab_size": 1024}), tmp_path / "fits.model").vocab_size == 1024
