"""Chinese text end to end: bits per byte counts UTF-8 bytes (by hand: three a CJK character), generation never
shows a broken multi-byte character, and cleaning and dedup keep the Chinese corpus (../shared/corpora/zh: what
each filter removes, and why)."""
import glob
import gzip
import io
import json
import math
import os
from contextlib import redirect_stdout

import numpy as np
import pytest
from omegaconf import OmegaConf

from base.schema import CleaningConfig, TokenizerConfig
from conftest import CORPORA, absent
from data.tokenizer import Tokenizer, train_tokenizer
from evaluation.bpb import bits_per_byte, dummy_prefix_pieces, piece_bytes, target_bytes

POEM = "春眠不觉晓，处处闻啼鸟。"  # 12 characters, each 3 bytes in UTF-8 (CJK and full-width punctuation)
MIXED = "Linux 内核"  # 5 ASCII letters, a space, 2 CJK characters: 5 + 1 + 6 bytes
ZH = sorted(glob.glob(os.path.join(CORPORA, "zh", "*.jsonl.gz")))


def zh_docs():
    if not ZH:  # under CI the corpus is part of the checkout's environment: missing is a failure, not a skip
        absent(f"no Chinese corpus under {CORPORA}/zh")
    return {os.path.basename(f): [json.loads(line)["text"] for line in gzip.open(f, "rt", encoding="utf-8")]
            for f in ZH}


@pytest.fixture(scope="module")
def zh_tokenizer(tmp_path_factory):
    """A small tokenizer with pieces for these characters (the Shakespeare one has byte fallback for them)."""
    docs = {"poem": [POEM * 3, MIXED * 3, "床前明月光，疑是地上霜。"] * 50}
    cfg = OmegaConf.merge(OmegaConf.structured(TokenizerConfig), {"vocab_size": 320, "character_coverage": 1.0})
    return train_tokenizer(docs, cfg, tmp_path_factory.mktemp("zh") / "zh.model")


@pytest.mark.parametrize("which", ["byte_fallback", "cjk_pieces"])
def test_bits_per_byte_counts_utf8_bytes_of_chinese_text(which, tokenizer_file, zh_tokenizer):
    tok = Tokenizer(tokenizer_file) if which == "byte_fallback" else zh_tokenizer
    table, prefix = piece_bytes(tok), dummy_prefix_pieces(tok)
    for text, by_hand in ((POEM, 12 * 3), (MIXED, 5 + 1 + 2 * 3)):
        ids = np.array([[tok.eos_id, *tok.encode(text), tok.eos_id]])  # a document as the rows hold it
        assert target_bytes(ids, table, tok.eos_id, prefix).sum() == by_hand == len(text.encode("utf-8"))
        n = ids.shape[1] - 1  # a uniform model: every target costs ln(vocab) nats
        assert bits_per_byte(n * math.log(tok.vocab_size), by_hand) == pytest.approx(n * math.log2(tok.vocab_size)
                                                                                      / by_hand)
    assert which == "cjk_pieces" or all(tok.sp.is_byte(i) for i in tok.encode(POEM)[1:])  # 3 pieces a character


def test_generation_never_shows_a_broken_multibyte_character(tokenizer_file, capsys):
    """Byte-fallback pieces arrive one at a time: whatever the cut, the text shown is whole characters, and the
    stream ends with all of it."""
    import generate as cli

    tok = Tokenizer(tokenizer_file)
    ids = tok.encode(POEM)
    assert sum(tok.sp.is_byte(i) for i in ids) == 36
    cuts = [tok.decode(tok.whole_chars(ids[:k])) for k in range(len(ids) + 1)]
    assert all("\ufffd" not in c and POEM.startswith(c.lstrip()) for c in cuts)
    assert len(set(cuts)) == 13  # each character appears once its third byte has
    out = io.StringIO()
    stream = cli.Stream(lambda new: tok.decode(tok.whole_chars(new)), [])
    with redirect_stdout(out):
        for k in range(1, len(ids) + 1):
            stream(k, [ids[:k]], [False])
        stream.emit(tok.decode(tok.whole_chars(ids)))
    assert "\ufffd" not in out.getvalue() and out.getvalue().lstrip() == POEM


def test_cleaning_and_dedup_keep_the_chinese_corpus():
    """Default cleaning on ../shared/corpora/zh, filter by filter: nothing is too short or too symbol-heavy (CJK
    punctuation is punctuation, not a symbol); one fortune is a box drawing of repeated lines; exact dedup finds
    nothing; near dedup (a CJK character is a word of its own) removes four man pages whose 5-gram sets overlap an
    earlier page's by about 0.8 (0.78 to 0.9, computed exactly here), and nothing else."""
    from data.cleaning import clean_batch, repeated_line_fraction
    from data.dedup import Deduplicator
    from data.minhash import _WORD

    sources = zh_docs()
    cfg = OmegaConf.structured(CleaningConfig)
    docs = [(name, text) for name, texts in sources.items() for text in texts]
    cleaned = clean_batch([text for _, text in docs], cfg)
    removed = {}
    for (name, text), c in zip(docs, cleaned):
        if c.removed_by:
            removed.setdefault(c.removed_by, []).append((name, text))
    assert {k: len(v) for k, v in removed.items()} == {"max_repeated_line_fraction": 1}
    (name, text), = removed["max_repeated_line_fraction"]
    assert name == "fortunes_zh.jsonl.gz" and "│" in text and repeated_line_fraction(text) > 0.5
    kept = [i for i, c in enumerate(cleaned) if c.removed_by is None]
    sigs = np.stack([cleaned[i].signature for i in kept])
    steps = Deduplicator(cfg, lambda i: sigs[i]).offer(np.array([cleaned[i].digest for i in kept], "S16"), sigs)
    assert (steps == 1).sum() == 0  # exact duplicates

    def grams(text):
        words = _WORD.findall(text.lower())
        return {tuple(words[i:i + 5]) for i in range(max(len(words) - 4, 1))}

    near = [kept[j] for j in np.flatnonzero(steps == 2)]
    assert len(near) == 4 and all(docs[i][0] == "manpages_zh.jsonl.gz" for i in near)
    for i in near:
        mine = grams(docs[i][1])
        best = max(len(mine & grams(docs[k][1])) / len(mine | grams(docs[k][1])) for k in kept if k < i)
        assert best >= 0.75  # 0.8 less about one standard error of the 128-permutation estimate (0.04)
    per_source = {name: sum(1 for k in kept if docs[k][0] == name and k not in near) / len(texts)
                  for name, texts in sources.items()}
    assert min(per_source.values()) > 0.99


def test_rouge_l_takes_each_chinese_character_as_a_word():
    """By hand: 春眠不觉晓 against 春眠不觉晓，处处闻啼鸟 (11 tokens, the comma one of them): LCS 5, precision 1,
    recall 5/11, F = 2 * 5/11 / (1 + 5/11) = 0.625; English stays by whitespace words."""
    from evaluation.tasks import rouge_l

    assert rouge_l("春眠不觉晓", POEM[:11]) == pytest.approx(0.625)
    assert rouge_l("Linux 内核模块", MIXED) == pytest.approx(2 * (3 / 5) * 1 / (3 / 5 + 1))  # Linux 内 核 模 块
    assert rouge_l("the cat sat", "the cat") == pytest.approx(0.8)
