"""BERT for pre-training (Devlin et al. 2019) as MindSpore cells, readable top to bottom.

    word + learned absolute position + token-type embeddings -> LayerNorm -> dropout
    N x post-LayerNorm encoder layer:
        x = LayerNorm(x + dropout(W_o · SelfAttention(x)))      (q/k/v/o linears with bias)
        x = LayerNorm(x + dropout(W_2 · GELU(W_1 x)))           (MLP linears with bias)
    pooler: tanh(dense(x[:, 0]))                               (the [CLS] position)
    MLM head: LayerNorm(GELU(dense(x))) @ E^T + bias           (decoder tied to the word embedding E)
    NSP head: dense(pooled) -> 2 logits                        (is-next / not-next)

Attention is bidirectional: every position attends to every position whose `attention_mask` is 1; keys
with mask 0 (padding) get -1e9 added to their scores (in fp32) before the softmax, so they receive no
weight. Padded query positions still produce (meaningless) outputs, exactly as in Hugging Face.

Parameter names equal Hugging Face `BertForPreTraining` state-dict names (`bert.embeddings.word_embeddings.weight`,
`bert.encoder.layer.{i}.attention.self.query.weight`, ..., `cls.predictions.bias`, `cls.seq_relationship.weight`),
so models/bert/hf.py renames nothing. The cell tree mirrors Hugging Face's module tree for that reason, down
to the attribute called `self` (the self-attention inside `attention`) and the attributes called `LayerNorm`.
Linear weights are [out_features, in_features] as in torch; LayerNorm parameters are `weight`/`bias`.
The MLM decoder has no weight of its own: it multiplies by the word embedding (Hugging Face's state dict
holds `cls.predictions.decoder.weight/.bias` as aliases of it and of `cls.predictions.bias`).

Precision: parameters are fp32 (master weights). Matmuls run in `compute_dtype` (fp32/fp16): inputs and
weights are cast for the matmul and the bias is added in that dtype. LayerNorm statistics, GELU/tanh, the
attention softmax, the residual stream and both heads' logits are fp32.

Dropout (embeddings, attention probabilities, each sublayer output) is active only in training mode
(`set_train(True)`); a rate of 0.0 builds no dropout op at all.
"""
import math
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}
MASK_VALUE = -1e9  # added (fp32) to the attention scores of padded keys


def _normal(rng: Optional[np.random.Generator], shape, std: float) -> Parameter:
    """N(0, std) weights from `rng`, or with rng None (a sharded build) by MindSpore's initializer when the sharded
    compile initialises each rank's slices (models/llama/model.py _init says why)."""
    if rng is None:
        return Parameter(initializer(Normal(std), shape, ms.float32))
    return Parameter(Tensor(rng.normal(0.0, std, size=shape).astype(np.float32)))


def _constant(shape, value: float) -> Parameter:
    return Parameter(Tensor(np.full(shape, value, np.float32)))


def _dropout(p: float) -> nn.Cell:
    """nn.Dropout only drops in training mode; p == 0 gets an identity, i.e. no dropout op."""
    return nn.Dropout(p=p) if p > 0 else nn.Identity()


def _activation(name: str):
    """Hugging Face's names: "gelu" is the exact erf GELU, "gelu_new"/"gelu_pytorch_tanh" the tanh approximation."""
    if name == "gelu":
        return lambda x: ops.gelu(x, approximate="none")
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: ops.gelu(x, approximate="tanh")
    if name == "relu":
        return ops.relu
    raise ValueError(f"unsupported hidden_act {name!r} (gelu | gelu_new | gelu_pytorch_tanh | relu)")


class Linear(nn.Cell):
    """y = x @ W^T + b with W [out, in] (torch layout), computed in `compute_dtype`; output in that dtype."""

    def __init__(self, in_features: int, out_features: int, std: float, rng, compute_dtype):
        super().__init__()
        self.weight = _normal(rng, (out_features, in_features), std)
        self.bias = _constant((out_features,), 0.0)
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        y = self.matmul(x, self.weight.astype(self.compute_dtype)) + self.bias.astype(self.compute_dtype)
        return y.reshape(shape[:-1] + (-1,))


class LayerNorm(nn.Cell):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, in fp32 (biased variance, as torch)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _constant((dim,), 1.0)
        self.bias = _constant((dim,), 0.0)
        self.eps = eps
        self.mean, self.square, self.rsqrt = ops.ReduceMean(keep_dims=True), ops.Square(), ops.Rsqrt()

    def construct(self, x):
        x32 = x.astype(ms.float32)
        centered = x32 - self.mean(x32, -1)
        normed = centered * self.rsqrt(self.mean(self.square(centered), -1) + self.eps)
        return normed * self.weight + self.bias


