"""The mixture-of-experts family against transformers 4.57.1 on the same weights: MixtralForCausalLM (top-2,
renormalised) and Qwen2MoeForCausalLM (fine-grained top-4 not renormalised, a sigmoid-gated shared expert): logits,
every layer's router logits, the load-balancing loss, greedy tokens with the KV cache; the HF round trip; the
capacity factor's dropped tokens against a hand count; the config's refusals."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from mindspore import Tensor

from base.errors import ConfigError
from models import family

SHAPE = dict(name="moe_test", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=64, init_std=0.2)
MIXTRAL = dict(SHAPE, num_experts=4, top_k=2, expert_intermediate_size=24, aux_loss_coef=0.02)
QWEN = dict(SHAPE, num_experts=6, top_k=4, expert_intermediate_size=16, norm_topk_prob=False,
            shared_expert_intermediate_size=40, shared_expert_gate=True, aux_loss_coef=0.001)


def config(**keys):
    return OmegaConf.merge(OmegaConf.structured(family("moe").Config), keys)


def built(keys, seed=0):
    cfg = config(**keys)
    return cfg, family("moe").build(cfg, 16, "fp32", False, seed)


def weights_of(model) -> dict:
    return {p.name: p.asnumpy() for p in model.get_parameters()}


def hf_model(cfg, weights):
    import torch
    import transformers

    fam = family("moe")
    hf_cfg = fam.hf.hf_config(cfg)
    cls = getattr(transformers, hf_cfg["architectures"][0])
    config_cls = cls.config_class
    model = cls(config_cls(**{k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")},
                           attn_implementation="eager")).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in fam.hf.to_hf(weights).items()}, strict=True)
    return model


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def pair(request):
    keys = MIXTRAL if request.param == "mixtral" else QWEN
    cfg, model = built(keys)
    return request.param, cfg, model, hf_model(cfg, weights_of(model))


def test_logits_router_logits_and_balance_loss_equal_transformers(pair, pynative):
    """The logits of the compiled graph; the router logits and the auxiliary loss eagerly (in graph mode each
    sub-cell those methods call from Python would compile a graph of its own)."""
    import mindspore as ms
    import torch

    name, cfg, model, hf = pair
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    with torch.no_grad():
        out = hf(torch.from_numpy(tokens.astype(np.int64)), output_router_logits=True)
    ms.set_context(mode=ms.GRAPH_MODE)
    np.testing.assert_allclose(model(Tensor(tokens)).asnumpy(), out.logits.numpy(), atol=2e-5, rtol=1e-4)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # (the fixture's teardown sets graph mode again)
    routers = model.router_logits(Tensor(tokens)).asnumpy()
    np.testing.assert_allclose(routers, np.stack([r.numpy() for r in out.router_logits]), atol=2e-5, rtol=1e-4)
    # the auxiliary loss: transformers' load_balancing_loss_func over all layers, times router_aux_loss_coef
    hidden, aux = model.model.with_aux(Tensor(tokens))
    want = cfg.aux_loss_coef * float(out.aux_loss)
    assert float(aux.asnumpy()) == pytest.approx(want, rel=1e-4)
    stats = family("moe").step_metrics(model)
    assert stats["router_balance"] == pytest.approx(float(out.aux_loss), rel=1e-4)
    assert stats["dropped_share"] == 0.0 and stats["expert_load_max"] >= 1.0


def test_validation_loss_is_transformers_cross_entropy_without_the_router_loss(pair, pynative):
    """What validation reports (trainer/module.py evaluate; `python -m evaluation` and bits per byte by the same
    code) is the LM cross-entropy alone: transformers' loss with labels and no router logits. The training loss
    cell's adds aux_loss_coef x transformers' load-balancing loss of the same input tokens."""
    import torch

    from helpers import optim_cfg
    from objectives.clm import Config, Objective
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer

    name, cfg, model, hf = pair
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    optimizer = build_optimizer(model.trainable_params(), optim_cfg(), 10)
    module = LocalModule(model, Objective(Config(name="clm")), optimizer, clip_grad_norm=0.0)
    validation, _ = module.evaluate([(ids, ids)])
    with torch.no_grad():
        tokens = torch.from_numpy(ids.astype(np.int64))
        cross_entropy = float(hf(tokens, labels=tokens, output_router_logits=False).loss)
        balance = float(hf(tokens[:, :-1], output_router_logits=True).aux_loss)
    assert validation["loss"] == pytest.approx(cross_entropy, rel=1e-5)
    trained = float(module.loss_net(Tensor(ids), Tensor(ids))[0].asnumpy())
    assert trained == pytest.approx(cross_entropy + cfg.aux_loss_coef * balance, rel=1e-5)
    assert trained - validation["loss"] > 1e-4  # the router loss is there to leave out


@pytest.mark.slow
def test_greedy_tokens_with_the_kv_cache_equal_transformers(pair):
    import torch

    name, cfg, model, hf = pair
    prompts = [[5, 17, 33, 2, 9], [40, 41, 7]]
    ours = family("moe").generator(model).generate(prompts, 10, eos_id=None)
    width = max(map(len, prompts))
    ids, mask = torch.zeros((2, width), dtype=torch.long), torch.zeros((2, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0,
                             eos_token_id=None)
    for i in range(2):
        assert ours.samples[i].tokens == theirs[i, width:].tolist()


def test_hf_export_import_round_trip(pair):
    name, cfg, model, _ = pair
    fam = family("moe")
    weights = {k: v for k, v in weights_of(model).items() if k != "model.router_stats"}
    hf_cfg = fam.hf.hf_config(cfg)
    back = fam.hf.from_hf(fam.hf.to_hf(weights), hf_cfg)
    assert sorted(back) == sorted(weights)
    for k in weights:
        np.testing.assert_array_equal(back[k], weights[k])
    again = config(name="back", **fam.hf.config_from_hf(hf_cfg, "config.json"))
    for key in ("num_experts", "top_k", "expert_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
                "shared_expert_gate", "num_kv_heads"):
        assert again[key] == cfg[key], key


def test_capacity_factor_drops_what_a_hand_count_says(pynative):
    """capacity 1.0 at 24 tokens, top 2 of 4: each expert holds ceil(24 x 2 / 4) = 12 assignments, first choices
    queued before second ones; what exceeds is dropped (counted by hand from the router's choices). The router
    logits and the two-layer statistics are computed eagerly (in graph mode each sub-cell called from Python would
    compile a graph of its own); the counted forward pass is the compiled graph, as training runs it."""
    import mindspore as ms

    from objectives.clm import CausalLMLoss

    keys = dict(MIXTRAL, capacity_factor=1.0)
    cfg, model = built(keys, seed=3)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    model.model.with_aux(Tensor(tokens))
    stats = family("moe").step_metrics(model)
    # dropless routing gives the same choices per layer for layer 0 only (layer 1's input depends on layer 0's
    # drops): check layer 0 with a one-layer model
    one = dict(keys, num_layers=1)
    cfg1, model1 = built(one, seed=3)
    routers = model1.router_logits(Tensor(tokens)).asnumpy()[0]
    chosen = np.argsort(-routers, axis=-1, kind="stable")[:, :2]  # [T, 2]
    queue = np.zeros(4, int)
    dropped = 0
    for rank in range(2):
        for t in range(chosen.shape[0]):
            e = chosen[t, rank]
            dropped += queue[e] >= 12
            queue[e] += 1
    ms.set_context(mode=ms.GRAPH_MODE)  # (the pynative fixture's teardown sets it too)
    ids = np.concatenate([tokens, tokens[:, :1]], 1)  # rows of 13: the loss cell reads the first 12
    CausalLMLoss(model1)(Tensor(ids), Tensor(ids))  # the training forward, as the compiled graph
    got = family("moe").step_metrics(model1)
    assert got["dropped_share"] == pytest.approx(dropped / (24 * 2))
    assert got["expert_load_max"] == pytest.approx(queue.max() / queue.mean())
    assert 0 <= stats["dropped_share"] < 1


@pytest.mark.parametrize("keys, key", [
    (dict(top_k=5), "model.top_k"),
    (dict(capacity_factor=0.0), "model.capacity_factor"),
    (dict(shared_expert_gate=True), "model.shared_expert_gate"),
])
def test_bad_moe_configs_are_refused_naming_the_key(keys, key):
    cfg = OmegaConf.create({"model": config(**dict(MIXTRAL, **keys)), "parallel": {"tp": 1, "pp": 1, "name": "single"},
                            "dry_run": False})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        family("moe").check(cfg)


def test_active_parameters_of_the_presets():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active (Jiang et al. 2024); Qwen1.5-MoE-A2.7B 14.3B and 2.7B (its
    model card, with q/k/v biases this family has not: 0.6M)."""
    from conftest import load_preset

    fam = family("moe")
    mixtral = fam.parameter_count(load_preset("model", "mixtral_8x7b"))
    assert mixtral["total"] == 46_702_792_704 and round(mixtral["active"] / 1e9, 1) == 12.9
    qwen = fam.parameter_count(load_preset("model", "qwen_moe_a2.7b"))
    assert round(qwen["total"] / 1e9, 1) == 14.3 and round(qwen["active"] / 1e9, 1) == 2.7
    assert fam.parameter_count(load_preset("model", "mixtral_8x22b"))["total"] > 100e9


def test_a_dense_checkpoint_given_to_a_moe_model_is_one_line_naming_the_file(tmp_path):
    """A Llama checkpoint as stage.init_from of model=moe_tiny: base/checkpoint.py's refusal, naming the file, a
    dense weight the MoE has not and the fix."""
    import mindspore as ms

    from base import checkpoint
    from base.errors import CheckpointError
    from conftest import load_preset

    dense = family("llama").build(load_preset("model", "tiny"), 16, "fp32", False, 0)
    ms.save_checkpoint(dense, str(tmp_path / "model.safetensors"), format="safetensors")
    _, moe = built(dict(MIXTRAL, vocab_size=4096, hidden_size=128, num_heads=4, num_kv_heads=2))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: holds \d+ weights this model does not have "
                                              r"\(e\.g\. model\.layers\.0\.feed_forward\.w1\.weight\).*set model="):
        checkpoint.load_weights(str(tmp_path / "model.safetensors"), moe)


