"""PPO: the rollout's numbers (KL estimators, GAE, whitening) against plain reference loops, the clipped losses
against a hand computation, a short real run that resumes exactly, and its bad inputs."""
import json

import numpy as np
import pytest

from base.validate import ConfigError, validate
from conftest import compose_cfg, load_preset


def test_gae_and_whitening_equal_a_reference_loop():
    from objectives.ppo import gae, whiten

    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(3, 10)), rng.normal(size=(3, 10))
    mask = np.zeros((3, 10))
    spans = [(2, 7), (0, 10), (5, 6)]
    for i, (a, e) in enumerate(spans):
        mask[i, a:e] = 1
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i, (a, e) in enumerate(spans):  # TRL's loop over one row's response
        last = 0.0
        expected = np.zeros(e - a)
        for t in reversed(range(a, e)):
            next_value = values[i, t + 1] if t + 1 < e else 0.0
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            last = delta + gamma * lam * last
            expected[t - a] = last
        np.testing.assert_allclose(adv[i, a:e], expected, rtol=1e-12)
        np.testing.assert_allclose(ret[i, a:e], expected + values[i, a:e], rtol=1e-12)
        assert not adv[i, :a].any() and not adv[i, e:].any() and not ret[i, e:].any()
    white = whiten(adv, mask)
    picked = adv[mask > 0]
    np.testing.assert_allclose(white[mask > 0], (picked - picked.mean()) / np.sqrt(picked.var(ddof=1) + 1e-8))
    assert not white[mask == 0].any()


def test_kl_estimators():
    from objectives.ppo import kl_per_token

    logp, ref = np.log(np.array([0.5, 0.2])), np.log(np.array([0.25, 0.4]))
    np.testing.assert_allclose(kl_per_token(logp, ref, "k1"), logp - ref)
    r = np.exp(ref - logp)
    np.testing.assert_allclose(kl_per_token(logp, ref, "k3"), (r - 1) - np.log(r))
    assert (kl_per_token(logp, ref, "k3") >= 0).all()


def test_ppo_losses_and_metrics_equal_a_hand_computation(pynative):
    import mindspore as ms
    from omegaconf import OmegaConf

    from models import build_model
    from objectives.ppo import Config, PolicyWithValue, PPOLoss

    lm = build_model(load_preset("model", "tiny"), 32, "fp32", "CPU", seed=0)
    policy = PolicyWithValue(lm)
    rng = np.random.default_rng(1)
    policy.value_head.set_data(ms.Tensor(rng.normal(0, 0.1, (1, 128)).astype(np.float32)))
    tokens = rng.integers(4, 4096, (2, 17)).astype(np.int32)
    mask = (rng.random((2, 16)) < 0.6).astype(np.float32)
    old_logp = rng.normal(-8, 1, (2, 16)).astype(np.float32)
    adv, ret, old_v = (rng.normal(size=(2, 16)).astype(np.float32) for _ in range(3))
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"name": "ppo", "cliprange": 0.2, "cliprange_value": 0.3,
                                                         "vf_coef": 0.5})
    out = [float(x.asnumpy()) for x in PPOLoss(policy, cfg)(*map(ms.Tensor, (tokens, mask, old_logp, adv, ret, old_v)))]
    logits = lm(ms.Tensor(tokens[:, :-1])).asnumpy().astype(np.float64)
    h = lm.model(ms.Tensor(tokens[:, :-1])).asnumpy().astype(np.float64)
    values = h @ policy.value_head.asnumpy()[0]
    logp_all = logits - logits.max(-1, keepdims=True)
    logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, tokens[:, 1:, None], -1)[..., 0]
    n = mask.sum()
    ratio = np.exp(logp - old_logp)
    pg1, pg2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    pg = (np.maximum(pg1, pg2) * mask).sum() / n
    clipped = old_v + np.clip(values - old_v, -0.3, 0.3)
    v1, v2 = (values - ret) ** 2, (clipped - ret) ** 2
    vf = 0.5 * (np.maximum(v1, v2) * mask).sum() / n
    entropy = (-(np.exp(logp_all) * logp_all).sum(-1) * mask).sum() / n
    want = [pg + 0.5 * vf, 0.5 * ((logp - old_logp) ** 2 * mask).sum() / n, ((pg2 > pg1) * mask).sum() / n, pg, vf,
            ((v2 > v1) * mask).sum() / n, entropy]
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6)


