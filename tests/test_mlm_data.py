"""BERT pretraining data: the wikitext source, sentence-pair rows, dynamic (whole-word) masking."""
import gzip

import numpy as np
import pytest
import sentencepiece as spm
from omegaconf import OmegaConf

from base.schema import SourceConfig
from data.errors import DataError
from data.tokenizer import Tokenizer
from objectives._sentence_pairs import pair_schema, sentence_end_ids, sentence_pairs
from objectives.mlm import IGNORE_INDEX, batch_rng, mask_tokens, word_start_table
from helpers import read_documents

# --- wikitext source ------------------------------------------------------------------------------------

WIKI = (" \n"
        " = Valkyria Chronicles = \n"
        " \n"
        " Valkyria is a tactical role @-@ playing <unk> game , sold 1 @,@ 000 @,@ 000 copies at 3 @.@ 5 $ . \n"
        " It has 2 modes . \n"
        " \n"
        " = = Gameplay = = \n"
        " \n"
        " Play is turn @-@ based . \n"
        " \n"
        " = = = Battle = = = \n"
        " \n"
        " Units move . \n"
        " \n"
        " \n"
        " = Tropical Storm Ana = \n"
        " \n"
        " Ana formed on May 1 . \n"
        " \n"
        " = = Impact = = \n"
        " Rain fell ; x = y = z . \n"
        " \n"
        " = Gambia = \n"
        " \n"
        " The Gambia is small . \n"
        " \n")
WIKI_DOCS = [" = Valkyria Chronicles = \n"
             " \n"
             " Valkyria is a tactical role-playing <unk> game , sold 1,000,000 copies at 3.5 $ . \n"
             " It has 2 modes . \n"
             " \n"
             " = = Gameplay = = \n"
             " \n"
             " Play is turn-based . \n"
             " \n"
             " = = = Battle = = = \n"
             " \n"
             " Units move . \n",
             " = Tropical Storm Ana = \n"
             " \n"
             " Ana formed on May 1 . \n"
             " \n"
             " = = Impact = = \n"
             " Rain fell ; x = y = z . \n",
             " = Gambia = \n"
             " \n"
             " The Gambia is small . \n"]


def wikitext(*paths):
    return read_documents(OmegaConf.merge(OmegaConf.structured(SourceConfig),
                                          {"name": "wiki", "kind": "wikitext", "paths": [str(p) for p in paths]}))


def test_wikitext_source_one_document_per_article(tmp_path):
    (tmp_path / "wiki.valid.tokens").write_text(WIKI, encoding="utf-8")
    assert list(wikitext(tmp_path / "wiki.valid.tokens")) == WIKI_DOCS
    (tmp_path / "wiki.test.tokens.gz").write_bytes(gzip.compress(WIKI.encode()))
    assert list(wikitext(tmp_path / "wiki.*.tokens*")) == WIKI_DOCS * 2  # glob: test.gz, then valid

    for name, text, expected in [("empty.tokens", "", "empty.tokens is empty or blank: no article heading"),
                                 ("blank.tokens", " \n \n", "blank.tokens is empty or blank: no article heading"),
                                 ("plain.tokens", " \n Just text . \n = = Sub = = \n",
                                  "plain.tokens:2: text before the first article heading")]:
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(DataError) as err:
            list(wikitext(tmp_path / name))
        assert "data source 'wiki'" in str(err.value) and expected in str(err.value)


# --- sentence pairs -------------------------------------------------------------------------------------

PAD, CLS, SEP, EOS = 0, 4, 5, 3
FIRST_ID = 10  # content ids are FIRST_ID + their stream position: every token says where it came from
MAX_SENTENCE = 16