@pytest.fixture
def moe_and_ids(pynative):
    """model=moe_tiny's shape, small, and rows of 13 tokens, in PyNative (a loss cell run twice)."""
    _, model = built(dict(MIXTRAL, z_loss_coef=0.01), seed=5)
    ids = np.random.default_rng(4).integers(4, MIXTRAL["vocab_size"], (4, 13)).astype(np.int32)
    return model, ids


def _with_and_without_aux(cell, *inputs):
    """(the loss cell's loss, which training optimises: the objective adds the auxiliary loss where HAS_AUX; the
    loss validation reports, the same cell without it: evaluation/validation.py lm_loss_only)."""
    from evaluation.validation import lm_loss_only

    with_aux = float(cell(*map(Tensor, inputs))[0].asnumpy())
    without = float(lm_loss_only(cell)(*map(Tensor, inputs))[0].asnumpy())
    return with_aux, without


def aux_of(model, ids) -> float:
    return float(model.model.with_aux(Tensor(ids))[1].asnumpy())


def test_clm_and_sft_losses_add_the_routers_auxiliary_loss(moe_and_ids):
    from objectives.clm import CausalLMLoss
    from objectives.sft import ResponseLoss

    model, ids = moe_and_ids
    loss, plain = _with_and_without_aux(CausalLMLoss(model), ids, ids)
    assert loss - plain == pytest.approx(aux_of(model, ids[:, :-1]), rel=1e-4) and aux_of(model, ids) > 0
    labels = ids.copy()
    labels[:, :6] = -100  # the prompt
    positions = np.tile(np.arange(13, dtype=np.int32), (4, 1))
    loss, plain = _with_and_without_aux(ResponseLoss(model), ids, labels, positions, np.zeros_like(ids))
    expected = float(model.model.with_aux(Tensor(ids[:, :-1]), Tensor(positions[:, :-1]),
                                          Tensor(np.zeros_like(ids)[:, :-1]))[1].asnumpy())
    assert loss - plain == pytest.approx(expected, rel=1e-4)