@pytest.fixture(scope="module")
def reward_checkpoint(tmp_path_factory, base_checkpoint, tokenizer_file):
    """A reward-model checkpoint (the base model's trunk and a random head), as a stage=rm run leaves it."""
    import mindspore as ms

    from base import checkpoint
    from models import build_model
    from objectives.rm import RewardModel

    cfg = compose_cfg("model=tiny", "stage=rm", f"stage.init_from={base_checkpoint}", "data=preferences")
    lm = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    checkpoint.load_weights(base_checkpoint, lm)
    reward_model = RewardModel(lm, seed=7)
    return checkpoint.save(str(tmp_path_factory.mktemp("rm") / "ckpt"), 10, reward_model,
                           ms.nn.SGD(reward_model.trainable_params()), {}, cfg, tokenizer_file)


def ppo_cfg(tmp_path, base, rm, *overrides, counts=range(1, 11), words=("apple", "river", "stone", "cloud")):
    prompts = [{"instruction": f"Say {w} {n} times.", "output": " ".join([w] * n)} for n in counts for w in words]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return compose_cfg("stage=ppo", f"stage.init_from={base}", f"objective.reward_model={rm}", "model=tiny",
                       f"data.sources=[{{name: say, kind: alpaca, paths: [{path}], val_paths: [{path}]}}]",
                       "data.name=say", "data.seq_len=96", f"data.cache_dir={tmp_path / 'cache'}",
                       "objective.max_prompt_len=64", "objective.max_new_tokens=12", "objective.ppo_epochs=2",
                       "trainer.micro_batch_size=4", "trainer.log_every=1", "trainer.max_steps=6", "optim.lr=1e-3",
                       "trainer.keep_last=0", "logger.progress_bar=false", *overrides)


def test_the_dry_run_plans_reference_reward_model_and_rollout_cache(tmp_path, base_checkpoint, reward_checkpoint):
    """The rows PPO adds, by hand for model=tiny (h 128, 4 layers, 4 heads of 32, 2 KV heads, vocab 4096):
    each frozen model is 4 B per parameter, the reward model without its LM head; the cache is K and V of
    4 prompts x (64 prompt columns + 12 new) per layer."""
    from planner.dry_run import dry_run_report

    report = dry_run_report(ppo_cfg(tmp_path, base_checkpoint, reward_checkpoint, "objective.minibatches=2"))
    params = 4096 * 128 + 4 * (128 + 128 * 128 * 2 + 128 * 64 * 2 + 128 + 3 * 128 * 352) + 128 + 4096 * 128
    rows = {line[2:20].strip(): float(line[20:28]) for line in report.splitlines()[-10:] if line.startswith("  ")}
    assert rows["reference (frozen)"] == round(4 * params / 2 ** 20, 2)
    assert rows["reward model"] == round(4 * (params - 4096 * 128 + 128) / 2 ** 20, 2)
    assert rows["rollout KV cache"] == round(2 * 4 * 4 * 2 * (64 + 12) * 32 * 4 / 2 ** 20, 2)
    assert rows["logits (fp32)"] == round(4 * 96 * 2 * 4096 / 2 ** 20, 2)  # a minibatch of 2 sequences


