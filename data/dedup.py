"""Exact and near-duplicate removal across all sources: the first occurrence stays.

Documents are offered in a fixed order (sources in config order, documents in reading order), so which
copy survives is deterministic and a document duplicated across sources stays in the earlier source.
"""
from __future__ import annotations

from typing import Optional, Set

from base.schema import CleaningConfig
from data.cleaning import CleanedDoc
from data.minhash import NearDuplicateIndex

STEPS = ("exact_dedup", "near_dedup")


class Deduplicator:
    def __init__(self, cfg: CleaningConfig):
        self.exact = cfg.exact_dedup
        self.near = NearDuplicateIndex(cfg.near_dedup_threshold) if cfg.near_dedup else None
        self._digests: Set[bytes] = set()

    def duplicate_of_earlier(self, doc: CleanedDoc) -> Optional[str]:
        """The step (one of STEPS) that removes `doc`, or None when it is new (and now remembered)."""
        if self.exact:
            if doc.digest in self._digests:
                return "exact_dedup"
            self._digests.add(doc.digest)
        if self.near and not self.near.add_unless_duplicate(doc.signature):
            return "near_dedup"
        return None