def synthetic_stream(seed=0, n_docs=250, long_sentence=70):
    """(tokens uint16, offsets, sentence end ids, per position its document or -1 at eos): documents of
    2-16-token sentences (some end in a one-token one), one document holding a `long_sentence`-token
    sentence, one one-token document, one empty (only its eos)."""
    rng = np.random.default_rng(seed)
    tokens, offsets, ends, doc_of = [], [0], [], []
    for d in range(n_docs):
        if d == 7:
            lengths = [1]
        elif d == 11:
            lengths = []
        else:
            lengths = list(rng.integers(2, MAX_SENTENCE + 1, rng.integers(1, 40)))
            if d == 3:
                lengths.insert(1, long_sentence)
            if d % 10 == 5:
                lengths.append(1)  # a one-token last sentence
        for n in lengths:
            start = len(tokens)
            tokens += range(FIRST_ID + start, FIRST_ID + start + n)
            ends.append(tokens[-1])
            doc_of += [d] * n
        if lengths and rng.random() < 0.3:  # some documents end without a sentence end
            ends.pop()
        tokens.append(EOS)
        doc_of.append(-1)
        offsets.append(len(tokens))
    assert len(tokens) + FIRST_ID < 65536
    return np.array(tokens, np.uint16), np.array(offsets, np.int64), ends, np.array(doc_of)


def check_row(row, seq_len, n_seps):
    ids, types = row["input_ids"], row["token_type_ids"]
    assert ids.dtype == types.dtype == np.int32 and ids.shape == types.shape == (seq_len,)
    assert row["next_sentence_label"].dtype == np.int32 and row["next_sentence_label"].shape == ()
    assert ids[0] == CLS
    seps = np.flatnonzero(ids == SEP)
    assert len(seps) == n_seps
    end = seps[-1] + 1
    assert (ids[end:] == PAD).all() and (ids[:end] != PAD).all()
    expected_types = np.zeros(seq_len, np.int32)
    if n_seps == 2:
        expected_types[seps[0] + 1:end] = 1
    assert (types == expected_types).all()
    segments = [ids[1:seps[0]]] + ([ids[seps[0] + 1:seps[1]]] if n_seps == 2 else [])
    positions = []
    for segment in segments:
        pos = segment.astype(np.int64) - FIRST_ID
        assert len(pos) >= 1 and (pos >= 0).all()
        assert (np.diff(pos) == 1).all()  # a contiguous piece of the stream...
        positions.append(pos)
    return positions


def test_nsp_pairs():
    tokens, offsets, ends, doc_of = synthetic_stream()
    seq_len = 32
    room = seq_len - 3
    rows = list(sentence_pairs(tokens, offsets, seq_len, CLS, SEP, PAD, ends, "nsp", seed=1))
    own = []  # (A and IsNext B) position ranges, and whether the row is full (truncation may have cut it)
    labels = []
    for row in rows:
        a, b = check_row(row, seq_len, 2)
        assert len(set(doc_of[a])) == 1 and len(set(doc_of[b])) == 1 and doc_of[a[0]] >= 0  # ...inside a document
        full = len(a) + len(b) == room
        label = int(row["next_sentence_label"])
        labels.append(label)
        if label == 0:  # IsNext: B follows A in the same document, right after it unless truncated
            assert doc_of[b[0]] == doc_of[a[0]] and b[0] > a[-1]
            assert b[0] == a[-1] + 1 or full
            own += [(a, full), (b, full)]
        else:  # NotNext: B from another document
            assert label == 1 and doc_of[b[0]] != doc_of[a[0]]
            own.append((a, full))
    assert len(rows) > 2000 and abs(np.mean(labels) - 0.5) < 0.05
    check_coverage(own, doc_of)
    again = list(sentence_pairs(tokens, offsets, seq_len, CLS, SEP, PAD, ends, "nsp", seed=1))
    other = list(sentence_pairs(tokens, offsets, seq_len, CLS, SEP, PAD, ends, "nsp", seed=2))
    stack = lambda rs: np.stack([r["input_ids"] for r in rs])  # noqa: E731
    assert stack(again).tobytes() == stack(rows).tobytes() and stack(other).tobytes() != stack(rows).tobytes()

    three_docs = list(sentence_pairs(tokens[:offsets[3]], offsets[:4], seq_len, CLS, SEP, PAD, ends, "nsp", 0))
    assert len(three_docs) > 3  # documents 0-2 as a stream of their own
    with pytest.raises(DataError, match="needs at least two documents.*'wiki' .train. has 1.*objective.sentence_task=sop or none"):
        list(sentence_pairs(tokens[:offsets[1]], offsets[:2], seq_len, CLS, SEP, PAD, ends, "nsp", 0,
                            where="data source 'wiki' (train)"))
    for mode in ("sop", "none"):  # no other document needed
        assert list(sentence_pairs(tokens[:offsets[1]], offsets[:2], seq_len, CLS, SEP, PAD, ends, mode, 0))


