"""Checkpoints under tp/pp layouts: per-rank slices, MindSpore strategy files, merge and reshard.

The slices and strategy files are written by distributed/sharded_checkpoint.py from the layout (a sharded run
on Ascend/GPU gets its strategy file from MindSpore's compiler, which CPU cannot run); merging and resharding
are MindSpore's own transform_checkpoints reading them, so a passing merge means MindSpore reads the files
as the slices were cut.
"""
import os

import numpy as np
import pytest

import mindspore as ms

from conftest import compose_cfg
from base.checkpoint import CheckpointError
from distributed import reshard
from planner.layout import Layout
from distributed.sharded_checkpoint import STRATEGY, SLICE, load_tensors, merge_checkpoint, rank_slice
from models import build_model
from models.llama import plan as llama_plan
from base import checkpoint
from trainer.optimizer import build_optimizer


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory):
    """A mindlab checkpoint of model=tiny with non-zero AdamW moments; returns (dir, its tensors)."""
    cfg = compose_cfg("model=tiny", "data.seq_len=64")
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=0)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10)
    rng = np.random.default_rng(1)
    for param in optimizer.exp_avg + optimizer.exp_avg_sq:  # AdamW's m and v
        param.set_data(ms.Tensor(rng.normal(size=param.shape).astype(np.float32)))
    path = checkpoint.save(str(tmp_path_factory.mktemp("ckpt")), 7, model, optimizer, {"run_id": "r"}, cfg)
    tensors = {**load_tensors(os.path.join(path, checkpoint.WEIGHTS)),
               **load_tensors(os.path.join(path, checkpoint.OPTIMIZER))}
    return path, tensors


def test_strategy_file_says_how_each_tensor_is_split(full_checkpoint, tmp_path):
    path, _ = full_checkpoint
    reshard.split(path, str(tmp_path), dp=1, tp=2, pp=2)
    layouts = ms.parallel.build_searched_strategy(str(tmp_path / STRATEGY))

    def entry(name):
        layout = layouts[name]
        return list(layout.dev_matrix[0].dim), list(layout.tensor_map[0].dim)

    # tensor_map counts dev-matrix axes from the right: 0 = tp (dev_matrix [dp, tp]), -1 = not split
    assert entry("0-model.layers.0.attention.wq.weight") == ([1, 2], [0, -1])  # column-parallel
    assert entry("1-model.layers.3.feed_forward.w2.weight") == ([1, 2], [-1, 0])  # row-parallel
    assert entry("0-adam_v.model.tok_embeddings.embedding_weight") == ([1, 2], [0, -1])  # vocab-parallel
    assert entry("1-model.norm_out.weight") == ([1, 2], [-1])
    assert "0-model.layers.2.attention.wq.weight" not in layouts  # layer 2 lives on stage 1
    assert {"0-global_step", "1-global_step"} <= set(layouts)


