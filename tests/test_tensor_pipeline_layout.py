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
    act = (2, 1)  # RMSNorm works on rows [batch x sequence, hidden]: split over dp x tp
    expected = {"square": (act,), "mean": (act,), "add": (act, ()), "rsqrt": (act,), "normalize": (act, act),
                "scale": (act, act)}
    norms = [f"model.layers.{i}.{n}" for i in range(4) for n in ("attention_norm", "ffn_norm")] + ["model.norm_out"]
    assert {k: v for k, v in plan.items() if k.rpartition(".")[0] in norms} == \
        {f"{norm}.{op}": s for norm in norms for op, s in expected.items()}
    assert dict(model.cells_and_names())["model.norm_out"].scale.in_strategy == (act, act)
    assert plan["model.layers.0.attention.wq.matmul"] == COL  # the tensor-parallel part is unchanged


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