def test_dpo_rm_and_ppo_losses_add_the_routers_auxiliary_loss(moe_and_ids):
    from objectives.dpo import Config as DpoConfig, PrecomputedPreferenceLoss
    from objectives.ppo import Config as PpoConfig, PPOLoss, PolicyWithValue
    from objectives.rm import PairwiseLoss, RewardModel

    model, ids = moe_and_ids
    chosen, rejected = ids[:2], ids[2:]
    dpo = PrecomputedPreferenceLoss(model, DpoConfig(name="dpo"))
    loss, plain = _with_and_without_aux(dpo, chosen, chosen, rejected, rejected, np.zeros(2, np.float32),
                                        np.zeros(2, np.float32))
    assert loss - plain == pytest.approx(aux_of(model, ids[:, :-1]), rel=1e-4)
    ends = np.array([12, 12], np.int32)
    rm = PairwiseLoss(RewardModel(model, seed=0), 0.0)
    loss, plain = _with_and_without_aux(rm, chosen, ends, rejected, ends, np.zeros(2, np.float32))
    assert loss - plain == pytest.approx(aux_of(model, ids), rel=1e-4)
    ppo = PPOLoss(PolicyWithValue(model), PpoConfig(name="ppo"))
    zeros = np.zeros((4, 12), np.float32)
    loss, plain = _with_and_without_aux(ppo, ids, zeros + 1, zeros, zeros, zeros, zeros)
    assert loss - plain == pytest.approx(aux_of(model, ids[:, :-1]), rel=1e-4)


def test_lora_adapts_the_attention_projections_of_a_moe_model_by_default(pynative):
    """peft=lora's default target_modules on the moe family: the attention projections (the routed experts are
    stacked Parameters, the router and shared expert are not named); everything else frozen. Eagerly: B's zeros
    leave the output as it was whether or not a graph is recompiled (test_moe_cli.py trains LoRA's graph)."""
    from adapters.lora import LoraConfig, apply_lora

    _, model = built(QWEN)
    before = model(Tensor(np.array([[3, 4, 5]], np.int32))).asnumpy()
    apply_lora(model, LoraConfig(), seed=0)
    trained = sorted(p.name for p in model.trainable_params())
    assert trained == sorted(f"model.layers.{i}.attention.{w}.lora_{ab}.weight" for i in range(2)
                             for w in ("wq", "wk", "wv", "wo") for ab in "AB")
    np.testing.assert_allclose(model(Tensor(np.array([[3, 4, 5]], np.int32))).asnumpy(), before, atol=1e-6)


# --- expert parallelism: validation, layout, memory, time, the advisor ------------------------------------------

def _validated(overrides):
    from base.validate import validate
    from conftest import compose_cfg

    validate(compose_cfg(*overrides))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.ep=3", "parallel.dp=6"], "ep=3 does not divide the 8 experts (model.num_experts); choose ep among 1, 2"),
    (["parallel.ep=4", "parallel.dp=2"], "ep=4 does not divide dp=2"),
    (["model=mixtral_8x7b", "parallel.ep=0"], "must be >= 1"),
])
def test_expert_parallel_is_validated_as_mindformers_expert_parallel(overrides, message):
    base = ["model=mixtral_8x7b", "device=ascend910b", "parallel=single", "dry_run=true"]
    with pytest.raises(ConfigError, match="parallel.ep: " + message.replace("(", r"\(").replace(")", r"\)")):
        _validated(base + overrides)
    with pytest.raises(ConfigError, match=r"parallel.ep: model.family=llama has no experts to split"):
        _validated(["model=7b", "device=ascend910b", "parallel=single", "parallel.dp=2", "parallel.ep=2",
                    "dry_run=true"])


def test_expert_groups_are_ep_consecutive_dp_ranks():
    from planner.layout import Layout

    layout = Layout(dp=4, tp=2, pp=1, num_layers=2, ep=2)
    assert layout.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # rank = dp_rank * tp + tp_rank
    assert "ep groups (4 x 2 ranks): [0 2] [1 3] [4 6] [5 7]" in layout.describe(max_groups=8)


def layout_blocks(layout) -> list:
    """Each rank's block along every tensor dimension under a MindSpore Layout: ranks row-major over its device
    matrix, a dimension split over the axes its tensor_map names (counted from the right), the first outermost."""
    d = layout.to_dict()
    dev = d["device_matrix"]
    out = []
    for rank in range(int(np.prod(dev))):
        coords = np.unravel_index(rank, dev)
        blocks = []
        for axes in d["tensor_map"]:
            index = 0
            for axis in (axes if isinstance(axes, tuple) else (axes,)):
                if axis >= 0:
                    index = index * dev[len(dev) - 1 - axis] + int(coords[len(dev) - 1 - axis])
            blocks.append(index)
        out.append(tuple(blocks))
    return out


@pytest.mark.parametrize("dp, tp, cp", [(4, 2, 1), (4, 1, 2), (8, 2, 1)])
def test_the_plans_expert_groups_are_the_layouts_ep_groups(dp, tp, cp):
    """The ranks that exchange tokens under the plan (the experts' input [E, C, h]: the same block of rows and
    width, different experts) are planner/layout.py's ep_groups, which the time model charges; and dp rank d holds
    the (d mod ep)-th slice of the experts, as distributed.reshard --ep writes it (ep 2)."""
    from models.moe import plan as moe_plan
    from planner.layout import Layout

    _, model = built(MIXTRAL)
    x, w = moe_plan.expert_strategies(model, dp, tp, cp, ep=2)["model.layers.0.feed_forward.experts.up"]
    groups = {}
    for rank, (expert, rows, _) in enumerate(layout_blocks(x)):
        groups.setdefault((rows, rank % tp), []).append(rank)
    layout = Layout(dp=dp, tp=tp, pp=1, num_layers=2, cp=cp, ep=2)
    assert sorted(groups.values()) == sorted(layout.ep_groups())
    for rank, (expert, width, _) in enumerate(layout_blocks(w)):
        assert (expert, width) == (layout.coords(rank).dp % 2, layout.coords(rank).tp), rank