def test_rank_files_hold_the_slices_the_layout_assigns(full_checkpoint, tmp_path):
    path, tensors = full_checkpoint
    reshard.split(path, str(tmp_path), dp=1, tp=2, pp=2)  # rank = stage * 2 + tp_rank
    rank3 = load_tensors(str(tmp_path / "rank_3" / SLICE))
    wo = tensors["model.layers.3.attention.wo.weight"]
    np.testing.assert_array_equal(rank3["model.layers.3.attention.wo.weight"], wo[:, wo.shape[1] // 2:])
    head = tensors["lm_head.weight"]
    np.testing.assert_array_equal(rank3["lm_head.weight"], head[head.shape[0] // 2:])
    assert not any(name.startswith(("model.layers.0.", "model.tok_embeddings")) for name in rank3)


@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 1), (1, 2, 2), (2, 2, 1)])
def test_merge_of_slices_equals_the_original_checkpoint(full_checkpoint, tmp_path, dp, tp, pp):
    path, tensors = full_checkpoint
    reshard.split(path, str(tmp_path / "sharded"), dp, tp, pp)
    reshard.merge(str(tmp_path / "sharded"), str(tmp_path / "merged"))
    merged = {**load_tensors(str(tmp_path / "merged" / checkpoint.WEIGHTS)),
              **load_tensors(str(tmp_path / "merged" / checkpoint.OPTIMIZER))}
    assert set(merged) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(merged[name], array, err_msg=name)
    assert checkpoint.read_state(str(tmp_path / "merged"))["step"] == 7  # a resumable checkpoint again


def test_reshard_tp2pp2_to_tp4_equals_slicing_the_original(full_checkpoint, tmp_path):
    path, tensors = full_checkpoint
    reshard.split(path, str(tmp_path / "tp2pp2"), dp=1, tp=2, pp=2)
    layout = Layout(dp=1, tp=4, pp=1, num_layers=4)
    from distributed.sharded_checkpoint import reshard_checkpoint

    assert reshard_checkpoint(str(tmp_path / "tp2pp2"), 1, 4, 1, str(tmp_path / "tp4"), llama_plan) == layout
    for rank in range(4):
        got = load_tensors(str(tmp_path / "tp4" / f"rank_{rank}" / SLICE))
        want = rank_slice(tensors, layout, rank, llama_plan)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"rank {rank} {name}")
    assert merge_checkpoint(str(tmp_path / "tp4")).keys() == tensors.keys()


def test_optimizer_sharded_slices_are_split_again_over_their_dp_group(full_checkpoint, tmp_path):
    """parallel.optimizer_shard: a tensor-parallel slice is cut once more along its first dimension over the dp
    ranks that share it, a replicated tensor over the whole stage, a tensor under 64 KB stays whole (MindSpore's
    parallel optimizer at its defaults); the strategy file says so, MindSpore's transform_checkpoints merges it
    back to the original, and a reshard into that layout cuts what slicing the original cuts."""
    path, tensors = full_checkpoint
    reshard.split(path, str(tmp_path / "zero"), dp=2, tp=2, pp=1, sharded_optimizer=True)  # rank = dp_rank*2 + tp
    rank3 = load_tensors(str(tmp_path / "zero" / "rank_3" / SLICE))
    wq = tensors["model.layers.0.attention.wq.weight"]  # column-parallel [128, 128], 64 KB: tp half 1, then dp half 1
    np.testing.assert_array_equal(rank3["model.layers.0.attention.wq.weight"], wq[64:][32:])
    v = tensors["adam_v.model.layers.0.feed_forward.w2.weight"]  # row-parallel: columns over tp, rows over dp
    np.testing.assert_array_equal(rank3["adam_v.model.layers.0.feed_forward.w2.weight"],
                                  v[:, v.shape[1] // 2:][v.shape[0] // 2:])
    norm = tensors["model.norm_out.weight"]  # 1 KB: under the threshold, whole on every rank
    np.testing.assert_array_equal(rank3["model.norm_out.weight"], norm)
    layouts = ms.parallel.build_searched_strategy(str(tmp_path / "zero" / STRATEGY))
    wq_layout = layouts["0-model.layers.0.attention.wq.weight"]
    assert (wq_layout.opt_weight_shard_size, wq_layout.opt_weight_shard_step) == (2, 2)
    assert layouts["0-model.norm_out.weight"].opt_weight_shard_size == 0

    reshard.merge(str(tmp_path / "zero"), str(tmp_path / "merged"))
    merged = {**load_tensors(str(tmp_path / "merged" / checkpoint.WEIGHTS)),
              **load_tensors(str(tmp_path / "merged" / checkpoint.OPTIMIZER))}
    for name, array in tensors.items():
        np.testing.assert_array_equal(merged[name], array, err_msg=name)

    from distributed.sharded_checkpoint import reshard_checkpoint

    reshard.split(path, str(tmp_path / "tp2"), dp=1, tp=2, pp=1)
    layout = reshard_checkpoint(str(tmp_path / "tp2"), 2, 2, 1, str(tmp_path / "again"), llama_plan, True)
    for rank in range(4):
        got = load_tensors(str(tmp_path / "again" / f"rank_{rank}" / SLICE))
        want = rank_slice(tensors, layout, rank, llama_plan, sharded_optimizer=True)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"rank {rank} {name}")


def test_bad_layouts_and_directories_give_one_clear_error(full_checkpoint, tmp_path):
    path, _ = full_checkpoint
    with pytest.raises(ValueError, match=r"lm_head.weight: dimension 0 \(size 4096\) does not split 3 ways"):
        reshard.split(path, str(tmp_path / "a"), dp=1, tp=3, pp=1)
    with pytest.raises(ValueError, match="pp=3 does not divide the checkpoint's 4 layers"):
        reshard.split(path, str(tmp_path / "b"), dp=1, tp=1, pp=3)
    with pytest.raises(CheckpointError, match="not a sharded checkpoint .* distributed.reshard split"):
        reshard.merge(path, str(tmp_path / "c"))


def test_a_sharded_runs_save_merges_back(tmp_path):
    """What distributed/semi_auto.py writes per rank (here one rank of a layout-free step, with the strategy
    file a compile would leave in <run dir>/strategy/) is what `reshard merge` reads."""
    from distributed.semi_auto import save_rank_slices
    from distributed.sharded_checkpoint import strategy_map
    from objectives.clm import CausalLMLoss
    from trainer.step import ShardedTrainStep

    cfg = compose_cfg("model=tiny", "data.seq_len=64")
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10)
    step = ShardedTrainStep(CausalLMLoss(model), optimizer, 1.0, pp=1, micro_batches=1, optimizer_shard=False)
    shapes = {name: tuple(p.shape) for name, p in optimizer.parameters_and_names()}
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "rank_0.ckpt").write_bytes(
        strategy_map(shapes, Layout(dp=1, tp=1, pp=1, num_layers=4), 0, llama_plan).SerializeToString())
    save_rank_slices(str(tmp_path / "step_000005"), step, 0, str(tmp_path))
    reshard.merge(str(tmp_path / "step_000005"), str(tmp_path / "merged"))
    merged = load_tensors(str(tmp_path / "merged" / checkpoint.WEIGHTS))
    for name, param in model.parameters_and_names():
        np.testing.assert_array_equal(merged[name], param.asnumpy(), err_msg=name)
    assert "adam_m.lm_head.weight" in load_tensors(str(tmp_path / "merged" / checkpoint.OPTIMIZER))


