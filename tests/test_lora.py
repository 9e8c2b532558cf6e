"""LoRA as a model converter (adapters/lora.py): names, freezing, merge, matching, PEFT export, fp16, graph mode."""
import math
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms
from mindspore import Tensor, nn

from adapters.lora import LoraConfig, apply_lora, describe, lora_state, merge_lora, peft_adapter_files, scaling, \
    single_name, write_peft_adapter
from adapters.twins import libraries_in
from conftest import ROOT, built_kernel, load_preset
from models import build_model
from objectives.clm import CausalLMLoss

TARGETS = LoraConfig().target_modules


def llama(seed=0, dtype="fp32"):
    return build_model(load_preset("model", "tiny"), 32, dtype, "CPU", seed=seed)


def tokens(shape=(2, 16), vocab=4096, seed=0):
    return Tensor(np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32))


def randomize_b(model, std=0.05, seed=1):
    """Trained-looking adapters (B = 0 makes every LoRA branch, and A's gradient, zero)."""
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        if p.name.endswith("lora_B.weight"):
            p.set_data(Tensor(rng.normal(0.0, std, p.shape).astype(np.float32)))


def params(model):
    return {p.name: p.asnumpy().copy() for p in model.get_parameters()}


@pytest.mark.usefixtures("pynative")
def test_lora_llama_is_the_base_model_with_frozen_base_and_named_adapters():
    from models.llama.plan import tensor_parallel_strategies

    base, model = llama(), llama()
    info = apply_lora(model, LoraConfig(), seed=0)
    x = tokens()
    np.testing.assert_array_equal(model(x).asnumpy(), base(x).asnumpy())  # B = 0

    m = load_preset("model", "tiny")
    layer_targets = [f"attention.w{n}" for n in "qkvo"] + [f"feed_forward.w{n}" for n in "123"]
    assert info["targets"] == [f"model.layers.{i}.{t}" for i in range(m.num_layers) for t in layer_targets]
    base_names = [p.name for p in base.get_parameters()]
    lora_names = [f"{t}.{ab}.weight" for t in info["targets"] for ab in ("lora_A", "lora_B")]
    assert sorted(p.name for p in model.get_parameters()) == sorted(base_names + lora_names)  # base names unchanged
    assert sorted(p.name for p in model.trainable_params()) == sorted(lora_names)

    h, f, r = m.hidden_size, m.intermediate_size, 8
    kv = m.num_kv_heads * h // m.num_heads
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + f))  # wq, wk+wv, wo, w1+w2+w3: r * (in + out)
    assert info["trainable"] == m.num_layers * per_layer == sum(p.size for p in model.trainable_params())
    assert info["total"] == sum(p.size for p in base.get_parameters()) + info["trainable"]
    assert describe(info).startswith(f"LoRA: {info['trainable']:,} trainable / {info['total']:,} total (")
    preset = OmegaConf.load(os.path.join(ROOT, "conf", "peft", "lora.yaml"))
    assert preset.r == LoraConfig().r and "target_modules" not in preset  # the dataclass's defaults: peft=lora's
    with open(os.path.join(ROOT, "docs", "sft.md"), encoding="utf-8") as f:  # the guide shows what peft=lora prints
        assert f"[peft] {describe(info)}\n" in f.read()

    weights = params(model)
    for t in info["targets"]:
        a, b = weights[f"{t}.lora_A.weight"], weights[f"{t}.lora_B.weight"]
        bound = 1.0 / math.sqrt(a.shape[1])  # PEFT's kaiming_uniform_(a=sqrt(5)) on A [r, in]
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.97 * bound
        assert abs(a.std() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)  # U(-b, b) has std b / sqrt(3)
        assert not b.any()
    again = llama()
    apply_lora(again, LoraConfig(), seed=0)  # same seed: same A on every rank
    assert all(np.array_equal(weights[k], v) for k, v in params(again).items())
    other = llama()
    apply_lora(other, LoraConfig(target_modules=["attention.wq"]), seed=0)  # A depends on (seed, path) only
    np.testing.assert_array_equal(params(other)["model.layers.0.attention.wq.lora_A.weight"],
                                  weights["model.layers.0.attention.wq.lora_A.weight"])
    with_lora = tensor_parallel_strategies(model, 1, 2)
    base_plan = tensor_parallel_strategies(base, 1, 2)
    assert {k: v for k, v in with_lora.items() if ".lora_" not in k} == base_plan  # the base keeps its paths and types
    assert len(with_lora) - len(base_plan) == 2 * len(info["targets"])  # and each adapter gets its A and B strategy
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig(), seed=0)


