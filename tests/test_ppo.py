"""PPO: the rollout's numbers (KL estimators, GAE, whitening) against plain reference loops, the clipped losses
against a hand computation, a short real run that resumes exactly, and its bad inputs."""
import json
import math

import numpy as np
import pytest

from conf.validate import ConfigError, validate
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