def check_coverage(segments, doc_of):
    """Own-document segments come in stream order without overlap, and every content token they miss sits
    next to a full row's segment (cut by truncation) or is a one-token document's (sop only drops those)."""
    covered = np.zeros(len(doc_of), bool)
    next_free = 0
    beside_full = np.zeros(len(doc_of) + 1, bool)
    for pos, full in sorted(segments, key=lambda s: s[0][0]):
        assert pos[0] >= next_free  # no token twice
        covered[pos] = True
        next_free = pos[-1] + 1
        if full:
            beside_full[pos[0]] = beside_full[pos[-1] + 1] = True
    content = doc_of >= 0
    missing = np.flatnonzero(content & ~covered)
    gaps = np.split(missing, np.flatnonzero(np.diff(missing) != 1) + 1) if len(missing) else []
    for gap in gaps:
        one_token_doc = len(gap) == 1 and (doc_of == doc_of[gap[0]]).sum() == 1
        assert beside_full[gap[0]] or beside_full[gap[-1] + 1] or one_token_doc, gap
    assert covered.sum() > 0.85 * content.sum()  # at seq_len 32 the truncation of BERT's pairs costs ~12%


def test_sop_pairs():
    tokens, offsets, ends, doc_of = synthetic_stream(seed=3)
    seq_len = 32
    rows = list(sentence_pairs(tokens, offsets, seq_len, CLS, SEP, PAD, ends, "sop", seed=0))
    own, labels = [], []
    for row in rows:
        a, b = check_row(row, seq_len, 2)
        label = int(row["next_sentence_label"])
        labels.append(label)
        assert doc_of[a[0]] == doc_of[b[0]] >= 0 and len(set(doc_of[np.r_[a, b]])) == 1  # one document
        first, second = (a, b) if label == 0 else (b, a)  # label 1: swapped
        assert second[0] > first[-1] and (second[0] == first[-1] + 1 or len(a) + len(b) == seq_len - 3)
        own += [(first, len(a) + len(b) == seq_len - 3), (second, len(a) + len(b) == seq_len - 3)]
    assert len(rows) > 1300 and abs(np.mean(labels) - 0.5) < 0.05
    assert np.mean([full for _, full in own]) > 0.65  # chunks fill rows (short targets, document tails aside)
    check_coverage(own, doc_of)

    doc = np.append(np.arange(FIRST_ID, FIRST_ID + 30), EOS).astype(np.uint16)  # sentences of 20, 9, 1 tokens
    for seed in range(5):  # the one-token last sentence can not make a row of its own: it joins the one before
        rows = list(sentence_pairs(doc, [0, 31], seq_len, CLS, SEP, PAD, doc[[19, 28]], "sop", seed, 0.0))
        assert len(rows) == 1 and doc[29] in rows[0]["input_ids"]


