"""BERT masked-LM pretraining through the plug-in architecture: the objective's config rules, the step's
loss-token weighting, a real run that resumes exactly after SIGKILL, and Hugging Face interop on its checkpoint."""
import json
import os
import signal

import numpy as np
import pytest
from omegaconf import OmegaConf

from base.validate import ConfigError, validate
from conftest import compose_cfg
from helpers import TINY_REF_DATA, losses, needs_corpora, run_in_process, start, wait_for_step, weights

SPECIALS = 'data.tokenizer.user_symbols=["[CLS]","[SEP]","[MASK]"]'
@pytest.mark.parametrize("overrides,key,message", [
    (["objective=mlm", SPECIALS], "objective", "objective=mlm needs a bidirectional encoder; model.family=llama"),
    (["model=bert_tiny"], "objective", "clm trains a causal decoder; model.family=bert attends both ways"),
    (["model=bert_tiny", "objective=mlm"], "data.tokenizer.user_symbols", "has no [CLS] [SEP] [MASK]"),
    (["model=bert_tiny", "objective=mlm", SPECIALS, "data.seq_len=1024"], "data.seq_len",
     "1024 exceeds model.max_position_embeddings=512"),
    (["model=bert_tiny", "objective=mlm", SPECIALS, "objective.sentence_task=nspp"], "objective.sentence_task",
     "choose one of nsp, sop, none"),
    (["model=bert_tiny", "objective=mlm", SPECIALS, "objective.mlm_probability=1.5"], "objective.mlm_probability",
     "must be in (0, 1)"),
    (["model=bert_tiny", "objective=mlm", SPECIALS, "parallel=tp8pp2", "dry_run=true"], "parallel",
     "the BERT family has no tensor/pipeline plan"),
], ids=["mlm-on-llama", "clm-on-bert", "no-mask-token", "seq-len", "sentence-task", "probability", "tp"])
def test_bad_mlm_configs_are_refused_naming_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert err.value.key == key and message in str(err.value)


def test_a_tokenizer_file_without_mask_is_refused(tokenizer_file):
    """A real sentencepiece model trained without data.tokenizer.user_symbols (the suite's Shakespeare one)."""
    cfg = compose_cfg("model=bert_tiny", "objective=mlm", f"data.tokenizer.path={tokenizer_file}")
    with pytest.raises(ConfigError, match=r"data.tokenizer.path: .*tokenizer.model has no \[CLS\] \[SEP\] \[MASK\] "
                                          r"piece; objective=mlm needs"):
        validate(cfg)


@pytest.mark.slow
def test_micro_batches_are_weighted_by_their_loss_tokens(pynative):
    """Two micro-batches with different numbers of loss tokens give the gradient and loss of one batch holding
    both (the mean over all loss tokens), not the mean of the two micro-batch means."""
    import mindspore as ms

    from conftest import load_preset
    from models import build_model
    from objectives.clm import Config, Objective
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer
    from helpers import optim_cfg

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, (6, 33)).astype(np.int32)
    labels = ids.copy()
    labels[:2, 3:30] = -100  # the first micro-batch keeps few loss tokens
    objective = Objective(Config(name="clm"))

    def run(micro_batches):
        # one layer: the weighting is the loss cell's and the step's, whatever the depth (fewer eager ops)
        model = build_model(OmegaConf.merge(load_preset("model", "tiny"), {"num_layers": 1}), 32, "fp32", "CPU", seed=0)
        optimizer = build_optimizer(model.trainable_params(), optim_cfg(lr=1e-2, eps=1e-4, schedule="constant"), 10)
        module = LocalModule(model, objective, optimizer, clip_grad_norm=0.0)
        result = module.step(micro_batches, 1.0)
        return result.loss, {p.name: p.asnumpy() for p in model.trainable_params()}

    whole_loss, whole = run([(ids, labels)])
    split_loss, split = run([(ids[:3], labels[:3]), (ids[3:], labels[3:])])
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    for name in whole:
        np.testing.assert_allclose(split[name], whole[name], atol=1e-6, err_msg=name)
    counts = [objective.loss_tokens((ids[:3], labels[:3])), objective.loss_tokens((ids[3:], labels[3:]))]
    assert counts[0] < counts[1] / 2  # the case where a mean of means would be wrong


