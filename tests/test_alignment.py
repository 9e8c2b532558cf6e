"""Alignment: preference pairs (format, rows, the rule-built set), the reward model's and DPO's losses against
hand computations, short real RM and DPO runs, and their bad inputs."""
import json

import numpy as np
import pytest

from base.validate import ConfigError, validate
from conftest import compose_cfg, load_preset, pair_cfg, synthetic_pairs, write_jsonl
from data import DataError
from objectives.sft import IGNORE_INDEX

PAIRS = [{"instruction": "Name the colour of the sky.", "chosen": "Blue.", "rejected": "Green.", "margin": 0.5},
         {"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"},
         {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
          "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello hello hello"}]}]


def test_pairs_become_rows_with_loss_on_the_responses_only(tmp_path, base_checkpoint):
    from data import build_data
    from objectives import objective

    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = pair_cfg(tmp_path, base_checkpoint, "dpo", path, path)
    data = build_data(cfg.data, 3, spec=objective("dpo").row_spec(cfg.objective), eval_batches=1)
    rows = data.val["prefs"][0]
    tok = data.tokenizer
    assert rows["margin"].reshape(-1).tolist() == [0.5, 0.0, 0.0]
    for i in range(3):
        c_ids, r_ids = rows["chosen_ids"][i], rows["rejected_ids"][i]
        c_lab, r_lab = rows["chosen_labels"][i], rows["rejected_labels"][i]
        prompt = int(np.argmax(c_lab != IGNORE_INDEX))  # the first loss token starts the response
        assert prompt > 0 and np.array_equal(c_ids[:prompt], r_ids[:prompt])  # one prompt, no loss on it
        assert (c_lab[:prompt] == IGNORE_INDEX).all() and (r_lab[:prompt] == IGNORE_INDEX).all()
        for ids, labels in ((c_ids, c_lab), (r_ids, r_lab)):
            end = int(np.nonzero(labels != IGNORE_INDEX)[0][-1])
            assert ids[end] == tok.eos_id and labels[end] == tok.eos_id  # the eos closing the response counts
            assert (ids[end + 1:] == tok.pad_id).all() and (labels[end + 1:] == IGNORE_INDEX).all()
            assert ids[-1] == tok.pad_id  # a side holds at most seq_len tokens
        assert tok.decode(c_ids[prompt:end].tolist()).strip() in ("Blue.", "5", "Hello.")
    assert "Hello hello hello" in tok.decode(rows["rejected_ids"][2].tolist())


@pytest.mark.parametrize("record,message", [
    ({"instruction": "x", "chosen": "same", "rejected": "same"}, r"pairs.jsonl:2: chosen and rejected are identical"),
    ({"instruction": "x", "chosen": "a"}, r"pairs.jsonl:2: no field 'rejected' \(keys: chosen, instruction\)"),
    ({"chosen": "a", "rejected": "b"}, r"pairs.jsonl:2: no prompt"),
    ({"prompt": "x", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     r"pairs.jsonl:2: 'chosen' and 'rejected' must both be strings or both be chat message lists"),
    ({"prompt": "x", "chosen": "a", "rejected": "b", "margin": -1}, r"pairs.jsonl:2: 'margin' must be a number >= 0"),
], ids=["identical", "missing-field", "no-prompt", "mixed-types", "negative-margin"])
def test_bad_pairs_name_the_file_and_line(tmp_path, base_checkpoint, record, message):
    from data.cache import prepare

    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], record])
    cfg = pair_cfg(tmp_path, base_checkpoint, "rm", path, path)
    with pytest.raises(DataError, match=message):
        prepare(cfg.data)
    assert not list((tmp_path / "cache").glob("*/tokens"))  # nothing half-built was left


