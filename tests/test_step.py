"""The optimizer step: gradient accumulation, overflow skipping, clipping, schedules, checkpoints."""
import json
import os

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor
from omegaconf import OmegaConf

from conftest import load_preset
from helpers import optim_cfg
from models import build_model
from objectives.clm import CausalLMLoss
from base import checkpoint
from trainer.guard import SpikeGuard
from trainer.module import LocalModule
from trainer.optimizer import build_optimizer, build_schedule, param_groups
from trainer.step import ApplyUpdate, DynamicLossScale, ForwardBackward, ShardedTrainStep

pytestmark = pytest.mark.usefixtures("pynative")
ONE = Tensor(1.0, ms.float32)
ALLOW = Tensor(True)


def tiny_model(seed=0):
    """model=tiny cut to one layer: every kind of weight the step treats apart (matrices, norms, the embedding,
    the head) is in it, and each eager step runs a quarter of the ops."""
    return build_model(OmegaConf.merge(load_preset("model", "tiny"), {"num_layers": 1}), 32, "fp32", "CPU", seed=seed)


def setup(seed=0, clip=1.0):
    model = tiny_model(seed)
    # eps well above tiny gradients keeps Adam's first step smooth in g (not sign-like), so sums compare
    optimizer = build_optimizer(model.trainable_params(), optim_cfg(lr=1e-2, eps=1e-4, schedule="constant"), 100)
    forward_backward = ForwardBackward(CausalLMLoss(model), optimizer.parameters)
    return model, optimizer, forward_backward, ApplyUpdate(optimizer, forward_backward.grad_buffers, clip)


def weights(model):
    return {p.name: p.asnumpy().copy() for p in model.trainable_params()}


def batch(rows=8, seed=0):
    return Tensor(np.random.default_rng(seed).integers(0, 4096, (rows, 33)).astype(np.int32))


def test_two_accumulated_micro_batches_equal_one_big_batch():
    x = batch(8)
    model_a, _, fb_a, update_a = setup()
    fb_a(ONE, x, x)
    update_a(ONE, ALLOW)
    model_b, _, fb_b, update_b = setup()
    for half in (x[:4], x[4:]):  # each half holds half of the step's loss tokens
        fb_b(Tensor(0.5, ms.float32), half, half)
    update_b(ONE, ALLOW)
    a, b = weights(model_a), weights(model_b)
    assert any(np.abs(a[k] - weights(setup()[0])[k]).max() > 1e-4 for k in a)  # the step did move the weights
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, err_msg=k)


def test_reported_grad_norm_is_the_global_norm_and_buffers_are_cleared():
    model, optimizer, fb, update = setup(clip=0.5)
    x = batch(4)
    grads = ms.value_and_grad(lambda a, b: CausalLMLoss(model)(a, b)[0], None, optimizer.parameters)(x, x)[1]
    expected = np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum()) for g in grads))
    fb(ONE, x, x)
    norm, finite, _ = update(ONE, ALLOW)
    assert bool(finite.asnumpy())
    assert float(norm.asnumpy()) == pytest.approx(expected, rel=1e-4)
    assert all(not buf.asnumpy().any() for buf in fb.grad_buffers)


def test_overflowing_step_is_skipped_and_the_loss_scale_backs_off():
    model, optimizer, fb, update = setup()
    before = weights(model)
    huge = Tensor(np.inf, ms.float32)  # the scaled gradients overflow, as fp16's do under too large a scale
    x = batch(4)
    fb(huge, x, x)
    _, finite, _ = update(huge, ALLOW)
    assert not bool(finite.asnumpy())
    for k, v in weights(model).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    assert int(optimizer.global_step.asnumpy()) == 0  # a skipped step does not advance the schedule
    scaler = DynamicLossScale(2.0 ** 16, growth_interval=2, growth_factor=2.0, backoff_factor=0.5)
    scaler.update(False)
    assert scaler.scale == 2.0 ** 15
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 2.0 ** 16


def lr_at(schedule, step):
    return float(schedule(Tensor(step, ms.int32)).asnumpy())


def test_cosine_schedule_with_warmup():
    s = build_schedule(optim_cfg(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="cosine"), 110)
    assert lr_at(s, 5) == pytest.approx(5e-4)
    assert lr_at(s, 10) == pytest.approx(1e-3)
    assert lr_at(s, 60) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-5)  # halfway down the cosine
    assert lr_at(s, 110) == pytest.approx(1e-4)