@pytest.mark.slow
def test_ppo_run_logs_trls_metrics_and_resumes_mid_rollout_exactly(tmp_path, base_checkpoint, reward_checkpoint):
    """6 steps = 3 rollouts of 2 updates; killed after step 3, half-way through a rollout, the resumed run
    ends with the same weights and logs the same numbers as the uninterrupted one."""
    import shutil

    from safetensors.numpy import load_file

    from trainer.loop import train

    cfg = ppo_cfg(tmp_path, base_checkpoint, reward_checkpoint, "trainer.save_every=3")
    validate(cfg)
    train(cfg, str(tmp_path / "full"))
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000006")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step_000003\n")
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "resumed" / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    train(cfg, str(tmp_path / "resumed"))
    full = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert {"objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl", "policy/clipfrac",
            "loss/policy", "loss/value", "val/clipfrac", "gen_len", "entropy"} <= set(full[0])
    assert full[0]["objective/kl"] == 0.0 and full[0]["policy/approxkl"] == 0.0  # policy == reference, old
    assert full[1]["policy/approxkl"] > 0  # the rollout's second update sees the first one's change
    assert full[0]["objective/scores"] == full[1]["objective/scores"] != full[2]["objective/scores"]
    timed = lambda k: "tokens_per_sec" in k or k == "mfu" or "rss" in k or k.startswith(("time/", "time_share/"))
    for a, b in zip(full, resumed):
        assert {k: v for k, v in a.items() if not timed(k)} == {k: v for k, v in b.items() if not timed(k)}
    # where each step's time went: the rollout's phases and the update add up to the step
    for m in full:
        parts = [m[f"time/{p}"] for p in ("rollout", "reward", "reference", "update")]
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(m["time/step"], rel=0.02, abs=1e-3)
        assert sum(m[f"time_share/{p}"] for p in ("rollout", "reward", "reference", "update")) == pytest.approx(
            1.0, abs=0.02)
    assert full[0]["time/rollout"] > 0 and full[1]["time/rollout"] == 0  # the second step trains on the same rollout
    weights = load_file(str(tmp_path / "full" / "checkpoints" / "step_000006" / "model.safetensors"))
    again = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_000006" / "model.safetensors"))
    assert "value_head.weight" in weights and np.abs(weights["value_head.weight"]).max() > 0
    for name in weights:
        np.testing.assert_array_equal(weights[name], again[name], err_msg=name)


@pytest.mark.slow
def test_ppo_normalizes_scores_by_the_reward_models_val_statistics(tmp_path, base_checkpoint, reward_checkpoint):
    """With the statistics a stage=rm checkpoint saves (objectives/rm.py), a rollout's normalized score, which
    the first rollout's returns show at each response's last token (KL 0, values 0), is (score - mean) / std."""
    import shutil

    import mindspore as ms

    from base import checkpoint
    from data import build_data
    from models import build_model
    from objectives import objective

    rm = str(tmp_path / "rm")
    shutil.copytree(reward_checkpoint, rm)
    state = {k: v for k, v in checkpoint.read_state(rm).items() if k != "file_sizes"}
    checkpoint.write_state(rm, {**state, "objective": {"val_reward_mean": 0.3, "val_reward_std": 2.5,
                                                       "val_rewards": 64}})
    cfg = ppo_cfg(tmp_path, base_checkpoint, rm, "objective.missing_eos_penalty=0")
    validate(cfg)
    ppo = objective("ppo")
    data = build_data(cfg.data, 4, spec=ppo.row_spec(cfg.objective))
    model = build_model(cfg.model, cfg.data.seq_len, "fp32", "CPU", seed=0)
    checkpoint.load_weights(base_checkpoint, model)
    o = ppo.Objective(cfg.objective, data.tokenizer, 0)
    o.attach(model, cfg)
    tokens, mask, _, _, returns, _ = o.rollout(data.train.next_batch(), 0)[0]
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], 1)  # each response's last target position
    scores = o.reward_model(ms.Tensor(tokens[:, :-1]), ms.Tensor((last + 1).astype(np.int32))).asnumpy()
    np.testing.assert_allclose(returns[np.arange(4), last], (scores - 0.3) / 2.5, rtol=1e-5, atol=1e-6)
    assert o.score_moments[0] == 0 and o.logged["objective/kl"] == 0.0  # running moments unused; KL 0 as said


