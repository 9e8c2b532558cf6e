"""Log-likelihood scoring with a causal LM's per-token NLL cell (an objective's `token_nll(model)` hook): the
summed log-probability of a continuation given its context, as lm-evaluation-harness's `loglikelihood` asks."""
from typing import List, Sequence, Tuple

import numpy as np

PAD_MULTIPLE = 32  # rows are padded to a multiple of this (graph mode compiles a few shapes)


def token_nll(cell, batches: Sequence[np.ndarray]) -> np.ndarray:
    """[N, S] per-token NLLs of the rows of `batches` (input_ids [B, S + 1] each) through `cell`, float64."""
    from mindspore import Tensor

    return np.concatenate([cell(Tensor(np.asarray(ids, np.int32)))[0].asnumpy().astype(np.float64) for ids in batches])


def encode_pair(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair`: whitespace ending the context moves to the
    continuation, the pair is encoded as one text and the continuation is what follows the context's own
    encoding (so the tokens are those the model sees in running text, not a separately encoded fragment)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n = len(tokenizer.encode(context)) if context else 0
    return whole[:n], whole[n:]


class LoglikelihoodScorer:
    """(context, continuation) pairs -> the summed log-probability of each continuation's tokens, in batches of
    `batch_size` rows through the per-token NLL cell. Each row is eos (a document start, as in the packed training
    rows), the context's tokens, the continuation's (`encode_pair`: lm-eval's split), cut on the left to
    `max_len` + 1 tokens, padded on the right to a multiple of PAD_MULTIPLE (a causal model's earlier positions
    do not see the padding); rows are sorted by length and a short last batch filled with padding rows."""

    def __init__(self, nll_cell, tokenizer, batch_size: int, max_len: int):
        self.cell, self.tokenizer, self.batch_size, self.max_len = nll_cell, tokenizer, batch_size, max_len

    def encode(self, context: str, continuation: str) -> Tuple[List[int], int]:
        ctx, cont = encode_pair(self.tokenizer, context, continuation)
        if not cont:
            raise ValueError(f"the continuation {continuation!r} encodes to no tokens")
        ids = ([self.tokenizer.eos_id] + ctx + cont)[-(self.max_len + 1):]
        return ids, min(len(cont), len(ids) - 1)

    def __call__(self, requests: Sequence[Tuple[str, str]]) -> List[float]:
        return [logp for logp, _ in self.score([self.encode(c, x) for c, x in requests])]

    def score(self, encoded: Sequence[Tuple[List[int], int]]) -> List[Tuple[float, bool]]:
        """Rows (ids, n): the summed log-probability of the last n tokens of ids given the ones before, and
        whether each of them is the model's most likely token (lm-eval's loglikelihood answer)."""
        from mindspore import Tensor

        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
        out = [(0.0, False)] * len(encoded)
        pad = self.tokenizer.pad_id
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            longest = max(len(encoded[i][0]) for i in chunk) - 1  # targets
            width = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_len) + 1
            rows = np.full((self.batch_size, width), pad, np.int32)
            for r, i in enumerate(chunk):
                rows[r, :len(encoded[i][0])] = encoded[i][0]
            nll, greedy = (x.asnumpy() for x in self.cell(Tensor(rows)))
            for r, i in enumerate(chunk):
                ids, n = encoded[i]
                span = slice(len(ids) - 1 - n, len(ids) - 1)
                out[i] = (-float(nll[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
        return out