def test_warmup_stable_decay_schedule():
    s = build_schedule(optim_cfg(lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.2), 100)
    assert lr_at(s, 5) == pytest.approx(5e-4)
    assert lr_at(s, 50) == pytest.approx(1e-3)
    assert lr_at(s, 80) == pytest.approx(1e-3)
    assert lr_at(s, 90) == pytest.approx(5e-4)


@pytest.mark.parametrize("schedule, warmup, min_lr", [("cosine", 10, 1e-4), ("cosine", 0, 3e-5), ("wsd", 10, 0.0),
                                                     ("wsd", 3, 2e-4), ("constant", 7, 0.0), ("constant", 0, 0.0)])
def test_native_schedules_equal_mindformers_at_every_step(schedule, warmup, min_lr):
    """trainer/schedules.py replaces MindFormers' classes, which runs before issue 16 used: same float32 lr at every
    update count, past the end too."""
    from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR, WarmUpStableDecayLR, ConstantWarmUpLR

    cfg, total = optim_cfg(lr=1e-3, min_lr=min_lr, warmup_steps=warmup, schedule=schedule, decay_fraction=0.3), 60
    theirs = {"cosine": CosineWithWarmUpLR(learning_rate=1e-3, warmup_steps=warmup, total_steps=total, lr_end=min_lr),
              "wsd": WarmUpStableDecayLR(learning_rate=1e-3, lr_end=min_lr, warmup_steps=warmup, total_steps=total,
                                         decay_start_steps=max(warmup, int(total * 0.7))),
              "constant": ConstantWarmUpLR(learning_rate=1e-3, warmup_steps=warmup)}[schedule]
    mine = build_schedule(cfg, total)
    steps = [Tensor([t], ms.int32) for t in range(total + 3)]  # the optimizer's global_step: int32, shape [1]
    assert [mine(t).asnumpy().item() for t in steps] == [theirs(t).asnumpy().item() for t in steps]