class Embedding(nn.Cell):
    """A lookup table `weight` [num, dim] (fp32 output)."""

    def __init__(self, num: int, dim: int, std: float, rng):
        super().__init__()
        self.weight = _normal(rng, (num, dim), std)
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.weight, ids, 0)


class BertEmbeddings(nn.Cell):
    """word(input_ids) + position(0..S-1) + token_type(token_type_ids) -> LayerNorm -> dropout."""

    def __init__(self, cfg, rng):
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_std
        self.word_embeddings = Embedding(cfg.vocab_size, h, std, rng)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, h, std, rng)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, h, std, rng)
        self.LayerNorm = LayerNorm(h, cfg.layer_norm_eps)
        self.dropout = _dropout(cfg.hidden_dropout)
        self.position_ids = Tensor(np.arange(cfg.max_position_embeddings, dtype=np.int32))

    def construct(self, input_ids, token_type_ids):
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(self.position_ids[:seq])  # [S, h] broadcast over the batch
        return self.dropout(self.LayerNorm(x))


class CoreAttention(nn.Cell):
    """dropout(softmax(q k^T / sqrt(d) + mask_bias)) v on [B, heads, S, D]; the part selective recompute redoes.

    mask_bias [B, 1, 1, S] is 0 for real keys and MASK_VALUE for padded ones; scores and softmax are fp32.
    """

    def __init__(self, head_dim: int, attention_dropout: float, compute_dtype):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.compute_dtype = compute_dtype
        self.qk = ops.BatchMatMul(transpose_b=True)
        self.pv = ops.BatchMatMul()
        self.dropout = _dropout(attention_dropout)

    def construct(self, q, k, v, mask_bias):
        scores = self.qk(q, k).astype(ms.float32) * self.scale + mask_bias
        probs = self.dropout(ops.softmax(scores, -1))
        return self.pv(probs.astype(self.compute_dtype), v)


class BertSelfAttention(nn.Cell):
    """query/key/value projections (with bias) and multi-head core attention; output [B, S, h] in compute dtype."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_std
        self.num_heads = cfg.num_heads
        self.head_dim = h // cfg.num_heads
        self.query = Linear(h, h, std, rng, compute_dtype)
        self.key = Linear(h, h, std, rng, compute_dtype)
        self.value = Linear(h, h, std, rng, compute_dtype)
        self.core = CoreAttention(self.head_dim, cfg.attention_dropout, compute_dtype)  # no parameters

    def construct(self, x, mask_bias):
        b, s, _ = x.shape
        q = self.query(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.key(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.value(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        out = self.core(q, k, v, mask_bias)
        return out.transpose(0, 2, 1, 3).reshape(b, s, -1)


class BertSelfOutput(nn.Cell):
    """LayerNorm(residual + dropout(dense(x))): the attention output projection and the post-LN."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, cfg.init_std, rng, compute_dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.dropout = _dropout(cfg.hidden_dropout)

    def construct(self, x, residual):
        return self.LayerNorm(residual + self.dropout(self.dense(x).astype(ms.float32)))


class BertAttention(nn.Cell):
    """Self-attention sublayer. The child is called `self` as in Hugging Face (`attention.self.query.weight`)."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.insert_child_to_cell("self", BertSelfAttention(cfg, rng, compute_dtype))
        self.output = BertSelfOutput(cfg, rng, compute_dtype)

    def construct(self, x, mask_bias):
        return self.output(self.self(x, mask_bias), x)


class BertIntermediate(nn.Cell):
    """act(dense(x)): h -> intermediate_size; activation in fp32, output in compute dtype."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.init_std, rng, compute_dtype)
        self.act = _activation(cfg.hidden_act)
        self.compute_dtype = compute_dtype

    def construct(self, x):
        return self.act(self.dense(x).astype(ms.float32)).astype(self.compute_dtype)


class BertOutput(nn.Cell):
    """LayerNorm(residual + dropout(dense(x))): intermediate_size -> h and the post-LN."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.dense = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.init_std, rng, compute_dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.dropout = _dropout(cfg.hidden_dropout)

    def construct(self, x, residual):
        return self.LayerNorm(residual + self.dropout(self.dense(x).astype(ms.float32)))


class BertLayer(nn.Cell):
    """One post-LN encoder layer: attention sublayer, then MLP sublayer; fp32 in and out."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.attention = BertAttention(cfg, rng, compute_dtype)
        self.intermediate = BertIntermediate(cfg, rng, compute_dtype)
        self.output = BertOutput(cfg, rng, compute_dtype)

    def construct(self, x, mask_bias):
        x = self.attention(x, mask_bias)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Cell):
    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.layer = nn.CellList([BertLayer(cfg, rng, compute_dtype) for _ in range(cfg.num_layers)])

    def construct(self, x, mask_bias):
        for layer in self.layer:
            x = layer(x, mask_bias)
        return x