@pytest.mark.usefixtures("pynative")
def test_merged_weights_give_the_lora_model_logits_and_rslora_scales_by_sqrt_r():
    cfg = LoraConfig(r=4, alpha=8.0)
    model = llama()
    apply_lora(model, cfg, seed=0)
    randomize_b(model)
    x = tokens()
    ours = model(x).asnumpy()
    merged = merge_lora(params(model), cfg)
    base = llama(seed=5)
    assert sorted(merged) == sorted(p.name for p in base.get_parameters())
    ms.load_param_into_net(base, {k: ms.Parameter(Tensor(v), name=k) for k, v in merged.items()}, strict_load=True)
    theirs = base(x).asnumpy()
    assert np.abs(ours - llama()(x).asnumpy()).max() > 1e-2  # the adapters do change the logits
    print(f"merge: max |merged - unmerged| = {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)

    rs = LoraConfig(r=4, alpha=8.0, use_rslora=True, target_modules=["layers.1.feed_forward.w2"])
    assert scaling(rs) == 4.0 and scaling(cfg) == 2.0  # 8 / sqrt(4) vs 8 / 4
    model = llama()
    assert apply_lora(model, rs, seed=0)["targets"] == ["model.layers.1.feed_forward.w2"]
    randomize_b(model)
    cell = model.model.layers[1].feed_forward.w2
    w, a, b = (p.asnumpy().astype(np.float64) for p in (cell.weight, cell.lora_A.weight, cell.lora_B.weight))
    h = np.random.default_rng(2).normal(0, 1, (2, 3, w.shape[1]))
    expected = h @ w.T + 4.0 * (h @ a.T) @ b.T
    np.testing.assert_allclose(cell(Tensor(h.astype(np.float32))).asnumpy(), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(merge_lora(params(model), rs)["model.layers.1.feed_forward.w2.weight"],
                               w + 4.0 * b @ a, atol=1e-6, rtol=0)


@pytest.mark.usefixtures("pynative")
def test_gradients_reach_only_the_adapters_and_adamw_moves_only_them():
    model = llama()
    apply_lora(model, LoraConfig(), seed=0)
    randomize_b(model)
    trainable = model.trainable_params()
    loss_net = CausalLMLoss(model)
    grad_fn = ms.value_and_grad(lambda ids: loss_net(ids, ids)[0], None, trainable)
    loss, grads = grad_fn(tokens((2, 17)))
    assert np.isfinite(float(loss.asnumpy()))
    assert len(grads) == len(trainable) and all(".lora_" in p.name for p in trainable)
    assert all(np.abs(g.asnumpy()).max() > 0 for g in grads)  # into A and B alike
    optimizer = nn.AdamWeightDecay(trainable, learning_rate=1e-2)
    assert len(optimizer.parameters) == len(optimizer.moments1) == len(trainable)  # state for adapters only
    before = params(model)
    optimizer(grads)
    after = params(model)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {p.name for p in trainable}


@pytest.mark.usefixtures("pynative")
def test_target_modules_match_like_peft_and_a_miss_lists_the_linear_cells():
    def targets(spec):
        return apply_lora(llama(), LoraConfig(target_modules=spec), seed=0)["targets"]

    assert targets(["attention.wq"]) == targets(["wq"]) == [f"model.layers.{i}.attention.wq" for i in range(4)]
    assert targets(["model.layers.1.feed_forward.w2", "lm_head"]) == ["model.layers.1.feed_forward.w2", "lm_head"]
    regex = r"re:model\.layers\.[02]\.attention\.w[qv]"
    structured = OmegaConf.structured(LoraConfig(target_modules=[regex]))  # as the `peft` config group gives it
    assert apply_lora(llama(), structured, seed=0)["targets"] == targets(regex) == \
        [f"model.layers.{i}.attention.w{n}" for i in (0, 2) for n in "qv"]
    for miss in (["q_proj"], ["ttention.wq"], "re:layers\\.0\\.attention\\.wq", ["re:.*attention"]):
        with pytest.raises(ValueError, match="peft.target_modules") as err:
            targets(miss)
        assert "attention.wq, attention.wk, attention.wv, attention.wo, feed_forward.w1, feed_forward.w2, " \
               "feed_forward.w3, lm_head" in str(err.value) and "layers.0" not in str(err.value).split(";")[1]

    base = build_model(load_preset("model", "bert_tiny"), 32, "fp32", "CPU", seed=0)
    bert = build_model(load_preset("model", "bert_tiny"), 32, "fp32", "CPU", seed=0)
    cfg = LoraConfig(target_modules=["attention.self.query", "attention.self.value"])
    info = apply_lora(bert, cfg, seed=0)
    assert info["targets"] == [f"bert.encoder.layer.{i}.attention.self.{n}" for i in (0, 1) for n in ("query", "value")]
    assert "bert.encoder.layer.0.attention.self.query.lora_A.weight" in {p.name for p in bert.trainable_params()}
    assert info["trainable"] == 4 * 8 * (128 + 128)
    rng = np.random.default_rng(0)
    inputs = (Tensor(rng.integers(7, 8192, (2, 16)).astype(np.int32)), Tensor(np.zeros((2, 16), np.int32)),
              Tensor(np.ones((2, 16), np.int32)))
    for ours, theirs in zip(bert(*inputs), base(*inputs)):
        np.testing.assert_array_equal(ours.asnumpy(), theirs.asnumpy())
    randomize_b(bert)
    cell = bert.bert.encoder.layer[0].attention.self.query
    cell.bias.set_data(Tensor(rng.normal(0, 1, 128).astype(np.float32)))
    w, bias, a, b = (p.asnumpy().astype(np.float64) for p in (cell.weight, cell.bias, cell.lora_A.weight,
                                                               cell.lora_B.weight))
    h = rng.normal(0, 1, (2, 5, 128))
    expected = h @ w.T + bias + scaling(cfg) * (h @ a.T) @ b.T  # the LoRA branch adds no bias
    np.testing.assert_allclose(cell(Tensor(h.astype(np.float32))).asnumpy(), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="attention.self.query, attention.self.key, .*cls.seq_relationship"):
        apply_lora(base, LoraConfig(), seed=0)  # Llama's default names are no BERT cells


@pytest.mark.usefixtures("pynative")
@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_loads_the_exported_adapter_and_gives_our_logits(tmp_path, use_rslora):
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.llama import hf

    model_cfg = load_preset("model", "tiny")
    model = llama(seed=3)
    cfg = LoraConfig(r=4, alpha=8.0, use_rslora=use_rslora)
    apply_lora(model, cfg, seed=0)
    randomize_b(model)
    x = tokens((2, 24))
    ours = model(x).asnumpy()

    base_weights = {k: v for k, v in params(model).items() if ".lora_" not in k}
    hf_model = LlamaForCausalLM(LlamaConfig(**hf.hf_config(model_cfg)))
    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.to_hf(base_weights).items()}, strict=True)
    tensors, adapter_config = peft_adapter_files(lora_state(model), cfg, single_name(hf.to_hf), str(tmp_path / "hf"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert adapter_config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    write_peft_adapter(str(tmp_path / "adapter"), tensors, adapter_config)
    peft_model = PeftModel.from_pretrained(hf_model.eval(), str(tmp_path / "adapter")).eval()
    assert peft_model.peft_config["default"].use_rslora is use_rslora
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(x.asnumpy()).long()).logits.numpy()
    print(f"peft (use_rslora={use_rslora}): max |peft - ours| = {np.abs(theirs - ours).max():.2e}")
    assert np.abs(theirs - ours).max() <= 1e-4
    assert np.abs(ours - llama(seed=3)(x).asnumpy()).max() > 1e-2  # ... with adapters that matter


@pytest.mark.usefixtures("pynative")
def test_fp16_compute_runs_the_lora_branch_in_fp16_close_to_fp32():
    fp32, fp16 = llama(), llama(dtype="fp16")
    for model in (fp32, fp16):
        apply_lora(model, LoraConfig(), seed=0)
        randomize_b(model)
    cell = fp16.model.layers[0].attention.wq
    assert cell(Tensor(np.ones((1, 2, 128), np.float32))).dtype == ms.float16
    x = tokens()
    a, b = fp32(x).asnumpy(), fp16(x).asnumpy()
    assert np.isfinite(b).all()
    print(f"fp16: max |fp16 - fp32| = {np.abs(a - b).max():.2e} (max |logit| {np.abs(a).max():.2f})")
    assert np.abs(a - b).max() < 2e-2 * max(1.0, np.abs(a).max())


@pytest.mark.parametrize("targets", [["attention.wq", "feed_forward.w2"],  # every layer alike
                                     ["model.layers.0.attention.wq", "model.layers.1.feed_forward.w2"]])
def test_graph_mode_forward_sees_the_adapters_after_an_earlier_compile(targets):
    """Graph mode (the session default): a model compiled before apply_lora is recompiled with its adapters. The
    decoder layer is compiled once and reused for every layer (lazy_inline, models/llama/model.py): a layer given
    adapters must not share the graph of one without, or of one with other adapters (the second case)."""
    model = llama()
    x = tokens()
    before = model(x).asnumpy()
    apply_lora(model, LoraConfig(target_modules=targets), seed=0)
    randomize_b(model)
    graph = model(x).asnumpy()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        eager = model(x).asnumpy()
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert np.abs(graph - before).max() > 1e-2
    np.testing.assert_allclose(graph, eager, atol=1e-5, rtol=0)


@pytest.mark.slow  # compiles generation's prefill and decode graphs (~5 s)
def test_one_prompt_generates_through_the_adapters_as_the_full_forward():
    """At batch 1 every projection of a decoding step is kernels/layers.cc's one-row product (Linear's
    RowLinearKernel); a LoRA cell runs that base product and adds its branch. Cached logits equal the adapted
    model's full forward at every step."""
    built_kernel("layers")  # the one-row op (models/llama/kernels.py KernelLinear) is what this test goes through
    model = llama(seed=3)
    assert "layers" in libraries_in(model)
    apply_lora(model, OmegaConf.structured(LoraConfig), seed=0)
    randomize_b(model)
    prompt = [5, 9, 300, 41, 7, 12, 90]
    out = model.generate([prompt], 6, return_logits=True)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        seq = prompt + out.samples[0].tokens[:5]
        full = model(Tensor(np.array([seq], np.int32))).asnumpy()[0, len(prompt) - 1:]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    np.testing.assert_allclose(out.logits[:, 0], full, atol=2e-5)


def test_the_dry_run_counts_the_adapters_that_apply_lora_adds(pynative):
    """The memory plan gives gradients and AdamW states to LoRA's adapters only: its count of them (from the family's
    linear shapes and target_modules) is what apply_lora adds to the model, for the default targets and a regex."""
    from models.llama import LORA_TARGETS, linear_shapes

    for targets in (list(LORA_TARGETS), ["re:model\\.layers\\.0\\..*", "lm_head"]):
        cfg = OmegaConf.merge(load_preset("model", "tiny"), {"tie_embeddings": False})
        model = build_model(cfg, 16, "fp32", "CPU", seed=0)
        peft = OmegaConf.structured(LoraConfig(r=4, target_modules=targets))
        before = sum(p.size for p in model.get_parameters())
        apply_lora(model, peft, 0)
        assert LoraConfig.adapter_parameters(linear_shapes(cfg), peft) == sum(p.size for p in model.get_parameters()) - before