def test_rule_built_pairs_follow_their_rules():
    from builders.preferences import MARGINS, make_pairs, sentences

    entries = ["apple", "Banana", "cherry", "date", "elder"]
    samples = [{"instruction": f"Define {e}.", "input": "", "task": "define", "entry": e,
                "output": f"The {e} grows in Spain since 1850. It is sweet and round. People in Peru eat it raw."}
               for e in entries]
    pairs = make_pairs([dict(s) for s in samples], seed=0)
    assert [p["corruption"] for p in pairs] == ["neighbour", "loop", "fact_swap", "shuffle", "truncate"]
    by_rule = {p["corruption"]: p for p in pairs}
    assert by_rule["neighbour"]["rejected"] == samples[1]["output"]  # apple's neighbour in casefolded order
    assert all(p["margin"] == MARGINS[p["corruption"]] for p in pairs)
    loop = by_rule["loop"]["rejected"].split()
    assert loop[-3:] == loop[-6:-3] == loop[-9:-6]  # the same 3 words over and over
    swapped = by_rule["fact_swap"]
    assert swapped["rejected"] != swapped["chosen"]
    assert len(swapped["rejected"].split()) == len(swapped["chosen"].split())
    assert sorted(sentences(by_rule["shuffle"]["rejected"])) == sorted(sentences(by_rule["shuffle"]["chosen"]))
    cut = by_rule["truncate"]
    assert cut["chosen"].startswith(cut["rejected"]) and not cut["rejected"].endswith(".")


def hand_rouge_l(prediction, reference):
    """ROUGE-L F1 = 2 LCS / (len(p) + len(r)) over whitespace words, LCS by the textbook recursion (not
    evaluation/tasks.py's dynamic program)."""
    import functools

    p, r = tuple(prediction.split()), tuple(reference.split())

    @functools.lru_cache(maxsize=None)
    def lcs(i, j):
        if i == len(p) or j == len(r):
            return 0
        return lcs(i + 1, j + 1) + 1 if p[i] == r[j] else max(lcs(i + 1, j), lcs(i, j + 1))

    return 2 * lcs(0, 0) / (len(p) + len(r)) if p and r else 0.0


