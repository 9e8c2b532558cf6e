"""Per-document cleaning: Unicode normalization, quality filters, and the keys deduplication compares.

`clean_batch` runs in worker processes. A document is removed by the first filter it fails, in the order
of FILTERS; the ones that pass carry a content digest (exact dedup) and a MinHash signature (near dedup),
which data/dedup.py compares across all sources in the main process.
"""
from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

import numpy as np

from base.schema import CleaningConfig
from data.minhash import signature

FILTERS = ("min_chars", "max_symbol_fraction", "max_repeated_line_fraction")
UNICODE_FORMS = ("NFC", "NFKC", "NFD", "NFKD", "none")


@dataclass
class CleanedDoc:
    text: str  # normalized; "" when removed
    removed_by: Optional[str]  # the first filter (one of FILTERS) it failed; None: kept
    digest: bytes = b""  # of the normalized text
    signature: Optional[np.ndarray] = None  # MinHash, when cfg.near_dedup


def clean_batch(texts: List[str], cfg: CleaningConfig) -> List[CleanedDoc]:
    """Normalize and filter `texts`; kept documents get their dedup keys."""
    out = []
    for text in texts:
        if cfg.unicode_form != "none":
            text = unicodedata.normalize(cfg.unicode_form, text)
        failed = first_failed_filter(text, cfg)
        if failed:
            out.append(CleanedDoc("", failed))
        else:
            out.append(CleanedDoc(text, None, hashlib.blake2b(text.encode(), digest_size=16).digest(),
                                  signature(text) if cfg.near_dedup else None))
    return out


def first_failed_filter(text: str, cfg: CleaningConfig) -> Optional[str]:
    if len(text) < cfg.min_chars:
        return "min_chars"
    if symbol_fraction(text) > cfg.max_symbol_fraction:
        return "max_symbol_fraction"
    if repeated_line_fraction(text) > cfg.max_repeated_line_fraction:
        return "max_repeated_line_fraction"
    return None


def symbol_fraction(text: str) -> float:
    """Fraction of characters that are not text: Unicode symbols (S*: math, currency, box drawing, emoji),
    control characters other than tab/newline/CR, private-use, unassigned and U+FFFD (failed decoding)."""
    counts = Counter(text)
    return sum(n for ch, n in counts.items() if _is_symbol(ch)) / max(len(text), 1)


@lru_cache(maxsize=65536)
def _is_symbol(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category[0] == "S" or (category[0] == "C" and ch not in "\t\n\r") or ch == "\ufffd"


def repeated_line_fraction(text: str) -> float:
    """Characters in non-blank lines that already occurred earlier in the document, over all characters in
    non-blank lines (Gopher's duplicate-line character fraction): boilerplate, spam, generated tables."""
    seen, repeated, total = set(), 0, 0
    for line in text.split("\n"):
        if line.strip():
            total += len(line)
            if line in seen:
                repeated += len(line)
            seen.add(line)
    return repeated / max(total, 1)