def test_unpaired_rows_keep_every_token_in_order(tmp_path):
    from mindspore.mindrecord import FileReader, FileWriter

    tokens, offsets, ends, doc_of = synthetic_stream(seed=5)
    seq_len = 32
    rows = list(sentence_pairs(tokens, offsets, seq_len, CLS, SEP, PAD, ends + [EOS], "none", seed=0))  # eos: dropped
    pieces = [check_row(row, seq_len, 1)[0] for row in rows]
    assert all(len(set(doc_of[p])) == 1 for p in pieces)  # one document per row
    assert (np.concatenate(pieces) == np.flatnonzero(doc_of >= 0)).all()  # every content token, in order
    assert all(int(r["next_sentence_label"]) == 0 for r in rows)
    sentence_ends = set(np.flatnonzero(np.isin(tokens, ends)) + 1) | set(offsets[1:] - 1)
    cut = [p for p in pieces if p[-1] + 1 not in sentence_ends]
    assert len(cut) == 2 and all(doc_of[p[0]] == 3 for p in cut)  # only the 70-token sentence is cut
    for piece, after in zip(pieces, pieces[1:]):  # a row ends only where the next sentence would not fit
        if doc_of[piece[0]] == doc_of[after[0]]:
            first_sentence = next(i for i, p in enumerate(after, 1) if p + 1 in sentence_ends or i == len(after))
            assert len(piece) + first_sentence > seq_len - 2

    writer = FileWriter(str(tmp_path / "pairs.mindrecord"), shard_num=1)  # the schema fits the rows
    writer.add_schema(pair_schema(seq_len), "pairs")
    writer.write_raw_data(rows[:5])
    writer.commit()
    reader = FileReader(str(tmp_path / "pairs.mindrecord"))
    back = list(reader.get_next())
    reader.close()
    assert len(back) == 5 and all((b[k] == r[k]).all() for b, r in zip(back, rows) for k in pair_schema(seq_len))


# --- masking --------------------------------------------------------------------------------------------

VOCAB, MASK = 1000, 6
SPECIALS = [0, 1, 2, 3, 4, 5, 6]  # pad unk bos eos cls sep mask


def test_mask_tokens_statistics():
    rng = np.random.default_rng(0)
    ids = rng.integers(len(SPECIALS), VOCAB, (10_000, 128)).astype(np.int32)
    sprinkle = rng.random(ids.shape) < 0.05
    ids[sprinkle] = rng.choice(SPECIALS[:-1], int(sprinkle.sum()))
    ids[:, 0] = 4
    ids[:, -20:] = 0
    before = ids.copy()
    masked, labels = mask_tokens(ids, batch_rng(7, 1234), 0.15, MASK, VOCAB, SPECIALS)
    assert (ids == before).all()  # the input stays as it was
    assert masked.dtype == labels.dtype == np.int32 and masked.shape == labels.shape == ids.shape
    special = np.isin(ids, SPECIALS)
    selected = labels != IGNORE_INDEX
    assert not (selected & special).any() and (masked[special] == ids[special]).all()
    assert (labels[selected] == ids[selected]).all() and (masked[~selected] == ids[~selected]).all()
    assert abs(selected.sum() / (~special).sum() - 0.15) < 0.005
    is_mask = masked[selected] == MASK
    kept = masked[selected] == ids[selected]
    randomized = ~is_mask & ~kept
    assert abs(is_mask.mean() - 0.8) < 0.01 and abs(kept.mean() - 0.1) < 0.01 and abs(randomized.mean() - 0.1) < 0.01
    assert not np.isin(masked[selected][randomized], SPECIALS).any()
    drawn = masked[selected][randomized]
    assert drawn.min() < 20 and drawn.max() > VOCAB - 20  # uniform over the non-special ids

    def mask(seed, index):
        return mask_tokens(ids[:64], batch_rng(seed, index), 0.15, MASK, VOCAB, SPECIALS)

    assert all((x == y).all() for x, y in zip(mask(7, 1234), mask(7, 1234)))
    assert not (mask(7, 1234)[1] == mask(7, 1298)[1]).all() and not (mask(7, 1234)[1] == mask(8, 1234)[1]).all()


