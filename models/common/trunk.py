"""What the trunks of the decoder families share (moved out of the Llama trunk unchanged): the attention inputs of
every layer (RoPE tables at the positions, the packed samples' mask) and the cached inference pass. A trunk has
`tok_embeddings`, `layers` (each with `cached`), `norm_out`, the RoPE tables `cos` / `sin` and the causal
`future` table.
"""
import mindspore as ms
from mindspore import nn, ops


class DecoderTrunk(nn.Cell):
    def attention_inputs(self, tokens, positions, segments):
        """(cos, sin, mask) for every layer's attention: the RoPE tables [S, D] (or [B, 1, S, D] at `positions`)
        and, with `segments`, the additive bias [B, 1, S, S] that keeps each token inside its sample (else None)."""
        seq = tokens.shape[1]
        if positions is None:
            cos, sin = self.cos[:seq], self.sin[:seq]
        else:  # [B, 1, S, D]: broadcast over the heads
            cos, sin = self.cos[positions].expand_dims(1), self.sin[positions].expand_dims(1)
        if segments is None:
            return cos, sin, None
        same = segments.expand_dims(2) == segments.expand_dims(1)  # [B, S, S]
        allowed = ops.logical_and(same, self.future[:seq, :seq] == 0).astype(ms.float32)
        return cos, sin, ((1.0 - allowed) * -1e9).expand_dims(1)  # [B, 1, S, S], added to the scores

    def cached(self, tokens, positions, bias, k_caches=None, v_caches=None, slot=None):
        """Inference: tokens/positions [B, S] (positions start at 0 at each row's first real token), the
        attention bias and per-layer caches (tuples of Parameters, written in place, or None) -> hidden
        [B, S, hidden]."""
        cos, sin = self.cos[positions].expand_dims(1), self.sin[positions].expand_dims(1)  # [B, 1, S, D]
        x = self.tok_embeddings(tokens)
        i = 0
        for layer in self.layers:
            k = None if k_caches is None else k_caches[i]
            v = None if v_caches is None else v_caches[i]
            x = layer.cached(x, cos, sin, bias, k, v, slot)
            i += 1
        return self.norm_out(x)