def test_memory_counts_the_experts_of_a_device_and_time_adds_the_all_to_alls():
    """Mixtral 8x7B at pp 4: a stage's 8 layers hold 8 x 8 experts of 3 x 4096 x 14336 weights; ep 2 halves them
    (by hand); the all-to-all: 2 passes x (dispatch + combine) x 8 layers x micro-batches, each moving top_k = 2
    copies of the micro-batch's [b, s, h] bf16 activations, half of them to the other rank of the group."""
    from types import SimpleNamespace

    from conftest import load_preset
    from planner.timing import step_time

    m, fam = load_preset("model", "mixtral_8x7b"), family("moe")
    layout = dict(dp=8, tp=1, pp=4, sequence_parallel=False, optimizer_shard=True, micro_batches=16, cp=1,
                  cp_algo="ring", vp=1, zero3=False, tp_overlap=False)
    one, two = (fam.stage_parameters(m, SimpleNamespace(ep=ep, **layout)) for ep in (1, 2))
    assert one[1] - two[1] == 8 * 8 * 3 * 4096 * 14336 // 2
    from conftest import compose_cfg

    device = compose_cfg("device=ascend910b").device
    times = {ep: step_time(m, SimpleNamespace(ep=ep, **layout), device, 4096, 1, 16, "bf16", "none")
             for ep in (1, 2)}
    assert not [c for c in times[1].comms if c.kind == "ep"]
    (a2a,) = [c for c in times[2].comms if c.kind == "ep"]
    assert a2a.collective == "all-to-all x 512" and a2a.link == "intra-node"
    assert a2a.bytes == 512 * 2 * 0.5 * 4096 * 4096 * 2
    # on the critical path: each micro-batch's share lengthens the pipeline's slot (the bubble: pp - 1 slots)
    assert times[2].bubble - times[1].bubble == pytest.approx(3 * a2a.seconds / 16, rel=1e-9)


def test_the_advisor_searches_expert_parallelism():
    from conftest import compose_cfg
    from planner.advisor import Search

    search = Search(compose_cfg("model=mixtral_8x7b", "device=ascend910b", "nodes=4", "dry_run=true"))
    assert search.expert_splits(8) == [1, 2, 4, 8] and search.expert_splits(6) == [1, 2]
    eps = {c.ep for c in search.candidates(32, 1024)}
    assert eps == {1, 2, 4, 8}
    dense = Search(compose_cfg("model=7b", "device=ascend910b", "dry_run=true"))
    assert dense.expert_splits(8) == [1]


def test_the_ranked_tables_communication_column_shows_the_all_to_alls_of_ep():
    from conftest import compose_cfg
    from planner.advisor import Search, summary_row

    search = Search(compose_cfg("model=mixtral_8x7b", "device=ascend910b", "nodes=4", "dry_run=true"))
    candidates = [c for c in search.candidates(32, 1024) if c.recompute == "none" and c.micro_batch_size == 1]
    assert {c.ep for c in candidates} == {1, 2, 4, 8}
    for c in candidates:
        o = search.option(c)
        ep = sum(x.exposed for x in o.time.comms if x.kind == "ep")
        row = summary_row(1, o, 1.0)
        assert float(row["comm s tp/cp/dp/pp/ep"].split("/")[-1]) == pytest.approx(ep, abs=0.005)
        assert (ep > 0) == (c.ep > 1)


def test_experts_split_over_tp_expose_their_routed_rows_and_the_ranking_prefers_ep():
    """Mixtral 8x7B on 32 Atlas 800T A2, 4M tokens a step, by hand: under tp 8 with sequence parallelism and
    tp_overlap the attention's all-gather + reduce-scatter ([s, h] bf16, 2 x 7/8 of it a ring) hide under the
    matmuls, while the experts' (top_k = 2 rows per token, 2 passes x 8 layers x 1,024 micro-batches) stay on the
    critical path; ep 8 sends the same 2 rows per token over its all-to-alls, but a replica's 128 micro-batches
    of dp 8 carry an eighth of tp 8's 1,024, so the ranked table's comm column reads 8 times less exposed ep than
    tp, and the advisor's fastest layouts split no expert's width (MindFormers' and Megatron-Core's Mixtral: TP 1,
    EP 8)."""
    from types import SimpleNamespace

    from conftest import compose_cfg, load_preset
    from planner.advisor import Search, summary_row
    from planner.timing import step_time

    m, device = load_preset("model", "mixtral_8x7b"), compose_cfg("device=ascend910b").device
    base = dict(pp=4, cp=1, cp_algo="ring", vp=1, zero3=False)
    by_tp = SimpleNamespace(dp=1, tp=8, ep=1, sequence_parallel=True, tp_overlap=True, optimizer_shard=False,
                            micro_batches=1024, **base)
    by_ep = SimpleNamespace(dp=8, tp=1, ep=8, sequence_parallel=False, tp_overlap=False, optimizer_shard=True,
                            micro_batches=128, **base)
    tp_time, ep_time = (step_time(m, p, device, 4096, 1, p.micro_batches, "bf16", "none") for p in (by_tp, by_ep))
    rows = 4096 * 4096 * 2  # one micro-batch's [s, h] in bf16
    attention, experts = [c for c in tp_time.comms if c.kind == "tp"]
    assert attention.bytes == 2 * 8 * 1024 * 2 * 7 / 8 * rows and attention.exposed == 0
    assert experts.collective == "all-gather + reduce-scatter x 16384 (the experts' rows, x 2)"
    assert experts.bytes == 2 * 8 * 1024 * 2 * 2 * 7 / 8 * rows
    assert experts.exposed == experts.seconds == pytest.approx(experts.bytes / 196e9)
    (a2a,) = [c for c in ep_time.comms if c.kind == "ep"]
    assert a2a.bytes == 2 * 2 * 8 * 128 * 2 * 7 / 8 * rows and a2a.exposed == pytest.approx(experts.exposed / 8)

    search = Search(compose_cfg("model=mixtral_8x7b", "device=ascend910b", "nodes=4", "data.seq_len=4096",
                                "dry_run=true"))
    table = {o.candidate.describe(): summary_row(1, o, 1.0)["comm s tp/cp/dp/pp/ep"]
             for o in (search.option(c) for c in search.candidates(32, 1024)
                       if c.recompute == "none" and c.micro_batch_size == 1 and c.cp == 1 and c.vp == 1
                       and ((c.tp, c.pp, c.ep, c.tp_overlap) == (8, 4, 1, True) or
                            (c.tp, c.pp, c.ep, c.optimizer_shard, c.zero3) == (1, 4, 8, True, False)))}
    assert {label: [float(x) for x in comm.split("/")] for label, comm in table.items()} == {
        "dp1 tp8 pp4 sp tp-overlap": pytest.approx([experts.exposed, 0, 0, 0.34, 0], abs=0.01),
        "dp8 tp1 pp4 ep8 zero1": pytest.approx([0, 0, 0, 0.34, a2a.exposed], abs=0.01)}
    assert all(o.candidate.tp == 1 for o in search.ranked(32, 1024)[:5])