@pytest.fixture(scope="module")
def signed_vocabulary(tmp_path_factory, base_checkpoint, tokenizer_file):
    """(policy, reward model) checkpoints built by hand so that PPO can raise the reward within a few rollouts.

    Each token x gets a sign s_x = ±1 (half the vocabulary each) and one unit direction u is drawn. The reward
    model's embedding of x is s_x u and every layer's output projections (attention.wo, feed_forward.w2) are 0, so
    its final hidden state at the last token is RMSNorm(s_x u) = sqrt(hidden) s_x u, and its head u / sqrt(hidden)
    scores a response exactly +1 if its last token is in the + half, -1 otherwise. The policy is the base model
    with A s_x u added to token x's LM-head row: one direction of its final hidden state raises every + token's
    logit at once, a lever PPO's gradient finds from a few samples (the base model's near-uniform logits over
    4096 tokens give it no other)."""
    import mindspore as ms

    from base import checkpoint
    from models import build_model
    from objectives.rm import RewardModel

    lever = 0.2  # A: the + half starts with roughly sigmoid(2 A h.u) of a context's probability, h.u ~ N(0, 1)
    rng = np.random.default_rng(11)
    u = rng.normal(size=128)
    u /= np.linalg.norm(u)
    signs = rng.choice([-1.0, 1.0], 4096)[:, None]
    tmp = tmp_path_factory.mktemp("signed")
    cfg = compose_cfg("model=tiny")
    policy = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    checkpoint.load_weights(base_checkpoint, policy)
    params = {p.name: p for p in policy.get_parameters()}
    params["lm_head.weight"].set_data(ms.Tensor((params["lm_head.weight"].asnumpy() + lever * signs * u)
                                                .astype(np.float32)))
    policy_dir = checkpoint.save(str(tmp / "policy"), 1, policy, ms.nn.SGD(policy.trainable_params()), {}, cfg,
                                 tokenizer_file)
    cfg = compose_cfg("model=tiny", "stage=rm", f"stage.init_from={base_checkpoint}", "data=preferences")
    reward_model = RewardModel(build_model(cfg.model, 64, "fp32", "CPU", seed=3), seed=0)
    for p in reward_model.get_parameters():
        if p.name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
        elif p.name == "model.tok_embeddings.embedding_weight":
            p.set_data(ms.Tensor((signs * u).astype(np.float32)))
        elif p.name == "score.weight":
            p.set_data(ms.Tensor((u / np.sqrt(128))[None].astype(np.float32)))
    return policy_dir, checkpoint.save(str(tmp / "rm"), 1, reward_model,
                                       ms.nn.SGD(reward_model.trainable_params()), {}, cfg, tokenizer_file)


@pytest.mark.slow
def test_a_short_ppo_run_raises_the_mean_reward_model_score(tmp_path, signed_vocabulary):
    """6 rollouts, each of the same 32 prompts with three-token responses, 2 updates each at lr 1e-3: the mean
    score of the last 3 rollouts exceeds the first rollout's by >= 0.6 (30 points more responses ending in a +
    token). Every rollout holds every prompt, so the spread between rollouts is the sampling's alone. Measured
    when written, trainer.seed 1234 / 2 / 3: this run rises by 0.73 / 0.83 / 1.02, the same run at lr 0
    (validation refuses it; train() runs it) by 0.06 / 0.21 / 0.46, so the margin is the learning's."""
    from trainer.loop import train

    cfg = ppo_cfg(tmp_path, *signed_vocabulary, "objective.max_prompt_len=80", "objective.max_new_tokens=3",
                  "trainer.micro_batch_size=32", "trainer.max_steps=12", "optim.lr=1e-3", "optim.min_lr=0",
                  "trainer.save_every=0", counts=range(1, 5),
                  words=("apple", "river", "stone", "cloud", "green", "quick", "table", "light"))
    validate(cfg)
    train(cfg, str(tmp_path / "run"))
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = [m for m in lines if "objective/scores" in m][::2]  # a rollout's two steps log its numbers twice
    scores = [m["objective/scores"] for m in logged]
    assert len(scores) == 6
    assert all(abs(16 * s - round(16 * s)) < 0.02 for s in scores)  # means of 32 scores of ±1 (up to RMSNorm's eps)
    assert np.mean(scores[-3:]) - scores[0] >= 0.6, scores
    assert logged[0]["objective/kl"] == 0 < logged[-1]["objective/kl"]


