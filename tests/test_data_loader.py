"""Data pipeline, consumption side: the blended order, MindRecord loading, dp sharding, resuming, build_data."""
import json
import os
import re

import numpy as np
import pytest
from omegaconf import OmegaConf

from base.validate import ConfigError, validate
from conftest import compose_cfg, corpus_path, write_docs
from data import BlendedBatches, DataError, build_data
from data.cache import prepare
from data.cache import cache_key
from data.mixing import BlendedOrder, mix_weights
from helpers import data_cfg, make_docs

WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
SEQ = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three sources of ~400, ~300 and ~100 rows of SEQ + 1 tokens."""
    tmp = tmp_path_factory.mktemp("mix")
    for i, (name, n) in enumerate([("a", 40), ("b", 30), ("c", 10)]):
        write_docs(tmp / f"{name}.jsonl", make_docs(i, n))
    cfg = data_cfg(tmp, [{"name": n, "kind": "jsonl", "paths": [str(tmp / f"{n}.jsonl")]} for n in "abc"],
                   seq_len=SEQ, weights=WEIGHTS, val_fraction=0.2)
    return prepare(cfg)


def window(prepared, source, row):
    return np.asarray(prepared.tokens(source, "train")[row * SEQ:row * SEQ + SEQ + 1], np.int32)


def samples(loader, n_batches):
    return [row for _ in range(n_batches) for row in loader.next_batch()["input_ids"]]


def loader(prepared, mbs=4, **kw):
    kw = {"weights": WEIGHTS, "seed": 3, **kw}
    return BlendedBatches(prepared, kw.pop("weights"), mbs, **kw)


# --- the blended order --------------------------------------------------------------------------------

def test_realized_mix_tracks_the_weights_at_every_prefix():
    weights = mix_weights({"x": 5, "y": 3, "z": 1.5, "w": 0.5}, {"x": 1000, "y": 40, "z": 7, "w": 3})
    assert weights == pytest.approx({"x": 0.5, "y": 0.3, "z": 0.15, "w": 0.05})  # normalized, in source order
    order = BlendedOrder({"x": 1000, "y": 40, "z": 7, "w": 3}, [(0, weights)], seed=0, block=777)
    src, _, _ = order.take(0, 10_000)
    counts = np.cumsum(np.eye(4, dtype=np.int64)[src], axis=0)  # [n, source]: samples among the first n + 1
    target = np.arange(1, 10_001)[:, None] * np.array(list(weights.values()))
    for n in (1000, 10_000):
        assert np.all(np.abs(counts[n - 1] / n - list(weights.values())) < 0.02)
    assert np.abs(counts - target).max() <= 2  # within two samples of n * weight at every prefix n
    assert mix_weights({}, {"x": 30, "y": 10}) == {"x": 0.75, "y": 0.25}  # no weights: by rows


def test_each_source_walks_reshuffled_epochs_over_all_its_rows():
    order = BlendedOrder({"x": 50, "y": 7}, [(0, {"x": 0.5, "y": 0.5})], seed=1)
    src, draw, row = order.take(0, 100)
    for s, rows in ((0, 50), (1, 7)):
        assert np.array_equal(draw[src == s], np.arange((src == s).sum()))  # each source's draws in sequence
        epochs = [row[src == s][e * rows:(e + 1) * rows] for e in range((src == s).sum() // rows)]
        assert all(sorted(e) == list(range(rows)) for e in epochs)  # every row once per epoch
    y_epochs = [tuple(row[src == 1][e * 7:(e + 1) * 7]) for e in range(7)]
    assert len(set(y_epochs)) > 1  # reshuffled
    again = BlendedOrder({"x": 50, "y": 7}, [(0, {"x": 0.5, "y": 0.5})], seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(again.take(60, 100, 3), order.take(60, 100, 3)))
    assert not np.array_equal(BlendedOrder({"x": 50, "y": 7}, [(0, {"x": .5, "y": .5})], seed=2).take(0, 100)[2], row)


def test_a_weight_change_continues_every_source_without_repeats():
    rows = {"x": 10_000, "y": 10_000}
    order = BlendedOrder(rows, [(0, {"x": 0.5, "y": 0.5}), (3000, {"x": 0.9, "y": 0.1})], seed=0)
    src, draw, row = order.take(0, 6000)
    for s in (0, 1):
        assert np.array_equal(draw[src == s], np.arange((src == s).sum()))
        assert len(set(row[src == s])) == (src == s).sum()  # no row twice: the change skips and repeats none
    assert abs(np.mean(src[:3000] == 0) - 0.5) < 0.01 and abs(np.mean(src[3000:4000] == 0) - 0.9) < 0.02


# --- loading through MindDataset ----------------------------------------------------------------------

def test_loader_yields_the_blended_rows_from_mindrecord(prepared, capsys):
    train = loader(prepared, mbs=4)
    got = samples(train, 300)  # 1200 samples: several epochs of every source, several MindDataset chunks
    src, _, row = BlendedOrder(train.rows, [(0, train.weights)], seed=3).take(0, 1200)
    names = list(train.rows)
    assert all(np.array_equal(g, window(prepared, names[s], r)) for g, s, r in zip(got, src, row))
    assert all(g.dtype == np.int32 and g.shape == (SEQ + 1,) for g in got)
    first_1000 = np.bincount(src[:1000], minlength=3) / 1000
    assert np.all(np.abs(first_1000 - [0.5, 0.3, 0.2]) < 0.02)
    assert train.samples_by_source() == dict(zip(names, np.bincount(src, minlength=3).tolist()))
    state = train.state_dict()
    assert state["epochs"] == {n: (c - 1) // train.rows[n] for n, c in
                               zip(names, np.bincount(src, minlength=3))}
    logged = [line for line in capsys.readouterr().out.splitlines() if "has used all its" in line]
    assert len(logged) == sum(state["epochs"].values())  # once per source and new epoch
    assert "source 'c' has used all its" in logged[0] and "epoch 2 over it (reshuffled)" in logged[0]


def test_data_parallel_ranks_split_the_single_rank_order(prepared):
    single = samples(loader(prepared, mbs=2), 20)
    ranks = [samples(loader(prepared, mbs=2, dp_rank=r, dp_size=2), 10) for r in (0, 1)]
    assert all(np.array_equal(a, b) for a, b in zip([s for pair in zip(*ranks) for s in pair], single))
    assert not {tuple(s) for s in ranks[0]} & {tuple(s) for s in ranks[1]}  # disjoint
    assert loader(prepared, mbs=2, dp_rank=1, dp_size=2).samples_by_source() == {"a": 0, "b": 0, "c": 0}


@pytest.mark.parametrize("k", [0, 5, 35, 400])  # 400: past an epoch of every source and a MindDataset chunk
def test_resumed_loader_continues_exactly(prepared, k):
    uninterrupted = loader(prepared, mbs=5)
    expected = samples(uninterrupted, 100)
    first = loader(prepared, mbs=5)
    samples(first, k // 5)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["position"] == k and state["dp_size"] == 1
    resumed = loader(prepared, mbs=5)
    resumed.load_state_dict(state)
    assert resumed.samples_by_source() == first.samples_by_source()
    assert all(np.array_equal(a, b) for a, b in zip(samples(resumed, 100 - k // 5), expected[k:]))
    assert resumed.samples_by_source() == uninterrupted.samples_by_source()


def test_resuming_with_another_dp_size_rescales_the_position(prepared):
    single = loader(prepared, mbs=3)
    expected = samples(single, 10)[6:]
    head = loader(prepared, mbs=3)
    samples(head, 2)
    ranks = [loader(prepared, mbs=3, dp_rank=r, dp_size=2) for r in (0, 1)]
    for rank in ranks:
        rank.load_state_dict(head.state_dict())
        assert rank.position == 3
    got = [s for pair in zip(samples(ranks[0], 4), samples(ranks[1], 4)) for s in pair]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    samples(head, 1)  # 9 samples: two ranks cannot split them
    with pytest.raises(DataError, match="consumed 9 samples over dp=1 ranks, which dp=2 ranks cannot split"):
        ranks[0].load_state_dict(head.state_dict())


def test_changed_weights_are_refused_unless_allowed(prepared):
    first = loader(prepared)
    samples(first, 10)
    state = first.state_dict()
    other = {"a": 0.2, "b": 0.2, "c": 0.6}
    with pytest.raises(DataError, match=r"data.weights changed since the checkpoint \(it mixed a 0.500, b 0.300, "
                                        r"c 0.200, now a 0.200.*data.allow_weight_change=true"):
        loader(prepared, weights=other).load_state_dict(state)
    changed = loader(prepared, weights=other, allow_weight_change=True)
    changed.load_state_dict(state)
    assert changed.state_dict()["schedule"] == [[0, WEIGHTS], [40, other]]
    expected = BlendedOrder(changed.rows, [(0, WEIGHTS), (40, other)], seed=3).take(40, 80)
    assert all(np.array_equal(g, window(prepared, "abc"[s], r))
               for g, s, r in zip(samples(changed, 10), expected[0], expected[2]))
    again = loader(prepared, weights=other)  # resuming that run with its new weights needs no permission
    again.load_state_dict(changed.state_dict())
    for key, value in [("seq_len", 16), ("seed", 4), ("rows", {"a": 1})]:
        with pytest.raises(DataError, match=f"saved with {key}=.*restore them to resume"):
            loader(prepared).load_state_dict({**state, key: value})


def test_loader_errors(prepared):
    with pytest.raises(DataError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        loader(prepared, dp_rank=2, dp_size=2)


# --- build_data and the config ------------------------------------------------------------------------

def test_build_data_bundle(prepared, tmp_path):
    cfg = data_cfg(tmp_path, [{"name": n, "kind": "jsonl", "paths": [str(prepared.dir.parents[1] / f"{n}.jsonl")]}
                              for n in "abc"], seq_len=SEQ, weights=WEIGHTS, val_fraction=0.2,
                   cache_dir=str(prepared.dir.parent))
    bundle = build_data(cfg, micro_batch_size=3, dp_rank=1, dp_size=2, seed=5, eval_batches=4)
    batch = bundle.train.next_batch()["input_ids"]
    assert batch.shape == (3, SEQ + 1) and batch.dtype == np.int32
    assert (bundle.train.dp_rank, bundle.train.dp_size, bundle.train.seed) == (1, 2, 5)
    assert bundle.tokenizer.eos_id == 3 and bundle.meta["weights"] == WEIGHTS
    for name in "abc":
        val_rows = bundle.meta["sources"][name]["val"]["rows"]
        assert len(bundle.val[name]) == min(4, val_rows // 3)
        tokens = prepared.tokens(name, "val")
        expected = [tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(3 * len(bundle.val[name]))]
        assert np.array_equal(np.concatenate([b["input_ids"] for b in bundle.val[name]]), np.stack(expected))
        assert {"docs_read", "removed", "docs_kept", "train", "val"} <= set(bundle.meta["sources"][name])
    small = build_data(cfg, micro_batch_size=10)  # c holds out fewer rows than a batch: one batch of those rows
    held_out = small.meta["sources"]["c"]["val"]["rows"]
    assert 0 < held_out < 10 and [b["input_ids"].shape[0] for b in small.val["c"]] == [held_out]
    tokens = prepared.tokens("c", "val")
    assert np.array_equal(small.val["c"][0]["input_ids"],
                          np.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(held_out)]))
    with pytest.raises(DataError, match=r"source 'c' has \d+ validation rows.*fewer than one batch of 10; set "
                                        r"data.val_fraction=([\d.]+) .* or trainer.micro_batch_size=(\d+), or lower "
                                        r"data.seq_len") as err:
        build_data(cfg, micro_batch_size=10, fit_small_val=False)
    fraction, rows = re.search(r"val_fraction=([\d.]+) .*micro_batch_size=(\d+)", str(err.value)).groups()
    for fixed, batch in ((OmegaConf.merge(cfg, {"val_fraction": float(fraction)}), 10), (cfg, int(rows))):
        assert len(build_data(fixed, micro_batch_size=batch).val["c"]) >= 1  # either setting it names works
    assert build_data(OmegaConf.merge(cfg, {"val_fraction": 0.0}), micro_batch_size=2).val == {}


BAD_WEIGHTS = [  # (weights, what the error names)
    ({"a": 1, "b": 1, "c": 0}, "data.weights.c: must be a number > 0, got 0"),
    ({"a": 1, "b": -1, "c": 1}, "data.weights.b: must be a number > 0, got -1"),
    ({"a": 0, "b": 0, "c": 0}, "data.weights.a: must be a number > 0"),
    ({"a": 1, "b": 1, "cc": 1}, "data.weights.cc: no source named 'cc'; did you mean data.weights.c?"),
    ({"a": 1, "b": 1}, "data.weights: no weight for c; give every source a weight, or none"),
]


@pytest.mark.parametrize("weights,expected", BAD_WEIGHTS, ids=["zero", "negative", "all-zero", "unknown", "missing"])
def test_bad_weights_raise_data_error_before_any_work(tmp_path, weights, expected):
    cfg = data_cfg(tmp_path, [{"name": n, "kind": "jsonl", "paths": ["/nonexistent.jsonl"]} for n in "abc"],
                   weights=weights)
    with pytest.raises(DataError) as err:
        build_data(cfg, micro_batch_size=2)
    assert expected in str(err.value) and not (tmp_path / "cache").exists()



@pytest.mark.parametrize("overrides,key,message", [
    (["data.weights.code=0"], "data.weights.code", "must be > 0"),
    (["+data.weights.cod=1"], "data.weights.cod", "did you mean data.weights.code?"),
    (["data=default", "+data.weights.python_stdlib=1"], "data.weights", "no weight for shakespeare"),
    (["data.cleaning.max_symbol_fraction=0"], "data.cleaning.max_symbol_fraction", "must be in (0, 1]"),
    (["data.cleaning.unicode_form=NFX"], "data.cleaning.unicode_form", "choose one of NFC"),
    (["data.num_workers=-1"], "data.num_workers", "must be >= 0"),
])
def test_config_validation_names_the_data_key(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("data=corpora_tiny", *overrides))
    assert err.value.key == key and message in str(err.value)


def test_presets_compose_and_the_mixes_share_one_cache(monkeypatch):
    monkeypatch.delenv("MINDLAB_CORPORA", raising=False)
    cfgs = {name: compose_cfg(f"data={name}") for name in ("default", "corpora_tiny", "corpora_5dom",
                                                           "mix_code_heavy", "mix_books_heavy", "mix_balanced")}
    for name, cfg in cfgs.items():
        validate(cfg)
        assert cfg.data.name == name
        if name.startswith("mix_"):
            assert sum(cfg.data.weights.values()) == pytest.approx(1.0)
            assert list(cfg.data.weights) == [s.name for s in cfg.data.sources]
    assert cfgs["mix_code_heavy"].data.weights.code == 0.5 and cfgs["mix_books_heavy"].data.weights.books_en == 0.5
    corpus_path("code")  # the cache key reads the files' sizes and times
    keys = {cache_key(cfg.data) for name, cfg in cfgs.items() if name.startswith(("mix_", "corpora_5"))}
    assert len(keys) == 1
