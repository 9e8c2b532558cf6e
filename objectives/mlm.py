"""Masked language modelling (BERT, Devlin et al. 2019): predict tokens hidden from the input.

Rows are BERT's `[CLS] A [SEP] B [SEP]` sentence pairs (objectives/_sentence_pairs.py), built once and cached
with the data.
Masks are drawn per batch on the host at training time (dynamic masking, as RoBERTa), not stored with
the rows: `mask_tokens(batch, batch_rng(seed, first_sample_index), ...)`. The loss is the MLM cross-entropy
over the masked tokens plus, with `sentence_task` nsp or sop, the 2-way cross-entropy of the sentence task
over the batch's rows (BERT's sum of the two). The step weights micro-batches by their masked tokens
(objectives/__init__.py), which the sentence term follows approximately (rows hold similar numbers of them).

Selection follows Hugging Face's DataCollatorForLanguageModeling: every position that is not a special
token is selected with probability `mlm_probability` (Bernoulli, so the count varies per row); labels
hold the original id at selected positions and IGNORE_INDEX elsewhere; of the selected positions 80%
become the mask id, 10% a random id (uniform over the non-special ids: HF draws from the whole
vocabulary) and 10% stay unchanged. Whole-word masking selects words instead, each with probability
`mlm_probability`, and gives each selected word one 80/10/10 decision for all its tokens (a random word
gets an independent random id per token).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from omegaconf import MISSING

from base.errors import require
from base.objective import ObjectiveBase
from data.rows import RowSpec
from objectives._cross_entropy import WeightedCrossEntropy, masked_mean_nll
from objectives._sentence_pairs import MODES, pair_schema, sentence_end_ids, sentence_pairs

IGNORE_INDEX = -100  # label of positions without loss
MASK_FRACTION = 0.8  # of selected positions (words): replaced by the mask id
RANDOM_FRACTION = 0.1  # of selected positions (words): replaced by a random non-special id; the rest stay
WORD_START = "\u2581"  # sentencepiece's space marker: a piece starting with it starts a word
SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]")  # data.tokenizer.user_symbols must hold them (data=wiki does)
VALIDATION_SAMPLES = 1 << 40  # validation batch i is masked as sample VALIDATION_SAMPLES + i: fixed, unlike training


@dataclass
class Config:
    name: str = MISSING  # mlm
    mlm_probability: float = 0.15  # of the non-special tokens (or words), selected for prediction
    whole_word_masking: bool = False  # select whole words (sentencepiece word starts) instead of tokens
    sentence_task: str = "nsp"  # nsp (next sentence, BERT) | sop (sentence order, ALBERT) | none
    short_seq_prob: float = 0.1  # documents whose rows are cut to a random shorter length (BERT's)
    pair_seed: int = 0  # which sentence pairs are built (cached with the data; trainer.seed drives the masks)


def check(cfg) -> None:
    from models import family

    o = cfg.objective
    require(not family(cfg.model.family).CAUSAL, "objective", f"objective=mlm needs a bidirectional encoder; "
            f"model.family={cfg.model.family} is causal (each position sees only the left). Use a BERT model "
            f"(model=bert_tiny), or objective=clm for this one")
    require(0 < o.mlm_probability < 1, "objective.mlm_probability", f"must be in (0, 1), got {o.mlm_probability}")
    require(o.sentence_task in MODES, "objective.sentence_task", f"got {o.sentence_task!r}; choose one of "
            f"{', '.join(MODES)}")
    require(0 <= o.short_seq_prob <= 1, "objective.short_seq_prob", f"must be in [0, 1], got {o.short_seq_prob}")
    tok = cfg.data.tokenizer
    if tok.path:  # a given sentencepiece model: it must have the pieces
        from data.tokenizer import Tokenizer

        missing = [p for p in SPECIAL_PIECES if Tokenizer(tok.path).piece_id(p) is None]
        require(not missing, "data.tokenizer.path", f"{tok.path} has no {' '.join(missing)} piece; objective=mlm "
                f"needs {' '.join(SPECIAL_PIECES)} (train one with data.tokenizer.user_symbols)")
    else:
        missing = [p for p in SPECIAL_PIECES if p not in tok.user_symbols]
        require(not missing, "data.tokenizer.user_symbols", f"has no {' '.join(missing)}; objective=mlm needs "
                f"{' '.join(SPECIAL_PIECES)} as whole pieces: use data=wiki or set "
                f"data.tokenizer.user_symbols='[\"[CLS]\",\"[SEP]\",\"[MASK]\"]'")


def row_spec(cfg: Config) -> RowSpec:
    return RowSpec(name=f"pairs-{cfg.sentence_task}-short{cfg.short_seq_prob:g}-seed{cfg.pair_seed}",
                   columns=("input_ids", "token_type_ids", "next_sentence_label"), schema=pair_schema,
                   build=partial(_pair_rows, cfg.sentence_task, cfg.short_seq_prob, cfg.pair_seed))


def _pair_rows(mode: str, short_seq_prob: float, seed: int, split, seq_len: int, tokenizer):
    cls_id, sep_id = tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]")
    return sentence_pairs(split.tokens, split.offsets, seq_len, cls_id, sep_id, tokenizer.pad_id,
                          sentence_end_ids(tokenizer), mode, seed, short_seq_prob, where=split.where)


class Objective(ObjectiveBase):
    metrics = ("mlm_loss", "mlm_accuracy")
    console = ("mlm_accuracy",)

    def __init__(self, cfg: Config, tokenizer, seed: int = 0):
        self.cfg, self.seed, self.pad_id = cfg, seed, tokenizer.pad_id
        self.mask_id = tokenizer.piece_id("[MASK]")
        self.vocab_size = tokenizer.vocab_size
        self.special_ids = sorted({tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id,
                                   *(tokenizer.piece_id(p) for p in SPECIAL_PIECES)})
        self.word_starts = word_start_table(tokenizer) if cfg.whole_word_masking else None
        self.sentence_task = cfg.sentence_task != "none"
        self.inputs = ("input_ids", "token_type_ids", "attention_mask", "labels") + \
            (("next_sentence_label",) if self.sentence_task else ())
        if self.sentence_task:
            self.metrics = self.metrics + (f"{cfg.sentence_task}_loss", f"{cfg.sentence_task}_accuracy")

    def batch(self, rows: dict, sample: int) -> tuple:
        """`sample` < 0: validation batch -1 - sample, masked the same way at every evaluation."""
        index = sample if sample >= 0 else VALIDATION_SAMPLES - 1 - sample
        ids = rows["input_ids"]
        masked, labels = mask_tokens(ids, batch_rng(self.seed, index), self.cfg.mlm_probability, self.mask_id,
                                     self.vocab_size, self.special_ids, self.word_starts)
        inputs = (masked, rows["token_type_ids"], (ids != self.pad_id).astype(np.int32), labels)
        return inputs + ((rows["next_sentence_label"].astype(np.int32),) if self.sentence_task else ())

    def loss_tokens(self, inputs: tuple) -> int:
        return int(np.count_nonzero(inputs[3] != IGNORE_INDEX))

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return MaskedLMLoss(model, self.sentence_task)

    def fill_mask(self, model: nn.Cell, k: int = 5) -> nn.Cell:
        """Evaluation's hook: fill-mask top-1 / top-k accuracy over the validation batches' masked tokens."""
        return FillMaskTopK(model, k, self.special_ids)


class MaskedLMLoss(nn.Cell):
    """(loss, mlm_loss, mlm_accuracy[, sentence_loss, sentence_accuracy]) in fp32: the MLM terms are means over
    the masked tokens, the sentence-task terms means over the rows."""

    def __init__(self, model: nn.Cell, sentence_task: bool):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model
        self.sentence_task = sentence_task
        self.cross_entropy = WeightedCrossEntropy()

    def construct(self, input_ids, token_type_ids, attention_mask, labels, *sentence_label):
        mlm_logits, sentence_logits = self.model(input_ids, token_type_ids, attention_mask)
        targets = labels.reshape(-1)
        logits = mlm_logits.reshape(-1, mlm_logits.shape[-1])
        mlm_loss, mask, n = masked_mean_nll(self.cross_entropy, logits, targets, IGNORE_INDEX)
        mlm_accuracy = ((logits.argmax(-1) == targets).astype(ms.float32) * mask).sum() / n
        if not self.sentence_task:
            return mlm_loss, mlm_loss, mlm_accuracy
        label = sentence_label[0]
        sentence_nll = -ops.gather_elements(ops.log_softmax(sentence_logits, -1), 1, label.reshape(-1, 1))
        sentence_loss = sentence_nll.mean()
        sentence_accuracy = (sentence_logits.argmax(-1) == label).astype(ms.float32).mean()
        return mlm_loss + sentence_loss, mlm_loss, mlm_accuracy, sentence_loss, sentence_accuracy


class FillMaskTopK(nn.Cell):
    """The step's inputs -> (int32 [B, S, k]: the k most likely tokens at every position, best first; the labels
    [B, S]: the masked tokens, IGNORE_INDEX elsewhere). `special_ids`: the tokens never masked, which
    evaluation's unigram baseline leaves out (it always predicts the most frequent other training token)."""

    def __init__(self, model: nn.Cell, k: int, special_ids: Sequence[int]):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model, self.k, self.special_ids = model, k, tuple(special_ids)

    def construct(self, input_ids, token_type_ids, attention_mask, labels, *sentence_label):
        mlm_logits, _ = self.model(input_ids, token_type_ids, attention_mask)
        return ops.topk(mlm_logits, self.k)[1], labels