@pytest.mark.slow
def test_on_policy_pairs_are_the_best_and_worst_of_the_models_samples(tmp_path, monkeypatch, base_checkpoint):
    """k = 4 samples per prompt from the tiny checkpoint, drawn once here with the command's random streams;
    the corpus answers are then made from them (one verbatim, others mixing two samples' words, one sharing
    nothing), so the ranks are known by hand. The command pairs the best against the worst sample wherever
    their ROUGE-L differ by >= --min-gap, writes the same bytes whatever the batch size, and the pairs load
    as preference data."""
    import models.pretrained
    from data.cache import prepare
    from builders.preferences import main, sample_responses
    from evaluation.tasks import alpaca_item
    from models.generation import SamplingOptions, generator, make_generate_fn
    from models.pretrained import build, load

    k, opts = 4, ["--samples", "4", "--max-new-tokens", "8", "--max-prompt-len", "80", "--seed", "5"]
    splits = {"train": [f"Say {w} {n} times." for w in ("apple", "stone") for n in (2, 3)],
              "val": ["Name a colour.", "Count to four."]}
    model_cfg, path, tokenizer = load(base_checkpoint, str(tmp_path / "unused"))
    model = build(model_cfg, path, "CPU")

    def built(cfg, at, device, precision="auto"):  # the command's model: this one, read from the same checkpoint,
        assert (cfg, at, device, precision) == (model_cfg, path, "CPU", "auto")  # its batch-8 graphs compiled here
        return model

    monkeypatch.setattr(models.pretrained, "build", built)
    generate_fn = make_generate_fn(generator(model_cfg.family, model), tokenizer, batch_size=8)
    drawn = {}
    for split, instructions in splits.items():
        prompts = [alpaca_item({"instruction": i, "output": ""})["prompt"] for i in instructions]
        drawn[split] = [[r.strip() for r in rs] for rs in sample_responses(
            generate_fn, prompts, range(len(prompts)), k, 8, sampling=SamplingOptions(temperature=1.0, seed=5),
            prompt_len=80)]
    assert all(r for rs in drawn["train"] + drawn["val"] for r in rs)

    def answer(i, rs):  # verbatim; half of one and half of another; nothing in common; verbatim, cut
        words = [r.split() for r in rs]
        return [rs[2], " ".join(words[1][:len(words[1]) // 2] + words[3][len(words[3]) // 2:]), "zz yy xx",
                " ".join(words[0][:-1]) or rs[0]][i % 4]

    (tmp_path / "inst").mkdir()
    for split, instructions in splits.items():
        write_jsonl(tmp_path / "inst" / f"{split}.jsonl",
                    [{"instruction": ins, "input": "", "output": answer(i + (split == "val"), drawn[split][i]),
                      "task": "say", "entry": f"{split}{i}"} for i, ins in enumerate(instructions)])
    for out, batch in (("a", "8"), ("b", "3")):
        assert main([*opts, "--on-policy", base_checkpoint, "--instructions", str(tmp_path / "inst"),
                     "--out", str(tmp_path / out), "--batch-size", batch]) == 0
    for split in splits:
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    expected = 0
    for split, instructions in splits.items():
        samples = [json.loads(line) for line in open(tmp_path / "inst" / f"{split}.jsonl")]
        pairs = {p["entry"]: p for p in map(json.loads, open(tmp_path / "a" / f"{split}.jsonl"))}
        for s, rs in zip(samples, drawn[split]):
            ranked = sorted((r.strip() == s["output"].strip(), hand_rouge_l(r, s["output"]), r) for r in set(rs))
            gap = ranked[-1][1] - ranked[0][1]
            if gap < 0.1:
                assert s["entry"] not in pairs
                continue
            expected += 1
            p = pairs[s["entry"]]
            assert p["corruption"] == "on_policy" and p["chosen"] != p["rejected"]
            assert p["chosen"] in rs and p["rejected"] in rs  # the model's own samples
            for side, at, want in (("chosen", 0, ranked[-1]), ("rejected", 1, ranked[0])):  # the best, the worst
                hand = (p[side] == s["output"].strip(), hand_rouge_l(p[side], s["output"]))
                assert hand == pytest.approx(want[:2]) and hand == pytest.approx(
                    (p["exact_match"][at], p["rouge_l"][at]), abs=1e-4)
            assert p["margin"] == pytest.approx(gap, abs=1e-4)
        assert len(pairs) == len([s for s in samples if s["entry"] in pairs])  # pairs of this split's prompts only
    assert expected >= 4 and json.load(open(tmp_path / "a" / "stats.json"))["splits"]["train"]["prompts"] == 4
    verbatim = json.loads(open(tmp_path / "a" / "train.jsonl").readline())
    assert verbatim["exact_match"] == [True, False] and verbatim["chosen"] == drawn["train"][0][2]
    cfg = pair_cfg(tmp_path, base_checkpoint, "dpo", tmp_path / "a" / "train.jsonl", tmp_path / "a" / "val.jsonl")
    prepare(cfg.data)  # the preference loader takes them (it refuses identical or empty sides)


@pytest.fixture(scope="module")
def models():
    from models import build_model

    cfg = load_preset("model", "tiny")
    reference = build_model(cfg, 32, "fp32", "CPU", seed=1)
    reference.update_parameters_name("reference.")  # as objectives/dpo.py names its copy
    return build_model(cfg, 32, "fp32", "CPU", seed=0), reference


def sequence_logps(model, ids, labels):
    """Per row: the sum of log p(label) over labelled targets, and their count (NumPy, float64)."""
    import mindspore as ms

    logits = model(ms.Tensor(ids[:, :-1])).asnumpy().astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    target, keep = labels[:, 1:], labels[:, 1:] != IGNORE_INDEX
    picked = np.take_along_axis(logp, np.where(keep, target, 0)[..., None], -1)[..., 0]
    return (picked * keep).sum(1), keep.sum(1), logp, keep


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


@pytest.mark.parametrize("loss,ls,nll", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.5), ("ipo", 0.0, 0.0),
                                         ("hinge", 0.0, 0.0)])
def test_dpo_losses_and_metrics_equal_a_hand_computation(pynative, models, loss, ls, nll):
    import mindspore as ms
    from omegaconf import OmegaConf

    from objectives.dpo import Config, PreferenceLoss

    policy, reference = models
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 4096, (4, 33)).astype(np.int32)
    labels = np.where(np.arange(33) >= rng.integers(5, 20, (4, 1)), ids, IGNORE_INDEX).astype(np.int32)
    beta = 0.3
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"name": "dpo", "beta": beta, "loss": loss,
                                                         "label_smoothing": ls, "nll_coefficient": nll})
    out = [float(x.asnumpy()) for x in PreferenceLoss(policy, reference, cfg)(
        *(ms.Tensor(x) for x in (ids[:2], labels[:2], ids[2:], labels[2:])))]
    pi, n, logp, keep = sequence_logps(policy, ids, labels)
    ref, _, ref_logp, _ = sequence_logps(reference, ids, labels)
    lp, lr_ = (pi / n, ref / n) if loss == "ipo" else (pi, ref)
    h = (lp[:2] - lp[2:]) - (lr_[:2] - lr_[2:])
    expected = {"sigmoid": (1 - ls) * softplus(-beta * h) + ls * softplus(beta * h),
                "ipo": (h - 1 / (2 * beta)) ** 2, "hinge": np.maximum(0, 1 - beta * h)}[loss].mean()
    expected -= nll * pi[:2].sum() / n[:2].sum()
    rc, rr = beta * (lp[:2] - lr_[:2]), beta * (lp[2:] - lr_[2:])  # ipo: per-token means, as TRL
    kl = ((np.exp(logp) * (logp - ref_logp)).sum(-1) * keep).sum() / keep.sum()
    want = [expected, rc.mean(), rr.mean(), (rc > rr).mean(), (rc - rr).mean(), pi[:2].mean(), pi[2:].mean(), kl]
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6)
    assert kl > 0


