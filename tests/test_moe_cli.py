"""Every stage on a mixture-of-experts checkpoint, as a user runs it: `python -m recipe recipe=tiny_chat
recipe.common.model=moe_tiny` (pretrain -> SFT -> DPO -> `python -m evaluation` and `python -m generate` of the
pretrained checkpoint) as a real process, then LoRA SFT and a reward model from its checkpoints through the calls
`python train.py stage=sft peft=lora` and `stage=rm` make, in this process (train.py itself runs as each of the
recipe's training stages). The smallest settings (4 steps, synthetic instruction and preference files), each
checked against a reference (the training run's own validation loss, the in-process model's greedy tokens, a hand
count, DPO's and the reward loss's values at a policy equal to its reference)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import ROOT, compose_cfg, synthetic_pairs, write_jsonl

pytestmark = pytest.mark.slow
STEPS = "{max_steps:4,micro_batch_size:2,eval_every:4,save_every:4,eval_batches:1,log_every:2}"
PROMPT = "Repeat apple 3 times."
LAYERS = 2  # moe_tiny's shape, fewer layers: each process compiles its graphs in less time


def run(args, cwd=ROOT):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def stage_dir(root, name):
    [found] = [os.path.realpath(root / entry) for entry in os.listdir(root) if entry.endswith(f"-{name}")]
    return found


def train_as_cli(run_dir, *overrides):
    """`python train.py OVERRIDES hydra.run.dir=RUN_DIR` through the library calls it makes, in this process: the
    config composed, the model's shape and template taken from stage.init_from's checkpoint where not typed,
    validated, trained (a process would add its imports; the CLI itself runs as one in the recipe's stages)."""
    from base.checkpoint import inherit
    from base.validate import validate
    from trainer.loop import train

    cfg = compose_cfg(*overrides)
    inherit(cfg, {o.split("=", 1)[0] for o in overrides})
    validate(cfg)
    train(cfg, run_dir)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The recipe's four stages, then LoRA SFT from its pretrained checkpoint and a reward model from its SFT one."""
    tmp = tmp_path_factory.mktemp("moe_cli")
    rng = np.random.default_rng(0)
    words = ["apple", "river", "stone", "cloud", "green", "quick", "silent", "table"]
    sft = write_jsonl(tmp / "sft.jsonl", [{"instruction": f"Repeat {w} {n} times.", "input": "",
                                           "output": " ".join([w] * n)}
                                          for w, n in zip(rng.choice(words, 64), rng.integers(1, 6, 64))])
    pairs = synthetic_pairs(64, seed=1)
    train, val = write_jsonl(tmp / "pairs.jsonl", pairs[:48]), write_jsonl(tmp / "pairs_val.jsonl", pairs[48:])
    sft_data = f"{{name:repeat,seq_len:128,val_fraction:0.1,sources:[{{name:repeat,kind:alpaca,paths:[{sft}]}}]}}"
    prefs = f"[{{name:prefs,kind:preference,paths:[{train}],val_paths:[{val}]}}]"
    root = tmp / "recipe"
    run(["-m", "recipe", "recipe=tiny_chat", f"hydra.run.dir={root}", "recipe.common.model=moe_tiny",
         "recipe.datasets=[]", "+recipe.common.logger={progress_bar:false}",
         *(f"+recipe.stages.{name}.model={{num_layers:{LAYERS}}}" for name in ("pretrain", "sft", "dpo")),
         f"recipe.stages.pretrain.trainer={STEPS}", "+recipe.stages.pretrain.data={seq_len:64}",
         f"recipe.stages.sft.trainer={STEPS}", f"recipe.stages.sft.data={sft_data}",
         f"recipe.stages.dpo.trainer={STEPS}", f"recipe.stages.dpo.data={{name:prefs,seq_len:128,sources:{prefs}}}",
         "+recipe.stages.evaluate.of=pretrain", "+recipe.stages.evaluate.tasks=[]",
         "recipe.stages.evaluate.eval={batches:1}", f"recipe.stages.evaluate.prompts=[{PROMPT}]",
         "+recipe.stages.evaluate.max_new_tokens=8"])
    dirs = {name: stage_dir(root, name) for name in ("pretrain", "sft", "dpo", "evaluate")}
    common = ["model=moe_tiny", f"model.num_layers={LAYERS}", "logger.progress_bar=false",
              *(f"trainer.{kv.replace(':', '=')}" for kv in STEPS[1:-1].split(","))]
    dirs["lora"], dirs["rm"] = str(tmp / "lora"), str(tmp / "rm")
    train_as_cli(dirs["lora"], "stage=sft", "peft=lora", f"stage.init_from={dirs['pretrain']}", "data.name=repeat",
                 "data.seq_len=128", "data.val_fraction=0.1", f"data.sources=[{{name:repeat,kind:alpaca,paths:[{sft}]}}]",
                 *common)
    train_as_cli(dirs["rm"], "stage=rm", f"stage.init_from={dirs['sft']}", "data.name=prefs", "data.seq_len=128",
                 f"data.sources={prefs}", *common)
    return root, dirs


def test_the_recipe_runs_every_stage_on_the_moe_model(chain):
    root, dirs = chain
    record = json.loads((root / "recipe.json").read_text())
    assert [s["state"] for s in record["stages"]] == ["ran"] * 4
    for name in ("pretrain", "sft", "dpo"):
        cfg = OmegaConf.load(os.path.join(dirs[name], "config.yaml"))
        assert cfg.model.family == "moe" and cfg.model.name == "moe_tiny" and cfg.model.num_layers == LAYERS
        logged = [m for m in metrics(dirs[name]) if "loss" in m]
        assert [m["step"] for m in logged] == [2, 4]
        assert all(math.isfinite(m["loss"]) and m["dropped_share"] == 0.0 and m["expert_load_max"] >= 1.0
                   for m in logged)  # dropless routing; the busiest expert's load over the mean
    assert OmegaConf.load(os.path.join(dirs["sft"], "config.yaml")).stage.init_from == dirs["pretrain"]


def test_evaluate_gives_the_pretraining_runs_own_validation_loss(chain):
    _, dirs = chain
    evaluated = json.loads(open(os.path.join(dirs["evaluate"], "eval.json")).read())
    final = [m for m in metrics(dirs["pretrain"]) if "val_loss" in m][-1]
    assert final["step"] == 4 and evaluated["step"] == 4
    assert evaluated["data_eval"]["all"]["loss"] == pytest.approx(final["val_loss"], abs=1e-6)
    for source, scores in evaluated["data_eval"]["sources"].items():
        assert scores["loss"] == pytest.approx(final[f"val_loss/{source}"], abs=1e-6)


def test_generate_gives_the_in_process_models_greedy_tokens(chain, tmp_path):
    """`python -m generate` (the KV cache, dropless routing) against a full forward pass per token, argmax."""
    import mindspore as ms

    from data.samples import encode_parts, prompt_parts, template_of
    from models.pretrained import build, load

    _, dirs = chain
    [sample] = [json.loads(line) for line in open(os.path.join(dirs["evaluate"], "samples.jsonl"))]
    checkpoint = os.path.join(dirs["pretrain"], "checkpoints", "step_000004")
    model_cfg, path, tokenizer = load(checkpoint, str(tmp_path))
    model = build(model_cfg, path, "CPU")
    ids = encode_parts(tokenizer, prompt_parts({"instruction": PROMPT},
                                               template_of(OmegaConf.load(os.path.join(path, "config.yaml")))))[0]
    new, width = [], len(ids) + sample["new_tokens"]  # one shape (one graph): the causal rows ignore the padding
    for _ in range(sample["new_tokens"]):
        row = ids + new
        logits = model(ms.Tensor(np.array([row + [0] * (width - len(row))], np.int32))).asnumpy()
        new.append(int(logits[0, len(row) - 1].argmax()))
    assert sample["finish_reason"] == "length" and tokenizer.decode(new) == sample["completion"]


def test_full_sft_and_lora_start_from_the_same_model_and_lora_trains_the_attention_only(chain):
    """LoRA's zero-initialised B: its step-0 validation loss is the full fine-tune's (same checkpoint, same rows).
    Its default targets on a MoE model are the four attention projections (the experts are stacked Parameters,
    not linear cells): r x (in + out) = 8 x (256 + 192 + 192 + 256) per layer."""
    from safetensors.numpy import load_file

    _, dirs = chain
    full, lora = metrics(dirs["sft"]), metrics(dirs["lora"])
    assert lora[0]["step"] == full[0]["step"] == 0
    assert lora[0]["val_loss"] == pytest.approx(full[0]["val_loss"], abs=1e-5)
    assert full[-1]["val_loss"] < full[0]["val_loss"]
    adapter = json.load(open(os.path.join(dirs["lora"], "checkpoints", "step_000004", "adapter_config.json")))
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    trained = load_file(os.path.join(dirs["lora"], "checkpoints", "step_000004", "model.safetensors"))
    assert sorted(trained) == sorted(f"model.layers.{i}.attention.{w}.lora_{ab}.weight" for i in range(LAYERS)
                                     for w in ("wq", "wk", "wv", "wo") for ab in "AB")  # what LoRA trained, only
    assert sum(v.size for v in trained.values()) == LAYERS * 8 * (256 + 192 + 192 + 256)


def test_dpo_and_the_reward_model_start_at_their_reference_values(chain):
    """At step 0 DPO's policy is its reference: every margin 0, the validation loss ln 2 (the router's auxiliary
    loss, which training adds, is not in it). The reward loss is the mean of -log sigmoid(r_chosen - r_rejected -
    margin) over pairs of margin 1, at least -log sigmoid(mean - 1) (Jensen)."""
    _, dirs = chain
    dpo = metrics(dirs["dpo"])[0]
    assert dpo["step"] == 0 and dpo["val_rewards/margins"] == 0.0 and dpo["val_rewards/accuracies"] == 0.0
    assert dpo["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    rm = metrics(dirs["rm"])
    assert rm[0]["step"] == 0 and rm[-1]["step"] == 4
    bound = -math.log(1 / (1 + math.exp(-(rm[0]["val_margin"] - 1.0))))
    assert bound <= rm[0]["val_loss"] < bound + 1.0
    assert all(math.isfinite(m.get("loss", m.get("val_loss"))) for m in rm)