# --- a mixture of experts: its routed experts over ep of the dp ranks, tp within each (models/moe/plan.py) ------------

@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A checkpoint of model=moe_tiny (2 layers: 8 experts of 176) with non-zero AdamW moments; (dir, tensors)."""
    cfg = compose_cfg("model=moe_tiny", "model.num_layers=2", "data.seq_len=64")
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=0)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10)
    rng = np.random.default_rng(2)
    for param in optimizer.exp_avg + optimizer.exp_avg_sq:
        param.set_data(ms.Tensor(rng.normal(size=param.shape).astype(np.float32)))
    path = checkpoint.save(str(tmp_path_factory.mktemp("moe")), 3, model, optimizer, {"run_id": "m"}, cfg)
    tensors = {**load_tensors(os.path.join(path, checkpoint.WEIGHTS)),
               **load_tensors(os.path.join(path, checkpoint.OPTIMIZER))}
    return path, tensors


def test_moe_slices_are_the_plans_expert_and_tensor_parallel_shards_and_merge_back(moe_checkpoint, tmp_path):
    """split --dp 4 --ep 2 --tp 2: each rank's expert weights are the full ones divided as the plan's batched
    matmuls split them ((ep, tp, 1) for w1 w3, (ep, 1, tp) for w2), dp ranks 0 and 2 holding experts 0-3, 1 and 3
    experts 4-7 (the plan's device matrix [dp / ep, ep, tp]: each ep group of consecutive dp ranks, [0 1] and
    [2 3], holds all the experts); merging gives the original back, and so does resharding to ep 4 tp 1 then
    merging."""
    from models.moe import plan as moe_plan

    path, tensors = moe_checkpoint
    reshard.split(path, str(tmp_path / "ep2tp2"), dp=4, tp=2, pp=1, ep=2)
    layout = Layout(dp=4, tp=2, pp=1, num_layers=2, ep=2)
    for rank in range(8):
        got = load_tensors(str(tmp_path / "ep2tp2" / f"rank_{rank}" / SLICE))
        assert set(got) == set(tensors)
        where = layout.coords(rank)
        for weight, primitive in (("w1", "up"), ("w3", "up"), ("w2", "down")):
            for prefix in ("", "adam_m."):
                name = f"{prefix}model.layers.1.feed_forward.experts.{weight}"
                split = (2, 2, 1) if primitive == "up" else (2, 1, 2)
                full = tensors[name]
                assert got[name].shape == tuple(n // ways for n, ways in zip(full.shape, split)), name
                experts = slice(4 * (where.dp % 2), 4 * (where.dp % 2 + 1))
                width = slice(88 * where.tp, 88 * (where.tp + 1))
                want = full[experts, width] if primitive == "up" else full[experts, :, width]
                np.testing.assert_array_equal(got[name], want, err_msg=f"rank {rank} {name}")
        wq = tensors["model.layers.0.attention.wq.weight"]  # column-parallel over tp, as a dense layer's
        np.testing.assert_array_equal(got["model.layers.0.attention.wq.weight"],
                                      np.split(wq, 2)[where.tp])
        np.testing.assert_array_equal(got["model.layers.0.feed_forward.router.weight"],
                                      tensors["model.layers.0.feed_forward.router.weight"])  # whole
    layouts = ms.parallel.build_searched_strategy(str(tmp_path / "ep2tp2" / STRATEGY))
    w2 = layouts["0-model.layers.0.feed_forward.experts.w2"]
    assert (list(w2.dev_matrix[0].dim), list(w2.tensor_map[0].dim)) == ([2, 2, 2], [1, -1, 0])

    for target in ("merged", "again"):
        if target == "again":
            reshard.main(["reshard", str(tmp_path / "ep2tp2"), str(tmp_path / "ep4"), "--dp", "4", "--ep", "4"])
            for rank in range(4):
                got = load_tensors(str(tmp_path / "ep4" / f"rank_{rank}" / SLICE))
                want = rank_slice(tensors, Layout(dp=4, tp=1, pp=1, num_layers=2, ep=4), rank, moe_plan)
                for name in want:
                    np.testing.assert_array_equal(got[name], want[name], err_msg=f"rank {rank} {name}")
        reshard.merge(str(tmp_path / ("ep2tp2" if target == "merged" else "ep4")), str(tmp_path / target))
        merged = {**load_tensors(str(tmp_path / target / checkpoint.WEIGHTS)),
                  **load_tensors(str(tmp_path / target / checkpoint.OPTIMIZER))}
        assert set(merged) == set(tensors)
        for name, array in tensors.items():
            np.testing.assert_array_equal(merged[name], array, err_msg=f"{target} {name}")


def test_expert_parallel_reshard_refuses_what_it_cannot_lay_out(full_checkpoint, moe_checkpoint, tmp_path):
    from base.errors import UsageError

    with pytest.raises(UsageError, match="--ep: model.family=llama has no experts to split"):
        reshard.split(full_checkpoint[0], str(tmp_path / "a"), dp=2, tp=1, pp=1, ep=2)
    with pytest.raises(UsageError, match="--ep: ep=2 does not divide dp=3"):
        reshard.split(moe_checkpoint[0], str(tmp_path / "b"), dp=3, tp=1, pp=1, ep=2)
    with pytest.raises(UsageError, match="--ep: expert-parallel slices are not written with --optimizer-shard"):
        reshard.split(moe_checkpoint[0], str(tmp_path / "c"), dp=2, tp=1, pp=1, sharded_optimizer=True, ep=2)
    with pytest.raises(CheckpointError, match=r"experts.w1: dimension 0 \(size 8\) does not split 3 ways.*ep the "
                                              r"experts"):
        reshard.split(moe_checkpoint[0], str(tmp_path / "d"), dp=3, tp=1, pp=1, ep=3)
