"""Rank layout (planner/layout.py), memory plan (planner/memory.py) and the dry-run report."""
import os

import pytest
from omegaconf import OmegaConf

from base.schema import DeviceConfig, use_flash_attention
from conftest import ROOT, compose_cfg, load_preset
from planner.dry_run import dry_run_report
from planner.layout import Coords, Layout
from planner.memory import GIB, ObjectiveMemory, fits, format_plan, layer_activation_bytes, memory_plan


def device(name: str, **overrides):
    """A conf/device preset on its schema (base/schema.py DeviceConfig), as Hydra composes it."""
    raw = OmegaConf.load(os.path.join(ROOT, "conf", "device", f"{name}.yaml"))
    raw.pop("defaults")
    return OmegaConf.merge(OmegaConf.structured(DeviceConfig), raw, overrides)


def model(name: str, **overrides):
    return OmegaConf.merge(load_preset("model", name), overrides)


def parallel(name: str, **overrides):
    return OmegaConf.merge(load_preset("parallel", name), overrides)


# --- layout -------------------------------------------------------------------------------------------

# tp4pp2dp2: rank -> (pp, dp, tp), tp fastest, then dp, then pp
TP4PP2DP2 = [
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3),
    (1, 0, 0), (1, 0, 1), (1, 0, 2), (1, 0, 3), (1, 1, 0), (1, 1, 1), (1, 1, 2), (1, 1, 3),
]


@pytest.fixture
def layout():
    return Layout.from_config(parallel("tp4pp2dp2"), num_layers=40)


def test_coords(layout):
    assert layout.world_size == 16
    assert [tuple(layout.coords(r))[:3] for r in range(16)] == TP4PP2DP2
    assert all(layout.rank(*layout.coords(r)) == r for r in range(16))
    assert layout.coords(13) == Coords(pp=1, dp=1, tp=1)


def test_groups(layout):
    assert layout.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.pp_groups() == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


def test_stages(layout):
    assert layout.layers_of_stage(0) == list(range(0, 20))
    assert layout.layers_of_stage(1) == list(range(20, 40))
    assert layout.ranks_of_stage(1) == range(8, 16)


def test_describe(layout):
    text = layout.describe(max_groups=4)
    assert "world 16 = dp 2 x tp 4 x pp 2" in text
    assert "stage 0: ranks 0-7  layers 0-19 (20) + embedding" in text
    assert "stage 1: ranks 8-15  layers 20-39 (20) + final norm + lm head" in text
    assert "tp groups (4 x 4 ranks): [0 1 2 3] [4 5 6 7] [8 9 10 11] [12 13 14 15]" in text
    assert "dp groups (8 x 2 ranks): [0 4] [1 5] [2 6] … [11 15]" in text
    assert "…" not in layout.describe(max_groups=8)


def test_describe_elides_long_groups():
    text = Layout(dp=64, tp=1, pp=1, num_layers=2).describe(max_groups=4)
    assert "dp groups (1 x 64 ranks): [0 1 2 3 4 5 6 … 63]" in text


# --- memory -------------------------------------------------------------------------------------------

def plan_for(model_name: str, parallel_name: str, seq_len: int = 4096, micro_batch_size: int = 1,
             dtype: str = "bf16", recompute: str = "none", flash: bool = False, **parallel_overrides):
    return memory_plan(model(model_name), parallel(parallel_name, **parallel_overrides), seq_len,
                       micro_batch_size, dtype, recompute, flash)


def test_an_objectives_needs_enter_the_plan():
    """A preference pair doubles the sequences (activations, logits), the extra rows add to the total and the
    trained model's extra parameters carry weights, grads and AdamW states (16 B each)."""
    base = plan_for("tiny", "single", seq_len=256, micro_batch_size=8, dtype="fp32")
    needs = ObjectiveMemory(sequences=2, logits=2, params_delta=-1000, extra=(("reference (frozen)", 123.0, "x"),))
    pair = memory_plan(model("tiny"), parallel("single"), 256, 8, "fp32", "none", False, needs)
    assert pair.activations == 2 * base.activations
    assert base.logits == 4 * 256 * 8 * 4096 and pair.logits == 4 * base.logits
    assert pair.params == base.params - 1000
    assert pair.total == base.total + base.activations + 3 * base.logits + 123.0 - 16 * 1000
    assert "reference (frozen)" in format_plan(pair, device("cpu"))


def test_optimizer_sharding_divides_by_dp():
    sharded = plan_for("7b", "dp8")  # optimizer_shard: true
    assert sharded.params == 6_738_415_616
    assert sharded.optimizer_states_unsharded == 8 * 6_738_415_616
    assert sharded.optimizer_states == sharded.optimizer_states_sharded == 6_738_415_616  # 8 B / 8
    assert sharded.grads == 4 * 6_738_415_616 and sharded.weights == 6_738_415_616 // 2  # weights: dp slices
    replicated = plan_for("7b", "dp8", optimizer_shard=False)
    assert replicated.optimizer_states == 8 * 6_738_415_616 and replicated.weights == 4 * 6_738_415_616
    assert replicated.total - sharded.total == 7 * 6_738_415_616 + 3.5 * 6_738_415_616