class BertPooler(nn.Cell):
    """tanh(dense(x[:, 0])): the [CLS] representation fed to the NSP head; fp32 [B, h]."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, cfg.init_std, rng, compute_dtype)

    def construct(self, x):
        return ops.tanh(self.dense(x[:, 0]).astype(ms.float32))


class BertModel(nn.Cell):
    """(input_ids, token_type_ids, attention_mask) -> (sequence output fp32 [B, S, h], pooled fp32 [B, h])."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg, rng)
        self.encoder = BertEncoder(cfg, rng, compute_dtype)
        self.pooler = BertPooler(cfg, rng, compute_dtype)

    def construct(self, input_ids, token_type_ids, attention_mask):
        b, s = attention_mask.shape
        # 0 where the key is a real token, MASK_VALUE where it is padding; broadcast over heads and queries
        mask_bias = ((1.0 - attention_mask.astype(ms.float32)) * MASK_VALUE).reshape(b, 1, 1, s)
        x = self.encoder(self.embeddings(input_ids, token_type_ids), mask_bias)
        return x, self.pooler(x)


class BertPredictionHeadTransform(nn.Cell):
    """LayerNorm(act(dense(x))) before the tied decoder; fp32 out."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, cfg.init_std, rng, compute_dtype)
        self.act = _activation(cfg.hidden_act)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def construct(self, x):
        return self.LayerNorm(self.act(self.dense(x).astype(ms.float32)))


class BertLMPredictionHead(nn.Cell):
    """transform, then x @ E^T (E: the word embedding, passed in) + `bias`; fp32 logits [B, S, vocab]."""

    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg, rng, compute_dtype)
        self.bias = _constant((cfg.vocab_size,), 0.0)
        self.compute_dtype = compute_dtype
        self.decoder = ops.MatMul(transpose_b=True)  # no weight of its own: tied to the word embedding

    def construct(self, x, embedding_weight):
        b, s, h = x.shape
        x = self.transform(x).reshape(-1, h).astype(self.compute_dtype)
        logits = self.decoder(x, embedding_weight.astype(self.compute_dtype)).astype(ms.float32)
        return (logits + self.bias).reshape(b, s, -1)


class BertPreTrainingHeads(nn.Cell):
    def __init__(self, cfg, rng, compute_dtype):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, rng, compute_dtype)
        self.seq_relationship = Linear(cfg.hidden_size, 2, cfg.init_std, rng, compute_dtype)

    def construct(self, sequence_output, pooled_output, embedding_weight):
        mlm = self.predictions(sequence_output, embedding_weight)
        return mlm, self.seq_relationship(pooled_output).astype(ms.float32)


class BertForPreTraining(nn.Cell):
    """(input_ids, token_type_ids, attention_mask), int32 [B, S] each -> (MLM logits fp32 [B, S, vocab],
    NSP logits fp32 [B, 2]). MLM logits are computed at every position; the loss picks the masked ones."""

    family = "bert"  # the family that builds it (what a converter asks: LoRA's default targets)

    def __init__(self, cfg, compute_dtype: str = "fp32", seed: int = 0, deferred: bool = False):
        """`deferred`: the weights are initialised by the sharded compile, each rank its slices (_normal)."""
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
        if getattr(cfg, "flash_attention", None):
            raise ValueError("BERT has no flash-attention path (it uses plain attention with a padding mask)")
        rng = None if deferred else np.random.default_rng(seed)  # numpy: identical weights on every rank
        dtype = DTYPES[compute_dtype]
        self.bert = BertModel(cfg, rng, dtype)
        self.cls = BertPreTrainingHeads(cfg, rng, dtype)

    def layers(self):
        """The encoder layer cells, in order (what recompute and pipeline stages operate on)."""
        return list(self.bert.encoder.layer)

    def construct(self, input_ids, token_type_ids, attention_mask):
        sequence_output, pooled_output = self.bert(input_ids, token_type_ids, attention_mask)
        return self.cls(sequence_output, pooled_output, self.bert.embeddings.word_embeddings.weight)

