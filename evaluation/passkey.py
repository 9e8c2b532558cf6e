"""Passkey retrieval (Mohtashami & Jaggi 2023): a 5-digit key hidden at a depth (fraction of the filler before
it) of a prompt of some length; the model is right when the hidden key is more likely, summed over its tokens,
than 9 other random keys (chance 0.1). Needs only the tokenizer and a per-token NLL cell, no data."""
from typing import Callable, Optional, Sequence

import numpy as np

from base.errors import ConfigError
from evaluation.scorer import token_nll

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def passkey_rows(tokenizer, length: int, depth: float, key: int, candidates: Sequence[int]):
    """(input_ids [len(candidates), length + 1], candidate token counts): eos, filler with the needle at `depth`
    of it, the question, then each candidate key; the filler is cut so every row is exactly length + 1."""
    needle, question = tokenizer.encode(PASSKEY_NEEDLE.format(key=key)), tokenizer.encode(PASSKEY_QUESTION)
    unit = tokenizer.encode(PASSKEY_FILLER)
    rows, counts = [], []
    for cand in candidates:
        answer = tokenizer.encode(f" {cand}")
        room = length + 1 - 1 - len(needle) - len(question) - len(answer)
        if room < 0:
            raise ConfigError("eval.passkey_lengths", f"{length} tokens cannot hold the needle and the question "
                              f"({length + 1 - room} tokens); use lengths >= 64")
        filler = (unit * (room // len(unit) + 1))[:room]
        cut = int(round(depth * room))
        rows.append([tokenizer.eos_id] + filler[:cut] + needle + filler[cut:] + question + answer)
        counts.append(len(answer))
    return np.array(rows, np.int32), counts


def passkey_accuracy(cell, tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int,
                     set_length: Optional[Callable[[int], None]] = None, seed: int = 0, batch_size: int = 10) -> dict:
    """{length: {depth: accuracy}}: the share of trials where the hidden key has the highest summed
    log-likelihood among itself and 9 other random 5-digit keys (chance 0.1). `set_length(length)` prepares the
    model for each length (models.set_context_length). The 10 rows of a trial are scored `batch_size` at a time
    (rounded down to a divisor of 10, so one graph shape per length): all 10 rows of 2048 tokens at once took
    18 GB RSS for model=tiny on CPU."""
    batch_size = max(d for d in (1, 2, 5, 10) if d <= max(batch_size, 1))
    rng = np.random.default_rng(seed)
    out = {}
    for length in lengths:
        if set_length is not None:
            set_length(length)
        out[str(length)] = {}
        for depth in depths:
            hits = 0
            for _ in range(trials):
                keys = rng.choice(np.arange(10000, 100000), 10, replace=False)
                rows, counts = passkey_rows(tokenizer, int(length), float(depth), int(keys[0]), keys)
                nll = token_nll(cell, [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)])
                scores = [-nll[i, -c:].sum() for i, c in enumerate(counts)]
                hits += int(np.argmax(scores) == 0)
            out[str(length)][str(depth)] = hits / trials
    return out