RUN = ["model=bert_tiny", "objective=mlm", "data=wiki", "data.seq_len=64", "data.val_fraction=0.1", *TINY_REF_DATA,
       "trainer.micro_batch_size=4", "trainer.grad_accum=2", "trainer.max_steps=16", "optim.warmup_steps=4",
       "optim.lr=2e-3", "trainer.log_every=1", "trainer.eval_every=8", "trainer.eval_batches=2",
       "trainer.save_every=4", "logger.progress_bar=false"]


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    run_dir = str(root / "run")
    with pytest.MonkeyPatch.context() as mp:  # the data from the shared cache, as test_step_reference.py reads it
        code, _, err = run_in_process(run_dir, mp, *RUN)
    assert code == 0, err[-3000:]
    return root, run_dir


@pytest.mark.slow
@needs_corpora
def test_mlm_run_learns_and_logs_its_metrics(mlm_run):
    _, run_dir = mlm_run
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "val_loss" in m]
    assert {"mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"} <= set(steps[0])
    assert steps[0]["mlm_loss"] == pytest.approx(np.log(2048), abs=0.3)  # an untrained model guesses uniformly
    assert steps[0]["loss"] == pytest.approx(steps[0]["mlm_loss"] + steps[0]["nsp_loss"], rel=1e-5)
    assert steps[-1]["mlm_loss"] < steps[0]["mlm_loss"] - 0.5
    assert [m["step"] for m in evals] == [0, 8, 16]
    assert {"val_mlm_accuracy", "val_nsp_accuracy", "val_mlm_loss/reference"} <= set(evals[-1])
    assert evals[-1]["val_mlm_loss"] < evals[0]["val_mlm_loss"]


@pytest.mark.slow
@needs_corpora
def test_mlm_resume_after_sigkill_equals_the_uninterrupted_run(mlm_run, monkeypatch):
    """Masks are a function of (trainer.seed, sample index): the resumed run masks every batch as the
    uninterrupted one did, so losses and final weights are equal bit for bit."""
    root, reference = mlm_run
    run_dir = str(root / "killed")
    proc = start(run_dir, *RUN)  # a process: the kill
    wait_for_step(run_dir, 9, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    code, out, err = run_in_process(run_dir, monkeypatch, *RUN)
    assert code == 0, err[-3000:]
    assert "resumed from" in out
    assert losses(run_dir) == losses(reference)
    final = weights(os.path.join(run_dir, "checkpoints", "step_000016"))
    expected = weights(os.path.join(reference, "checkpoints", "step_000016"))
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)


@needs_corpora
@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_hf_export_of_an_mlm_checkpoint_gives_our_logits_on_real_text(mlm_run, tmp_path, pynative):
    """models.convert --to hf writes a BertForPreTraining that transformers loads with our MLM and NSP logits
    (within 1e-4) on validation rows of the run, masked as in training; --to mindlab brings it back exactly."""
    import torch
    from transformers import BertForPreTraining

    import mindspore as ms
    from data import build_data
    from models import build_model
    from models.convert import export_hf, import_hf
    from objectives.mlm import Config, Objective, row_spec

    root, run_dir = mlm_run
    ckpt = os.path.join(run_dir, "checkpoints", "step_000016")
    export_hf(ckpt, str(tmp_path / "hf"))
    cfg = OmegaConf.load(os.path.join(ckpt, "config.yaml"))
    ours = build_model(cfg.model, 64, "fp32", "CPU", seed=0)
    from base import checkpoint

    checkpoint.load_weights(ckpt, ours)
    data = build_data(cfg.data, 8, eval_batches=1, spec=row_spec(cfg.objective))
    objective = Objective(OmegaConf.merge(OmegaConf.structured(Config), cfg.objective), data.tokenizer)
    ids, types, mask, _, _ = objective.batch(data.val["reference"][0], -1)
    mlm, nsp = ours(*(ms.Tensor(a) for a in (ids, types, mask)))
    hf = BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), token_type_ids=torch.tensor(types, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long))
    real = mask.astype(bool)
    np.testing.assert_allclose(out.prediction_logits.numpy()[real], mlm.asnumpy()[real], atol=1e-4)
    np.testing.assert_allclose(out.seq_relationship_logits.numpy(), nsp.asnumpy(), atol=1e-4)
    assert (ids == data.tokenizer.piece_id("[MASK]")).any()  # real text, with masks in it

    from safetensors.numpy import load_file

    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back, original = load_file(str(tmp_path / "back" / "model.safetensors")), load_file(os.path.join(ckpt, "model.safetensors"))
    assert back.keys() == original.keys() and all(np.array_equal(back[k], original[k]) for k in original)
    assert OmegaConf.load(str(tmp_path / "back" / "config.yaml")).model.family == "bert"