def test_the_mindformers_config_of_a_moe_layout_leaves_fine_grain_interleave_off():
    """MindFormers 1.9's interleaved decoder layer (fine_grain_interleave) takes no moe_config, where its plain one
    does: the exported config of a tp-overlapped MoE layout says so instead of setting the key; a dense one sets it."""
    import inspect

    from mindformers.models.llama.llama_interleave import LLamaDecodeLayerInterleave
    from mindformers.models.llama.llama_transformer import LLamaDecodeLayer
    from planner.advisor import Candidate
    from planner.launch import mindformers_parallel_config

    assert "moe_config" in inspect.getsource(LLamaDecodeLayer)
    assert "moe_config" not in inspect.getsource(LLamaDecodeLayerInterleave)
    c = Candidate(dp=8, tp=4, pp=1, optimizer_shard=True, sequence_parallel=True, recompute="none",
                  micro_batch_size=1, micro_batches=1, tp_overlap=True, ep=8)
    dense, moe = (mindformers_parallel_config(c, "bf16", 8, experts) for experts in (False, True))
    assert "    fine_grain_interleave: 2" in dense.splitlines()
    assert "fine_grain_interleave: 2" not in moe and "expert_parallel: 8" in moe
    assert "    # fine_grain_interleave: not set, its decoder layer has no MoE feed-forward" in moe.splitlines()


# --- the expert-parallel plan (models/moe/plan.py), as data: built under SEMI_AUTO_PARALLEL, never run on CPU -------

@pytest.fixture
def semi_auto_parallel():
    import mindspore as ms

    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=16, pipeline_stages=2)
    yield
    ms.reset_auto_parallel_context()


def mindformers_expert_strategies(dp, tp, ep, experts, hidden, width):
    """MindFormers 1.9's own MoE feed-forward (LlamaFeedForward with expert_num > 1) sharded for this layout: its
    w1, w2, w3 BatchMatMul strategies, on x [dp x cp / ep, E, C, in] and weights [E, out, in] (ours' shapes)."""
    import mindspore as ms
    from mindformers.models.llama.llama_layer import LlamaFeedForward
    from mindformers.modules.transformer.moe import MoEConfig
    from mindformers.modules.transformer.op_parallel_config import MoEParallelConfig

    config = MoEParallelConfig(data_parallel=dp, model_parallel=tp, expert_parallel=ep)
    ffn = LlamaFeedForward(dim=hidden, intermediate_size=width, expert_num=experts, parallel_config=config,
                           moe_config=MoEConfig(expert_num=experts), compute_dtype=ms.float32)
    ffn.shard(config)
    return {name: getattr(ffn, name).matmul.attrs["in_strategy"] for name in ("w1", "w2", "w3")}


