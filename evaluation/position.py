"""Loss by position in the row: does the model use its context (the loss falls with the position), and how far
does it carry past the training length (rows re-packed longer, evaluation/sources.py)."""
from typing import Optional

import numpy as np


def loss_by_position(nll: np.ndarray, bucket: int, mask: Optional[np.ndarray] = None) -> list:
    """Mean NLL per bucket of positions: `nll` [N, S] (row n's target j, predicted from j + 1 tokens of its row),
    buckets [0, bucket), [bucket, 2 bucket), ..., the last one cut at S. `mask` [N, S] (1: counted) leaves
    positions out. Returns [{"start", "end", "tokens", "loss"}, ...]; loss is NaN for a bucket without tokens.
    Rows are packed, so position counts context inside the row, which may start mid-document."""
    nll = np.asarray(nll, np.float64)
    if nll.ndim != 2:
        raise ValueError(f"nll must be [rows, positions], got shape {nll.shape}")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    weights = np.ones_like(nll) if mask is None else np.asarray(mask, np.float64)
    out = []
    for start in range(0, nll.shape[1], bucket):
        end = min(start + bucket, nll.shape[1])
        w = weights[:, start:end]
        n = float(w.sum())
        out.append({"start": start, "end": end, "tokens": int(n),
                    "loss": float((nll[:, start:end] * w).sum() / n) if n else float("nan")})
    return out
