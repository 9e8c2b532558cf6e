"""Tensor/pipeline layouts of the native Llama: the strategies and stages the layout modules assign, checked
against hand-written tables, and applied to a model built under SEMI_AUTO_PARALLEL on CPU.

What is NOT run here: the first training step. MindSpore compiles sharded and pipelined graphs only for
Ascend/GPU ("Invalid backend: CPU"), so these layouts are built and inspected, never executed, on CPU.
"""
import pytest
from omegaconf import OmegaConf

import mindspore as ms

from conftest import load_preset
from distributed.semi_auto import apply_tensor_parallel, assign_stages
from models.llama import plan as llama_plan
from models import build_model

COL, ROW, HEADS = ((1, 1), (2, 1)), ((1, 2), (1, 2)), ((1, 2, 1, 1), (1, 2, 1, 1))
EXPECTED_LAYER = {  # tp2, dp1: per decoder layer
    "attention.wq.matmul": COL, "attention.wk.matmul": COL, "attention.wv.matmul": COL,
    "attention.wo.matmul": ROW, "attention.core.block.qk": HEADS, "attention.core.block.pv": HEADS,
    "feed_forward.w1.matmul": COL, "feed_forward.w3.matmul": COL, "feed_forward.w2.matmul": ROW,
    "attention_residual": ((1, 1, 1), (1, 1, 1)), "ffn_residual": ((1, 1, 1), (1, 1, 1)),  # [B, S, h]: by batch
}


@pytest.fixture
def semi_auto_parallel():
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=4, pipeline_stages=2)
    yield
    ms.reset_auto_parallel_context()


def test_tp2_pp2_strategies_and_stages_of_tiny(semi_auto_parallel):
    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    plan = apply_tensor_parallel(model, llama_plan, dp=1, tp=2)
    expected = {f"model.layers.{i}.{op}": s for i in range(4) for op, s in EXPECTED_LAYER.items()}
    expected["model.tok_embeddings.gather"] = ((2, 1), (1, 1))  # vocab-parallel embedding
    expected["lm_head.matmul"] = COL  # vocab-parallel head
    assert plan == expected
    cells = dict(model.cells_and_names())
    assert cells["model.layers.2.attention.wo"].matmul.in_strategy == ROW  # really applied to the primitive
    assert cells["model.tok_embeddings"].gather.in_strategy == ((2, 1), (1, 1))

    stages = assign_stages(model, llama_plan, pp=2)
    assert stages == {"model.tok_embeddings": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                      "model.layers.3": 1, "model.norm_out": 1, "lm_head": 1}
    assert cells["model.layers.3"].pipeline_stage == 1 and cells["model.layers.1"].pipeline_stage == 0


def test_tied_head_is_vocab_parallel_too(semi_auto_parallel):
    model = build_model(OmegaConf.merge(load_preset("model", "tiny"), {"tie_embeddings": True}), 64, "fp32", "CPU", 0,
                        sharded=True)
    plan = apply_tensor_parallel(model, llama_plan, dp=2, tp=2)
    assert plan["head_matmul"] == ((2, 1), (2, 1)) and plan["model.layers.0.attention.wo.matmul"] == ((2, 2), (1, 2))
    assert "lm_head" not in assign_stages(model, llama_plan, pp=2)


def test_checkpoint_splits_agree_with_the_primitive_strategies(semi_auto_parallel):
    """distributed/sharded_checkpoint.py cuts each parameter as the weight input of its sharded primitive."""
    from models.llama.plan import tensor_parallel_strategies, weight_split

    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    for path, strategy in tensor_parallel_strategies(model, dp=2, tp=2).items():
        owner = path.rpartition(".")[0]
        if path.endswith(".matmul"):
            assert weight_split(f"{owner}.weight", 2, 2) == strategy[1], path
        elif path.endswith(".gather"):
            assert weight_split(f"{owner}.embedding_weight", 2, 2) == strategy[0], path
    assert weight_split("model.layers.0.ffn_norm.weight", 1, 2) == (1,)


