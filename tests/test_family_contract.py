"""The family contract (base/family.py): a family defined only in this file, registered as a family package
registers itself, gets the dry run, training (a step and its evaluation: bits per byte through the causal-LM
interface) and the Hugging Face export, nothing outside this file changed; one lacking a member is refused at
registration in one line naming what is missing."""
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from base.family import ContractError, Family, FamilyConfig


@dataclass
class BigramConfig(FamilyConfig):
    family: str = "bigram"


def build(cfg, seq_len, compute_dtype, use_flash, seed, sharded=False):
    """A bigram LM as a CausalLM: embedding -> RMSNorm -> head (the models/common/ blocks)."""
    from mindspore import nn

    from models.common.causal_lm import CausalLM
    from models.common.layers import DTYPES, Embedding, Linear, RMSNorm

    class Trunk(nn.Cell):
        def __init__(self, rng):
            super().__init__()
            self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, rng)
            self.norm_out = RMSNorm(cfg.hidden_size, 1e-5)

        def construct(self, tokens, positions=None, segments=None):
            return self.norm_out(self.tok_embeddings(tokens))

    class Bigram(CausalLM):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(seed)
            self.hidden_size, self.tie_embeddings, self.compute_dtype = cfg.hidden_size, False, DTYPES[compute_dtype]
            self.model = Trunk(rng)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std, rng, self.compute_dtype)

        def layers(self):
            return []

    return Bigram()


def parameter_count(m):
    counts = {"embedding": m.vocab_size * m.hidden_size, "final_norm": m.hidden_size,
              "lm_head": m.vocab_size * m.hidden_size}
    return {**counts, "total": sum(counts.values())}


HF_NAMES = {"model.tok_embeddings.embedding_weight": "embed.weight", "model.norm_out.weight": "norm.weight",
            "lm_head.weight": "head.weight"}
HF = SimpleNamespace(ARCHITECTURES=("BigramForCausalLM",), to_hf=lambda w: {HF_NAMES[k]: v for k, v in w.items()},
                     from_hf=lambda w, c: {k: w[v] for k, v in HF_NAMES.items()},
                     hf_config=lambda m: {"architectures": ["BigramForCausalLM"], "vocab_size": m.vocab_size,
                                          "hidden_size": m.hidden_size},
                     config_from_hf=lambda c, where: {"family": "bigram", "vocab_size": c["vocab_size"],
                                                      "hidden_size": c["hidden_size"], "num_layers": 1, "num_heads": 1},
                     save_tokenizer=lambda tokenizer_file, out_dir, chat_template=None: None)
MEMBERS = dict(
    Config=BigramConfig, CAUSAL=True, build=build, check=lambda cfg: None,
    describe=lambda m, count: [f"  a bigram table of {count(m.vocab_size * m.hidden_size)} x 2"],
    recompute_cells=lambda model, mode: [], attention_kind=lambda cfg, target, dtype, sharded: "plain",
    parameter_count=parameter_count, matmul_parameter_count=lambda m: m.vocab_size * m.hidden_size,
    flops_per_token=lambda m, seq_len: 6.0 * m.vocab_size * m.hidden_size,
    stage_parameters=lambda m, p: [parameter_count(m)["total"]], layer_activation_factors=lambda m: (1.0, 0.0),
    hf=HF)


@pytest.fixture
def bigram(monkeypatch):
    """`model.family=bigram`, registered as a family package registers itself (models/__init__.py)."""
    from base.registry import FAMILIES
    from plugins import register

    register()
    FAMILIES.add("bigram", SimpleNamespace(__name__="tests.bigram", **MEMBERS))
    register()  # its schema, base_model_bigram
    yield
    FAMILIES.remove("bigram")