def test_activations_7b_by_hand():
    # s=4096 b=1 h=4096 bf16: s*b*h*2 B = 33,554,432 B per element per s*b*h.
    # kept per layer: 4 + 2 + 2*32/32 + 4*11008/4096 = 18.75 elements, plus a*s/h = 32 for the softmax.
    sbh = 4096 * 4096 * 2
    plan = plan_for("7b", "single")
    assert plan.activations_by_recompute == {
        "none": 32 * 50.75 * sbh,  # 54,492,397,568
        "selective": 32 * 18.75 * sbh,
        "full": 32 * sbh + 50.75 * sbh,  # each layer's input + one layer being recomputed
    }
    assert plan.activations == 54_492_397_568
    full = plan_for("7b", "single", recompute="full")
    assert full.activations == 2_776_629_248 < plan.activations
    assert plan_for("7b", "single", flash=True).activations == 32 * 18.75 * sbh
    assert plan_for("7b", "single", dtype="fp32").activations == 2 * plan.activations


def test_activations_tensor_and_sequence_parallel():
    m, sbh = model("7b"), 4096 * 4096 * 2
    tp8 = parallel("single", tp=8)
    # without sequence parallelism the 4 norm-side elements stay replicated: 4 + 46.75 / 8
    assert layer_activation_bytes(m, tp8, 4096, 1, "bf16", "none", False) == 9.84375 * sbh
    tp8.sequence_parallel = True
    assert layer_activation_bytes(m, tp8, 4096, 1, "bf16", "none", False) == 50.75 / 8 * sbh
    assert layer_activation_bytes(m, tp8, 4096, 1, "bf16", "full", False) == sbh / 8


def test_tensor_parallel_divides_weights():
    single, tp8 = plan_for("7b", "single"), plan_for("7b", "single", tp=8)
    # matmul weights and the vocab-parallel embedding/head / 8; the 2*h norm weights per layer replicated
    assert tp8.params == 32 * ((202_383_360 - 8192) // 8 + 8192) + 2 * 32000 * 4096 // 8 + 4096 == 842_534_912
    assert tp8.weights == 4 * 842_534_912
    assert tp8.weights == pytest.approx(single.weights / 8, rel=1e-3)


def test_first_pipeline_stage_holds_pp_micro_batches():
    m, p = model("70b"), parallel("tp8pp4")  # micro_batches 16
    plan = memory_plan(m, p, 4096, 1, "bf16", "none", True)
    assert plan.stage == 0
    assert plan.activations == 4 * 20 * layer_activation_bytes(m, p, 4096, 1, "bf16", "none", True)


def test_13b_tp8pp2_plan():
    plan = plan_for("13b", "tp8pp2", flash=True)
    # stage 0: 20 layers of (317,194,240 matmul weights / 8 + 10,240 norm weights) + embedding / 8
    assert plan.stage == 0
    assert plan.params == 20 * (317_194_240 // 8 + 10_240) + 32000 * 5120 // 8 == 813_670_400
    assert plan.weights == pytest.approx(13.0e9 / 16 * 4, rel=0.01)
    # 16 B/param + 2 micro-batches x 20 layers x 4096*5120*2 B x (4 + 2 + 2 + 4*13824/5120) / 8
    assert plan.total == 16 * 813_670_400 + 2 * 20 * 4096 * 5120 * 2 * 2.35 == 16_961_372_160
    assert 15 < plan.total / GIB < 16.5
    assert "fits" in format_plan(plan, device("h100"))
    assert "DOES NOT FIT" in format_plan(plan, device("h100", memory_gb=8, reserved_gb=0))


def test_fits_leaves_the_runtime_its_memory_and_room_for_fragmentation():
    """A plan fits when it plus 10% stays within memory_gb less reserved_gb: 13b tp8pp2's 15.80 GiB needs 17.38."""
    plan = plan_for("13b", "tp8pp2", flash=True)
    assert fits(plan, device("ascend910b", memory_gb=17.4, reserved_gb=0))
    assert not fits(plan, device("ascend910b", memory_gb=17.4, reserved_gb=0.1))
    assert not fits(plan, device("ascend910b", memory_gb=17.3, reserved_gb=0))
    assert "+10% fragmentation = 17.38 of 58.00 usable, 64 less 6 reserved (30%): fits" in format_plan(
        plan, device("ascend910b"))


# --- dry run ------------------------------------------------------------------------------------------


def test_dry_run_report():
    cfg = compose_cfg("model=13b", "parallel=tp8pp2", "device=h100", "precision=bf16", "data.seq_len=4096",
                         "trainer.micro_batch_size=1")
    text = dry_run_report(cfg)
    assert "13,015,864,320" in text
    assert "micro_batch_size 1 x 8 pipeline micro-batches" in text
    assert "attention plain" in text  # auto: flash is Ascend-only, the fused CPU kernel fp32 and CPU-only
    assert "tokens per step: 32,768" in text  # 1 x 8 micro-batches x dp 1 x grad_accum 1 x 4096
    assert "stage 1: ranks 8-15  layers 20-39 (20)" in text
    # 16 B x 813,670,400 params + 2 micro-batches x 20 layers x 4096*5120*2 B x (18.8 + 32) / 8
    assert "22.05  +10% fragmentation = 24.25 of 76.00 usable, 80 less 4 reserved (32%): fits" in text


def test_dry_run_flash_auto_on_ascend():
    cfg = compose_cfg("model=13b", "parallel=tp8pp2", "device=ascend910b", "precision=bf16",
                         "data.seq_len=4096", "trainer.micro_batch_size=1")
    assert use_flash_attention(cfg.model, cfg.device.target)
    assert "15.80  +10% fragmentation" in dry_run_report(cfg)  # test_13b_tp8pp2_plan's total