def test_native_adamw_equals_mindformers_adamw():
    """Same weights, moments, step counter and state names as MindFormers' AdamW after 5 updates on the same
    gradients (decay and no-decay groups, warmup then cosine), so its checkpoints resume under the native class."""
    from mindformers.core.optim import AdamW as MindFormersAdamW

    rng = np.random.default_rng(0)
    init = {"w.weight": rng.normal(size=(8, 4)), "norm.weight": rng.normal(size=(4,))}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()} for _ in range(5)]
    cfg = optim_cfg(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    states = []
    for native in (True, False):
        params = [ms.Parameter(Tensor(v.astype(np.float32)), name=k) for k, v in init.items()]
        if native:
            optimizer = build_optimizer(params, cfg, 10)
        else:
            optimizer = MindFormersAdamW(param_groups(params, cfg), learning_rate=build_schedule(cfg, 10),
                                         betas=(0.9, 0.95), eps=1e-8)
        for g in grads:
            optimizer(tuple(Tensor(g[p.name]) for p in optimizer.parameters))
        states.append({k: v.asnumpy() for k, v in optimizer.parameters_dict().items()})
        states[-1].update({p.name: p.asnumpy() for p in params})
    assert sorted(states[0]) == sorted(states[1])
    assert {"adam_m.w.weight", "adam_v.norm.weight", "global_step"} < set(states[0])
    for k, v in states[0].items():
        np.testing.assert_allclose(v, states[1][k], rtol=0, atol=1e-6, err_msg=k)
    assert not np.allclose(states[0]["w.weight"], init["w.weight"], atol=1e-3)  # the updates did move the weights


def test_weight_decay_spares_norms_and_embeddings():
    model = tiny_model(0)
    groups = param_groups(model.trainable_params(), optim_cfg(weight_decay=0.1))
    decayed = {p.name for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert "model.layers.0.attention.wq.weight" in decayed and "lm_head.weight" in decayed
    assert not any("norm" in n or "embedding" in n for n in decayed)


CAME = pytest.param("came", marks=pytest.mark.slow)  # MindFormers' CAME runs its many ops eagerly here: ~6 s a test


@pytest.mark.parametrize("name", ["adamw", "adamw_bert", CAME])
def test_weight_decay_is_decoupled_and_spares_the_no_decay_group(name):
    """With zero gradients every preset's update is zero, so one step is the decay alone: w * (1 - lr * wd) on
    matrices, norms and embeddings untouched."""
    model = tiny_model(0)
    optimizer = build_optimizer(model.trainable_params(), optim_cfg(name, lr=1e-2, weight_decay=0.5,
                                                                    schedule="constant"), 10)
    before = weights(model)
    ApplyUpdate(optimizer, optimizer.parameters.clone(prefix="zero_grad", init="zeros"), 1.0)(ONE, ALLOW)
    for k, v in weights(model).items():
        keep = 1.0 if any(s in k for s in ("norm", "embedding")) else 1 - 1e-2 * 0.5
        np.testing.assert_allclose(v, before[k] * keep, rtol=1e-6, err_msg=k)
    assert int(optimizer.parameters_dict()["global_step"].asnumpy()) == 1  # the update count, saved with the state


def test_adamw_first_update_is_bias_corrected_and_adamw_bert_is_not():
    """Step 1 on a constant gradient g: AdamW moves each weight by lr * g / (|g| + eps) (~lr), BERT's
    AdamWeightDecay by lr * (1 - beta1) g / (sqrt(1 - beta2) |g| + eps) (~0.447 lr at betas 0.9/0.95)."""
    moved = {}
    for name in ("adamw", "adamw_bert"):
        model = tiny_model(0)
        optimizer = build_optimizer(model.trainable_params(), optim_cfg(name, lr=1e-3, weight_decay=0.0,
                                                                        schedule="constant"), 10)
        grads = optimizer.parameters.clone(prefix="grad", init="ones")
        before = weights(model)
        ApplyUpdate(optimizer, grads, 0.0)(ONE, ALLOW)
        moved[name] = np.concatenate([(before[k] - v).ravel() for k, v in weights(model).items()])
    np.testing.assert_allclose(moved["adamw"], 1e-3, rtol=1e-4)
    np.testing.assert_allclose(moved["adamw_bert"], 1e-3 * 0.1 / (np.sqrt(0.05) + 1e-8), rtol=1e-4)


def test_a_skipped_step_discards_its_gradients():
    model, optimizer, fb, update = setup()
    before = weights(model)
    x = batch(4)
    fb(ONE, x, x)
    _, finite, _ = update(ONE, Tensor(False))
    assert bool(finite.asnumpy())
    assert all(np.array_equal(v, before[k]) for k, v in weights(model).items())
    assert all(not buf.asnumpy().any() for buf in fb.grad_buffers)


def test_checkpoint_round_trip_restores_weights_and_optimizer_state(tmp_path):
    model, optimizer, fb, update = setup(seed=0)
    x = batch(4)
    fb(ONE, x, x)
    update(ONE, ALLOW)
    path = checkpoint.save(str(tmp_path), 1, model, optimizer, {"tokens_seen": 128}, OmegaConf.create({"a": 1}))
    assert sorted(os.listdir(path)) == ["config.yaml", "model.safetensors", "optimizer.safetensors", "state.json"]
    state = json.load(open(os.path.join(path, "state.json")))
    assert state["step"] == 1 and state["tokens_seen"] == 128
    assert open(os.path.join(str(tmp_path), "latest")).read() == "step_000001\n"
    fresh, fresh_optimizer, *_ = setup(seed=1)
    assert checkpoint.load(path, fresh, fresh_optimizer)["tokens_seen"] == 128
    for k, v in weights(fresh).items():
        np.testing.assert_array_equal(v, weights(model)[k])
    for mine, theirs in zip(fresh_optimizer.exp_avg, optimizer.exp_avg):
        np.testing.assert_array_equal(mine.asnumpy(), theirs.asnumpy())
    assert int(fresh_optimizer.global_step.asnumpy()) == 1
    moments = ms.load_checkpoint(os.path.join(path, "optimizer.safetensors"), format="safetensors")
    assert not set(moments) & set(weights(model))  # optimizer file: moments and step only
    assert int(moments["global_step"].asnumpy()) == 1  # AdamW's bias correction resumes from it


@pytest.mark.parametrize("name", ["adamw_bert", CAME])
def test_every_presets_state_round_trips_through_a_checkpoint(tmp_path, name):
    """Moments, CAME's factored statistics and step counters: all of it is what a resumed run continues from."""
    cfg = optim_cfg(name, lr=1e-2, schedule="constant")
    model = tiny_model(0)
    optimizer = build_optimizer(model.trainable_params(), cfg, 10)
    fb = ForwardBackward(CausalLMLoss(model), optimizer.parameters)
    fb(ONE, batch(4), batch(4))
    ApplyUpdate(optimizer, fb.grad_buffers, 1.0)(ONE, ALLOW)
    path = checkpoint.save(str(tmp_path), 1, model, optimizer, {}, OmegaConf.create({"a": 1}))
    fresh = tiny_model(1)
    fresh_optimizer = build_optimizer(fresh.trainable_params(), cfg, 10)
    checkpoint.load(path, fresh, fresh_optimizer)
    state = {k: v.asnumpy() for k, v in optimizer.parameters_dict().items()}
    assert int(state["global_step"]) == 1 and any(v.any() for k, v in state.items() if k.startswith(("adam_v", "exp_avg_sq")))
    for k, v in fresh_optimizer.parameters_dict().items():
        np.testing.assert_array_equal(v.asnumpy(), state[k], err_msg=k)


@pytest.mark.parametrize("saved, message", [(None, "optim=adamw_bert's (written before"), ("came", "optim=came's")])
def test_resuming_another_optimizers_state_is_refused_naming_the_fix(tmp_path, saved, message):
    """A checkpoint from before issue 17 holds nn.AdamWeightDecay moments under the names MindFormers' AdamW
    uses too: it would load silently into optim=adamw and continue another update rule."""
    state = {"tokens_seen": 0, **({"optimizer": saved} if saved else {})}
    checkpoint.write_state(str(tmp_path), {"step": 5, **state})
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.check_optimizer(str(tmp_path), "adamw")
    assert message in str(err.value) and "but this run uses optim=adamw" in str(err.value)
    assert f"stage.init_from={tmp_path} trainer.resume=none" in str(err.value)
    checkpoint.check_optimizer(str(tmp_path), saved or "adamw_bert")  # the same preset resumes



def test_one_graph_sharded_step_equals_the_two_graph_step():
    """trainer/step.py's ShardedTrainStep (here without a layout, as a plain cell) computes the same
    loss, norm, clipping and update as ForwardBackward + ApplyUpdate, with a loss scale in play."""
    x, scale = batch(8), Tensor(128.0, ms.float32)
    model_a, _, fb_a, update_a = setup(clip=0.05)
    loss_a = fb_a(scale, x, x)
    norm_a, _, _ = update_a(scale, ALLOW)
    model_b, optimizer_b, _, _ = setup(clip=0.05)
    step = ShardedTrainStep(CausalLMLoss(model_b), optimizer_b, 0.05, pp=1, micro_batches=1, optimizer_shard=False)
    step.loss_scale.set_data(scale)  # a parameter: every input of the sharded graph is a batch column
    loss_b, norm_b, finite, _ = step(x, x)
    assert bool(finite.asnumpy()) and float(norm_a.asnumpy()) > 0.05  # clipping was active
    np.testing.assert_allclose(loss_b.asnumpy(), loss_a[0].asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(norm_b.asnumpy(), norm_a.asnumpy(), rtol=1e-5)
    a, b = weights(model_a), weights(model_b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-6, err_msg=k)


class _CausalLM:
    """The objective interface LocalModule uses (objectives/clm.py's loss, no metrics)."""
    metrics = ()

    def loss_cell(self, model):
        return CausalLMLoss(model)

    def loss_tokens(self, inputs):
        return inputs[1][:, 1:].size


@pytest.mark.slow  # two step graphs of model=tiny compiled, ~13 s
def test_one_graph_local_step_equals_the_two_graph_step_and_the_guards_verdict():
    """trainer/module.py with one_graph (TrainStep: the default at grad_accum=1 on one device) against the two
    graphs, both through LocalModule.step with a spike guard and a loss scale: the same losses, norms (clipping
    active) and weights over three steps; then a spike and a NaN loss are skipped by both, for the same reason."""
    x = batch(8).asnumpy()
    runs = {}
    for one_graph in (False, True):
        model, optimizer, _, _ = setup(clip=0.05)
        module = LocalModule(model, _CausalLM(), optimizer, 0.05, one_graph=one_graph)
        guard = SpikeGuard(factor=0.5, window=3, max_consecutive=5)  # from step 4 every loss spikes
        results = []
        for scale in (128.0, 128.0, 128.0, 128.0, float("nan")):
            result = module.step([(x, x)], scale, guard)
            guard.record(result.loss, result.skip)
            results.append(result)
        runs[one_graph] = results, weights(model), int(optimizer.global_step.asnumpy())
    (two, two_weights, two_steps), (one, one_weights, one_steps) = runs[False], runs[True]
    assert [r.skip for r in one] == [r.skip for r in two]
    assert one[3].skip.startswith("loss spike") and one[4].skip == "non-finite loss"
    assert one_steps == two_steps == 3  # the skipped steps did not advance the schedule
    for a, b in zip(one[:4], two[:4]):
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.finite and a.loss_tokens == b.loss_tokens == 8 * 32
        assert float(a.grad_norm.asnumpy()) == pytest.approx(float(b.grad_norm.asnumpy()), rel=1e-5)
    assert float(one[0].grad_norm.asnumpy()) > 0.05  # clipping was active
    for k in two_weights:
        np.testing.assert_allclose(one_weights[k], two_weights[k], atol=1e-6, err_msg=k)


def test_the_guards_limit_gives_its_verdict_in_float32():
    """SpikeGuard.limit is what a graph compares the float32 loss to: at and around the threshold every float32
    loss is accepted by `loss <= limit` exactly when check() accepts it."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        guard = SpikeGuard(factor=float(rng.uniform(1.1, 3)), window=3, max_consecutive=5)
        guard.history = rng.uniform(1, 10, 3).astype(np.float32).astype(float).tolist()
        threshold = np.float32(guard.factor * sum(guard.history) / 3)
        for loss in (np.nextafter(threshold, np.float32(-np.inf)), threshold, np.nextafter(threshold, np.float32(np.inf))):
            assert (guard.check(float(loss)) is None) == bool(loss <= guard.limit())
    assert SpikeGuard(2.0, 3, 5).limit() == np.inf  # no history yet: no spike check


class _WithMetric:
    """An objective whose loss cell returns a metric after the loss (twice the loss, to be recognisable)."""
    metrics = ("twice",)

    def loss_cell(self, model):
        return _LossAndTwice(CausalLMLoss(model))

    def loss_tokens(self, inputs):
        return inputs[1][:, 1:].size


class _LossAndTwice(ms.nn.Cell):
    def __init__(self, loss):
        super().__init__(auto_prefix=False)
        self.loss = loss

    def construct(self, x, labels):
        (loss,) = self.loss(x, labels)
        return loss, loss * 2


def test_the_sharded_step_keeps_the_objectives_metrics():
    """ShardedModule.step (its compiled step here the plain ShardedTrainStep: nothing sharded runs on CPU) reports
    the objective's metrics as the local step does."""
    from trainer.module import ShardedModule

    model, optimizer, _, _ = setup()
    module = object.__new__(ShardedModule)
    module.objective, module.dp, module.pp, module.stage, module.fed, module.loss_scale = _WithMetric(), 1, 1, 0, set(), 1.0
    module.compiled = module.train_step = ShardedTrainStep(module.objective.loss_cell(model), optimizer, 1.0, pp=1,
                                                           micro_batches=1, optimizer_shard=False)
    module.compiled.dataset_strategy = lambda config: None  # (AutoParallel's: the plain cell has none)
    x = batch(4)
    result = module.step([(x.asnumpy(), x.asnumpy())], 1.0)
    assert set(result.metrics) == {"twice"} and result.metrics["twice"] == pytest.approx(2 * result.loss, rel=1e-6)


def test_data_parallel_numbers_travel_in_one_all_reduce():
    """The two-graph step under data parallelism (the replicas faked: an all-reduce that sees two equal ones): one
    AllReduce a step carries the loss tokens, the loss and the metrics; the global numbers come back from it."""
    model, optimizer, _, _ = setup()
    module = LocalModule(model, _WithMetric(), optimizer, 1.0, world_size=1, one_graph=False)
    calls = []
    module.world_size = 2
    module.replica_sum = lambda t: calls.append(t.asnumpy().copy()) or Tensor(t.asnumpy() * 2)
    x = batch(4)
    result = module.step([(x.asnumpy()[:2], x.asnumpy()[:2]), (x.asnumpy()[2:], x.asnumpy()[2:])], 1.0)
    (sent,) = calls
    tokens = 4 * 32
    assert sent[0] == tokens and result.loss_tokens == 2 * tokens
    assert result.loss == pytest.approx(sent[1] / tokens, rel=1e-6)  # two equal replicas: their mean is one's
    assert result.metrics["twice"] == pytest.approx(2 * result.loss, rel=1e-6)