def test_a_family_missing_members_is_refused_in_one_line_naming_them():
    partial = SimpleNamespace(__name__="models.half", **{k: v for k, v in MEMBERS.items()
                                                        if k not in ("matmul_parameter_count", "hf")})
    with pytest.raises(ContractError) as err:
        Family("half", partial)
    message = str(err.value)
    assert message == ("model family 'half' (models.half) lacks matmul_parameter_count, hf: a family provides "
                       "what base/family.py REQUIRED lists (docs/extending.md)")
    hf_less = SimpleNamespace(__name__="models.half", **dict(MEMBERS, hf=SimpleNamespace(to_hf=HF.to_hf)))
    with pytest.raises(ContractError, match=r"lacks hf\.ARCHITECTURES, hf\.from_hf, hf\.hf_config, "
                                            r"hf\.config_from_hf, hf\.save_tokenizer:"):
        Family("half", hf_less)
    assert Family("bigram", SimpleNamespace(__name__="x", **MEMBERS)).generator is None  # optional: None


def test_an_objective_missing_members_is_refused_in_one_line_naming_them():
    from base.objective import ObjectiveBase, ObjectivePlugin

    class Half(ObjectiveBase):
        def batch(self, rows, sample):
            return ()

    module = SimpleNamespace(__name__="objectives.half", Config=BigramConfig, check=lambda cfg: None, Objective=Half)
    with pytest.raises(ContractError) as err:
        ObjectivePlugin("half", module)
    assert str(err.value) == ("objective 'half' (objectives.half) lacks row_spec, Objective.loss_tokens, "
                              "Objective.loss_cell: an objective provides what base/objective.py REQUIRED lists "
                              "(objectives/__init__.py)")
    assert Half.token_nll is None and Half.console == ()  # the optional hooks, absent


def test_every_registered_family_keeps_the_contract_on_its_presets():
    """parameter_count's total (and lm_head for a causal family), active matmul weights no more than the total (what the planner's time
    model, RM, PPO and the reference model read), for every preset of every registered family."""
    from conftest import ROOT, load_preset
    from models import family

    names = sorted(p.removesuffix(".yaml") for p in os.listdir(os.path.join(ROOT, "conf", "model")))
    families = set()
    for name in names:
        m = load_preset("model", name)
        fam = family(m.family)
        families.add(m.family)
        counts = fam.parameter_count(m)
        assert {"total", "lm_head"} <= set(counts) if fam.CAUSAL else "total" in counts, name
        assert 0 < fam.matmul_parameter_count(m) <= counts["total"] + m.vocab_size * m.hidden_size, name
        assert fam.flops_per_token(m, 2048) > 6 * fam.matmul_parameter_count(m), name
    assert families == {"llama", "bert", "moe"}


@pytest.mark.slow
def test_a_family_defined_in_a_test_plans_trains_evaluates_and_exports(bigram, tokenizer_file, tmp_path):
    from conftest import compose_cfg
    from models.convert import export_hf
    from planner.dry_run import dry_run_report
    from safetensors.numpy import load_file
    from helpers import shakespeare_data
    from trainer.loop import train

    overrides = ("trainer.max_steps=2", "trainer.micro_batch_size=2", "trainer.eval_batches=1", "trainer.eval_every=2",
                 "trainer.log_every=1", "logger.progress_bar=false", "optim.warmup_steps=1", "optim.lr=1e-2")
    cfg = compose_cfg(*overrides)
    cfg.model = OmegaConf.structured(BigramConfig(name="bigram", vocab_size=4096, hidden_size=16, num_layers=1,
                                                  num_heads=1))
    cfg.data = shakespeare_data(tokenizer_file)
    report = dry_run_report(cfg)
    assert "model bigram: 131.09K parameters (131,088)" in report and "a bigram table of 65.54K x 2" in report
    last = train(cfg, str(tmp_path / "run"))
    evals = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "val_bpb" in line]
    assert [m["step"] for m in evals] == [0, 2] and last["val_bpb"] < evals[0]["val_bpb"]
    export_hf(str(tmp_path / "run" / "checkpoints" / "step_000002"), str(tmp_path / "hf"))
    assert sorted(load_file(str(tmp_path / "hf" / "model.safetensors"))) == ["embed.weight", "head.weight",
                                                                          "norm.weight"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BigramForCausalLM"]