def test_the_expert_parallel_plan_splits_experts_over_ep_and_their_width_over_tp_as_mindformers(semi_auto_parallel):
    """dp 8 x tp 2, ep 2 over a Qwen2-MoE shape (shared gated expert): per layer, attention and the shared expert
    as Llama's tensor-parallel plan (column / row), the router and the gate replicated, the experts [E, C, h] on the
    device matrix (dp / ep, ep, cp, tp) = (4, 2, 1, 2): over ep = 2 with their rows over dp / ep = 4 and their width
    over tp. Every rank holds the block of experts, rows and width that MindFormers' own MoE feed-forward gives it
    (its tuple strategies on [dp / ep, E, C, h], whose device matrix is x's strategy then the weight's width split)."""
    from distributed.semi_auto import apply_tensor_parallel, assign_stages
    from models import build_model
    from models.moe import plan as moe_plan

    cfg = config(**QWEN)
    model = build_model(cfg, 16, "fp32", "CPU", seed=0, sharded=True)
    plan = apply_tensor_parallel(model, moe_plan, dp=8, tp=2, ep=2)
    col, row, heads, replicated = ((8, 1), (2, 1)), ((8, 2), (1, 2)), ((8, 2, 1, 1),) * 2, ((8, 1), (1, 1))
    layer = {"attention.wq.matmul": col, "attention.wk.matmul": col, "attention.wv.matmul": col,
             "attention.wo.matmul": row, "attention.core.block.qk": heads, "attention.core.block.pv": heads,
             "attention_residual": ((8, 1, 1),) * 2, "ffn_residual": ((8, 1, 1),) * 2,
             "feed_forward.router.matmul": replicated, "feed_forward.shared_expert_gate.matmul": replicated,
             "feed_forward.shared_expert.w1.matmul": col, "feed_forward.shared_expert.w3.matmul": col,
             "feed_forward.shared_expert.w2.matmul": row}
    expected = {f"model.layers.{i}.{op}": s for i in range(2) for op, s in layer.items()}
    expected.update({"model.tok_embeddings.gather": ((2, 1), (8, 1)), "lm_head.matmul": col})
    assert {path: s for path, s in plan.items() if not path.endswith(("experts.up", "experts.down"))} == expected
    grid = dict(device_matrix=(4, 2, 1, 2), alias_name=("dp", "ep", "cp", "tp"), interleaved_parallel=False)
    maps = {"up": ((2, (3, 1), -1), (2, 0, -1)), "down": ((2, (3, 1), 0), (2, -1, 0))}  # axes from the right: tp 0
    for i in range(2):
        for primitive, tensor_maps in maps.items():
            layouts = plan[f"model.layers.{i}.feed_forward.experts.{primitive}"]
            assert [{k: v for k, v in layout.to_dict().items() if k != "rank_list"} for layout in layouts] == \
                [dict(grid, tensor_map=tensor_map) for tensor_map in tensor_maps]
    experts = dict(model.cells_and_names())["model.layers.1.feed_forward.experts"]
    assert experts.down.in_layout[1]["tensor_map"] == (2, -1, 0)  # set on the primitive itself

    theirs = mindformers_expert_strategies(8, 2, 2, cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
    for name, primitive in (("w1", "up"), ("w3", "up"), ("w2", "down")):
        (x, w), (ours_x, ours_w) = theirs[name], plan[f"model.layers.0.feed_forward.experts.{primitive}"]
        width = 1 if primitive == "up" else 2  # the dimension tp splits: f of w1 / w3 [E, f, h], of w2 [E, h, f]
        assert (x[0], x[1], w[width]) == (4, 2, 2)  # MindFormers' device matrix (dp', ep, tp)
        for rank, (x_blocks, w_blocks) in enumerate(zip(layout_blocks(ours_x), layout_blocks(ours_w))):
            group, expert, slice_ = rank // (x[1] * w[width]), rank // w[width] % x[1], rank % w[width]
            assert (x_blocks[0], x_blocks[1], w_blocks[0], w_blocks[width]) == (expert, group, expert, slice_), rank

    for path, strategy in plan.items():  # the checkpoint splits (distributed.reshard): the weights' strategies
        owner, _, primitive = path.rpartition(".")
        if primitive == "matmul":
            assert moe_plan.weight_split(f"{owner}.weight", 2, 2) == strategy[1], path
        elif primitive in ("up", "down"):
            ways = tuple(max(b) + 1 for b in zip(*layout_blocks(strategy[1])))
            for weight in (("w1", "w3") if primitive == "up" else ("w2",)):
                assert moe_plan.weight_split(f"{owner}.{weight}", 3, 2, ep=2) == ways, path
    assert assign_stages(model, moe_plan, pp=2) == {"model.tok_embeddings": 0, "model.layers.0": 0,
                                                     "model.layers.1": 1, "model.norm_out": 1, "lm_head": 1}


def test_sequence_parallel_splits_the_moe_layers_norms_and_residuals_along_the_sequence(semi_auto_parallel):
    from models import build_model
    from models.moe import plan as moe_plan

    model = build_model(config(**MIXTRAL), 16, "fp32", "CPU", seed=0, sharded=True)
    plan = moe_plan.tensor_parallel_strategies(model, dp=2, tp=4, sequence_parallel=True, ep=2)
    act = (2, 4, 1)
    assert plan["model.layers.0.ffn_norm.normalize"] == (act, act) and plan["model.layers.1.ffn_residual"] == (act, act)
    x, w = plan["model.layers.0.feed_forward.experts.up"]
    assert (x.to_dict()["device_matrix"], x.to_dict()["tensor_map"], w.to_dict()["tensor_map"]) == \
        ((1, 2, 1, 4), (2, (3, 1), -1), (2, 0, -1))
    assert moe_plan.output_strategies(model, 2, 4, True) == {f"model.layers.{i}.attention.wo.matmul": ((8, 1),)
                                                             for i in range(2)}


def test_the_moe_family_takes_tensor_pipeline_and_expert_parallel_layouts_outside_the_dry_run():
    """What the plan covers passes the layout rules a run meets (base/validate.py validate_layout: the machine's own
    devices aside); an expert width tp does not divide is refused with its key."""
    from base.validate import validate_layout
    from conftest import compose_cfg

    validate_layout(compose_cfg("model=mixtral_8x7b", "device=ascend910b", "parallel=tp8pp4", "parallel.dp=2",
                                "parallel.ep=2", "parallel.micro_batches=8", "nodes=8"))
    with pytest.raises(ConfigError, match=r"model.expert_intermediate_size: 14338 is not divisible by "
                                          r"parallel.tp=4"):
        validate_layout(compose_cfg("model=mixtral_8x7b", "device=ascend910b", "parallel=single", "parallel.tp=4",
                                    "model.expert_intermediate_size=14338"))


# --- MindFormers' export: its own config classes and model take the files ------------------------------------------

@pytest.mark.parametrize("keys", [dict(MIXTRAL, capacity_factor=1.25),
                                  dict(QWEN, shared_expert_intermediate_size=32, z_loss_coef=0.002,
                                       bias_update_rate=0.001)],
                         ids=["mixtral-capacity", "qwen-shared-gated-biased"])
def test_mindformers_export_is_taken_by_mindformers_moe_config_and_llama(tmp_path, tokenizer_file, keys):
    """The exported YAML's moe_config builds MindFormers 1.9's MoEConfig (its own validation) with our routing, and
    its model_config + moe_config build its LlamaForCausalLM, into which the .ckpt loads strictly: every parameter,
    the same values (shapes and names are MindFormers' own)."""
    import mindspore as ms
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.moe import MoEConfig

    from base import checkpoint
    from models.convert import main as convert_main
    from models.moe.mindformers import mindformers_names

    cfg, model = built(keys)
    run = OmegaConf.create({"model": cfg, "data": {"seq_len": 16}})
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, model, ms.nn.SGD(model.trainable_params()), {}, run,
                           tokenizer_file)
    assert convert_main([path, str(tmp_path / "mf"), "--to", "mindformers"]) == 0
    yaml = OmegaConf.to_container(OmegaConf.load(tmp_path / "mf" / "llama_mindlab.yaml"))
    moe = MoEConfig(**yaml["moe_config"])
    shared = cfg.shared_expert_intermediate_size // cfg.expert_intermediate_size
    assert (moe.expert_num, moe.num_experts_chosen, moe.norm_topk_prob) == (cfg.num_experts, cfg.top_k,
                                                                           cfg.norm_topk_prob)
    dropless = -1.0  # MindFormers' "capacity_factor <= 0 means dropless" (research/mixtral's YAML)
    assert (moe.capacity_factor, moe.aux_loss_factor, moe.z_loss_factor) == (
        cfg.capacity_factor or dropless, cfg.aux_loss_coef, cfg.z_loss_coef)
    assert (moe.shared_expert_num, moe.use_shared_expert_gating) == (shared, cfg.shared_expert_gate)
    assert (moe.balance_via_topk_bias, moe.topk_bias_update_rate) == (cfg.bias_update_rate > 0, cfg.bias_update_rate)
    model_config = {k: v for k, v in yaml["model"]["model_config"].items() if k != "type"}
    assert model_config["intermediate_size"] == cfg.expert_intermediate_size
    mf = LlamaForCausalLM(LlamaConfig(**{**model_config, "compute_dtype": "float32"}, moe_config=moe))
    not_loaded, unused = ms.load_param_into_net(mf, ms.load_checkpoint(yaml["load_checkpoint"]), strict_load=True)
    assert not_loaded == [] and unused == []
    ours = mindformers_names({p.name: p.asnumpy() for p in model.get_parameters()}, shared > 0)
    theirs = {p.name: p.asnumpy() for p in mf.get_parameters()}
    assert any(name.endswith("router.router.topk_bias") for name in theirs) == (cfg.bias_update_rate > 0)
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_mindformers_export_refuses_what_moe_config_cannot_say():
    from models.moe.mindformers import moe_config

    with pytest.raises(ConfigError, match="model.shared_expert_intermediate_size: 40 is not a multiple of "
                                          "model.expert_intermediate_size=16"):
        moe_config(config(**QWEN))
    with pytest.raises(ConfigError, match=r"model.aux_loss_coef: 0.0: MindFormers' MoEConfig takes an "
                                          r"aux_loss_factor in \(0, 1\)"):
        moe_config(config(**dict(MIXTRAL, aux_loss_coef=0.0)))


