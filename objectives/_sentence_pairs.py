"""BERT pretraining rows (objectives/mlm.py's) from one split's tokenized documents: `[CLS] A [SEP] B [SEP]`,
padded.

Input is what data/documents.py writes: `tokens/<source>.<split>.npy`, every document's ids followed by
eos, and `.offsets.npy`, the start of every document and then the total length. The eos ending each
document is dropped, and every document is cut into "sentences" after each token of `sentence_end_ids`
(pieces ending in `.`, `!`, `?` or their full-width forms, or holding a newline: see `sentence_end_ids`).
Digits are split, so "3.14" ends a sentence after "3."; a sentence is only a unit the pairs are cut at.

Rows follow Google's `create_pretraining_data.py` (`create_instances_from_document`), per document in
order: sentences are gathered into a chunk until it holds `target` tokens, where target is seq_len - 3,
or for 10% of documents (`short_seq_prob`) a random length in [2, seq_len - 3] drawn once per document
(short rows teach the model short inputs, as BERT does); the chunk is split after a random sentence into
A and B, and `mode` says what B is:
- "nsp" (next-sentence prediction, BERT): half the rows keep the true continuation, label 0 (IsNext, as
  Hugging Face's `next_sentence_label`: 0 means B continues A); the other half take B from a random other
  document, from a random sentence on, as long as the chunk's target left after A, label 1 (NotNext); the
  chunk's sentences after A then go back and start the next chunk, so no text is skipped.
- "sop" (sentence-order prediction, ALBERT): B is always the true continuation; half the rows swap A and
  B, label 1; label 0 in order.
- "none": no pair; each row holds as many whole sentences of one document as fit, `[CLS] A [SEP]`, label
  0 (unused). Rows are filled up (no short rows), so every content token lands in a row, in order.
A pair longer than seq_len - 3 loses tokens from its longer segment, one at a time from its front or back
at random (BERT's `truncate_seq_pair`). A sentence longer than the row's room (seq_len - 3, or seq_len - 2
in "none") is first cut into near-equal pieces, so nothing is dropped. A chunk of one sentence can not be
split after a sentence; it is split after a random token instead (Google's code makes such a chunk
NotNext instead, which would skew the labels away from 50/50) and in "nsp" a one-token chunk gets a
random B. In "sop" a one-token last sentence joins the chunk before it, and a one-token document is
dropped (it can not make two segments).

Row columns (`pair_schema`): `input_ids` int32 [seq_len], `token_type_ids` int32 [seq_len] (0 for [CLS],
A and its [SEP]; 1 for B and its [SEP]; 0 for padding), `next_sentence_label` int32. The attention mask
is `input_ids != pad_id`. Rows come in document order: the training order is the loader's to shuffle.

No masking happens here: masked-LM masks are drawn per batch at training time (`objectives.mlm`,
dynamic masking as in RoBERTa), so each epoch sees a row under a fresh mask and the rows on disk depend
only on (tokens, seq_len, mode, seed). Deterministic given `seed`.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator, List, Sequence, Tuple

import numpy as np

from data.errors import DataError

MODES = ("nsp", "sop", "none")
SENTENCE_END_CHARS = ".!?。！？"  # a piece ending in one of these ends a sentence, as does one holding "\n"
_SPACE = "\u2581"  # sentencepiece's space marker


def pair_schema(seq_len: int) -> dict:
    """The rows' MindRecord `FileWriter.add_schema` schema."""
    return {"input_ids": {"type": "int32", "shape": [seq_len]},
            "token_type_ids": {"type": "int32", "shape": [seq_len]},
            "next_sentence_label": {"type": "int32"}}


def sentence_end_ids(tokenizer) -> np.ndarray:
    """Sorted ids of `tokenizer` (a data.tokenizer.Tokenizer) whose piece ends a sentence: it ends with one
    of SENTENCE_END_CHARS (trailing U+2581 spaces aside) or holds a newline; byte-fallback pieces (`<0x0A>`)
    count as the byte they stand for. Control and unknown pieces never end a sentence."""
    sp = tokenizer.sp
    ends = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            continue
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):  # "<0x0A>"
            piece = chr(int(piece[1:-1], 16))
        if "\n" in piece or piece.rstrip(_SPACE)[-1:] in tuple(SENTENCE_END_CHARS):
            ends.append(i)
    return np.array(ends, dtype=np.int64)


