"""SentencePiece tokenizer: a thin wrapper, and training one from the data sources.

Trained models use LLaMA-style settings: byte fallback (no text is ever <unk>), digits split, identity
normalization and whitespace kept as is, so `decode(encode(text)) == text` for any text without the
character U+2581 (sentencepiece's own space marker, decoded as a space).
Special ids: pad 0, unk 1, bos 2, eos 3; `data.tokenizer.user_symbols` (e.g. BERT's [CLS] [SEP] [MASK]) follow
as 4, 5, ... (whole pieces that are never split).
"""
from __future__ import annotations

import io
import re
import shutil
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np
import sentencepiece as spm

from base.schema import TokenizerConfig
from data.errors import DataError

MAX_LINE_CHARS = 4096  # longer training lines are cut


class Tokenizer:
    """A sentencepiece model loaded from a `.model` file."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.sample: Optional[Dict[str, Dict[str, int]]] = None  # trained here: lines, chars per source

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self.sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def piece_id(self, piece: str) -> Optional[int]:
        """The id of a whole piece such as "[MASK]", or None when the vocabulary has no such piece."""
        i = self.sp.piece_to_id(piece)
        return None if i == self.unk_id and piece != self.sp.id_to_piece(self.unk_id) else i

    def encode(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(np.asarray(ids, dtype=np.int64).tolist())

    def whole_chars(self, ids: Sequence[int]) -> List[int]:
        """`ids` without the byte-fallback pieces at its end that begin a UTF-8 character they do not finish
        (generation cut at a length, or still running: a CJK character is three such pieces); decoded, they would
        print U+FFFD."""
        ids = list(ids)
        for back in range(1, min(4, len(ids)) + 1):
            piece = ids[-back]
            if not self.sp.is_byte(piece):
                break
            byte = int(self.sp.id_to_piece(piece)[1:-1], 16)  # "<0xE6>"
            if byte >= 0xC0:  # a lead byte: its character needs 2, 3 or 4 bytes
                needs = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                return ids[:-back] if back < needs else ids
        return ids

    @property
    def token_dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id."""
        return np.dtype(np.uint16 if self.vocab_size <= 65536 else np.uint32)


_loaded: Dict[str, Tokenizer] = {}  # per worker process: the model is loaded once, not per chunk


def encode_documents(model_path: str, texts: Sequence[str]) -> List[np.ndarray]:
    """Each text's ids followed by eos, as arrays of the tokenizer's token_dtype (runs in worker processes)."""
    if model_path not in _loaded:
        _loaded[model_path] = Tokenizer(model_path)
    tok = _loaded[model_path]
    return [np.array(ids + [tok.eos_id], tok.token_dtype) for ids in tok.sp.encode(list(texts))]


def build_tokenizer(cfg: TokenizerConfig, docs_by_source: Mapping[str, Sequence[str]], out_path: Union[str, Path],
                    sizes: Optional[Mapping[str, int]] = None) -> Tokenizer:
    """Copy the model at `cfg.path` to `out_path` after checking it, or train one from the documents
    (`sizes`: each source's characters, when the caller knows them without reading every document)."""
    path = pretrained_path(cfg)
    if path is None:
        return train_tokenizer(docs_by_source, cfg, out_path, sizes)
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise DataError(f"data.tokenizer.path={cfg.path} has {tokenizer.vocab_size} pieces but "
                        f"model.vocab_size={cfg.vocab_size}; set model.vocab_size={tokenizer.vocab_size}")
    if tokenizer.eos_id < 0:
        raise DataError(f"data.tokenizer.path={cfg.path} has no eos piece, needed between packed documents")
    shutil.copyfile(path, out_path)
    return Tokenizer(out_path)


_REQUIRED = re.compile(r"smaller than required_chars\. \d+ vs (\d+)")  # sentencepiece's refusal of a small vocab


def pretrained_path(cfg: TokenizerConfig) -> Optional[Path]:
    """`cfg.path` as a Path after checking it exists; None when a tokenizer is to be trained."""
    if cfg.path is None:
        return None
    if not Path(cfg.path).is_file():
        raise DataError(f"data.tokenizer.path={cfg.path}: file not found; fix the path, or unset it to train one")
    return Path(cfg.path)