def test_whole_word_masking():
    rng = np.random.default_rng(1)
    ids = rng.integers(len(SPECIALS), VOCAB, (2000, 128)).astype(np.int32)
    sprinkle = rng.random(ids.shape) < 0.05
    ids[sprinkle] = rng.choice([1, 5], int(sprinkle.sum()))
    ids[::2, 0] = 4  # the other rows start with a word's continuation as often as not
    ids[::3, -10:] = 0  # and some follow a row ending in a word
    word_starts = np.arange(VOCAB) % 3 == 0  # a third of the pieces start a word
    word_starts[SPECIALS] = True
    masked, labels = mask_tokens(ids, batch_rng(0, 0), 0.15, MASK, VOCAB, SPECIALS, word_starts)
    special = np.isin(ids, SPECIALS)
    selected = labels != IGNORE_INDEX
    assert not (selected & special).any() and (labels[selected] == ids[selected]).all()
    words = []  # (row, first, stop) of every non-special word, found the slow way
    for r in range(len(ids)):
        start = None
        for c in range(ids.shape[1] + 1):
            if start is not None and (c == ids.shape[1] or special[r, c] or word_starts[ids[r, c]]):
                words.append((r, start, c))
                start = None
            if c < ids.shape[1] and not special[r, c] and start is None:
                start = c
    n_selected = n_masked = 0
    for r, a, b in words:
        sel = selected[r, a:b]
        assert sel.all() or not sel.any()  # never part of a word
        if sel.all():
            n_selected += 1
            is_mask = masked[r, a:b] == MASK
            assert is_mask.all() or not is_mask.any()  # one decision per word
            n_masked += is_mask.all()
    assert any(b - a > 2 for _, a, b in words) and any(not word_starts[ids[r, a]] for r, a, _ in words)
    assert abs(n_selected / len(words) - 0.15) < 0.01 and abs(n_masked / n_selected - 0.8) < 0.02

    two = np.array([[13, 12, 15], [13, 13, 13]], np.int32)  # 15 starts a word, 13 continues one: row 1 is a
    picks = [mask_tokens(two, batch_rng(0, i), 0.5, MASK, VOCAB, SPECIALS, word_starts)[1] != IGNORE_INDEX
             for i in range(50)]  # word of its own, not the end of row 0's last word
    assert all(p[1].all() or not p[1].any() for p in picks) and any(p[0, 2] != p[1, 0] for p in picks)


# --- tokenizer helpers ----------------------------------------------------------------------------------

def test_sentence_ends_and_word_starts_from_sentencepiece(tmp_path):
    text = ["Hello world. Is it so? Yes! The end of the line", "and a new line. 中文句子。再来！ é café [SEP]"] * 50
    spm.SentencePieceTrainer.train(  # data.tokenizer's settings, plus BERT's symbols
        sentence_iterator=iter(text), model_prefix=str(tmp_path / "t"), model_type="bpe", vocab_size=330,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    tok = Tokenizer(tmp_path / "t.model")
    ends, starts = set(sentence_end_ids(tok).tolist()), word_start_table(tok)
    assert len(starts) == tok.vocab_size
    piece = tok.sp.piece_to_id
    named = [".", "?", "!", "<0x0A>", "。", "<0x41>", "<0xE4>", "<0x80>", "<0xBF>", "中", "\u2581line", "d",
             "[SEP]"]
    assert tok.unk_id not in [piece(p) for p in named]  # they are pieces (piece_to_id gives unk otherwise)
    assert {piece("."), piece("?"), piece("!"), piece("<0x0A>"), piece("。")} <= ends
    assert not {piece("<0x41>"), piece("\u2581line"), tok.eos_id, tok.pad_id} & ends
    text_of = [tok.decode([i]) if tok.sp.is_byte(i) else tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
    assert ends == {i for i, t in enumerate(text_of) if t[-1:] in tuple(".!?。！？") or "\n" in t} - {tok.unk_id}
    ids = tok.encode("Hello world. Is it so? 中文")
    assert all(starts[i] == (tok.sp.id_to_piece(i)[:1] in "\u2581中文") for i in ids)
    assert piece("[SEP]") in tok.encode("line[SEP]") and piece("[SEP]") not in ends
    assert starts[[tok.eos_id, tok.pad_id, tok.unk_id, piece("[SEP]"), piece("<0x41>"), piece("<0xE4>"),
                   piece("中"), piece("\u2581line")]].all()
    assert not starts[[piece("<0x80>"), piece("<0xBF>"), piece("d"), piece(".")]].any()