def sentence_pairs(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, cls_id: int, sep_id: int, pad_id: int,
                   sentence_end_ids: Sequence[int], mode: str, seed: int, short_seq_prob: float = 0.1,
                   where: str = "the split") -> Iterator[dict]:
    """Yield the rows of one split's token stream (see the module docstring); `where` names the split in
    errors (e.g. "data source 'wiki' (train)")."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(MODES)}")
    room = seq_len - (2 if mode == "none" else 3)  # content tokens a row holds
    if room < (1 if mode == "none" else 2):
        raise DataError(f"data.seq_len={seq_len} leaves {room} tokens for text after [CLS] and [SEP]s; "
                        f"raise data.seq_len")
    tokens = np.asarray(tokens)
    starts, ends, doc_sentences = _sentences(tokens, np.asarray(offsets, dtype=np.int64), sentence_end_ids, room)
    docs = [d for d in range(len(doc_sentences) - 1) if doc_sentences[d + 1] > doc_sentences[d]]  # non-empty
    if mode == "nsp" and len(docs) < 2:
        raise DataError(f"next-sentence prediction needs at least two documents, to draw a NotNext segment "
                        f"from another one, but {where} has {len(docs)} with text; set objective.sentence_task=sop or none "
                        f"or add documents")
    row = _RowWriter(tokens, seq_len, cls_id, sep_id, pad_id)
    rng = np.random.default_rng(seed)
    for pos, d in enumerate(docs):
        sentences = list(zip(starts[doc_sentences[d]:doc_sentences[d + 1]].tolist(),
                             ends[doc_sentences[d]:doc_sentences[d + 1]].tolist()))
        if mode == "none":
            yield from _whole_sentence_rows(sentences, room, row)
            continue
        target = room if rng.random() >= short_seq_prob else int(rng.integers(2, room + 1))
        other = functools.partial(_random_segment, rng, docs, pos, doc_sentences, starts, ends)
        yield from _document_pairs(sentences, target, mode, rng, row, room, other)


def _document_pairs(sentences: List[Tuple[int, int]], target: int, mode: str, rng: np.random.Generator, row,
                    room: int, other_segment: Callable[[int], Tuple[int, int]]) -> Iterator[dict]:
    """The nsp or sop rows of one document's sentences: chunks of about `target` tokens, each cut into segments A
    and B (the module docstring); `other_segment(n)`: about n tokens of another document (nsp's NotNext)."""
    first = i = length = 0  # the chunk is sentences[first:i + 1]
    while i < len(sentences):
        length += sentences[i][1] - sentences[i][0]
        last = i == len(sentences) - 1
        if not (last or (length >= target and not (mode == "sop" and _one_token_tail(sentences, i)))):
            i += 1
            continue
        if i == first and sentences[i][1] - sentences[i][0] >= 2:  # one sentence: split it at a token
            s, e = sentences[i]
            cut = s + int(rng.integers(1, e - s))
            sentences[i:i + 1] = [(s, cut), (cut, e)]
            i += 1
        a_end = first + 1 + (int(rng.integers(0, i - first)) if i > first else 0)  # B's first sentence
        a = (sentences[first][0], sentences[a_end - 1][1])
        if mode == "nsp" and (i == first or rng.random() < 0.5):
            b = other_segment(target - (a[1] - a[0]))
            label, i = 1, a_end - 1  # the chunk's sentences after A start the next chunk
        elif i > first:
            b, label = (sentences[a_end][0], sentences[i][1]), 0
            if mode == "sop" and rng.random() < 0.5:
                a, b, label = b, a, 1
        else:  # sop, a one-token document: no second segment
            return
        yield row(*_truncate_pair(a, b, room, rng), label)
        first, length = i + 1, 0
        i += 1

def _sentences(tokens: np.ndarray, offsets: np.ndarray, end_ids: Sequence[int],
               room: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end) stream positions of every sentence, in order, each at most `room` tokens long (longer
    ones cut into near-equal pieces), and per document the index of its first sentence, then the count."""
    doc_starts = offsets[:-1]
    content_ends = np.maximum(offsets[1:] - 1, doc_starts)  # without the eos
    is_end = np.isin(tokens, np.asarray(end_ids, dtype=np.int64))
    is_end[offsets[1:][offsets[1:] > doc_starts] - 1] = False  # the eos of each non-empty document
    ends = np.union1d(np.flatnonzero(is_end) + 1, content_ends[content_ends > doc_starts])
    doc_of_end = np.searchsorted(doc_starts, ends - 1, side="right") - 1
    starts = np.maximum(np.concatenate([[0], ends[:-1]]), doc_starts[doc_of_end])
    pieces = -(-(ends - starts) // room)  # ceil
    if (pieces > 1).any():
        sentence = np.repeat(np.arange(len(ends)), pieces)
        k = np.arange(len(sentence)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index
        length, n = (ends - starts)[sentence], pieces[sentence]
        starts, ends = starts[sentence] + length * k // n, starts[sentence] + length * (k + 1) // n
    doc_sentences = np.searchsorted(starts, np.append(doc_starts, offsets[-1]))
    return starts, ends, doc_sentences


def _one_token_tail(sentences: List[Tuple[int, int]], i: int) -> bool:
    """Whether the only sentence after sentences[i] is one token (sop keeps it in the chunk: alone it could
    not make two segments)."""
    return i == len(sentences) - 2 and sentences[-1][1] - sentences[-1][0] == 1


def _whole_sentence_rows(sentences: List[Tuple[int, int]], room: int, row) -> Iterator[dict]:
    """Greedy: a row ends before the sentence that would not fit (every sentence fits alone)."""
    start = end = sentences[0][0]
    for s, e in sentences:
        if e - start > room:
            yield row((start, end), None, 0)
            start = s
        end = e
    yield row((start, end), None, 0)


def _random_segment(rng: np.random.Generator, docs: List[int], pos: int, doc_sentences: np.ndarray,
                    starts: np.ndarray, ends: np.ndarray, target: int) -> Tuple[int, int]:
    """Consecutive sentences of a random document other than docs[pos], from a random one on, until they
    hold `target` tokens or the document ends."""
    other = int(rng.integers(0, len(docs) - 1))
    other = docs[other + (other >= pos)]
    lo, hi = doc_sentences[other], doc_sentences[other + 1]
    first = lo + int(rng.integers(0, hi - lo))
    last = min(first + int(np.searchsorted(ends[first:hi], starts[first] + target)), hi - 1)
    return int(starts[first]), int(ends[last])


def _truncate_pair(a: Tuple[int, int], b: Tuple[int, int], room: int,
                   rng: np.random.Generator) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """BERT's truncate_seq_pair on stream ranges: drop a token from the longer segment (B on a tie), its
    front or back at random, until both fit in `room`."""
    (a0, a1), (b0, b1) = a, b
    excess = (a1 - a0) + (b1 - b0) - room
    if excess > 0:
        for front in rng.random(excess) < 0.5:
            if a1 - a0 > b1 - b0:
                a0, a1 = (a0 + 1, a1) if front else (a0, a1 - 1)
            else:
                b0, b1 = (b0 + 1, b1) if front else (b0, b1 - 1)
    return (a0, a1), (b0, b1)


class _RowWriter:
    """(A range, B range or None, label) -> a row dict."""

    def __init__(self, tokens: np.ndarray, seq_len: int, cls_id: int, sep_id: int, pad_id: int):
        self.tokens, self.seq_len, self.cls_id, self.sep_id, self.pad_id = tokens, seq_len, cls_id, sep_id, pad_id

    def __call__(self, a: Tuple[int, int], b, label: int) -> dict:
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        types = np.zeros(self.seq_len, dtype=np.int32)
        ids[0] = self.cls_id
        n_a = a[1] - a[0]
        ids[1:1 + n_a] = self.tokens[a[0]:a[1]]
        ids[1 + n_a] = self.sep_id
        if b is not None:
            n_b = b[1] - b[0]
            ids[2 + n_a:2 + n_a + n_b] = self.tokens[b[0]:b[1]]
            ids[2 + n_a + n_b] = self.sep_id
            types[2 + n_a:3 + n_a + n_b] = 1
        return {"input_ids": ids, "token_type_ids": types, "next_sentence_label": np.int32(label)}