def train_tokenizer(docs_by_source: Mapping[str, Sequence[str]], cfg: TokenizerConfig, out_path: Union[str, Path],
                    sizes: Optional[Mapping[str, int]] = None) -> Tokenizer:
    """Train on `cfg.sample_chars` characters drawn evenly across sources; write the model to `out_path`.
    The sample bounds the memory and time it takes whatever the corpus size; what it held is the returned
    tokenizer's `sample` (lines and characters per source)."""
    model = io.BytesIO()
    extra = {"user_defined_symbols": list(cfg.user_symbols)} if cfg.user_symbols else {}
    sample: Dict[str, Dict[str, int]] = {}
    try:
        spm.SentencePieceTrainer.train(**extra,
            sentence_iterator=sample_lines(docs_by_source, cfg.sample_chars, sizes, sample), model_writer=model,
            model_type=cfg.model_type, vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage,
            byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            max_sentence_length=4 * MAX_LINE_CHARS,  # in bytes
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, num_threads=2, minloglevel=2)
    except RuntimeError as e:
        needed = _REQUIRED.search(str(e))
        if needed:  # the characters within the coverage, byte fallback's and the special pieces: one id each
            fits = 1 << (int(needed.group(1)) - 1).bit_length()
            raise DataError(f"data.tokenizer: the text's characters need {int(needed.group(1)):,} pieces at "
                            f"character_coverage={cfg.character_coverage} (byte fallback's 256, the special and user "
                            f"pieces included), more than model.vocab_size={cfg.vocab_size}; set model.vocab_size={fits} "
                            f"(the next power of two: room for merged pieces too), or lower "
                            f"data.tokenizer.character_coverage") from e
        raise DataError(f"sentencepiece could not train a {cfg.model_type} tokenizer with model.vocab_size="
                        f"{cfg.vocab_size}: {e}. Too small a vocabulary: byte fallback takes 260 ids and every "
                        f"character within data.tokenizer.character_coverage one more, so raise model.vocab_size or "
                        f"lower the coverage. Too large: the text has fewer pieces to offer, so lower "
                        f"model.vocab_size or raise data.tokenizer.sample_chars") from e
    Path(out_path).write_bytes(model.getvalue())
    tokenizer = Tokenizer(out_path)
    tokenizer.sample = sample
    return tokenizer


def sample_lines(docs_by_source: Mapping[str, Sequence[str]], sample_chars: int,
                 sizes: Optional[Mapping[str, int]] = None,
                 counts: Optional[Dict[str, Dict[str, int]]] = None) -> Iterator[str]:
    """Non-empty lines (cut to MAX_LINE_CHARS) totalling about `sample_chars`, split evenly over sources
    (`sizes`: their characters; None: counted here). `counts` gets each source's lines and characters.

    A source smaller than its share gives all of it and the rest goes to the others. Within a source,
    documents are visited in a fixed pseudo-random order so the sample spans the whole source.
    """
    sizes = sizes if sizes is not None else {name: sum(map(len, docs)) for name, docs in docs_by_source.items()}
    for name, budget in _even_shares(dict(sizes), sample_chars).items():
        mine = (counts if counts is not None else {}).setdefault(name, {"lines": 0, "chars": 0})
        for line in _source_lines(docs_by_source[name], budget):
            mine["lines"] += 1
            mine["chars"] += len(line)
            yield line


def _source_lines(docs: Sequence[str], budget: int) -> Iterator[str]:
    for i in np.random.default_rng(0).permutation(len(docs)):
        for line in docs[i].split("\n"):
            if budget <= 0:
                return
            if line:
                line = line[:MAX_LINE_CHARS]
                budget -= len(line)
                yield line


def _even_shares(sizes: Dict[str, int], total: int) -> Dict[str, int]:
    """Split `total` evenly over sources, capped by their sizes (water-filling, smallest first)."""
    shares, left = {}, total
    for i, (name, size) in enumerate(sorted(sizes.items(), key=lambda kv: kv[1])):
        shares[name] = min(size, left // (len(sizes) - i))
        left -= shares[name]
    return {name: shares[name] for name in sizes}