def batch_rng(seed: int, sample_index: int) -> np.random.Generator:
    """The generator masking the batch whose first sample has global index `sample_index`.

    A batch's mask depends only on (seed, that index): each time a row is seen again (a new epoch means a
    new sample index) it gets a fresh mask, and resuming at a sample index reproduces the same masks with
    no extra state to checkpoint.
    """
    return np.random.default_rng([seed, sample_index])


def mask_tokens(input_ids: np.ndarray, rng: np.random.Generator, mlm_probability: float, mask_id: int,
                vocab_size: int, special_ids: Sequence[int],
                word_starts: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(masked input_ids, labels), both int32 [B, S]; `input_ids` itself is not modified.

    `special_ids` (pad, cls, sep, bos, eos, unk, ...) and `mask_id` are never selected nor drawn as random ids.
    With `word_starts` (bool [vocab_size], see `word_start_table`) whole words are masked: a word is a token
    whose id starts a word and the tokens after it that do not, within a row and never across a special
    token (a continuation right after [CLS] / [SEP] starts a word).
    """
    if not 0.0 <= mlm_probability <= 1.0:
        raise ValueError(f"mlm_probability={mlm_probability} must be in [0, 1]")
    ids = np.asarray(input_ids)
    special = np.zeros(vocab_size, dtype=bool)
    special[np.asarray(list(special_ids) + [mask_id], dtype=np.int64)] = True
    eligible = ~special[ids]
    if word_starts is None:
        selected = eligible & (rng.random(ids.shape) < mlm_probability)
        decision = rng.random(ids.shape)
    else:
        starts = word_starts[ids] | ~eligible  # a special token is a word of its own, and so ends the one before
        starts[:, 0] = True  # and so does a row's end
        word = np.cumsum(starts.ravel()).reshape(ids.shape) - 1  # word index of every position
        n_words = int(word[-1, -1]) + 1 if ids.size else 0
        selected = eligible & (rng.random(n_words) < mlm_probability)[word]
        decision = rng.random(n_words)[word]
    replace = selected & (decision < MASK_FRACTION)
    randomize = selected & (decision >= MASK_FRACTION) & (decision < MASK_FRACTION + RANDOM_FRACTION)
    candidates = np.flatnonzero(~special)
    masked = ids.astype(np.int32, copy=True)
    masked[replace] = mask_id
    if randomize.any():
        masked[randomize] = candidates[rng.integers(0, len(candidates), int(randomize.sum()))]
    labels = np.where(selected, ids, IGNORE_INDEX).astype(np.int32)
    return masked, labels


def word_start_table(tokenizer) -> np.ndarray:
    """bool [vocab_size]: whether each piece of `tokenizer` (a data.tokenizer.Tokenizer) starts a word.

    Pieces starting with U+2581 start one; control, unknown, unused and user-defined pieces ([CLS], [MASK])
    are words of their own; so is a byte-fallback piece, unless it is a UTF-8 continuation byte (0x80-0xBF):
    that one continues the character its lead byte started, so a character is masked whole; a piece
    starting with a CJK ideograph starts a word (BERT's tokenizer puts spaces around those characters).
    Other pieces continue the word before them.
    """
    from sentencepiece import sentencepiece_model_pb2 as model_pb2  # the piece types, user-defined included

    kind = model_pb2.ModelProto.SentencePiece
    proto = model_pb2.ModelProto.FromString(tokenizer.sp.serialized_model_proto())
    table = np.zeros(len(proto.pieces), dtype=bool)
    for i, p in enumerate(proto.pieces):
        if p.type == kind.BYTE:  # "<0xE4>"
            table[i] = not 0x80 <= int(p.piece[1:-1], 16) <= 0xBF
        elif p.type == kind.NORMAL:
            table[i] = p.piece.startswith(WORD_START) or _is_cjk(p.piece[:1])
        else:  # CONTROL, UNKNOWN, UNUSED, USER_DEFINED
            table[i] = True
    return table


def _is_cjk(char: str) -> bool:
    """The CJK ideograph blocks of BERT's tokenization.py `_is_chinese_char`."""
    if not char:
        return False
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                             (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
                                             (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))