def test_reward_model_loss_and_metrics_equal_a_hand_computation(pynative, models):
    import mindspore as ms

    from objectives.rm import PairwiseLoss, RewardModel

    lm, _ = models
    reward_model = RewardModel(lm, seed=0)
    assert {p.name for p in reward_model.get_parameters()} == \
        {p.name for p in lm.get_parameters() if not p.name.startswith("lm_head")} | {"score.weight"}
    w = reward_model.score.asnumpy()
    assert abs(w.std() - 1 / np.sqrt(w.shape[1] + 1)) < 0.2 / np.sqrt(w.shape[1])
    rng = np.random.default_rng(2)
    ids = rng.integers(4, 4096, (4, 32)).astype(np.int32)
    ends = np.array([31, 7, 20, 12], np.int32)
    margin = np.array([0.0, 1.0], np.float32)
    hidden = lm.model(ms.Tensor(ids)).asnumpy().astype(np.float64)
    rewards = hidden[np.arange(4), ends] @ w[0]
    diff = rewards[:2] - rewards[2:]
    out = [float(x.asnumpy()) for x in PairwiseLoss(reward_model, 0.1)(
        *(ms.Tensor(x) for x in (ids[:2], ends[:2], ids[2:], ends[2:], margin)))]
    want = [softplus(margin - diff).mean() + 0.1 * ((rewards[:2] + rewards[2:]) ** 2).mean(), (diff > 0).mean(),
            diff.mean(), rewards.mean(), (rewards ** 2).mean(), rewards.min(), rewards.max()]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def alignment_runs(tmp_path_factory, base_checkpoint):
    """DPO (a LoRA policy, reference = its frozen base) and a reward model, 20 steps each from the same
    checkpoint on the synthetic pairs, evaluated on held-out pairs at steps 10 and 20."""
    from trainer.loop import train

    tmp = tmp_path_factory.mktemp("align")
    train_path = write_jsonl(tmp / "train.jsonl", synthetic_pairs(160, 0))
    val_path = write_jsonl(tmp / "val.jsonl", synthetic_pairs(32, 1))
    common = ("trainer.micro_batch_size=8", "trainer.eval_batches=4", "trainer.log_every=1", "data.seq_len=80",
              "optim.warmup_steps=2")
    runs = {}
    for stage, extra in (("dpo", ("peft=lora", "objective.reference=lora_base", "optim.lr=5e-3")),
                         ("rm", ("optim.lr=1e-3",))):
        cfg = pair_cfg(tmp, base_checkpoint, stage, train_path, val_path, "trainer.max_steps=20",
                       "trainer.eval_every=10", *common, *extra)
        validate(cfg)
        train(cfg, str(tmp / stage))
        lines = [json.loads(line) for line in open(tmp / stage / "metrics.jsonl")]
        runs[stage] = [m for m in lines if "val_loss" in m], [m for m in lines if "loss" in m]
    return tmp, runs


@pytest.mark.slow
def test_dpo_with_a_lora_policy_raises_held_out_preference_accuracy_above_chance(alignment_runs):
    tmp, runs = alignment_runs
    evals, steps = runs["dpo"]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-3)  # policy == reference before the first update
    assert steps[0]["kl"] < 1e-6 < evals[-1]["val_kl"]
    # 0.7 of 32 held-out pairs: P(>= 23 of 32 | chance 0.5) ~ 1%
    assert evals[-1]["val_rewards/accuracies"] >= 0.7 and evals[-1]["val_rewards/margins"] > 0
    assert evals[-1]["val_loss"] < np.log(2) - 0.05