# --- DeepSeek-V3's auxiliary-loss-free balancing (model.bias_update_rate) ---------------------------------------------

def test_the_routing_bias_chooses_the_experts_and_the_unbiased_probabilities_weigh_them(pynative):
    """A layer's output with a routing bias, by hand: p = softmax(x W_r^T), the top-k of p + b chosen, weighted by
    p at those experts (renormalised, Mixtral)."""
    cfg, model = built(dict(MIXTRAL, bias_update_rate=0.05))
    ffn = model.model.layers[0].feed_forward
    bias = np.array([0.0, 0.3, -0.2, 0.05], np.float32)  # enough to change some choices
    ffn.routing_bias.set_data(Tensor(bias))
    x = np.random.default_rng(1).normal(size=(1, 12, cfg.hidden_size)).astype(np.float32)
    y = ffn(Tensor(x))[0].asnumpy()[0]

    w = {k: getattr(ffn.experts, k).asnumpy() for k in ("w1", "w2", "w3")}
    logits = x[0] @ ffn.router.weight.asnumpy().T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-(p + bias), -1, kind="stable")[:, :cfg.top_k]
    assert (chosen != np.argsort(-p, -1, kind="stable")[:, :cfg.top_k]).any()  # the bias changed some choices
    weight = np.take_along_axis(p, chosen, -1)
    weight /= weight.sum(-1, keepdims=True)
    silu = lambda a: a / (1 + np.exp(-a))
    expert = lambda e, v: w["w2"][e] @ (silu(w["w1"][e] @ v) * (w["w3"][e] @ v))
    expected = np.stack([sum(weight[t, i] * expert(chosen[t, i], x[0, t]) for i in range(cfg.top_k))
                         for t in range(x.shape[1])])
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def hand_counts(model, rows, biases) -> np.ndarray:
    """[L, E]: each layer's assignments per expert over `rows`, chosen by hand from its router logits: the top-k of
    softmax + that layer's bias."""
    logits = model.router_logits(Tensor(rows)).asnumpy()  # [L, T, E]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    k, e = model.model.top_k, model.model.num_experts
    chosen = np.argsort(-(p + np.asarray(biases)[:, None]), -1, kind="stable")[..., :k]
    return np.stack([np.bincount(c.ravel(), minlength=e) for c in chosen]).astype(np.float32)


def test_the_training_forward_counts_the_assignments_and_the_update_moves_each_layers_bias(pynative):
    """The training forward (with_aux) adds each layer's assignments per expert; the plain forward adds none; after
    the step each bias moves by gamma sign(1/E - load), load the expert's share of its layer's assignments
    (DeepSeek-V3 section 2.1.2), and the counts restart from zero; an update with nothing counted moves nothing.
    The counted forward is the compiled graph, as training runs it: its layers share one graph (lazy_inline) yet
    each reads its own bias and adds to its own counts."""
    import mindspore as ms

    from models.moe import after_step
    from objectives.clm import CausalLMLoss

    cfg, model = built(dict(MIXTRAL, bias_update_rate=0.05))
    biases = np.array([[0.0, 0.3, -0.2, 0.05], [0.0, 0.0, 0.0, 0.0]], np.float32)
    for layer, bias in zip(model.model.layers, biases):
        layer.feed_forward.routing_bias.set_data(Tensor(bias))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    model(Tensor(tokens))  # the plain forward: nothing counted
    ms.set_context(mode=ms.GRAPH_MODE)  # (the pynative fixture's teardown sets it too)
    ids = np.concatenate([tokens, tokens[:, :1]], 1)  # rows of 13: the loss cell reads the first 12
    CausalLMLoss(model)(Tensor(ids), Tensor(ids))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    counts = hand_counts(model, tokens, biases)
    for layer, want in zip(model.model.layers, counts):
        np.testing.assert_array_equal(layer.feed_forward.expert_load.asnumpy(), want)
    after_step(model, cfg)
    load = counts / counts.sum(-1, keepdims=True)
    for layer, bias, share in zip(model.model.layers, biases, load):
        np.testing.assert_allclose(layer.feed_forward.routing_bias.asnumpy(),
                                   bias + 0.05 * np.sign(1 / cfg.num_experts - share), atol=1e-7)
        assert not layer.feed_forward.expert_load.asnumpy().any()
    moved = [layer.feed_forward.routing_bias.asnumpy() for layer in model.model.layers]
    after_step(model, cfg)  # nothing routed since (a step without loss tokens): no bias moves, as in MindFormers
    for layer, bias in zip(model.model.layers, moved):
        np.testing.assert_array_equal(layer.feed_forward.routing_bias.asnumpy(), bias)