def test_sequence_parallel_shards_every_norm_primitive_along_the_sequence(semi_auto_parallel):
    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    plan = apply_tensor_parallel(model, llama_plan, dp=1, tp=2, sequence_parallel=True)
    act = (1, 2, 1)  # [batch, sequence, hidden]: the sequence split over tp
    expected = {"square": (act,), "mean": (act,), "add": (act, ()), "rsqrt": (act,), "normalize": (act, act),
                "scale": (act, (1,))}
    assert {k: v for k, v in plan.items() if k.rpartition(".")[0] in NORMS} == \
        {f"{norm}.{op}": s for norm in NORMS for op, s in expected.items()}
    assert dict(model.cells_and_names())["model.norm_out"].scale.in_strategy == (act, (1,))
    assert plan["model.layers.0.attention.wq.matmul"] == COL  # the tensor-parallel part is unchanged


def test_sequence_parallel_reduce_scatters_the_row_parallel_outputs(semi_auto_parallel):
    """Megatron's sequence parallelism, MindFormers' way: the row-parallel matmuls (wo, w2) output [B*S, h] split
    over dp*tp rows (out_strategy), so their partial sums are reduce-scattered into sequence slices, and the
    residual adds between them keep [B, S, h] split (dp, tp, 1). Without an out_strategy MindSpore all-reduces the
    whole activation, and without the adds' strategies it re-lays it out between every two annotated ops."""
    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    plan = apply_tensor_parallel(model, llama_plan, dp=2, tp=2, sequence_parallel=True)
    cells = dict(model.cells_and_names())
    for i in range(4):
        layer = f"model.layers.{i}"
        for row in ("attention.wo", "feed_forward.w2"):
            assert cells[f"{layer}.{row}"].matmul.out_strategy == ((4, 1),)
        for add in ("attention_residual", "ffn_residual"):
            assert plan[f"{layer}.{add}"] == ((2, 2, 1), (2, 2, 1))
            assert getattr(cells[layer], add).in_strategy == ((2, 2, 1), (2, 2, 1))
    assert not hasattr(cells["model.layers.0.attention.wq"].matmul, "out_strategy")  # column-parallel: MindSpore's
    plain = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    apply_tensor_parallel(plain, llama_plan, dp=2, tp=2)
    assert not hasattr(dict(plain.cells_and_names())["model.layers.0.feed_forward.w2"].matmul, "out_strategy")


NORMS = [f"model.layers.{i}.{n}" for i in range(4) for n in ("attention_norm", "ffn_norm")] + ["model.norm_out"]


def test_flash_attention_is_split_by_head_over_tp_and_by_batch_over_dp(semi_auto_parallel):
    """As MindFormers shards its FlashAttentionScore (BNSD): q, k, v (dp, tp, 1, 1), the compressed causal mask
    replicated, a packed-sample mask by batch. GQA (8 heads, 2 kv heads): the kv heads split over tp too. What the
    Ascend build of a tp/pp layout holds: flash attention, Ascend's RmsNorm, MindSpore's RoPE products."""
    from models.llama.device_ops import FusedRMSNorm
    from models.llama.model import FlashCoreAttention, Rotary

    cfg = OmegaConf.merge(load_preset("model", "tiny"), {"num_kv_heads": 2})
    model = build_model(cfg, 64, "bf16", "Ascend", seed=0, sharded=True)
    cells = dict(model.cells_and_names())
    assert all(isinstance(cells[f"model.layers.{i}.attention.core"], FlashCoreAttention) for i in range(4))
    assert all(type(cells[f"model.layers.{i}.attention.rope"]) is Rotary for i in range(4))
    plan = apply_tensor_parallel(model, llama_plan, dp=2, tp=2, sequence_parallel=True)
    heads = (2, 2, 1, 1)
    for i in range(4):
        core = f"model.layers.{i}.attention.core"
        assert plan[f"{core}.causal"] == (heads, heads, heads, (1, 1))
        assert plan[f"{core}.masked"] == (heads, heads, heads, (2, 1, 1, 1))
        assert f"{core}.block.qk" not in plan
    assert cells["model.layers.1.attention.core"].causal.in_strategy == (heads, heads, heads, (1, 1))
    assert all(isinstance(cells[norm], FusedRMSNorm) for norm in NORMS)
    assert {k: v for k, v in plan.items() if k.rpartition(".")[0] in NORMS} == \
        {f"{norm}.norm": ((2, 2, 1), (1,)) for norm in NORMS}