@pytest.mark.parametrize("overrides,key,message", [
    ([], "objective.reward_model", "stage=ppo needs a reward model"),
    (["objective.reward_model=/nonexistent"], "objective.reward_model", "/nonexistent is not a checkpoint directory"),
    (["objective.reward_model=BASE"], "objective.reward_model", "is not a reward-model checkpoint"),
    (["objective.reward_model=RM", "objective.adaptive_kl=true", "objective.kl_target=0"], "objective.kl_target",
     "must be > 0"),
    (["objective.reward_model=RM", "objective.kl_estimator=k2"], "objective.kl_estimator", "choose one of k1, k3"),
    (["objective.reward_model=RM", "trainer.grad_accum=2"], "trainer.grad_accum", "one optimizer step per minibatch"),
    (["objective.reward_model=RM", "objective.max_new_tokens=1000", "data.seq_len=1024"], "objective.max_new_tokens",
     "must fit model.max_position_embeddings=1024"),
    (["objective.reward_model=RM", "objective.max_new_tokens=200"], "data.seq_len",
     "must hold objective.max_prompt_len + max_new_tokens = 328"),
    (["objective.reward_model=RM", "objective.reference=precomputed"], "objective.reference",
     "objective=ppo takes one of copy, lora_base"),
    (["objective.reward_model=RM", "objective.score_norm=whiten"], "objective.score_norm",
     "choose one of auto, rm_val, running"),
    (["objective.reward_model=RM", "objective.score_norm=rm_val"], "objective.score_norm",
     "state.json has no objective.val_reward_mean/val_reward_std"),
], ids=["no-rm", "missing-rm", "not-an-rm", "kl-target", "estimator", "grad-accum", "cache", "seq-len", "precomputed",
        "score-norm", "rm-val-missing"])
def test_bad_ppo_configs_are_refused(base_checkpoint, reward_checkpoint, overrides, key, message):
    overrides = [o.replace("=BASE", f"={base_checkpoint}").replace("=RM", f"={reward_checkpoint}") for o in overrides]
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("stage=ppo", f"stage.init_from={base_checkpoint}", "model=tiny", *overrides))
    assert err.value.key == key and message in str(err.value)


def test_a_reward_model_of_another_vocabulary_is_refused(tmp_path, base_checkpoint, reward_checkpoint):
    import shutil

    from omegaconf import OmegaConf

    other = tmp_path / "rm"
    shutil.copytree(reward_checkpoint, other)
    cfg = OmegaConf.load(other / "config.yaml")
    cfg.model.vocab_size = 8192
    OmegaConf.save(cfg, other / "config.yaml")
    with pytest.raises(ConfigError, match="its vocabulary \\(8192\\) differs from the policy's \\(4096\\)"):
        validate(compose_cfg("stage=ppo", f"stage.init_from={base_checkpoint}", "model=tiny",
                             f"objective.reward_model={other}"))


def test_a_reward_model_of_another_tokenizer_of_the_same_size_is_refused(tmp_path, base_checkpoint,
                                                                         reward_checkpoint):
    """Same vocabulary size, other pieces: a reward model that would read the policy's ids as other text (its
    tokenizer with two pieces' ids swapped) is refused at start, naming both sides."""
    import shutil

    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    other = tmp_path / "rm"
    shutil.copytree(reward_checkpoint, other)
    proto = model_pb2.ModelProto()
    proto.ParseFromString((other / "tokenizer.model").read_bytes())
    a, b = proto.pieces[100], proto.pieces[101]
    a.piece, b.piece = b.piece, a.piece
    (other / "tokenizer.model").write_bytes(proto.SerializeToString())
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("stage=ppo", f"stage.init_from={base_checkpoint}", "model=tiny",
                             f"objective.reward_model={other}"))
    assert err.value.key == "objective.reward_model"
    assert str(err.value).startswith(f"objective.reward_model: the reward model {other} and the policy's data use "
                                     f"different tokenizers ({other / 'tokenizer.model'}: sha256 ")