def test_under_accumulation_the_bias_update_reads_every_micro_batch_of_the_step(pynative):
    """trainer.grad_accum=2 of 2 rows moves the routing bias as one micro-batch of the 4 rows does, as a hand count
    over the 4 rows' routing says (the last micro-batch's alone says otherwise); validation before the step and
    between the step and the update (the loop's step-0 evaluation, a later one) counts nothing."""
    from helpers import optim_cfg
    from models.moe import after_step
    from objectives.clm import Config, Objective
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer

    ids = np.random.default_rng(7).integers(4, MIXTRAL["vocab_size"], (4, 13)).astype(np.int32)
    objective = Objective(Config(name="clm"))

    def bias_after_a_step(micro_batches):
        cfg, model = built(dict(MIXTRAL, bias_update_rate=0.05), seed=2)
        optimizer = build_optimizer(model.trainable_params(), optim_cfg(lr=1e-2, schedule="constant"), 10)
        module = LocalModule(model, objective, optimizer, clip_grad_norm=0.0)
        module.evaluate([(ids, ids)])
        module.step(micro_batches, 1.0)
        module.evaluate([(ids, ids)])
        after_step(model, cfg)
        return np.stack([layer.feed_forward.routing_bias.asnumpy() for layer in model.model.layers])

    accumulated = bias_after_a_step([(ids[:2], ids[:2]), (ids[2:], ids[2:])])
    whole = bias_after_a_step([(ids, ids)])
    np.testing.assert_array_equal(accumulated, whole)
    _, model = built(dict(MIXTRAL, bias_update_rate=0.05), seed=2)  # the weights the step's forward saw

    def by_hand(rows):
        counts = hand_counts(model, rows[:, :-1], np.zeros((2, MIXTRAL["num_experts"]), np.float32))
        return 0.05 * np.sign(1 / MIXTRAL["num_experts"] - counts / counts.sum(-1, keepdims=True))

    np.testing.assert_allclose(whole, by_hand(ids), atol=1e-7)
    assert (by_hand(ids[2:]) != by_hand(ids)).any()  # what reading the last micro-batch only gave


def test_a_skipped_step_still_moves_the_bias_by_its_own_counts_and_leaves_the_weights(pynative):
    """MindFormers' TopkBiasBalanceCallback updates the bias and zeroes expert_load at every step's end, overflow
    steps too; so does the loop's FamilyUpdate: a step the spike guard skips (its limit below the loss) and then one
    whose gradients are not finite (a NaN loss scale, as trainer.inject_nan_steps makes) leave the weights as they
    were, yet each moves every layer's bias by gamma sign(1/E - load), load from a hand count of that step's own
    routing (the second step's by the bias the first one moved), and zeroes the counts."""
    from helpers import optim_cfg
    from objectives.clm import Config, Objective
    from trainer.callbacks import FamilyUpdate
    from trainer.guard import SpikeGuard
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer

    gamma, e = 0.05, MIXTRAL["num_experts"]
    cfg, model = built(dict(MIXTRAL, bias_update_rate=gamma), seed=2)
    optimizer = build_optimizer(model.trainable_params(), optim_cfg(lr=1e-2, schedule="constant"), 10)
    module = LocalModule(model, Objective(Config(name="clm")), optimizer, clip_grad_norm=0.0)
    update = FamilyUpdate(family("moe").after_step, model, cfg)
    spiky = SpikeGuard(factor=2.0, window=1, max_consecutive=5, history=[1e-3])  # any real loss is a spike
    rows = np.random.default_rng(7).integers(4, MIXTRAL["vocab_size"], (2, 4, 13)).astype(np.int32)
    for step, (ids, scale, guard) in enumerate(((rows[0], 1.0, spiky), (rows[1], float("nan"), None)), 1):
        weights = {p.name: p.asnumpy() for p in model.trainable_params()}
        bias = np.stack([layer.feed_forward.routing_bias.asnumpy() for layer in model.model.layers])
        counts = hand_counts(model, ids[:, :-1], bias)
        result = module.step([(ids, ids)], scale, guard)
        if guard:  # the guard's verdict on a finite step
            assert result.finite and result.skip.startswith("loss spike")
        else:
            assert not result.finite and result.skip is None
        for layer, want in zip(model.model.layers, counts):
            np.testing.assert_array_equal(layer.feed_forward.expert_load.asnumpy(), want)
        update.on_step(step, result)
        want = bias + gamma * np.sign(1 / e - counts / counts.sum(-1, keepdims=True))
        assert (want != bias).any()
        for layer, moved in zip(model.model.layers, want):
            np.testing.assert_array_equal(layer.feed_forward.routing_bias.asnumpy(), moved)
            assert not layer.feed_forward.expert_load.asnumpy().any()
        for p in model.trainable_params():
            np.testing.assert_array_equal(p.asnumpy(), weights[p.name], err_msg=p.name)


def test_the_bias_matches_transformers_deepseek_v3_choice_rule():
    """transformers 4.57.1's DeepseekV3TopkRouter chooses by scores + e_score_correction_bias and weighs by the
    scores (n_group = topk_group = 1: no group limit). Its scores are sigmoids of the logits, ours the softmax: the
    rule (models/moe/model.py's biased branch, here in NumPy) is compared on its scores."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, k, h = 6, 2, 8
    router = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k,
                                                   n_group=1, topk_group=1, norm_topk_prob=True,
                                                   routed_scaling_factor=1.0))
    rng = np.random.default_rng(2)
    weight, bias = rng.normal(size=(e, h)).astype(np.float32), rng.normal(scale=0.3, size=e).astype(np.float32)
    x = rng.normal(size=(10, h)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        indices, weights = (t.numpy() for t in router(torch.from_numpy(x)))
    scores = 1 / (1 + np.exp(-(x @ weight.T)))
    chosen = np.argsort(-(scores + bias), -1, kind="stable")[:, :k]
    assert (chosen != np.argsort(-scores, -1, kind="stable")[:, :k]).any()  # the bias changed some choices
    ours = np.take_along_axis(scores, chosen, -1)
    ours /= ours.sum(-1, keepdims=True)
    theirs_order, ours_order = np.argsort(indices, -1), np.argsort(chosen, -1)
    assert (np.take_along_axis(indices, theirs_order, -1) == np.take_along_axis(chosen, ours_order, -1)).all()
    np.testing.assert_allclose(np.take_along_axis(weights, theirs_order, -1),
                               np.take_along_axis(ours, ours_order, -1), rtol=1e-5)


def test_bias_balancing_is_refused_where_it_cannot_run():
    from models.moe.hf import architecture

    with pytest.raises(ConfigError, match="model.bias_update_rate: a routing bias"):
        architecture(config(**dict(MIXTRAL, bias_update_rate=0.001)))
    with pytest.raises(ConfigError, match="model.bias_update_rate: moves the routing bias by one device"):
        _validated(["model=moe_tiny", "model.bias_update_rate=0.001", "parallel=dp2"])