def test_lora_adapters_are_split_like_their_base_linear(semi_auto_parallel):
    """Column-parallel base: B split by rows, A replicated; row-parallel base: A split by columns, B replicated;
    and the checkpoint splits (weight_split) agree with those strategies."""
    from adapters.lora import LoraConfig, apply_lora
    from models.llama.plan import tensor_parallel_strategies, weight_split

    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    apply_lora(model, LoraConfig(r=4), seed=0)
    plan = apply_tensor_parallel(model, llama_plan, dp=1, tp=2)
    assert plan["model.layers.0.attention.wq.lora_A.matmul"] == ((1, 1), (1, 1))
    assert plan["model.layers.0.attention.wq.lora_B.matmul"] == COL
    assert plan["model.layers.0.attention.wo.lora_A.matmul"] == ROW
    assert plan["model.layers.0.attention.wo.lora_B.matmul"] == ((1, 1), (1, 1))
    assert plan["model.layers.0.attention.wq.matmul"] == COL  # the base is unchanged
    for path, strategy in tensor_parallel_strategies(model, dp=1, tp=2).items():
        if ".lora_" in path:
            assert weight_split(path.removesuffix(".matmul") + ".weight", 2, 2) == strategy[1], path


@pytest.mark.parametrize("algo, ulysses, ring", [("ring", 1, 2), ("ulysses", 2, 1)])
def test_context_parallel_splits_the_tokens_and_flash_attentions_sequence_or_heads(semi_auto_parallel, algo, ulysses,
                                                                                   ring):
    """cp 2 with dp 1, tp 2: the linears' [batch x sequence] rows over dp x cp; flash attention's heads over tp x the
    Ulysses ranks and its sequence over the ring's, with MindSpore's ring attention attributes set on the primitive
    only when the ring has more than one rank (as MindFormers' FlashAttention does)."""
    cfg = OmegaConf.merge(load_preset("model", "tiny"), {"num_kv_heads": 4})
    model = build_model(cfg, 64, "bf16", "Ascend", seed=0, sharded=True)
    plan = apply_tensor_parallel(model, llama_plan, dp=1, tp=2, cp=2, cp_algo=algo)
    split = (1, 2 * ulysses, ring, 1)
    assert plan["model.layers.0.attention.core.causal"] == (split, split, split, (1, 1))
    assert plan["model.layers.0.attention.wq.matmul"] == ((2, 1), (2, 1)) == plan["lm_head.matmul"]
    assert plan["model.layers.0.attention.wo.matmul"] == ((2, 2), (1, 2))
    assert plan["model.tok_embeddings.gather"] == ((2, 1), (1, 2))
    causal = dict(model.cells_and_names())["model.layers.0.attention.core"].causal
    assert causal.attrs.get("enable_ring_attention", False) is (ring > 1)


def test_interleaved_stages_take_every_pp_th_chunk(semi_auto_parallel):
    """pp 2 x vp 2 over 4 layers: chunks of one layer, chunk c on stage c % 2 in segment c // 2."""
    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0, sharded=True)
    stages = assign_stages(model, llama_plan, pp=2, vp=2)
    assert [stages[f"model.layers.{i}"] for i in range(4)] == [0, 1, 0, 1]
    cells = dict(model.cells_and_names())
    assert [cells[f"model.layers.{i}"].pipeline_segment for i in range(4)] == [0, 0, 1, 1]
    assert stages["model.tok_embeddings"] == 0 and stages["lm_head"] == 1