@pytest.mark.slow
def test_reward_model_learns_held_out_pairs_and_saves_its_head(alignment_runs):
    from safetensors.numpy import load_file

    tmp, runs = alignment_runs
    evals, _ = runs["rm"]
    assert evals[-1]["val_accuracy"] >= 0.8 and evals[-1]["val_loss"] < np.log(2) - 0.05
    weights = load_file(str(tmp / "rm" / "checkpoints" / "step_000020" / "model.safetensors"))
    assert "score.weight" in weights and weights["score.weight"].shape == (1, 128)
    assert not any(k.startswith("lm_head") for k in weights)


@pytest.mark.slow
def test_a_reward_models_checkpoint_holds_its_val_reward_mean_and_std(alignment_runs):
    """The statistics PPO normalizes by equal those the run logged at the same step: mean = val_mean_reward,
    std = sqrt(val_reward_sq - val_mean_reward^2)."""
    tmp, runs = alignment_runs
    logged = runs["rm"][0][-1]
    state = json.loads((tmp / "rm" / "checkpoints" / "step_000020" / "state.json").read_text())["objective"]
    mean, sq = logged["val_mean_reward"], logged["val_reward_sq"]
    assert logged["step"] == 20 and state["val_rewards"] == 64  # 4 batches of 8 pairs, both sides
    np.testing.assert_allclose([state["val_reward_mean"], state["val_reward_std"]], [mean, np.sqrt(sq - mean ** 2)],
                               rtol=1e-5, atol=1e-6)
    assert state["val_reward_std"] > 0.01


@pytest.mark.parametrize("overrides,key,message", [
    (["stage=dpo"], "stage.init_from", "objective=dpo fine-tunes a pretrained model"),
    (["stage=rm", "stage.init_from=/x", "data=instructions"], "data.sources",
     "objective=rm trains on sources of kind preference, feedback, rated, hh, auto, not alpaca"),
    (["stage=dpo", "stage.init_from=/x", "data=preferences", "objective.beta=0"], "objective.beta", "must be > 0"),
    (["stage=dpo", "stage.init_from=/x", "data=preferences", "objective.loss=kto"], "objective.loss",
     "choose one of sigmoid, ipo, hinge"),
    (["stage=dpo", "stage.init_from=/x", "data=preferences", "objective.reference=lora_base"], "objective.reference",
     "set peft=lora"),
    (["stage=dpo", "stage.init_from=/x", "data=preferences", "objective.loss=ipo", "objective.label_smoothing=0.1"],
     "objective.label_smoothing", "applies to loss=sigmoid only"),
    (["stage=dpo", "stage.init_from=/x", "data=preferences", "objective.reference=cached"], "objective.reference",
     "objective=dpo takes one of copy, lora_base, precomputed"),
], ids=["no-init", "instructions", "beta", "loss", "lora-base", "smoothing", "reference"])
def test_bad_alignment_configs_are_refused(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert err.value.key == key and message in str(err.value)


def test_reward_model_exports_as_a_sequence_classifier_with_equal_scores(tmp_path, models, pynative):
    """A reward-model checkpoint -> transformers' LlamaForSequenceClassification: equal scores on right-padded
    rows (it reads the last non-pad token, we read the eos)."""
    import mindspore as ms
    import torch
    from transformers import LlamaForSequenceClassification

    from base import checkpoint
    from models.convert import export_hf
    from models.llama.hf import EOS_ID, PAD_ID
    from objectives.rm import RewardModel

    lm, _ = models
    reward_model = RewardModel(lm, seed=4)
    cfg = compose_cfg("model=tiny", "stage=rm", "stage.init_from=/x", "data=preferences")
    ckpt = checkpoint.save(str(tmp_path / "rm"), 1, reward_model, ms.nn.SGD(reward_model.trainable_params()), {},
                           cfg, None)
    export_hf(ckpt, str(tmp_path / "hf"))
    hf = LlamaForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    rng = np.random.default_rng(5)
    ids = rng.integers(4, 4096, (3, 24)).astype(np.int32)
    ends = np.array([23, 9, 15], np.int32)
    for row, end in zip(ids, ends):
        row[end], row[end + 1:] = EOS_ID, PAD_ID
    ours = reward_model(ms.Tensor(ids), ms.Tensor(ends)).asnumpy()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
