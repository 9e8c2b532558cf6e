"""Templates: the article's own (alpaca_zh) against its text, a template typed on the command line meaning what
was typed, and a template travelling with the checkpoint into later stages, generation and the export, with the
model's shape (base/checkpoint.py inherit)."""
import json
import os

import pytest
from omegaconf import OmegaConf

from base.checkpoint import inherit
from base.schema import TemplateConfig
from conftest import compose_cfg, invoke, train_main
from data import DataError
from data.samples import chat_template, render, template_of, template_parts

# the article's instruction tuning: f"### 指令: {inst}\n### 输入: {inp}\n### 输出: {out}", its reward model's
# inputs: f"### 指令: {prompt}\n### 输出: {res1}"
ARTICLE = "### 指令: {inst}\n### 输入: {inp}\n### 输出: {out}"
ARTICLE_RM = "### 指令: {prompt}\n### 输出: {res1}"


def parts(**keys):
    return template_parts(OmegaConf.merge(OmegaConf.structured(TemplateConfig), keys))


def text_of(sample, t):
    return "".join(text for text, _ in render(sample, t) if text is not None)


def test_alpaca_zh_is_the_articles_text_with_and_without_input():
    t = parts(name="alpaca_zh")
    assert text_of({"instruction": "翻译", "input": "你好", "output": "Hello"}, t) == \
        ARTICLE.format(inst="翻译", inp="你好", out="Hello")
    assert text_of({"instruction": "春天", "input": "", "output": "花开"}, t) == \
        ARTICLE_RM.format(prompt="春天", res1="花开")


def test_a_template_typed_on_the_command_line_means_what_was_typed():
    """`\\n` typed as two characters is a newline, and `{output}` where the article writes it ends the prompt."""
    cfg = compose_cfg('data.template.prompt_input="### 指令: {instruction}\\n### 输入: {input}\\n### 输出: {output}"',
                      'data.template.prompt_no_input="### 指令: {instruction}\\n### 输出: {output}"')
    assert "\\n" in cfg.data.template.prompt_input  # Hydra keeps the two characters
    typed = template_parts(cfg.data.template)
    assert {k: typed[k] for k in ("prompt_input", "prompt_no_input")} == \
        {k: parts(name="alpaca_zh")[k] for k in ("prompt_input", "prompt_no_input")}
    assert parts(prompt_no_input="Q: {instruction}\\nA: {output}\\n\\n")["assistant_end"] == "\n\n"
    assert parts(prompt_no_input="a\\\\nb {instruction}")["prompt_no_input"] == "a\\nb {instruction}"


@pytest.mark.parametrize("keys,message", [
    ({"prompt_input": "### 指令: {instrction}"}, r"data.template.prompt_input: \{instrction\} is not filled in; it "
                                                r"fills \{instruction\}, \{input\} \(and \{output\} at its end\)"),
    ({"user": "{content"}, r"data.template.user: '\{content' is not a template"),
    ({"name": "alpaca-zh"}, r"data.template.name: got 'alpaca-zh'; choose one of alpaca, chatml, alpaca_zh, custom"),
    ({"prompt_input": "{instruction}{input}{output}</s>", "assistant_end": "<end>"},
     r"'</s>' follows \{output\} but assistant_end is '<end>'"),
], ids=["unknown-field", "unclosed", "unknown-name", "two-ends"])
def test_a_template_that_cannot_be_filled_is_refused_in_one_line(keys, message):
    with pytest.raises(DataError, match=message):
        parts(**keys)


def saved_checkpoint(tmp_path, **config):
    path = tmp_path / "ckpt"
    path.mkdir()
    OmegaConf.save(OmegaConf.merge(compose_cfg("model=tiny"), config), path / "config.yaml")
    return str(path)


def test_a_stage_takes_the_checkpoints_template_and_model_shape_unless_typed(tmp_path):
    ckpt = saved_checkpoint(tmp_path, model={"vocab_size": 8192, "num_layers": 2},
                            data={"template": {"name": "alpaca_zh"}})
    cfg = compose_cfg("stage=dpo", f"stage.init_from={ckpt}", "model=tiny", "model.num_layers=4")
    notes = inherit(cfg, {"stage", "stage.init_from", "model", "model.num_layers"})
    assert cfg.model.vocab_size == 8192 and cfg.data.tokenizer.vocab_size == 8192 and cfg.model.num_layers == 4
    assert cfg.data.template.name == "alpaca_zh"
    assert notes == ["model.vocab_size=8192 from the checkpoint (the preset says 4096)",
                     "model.num_layers=4 as typed; the checkpoint's is 2", "data.template: the checkpoint's (alpaca_zh)"]
    cfg = compose_cfg("stage=dpo", f"stage.init_from={ckpt}", "data.template.name=chatml")
    assert inherit(cfg, {"data.template.name"})[-1] == "data.template: chatml as set, not the checkpoint's (alpaca_zh)"
    assert cfg.data.template.name == "chatml"


def test_a_stage_from_a_mixture_of_experts_takes_its_experts_and_routing_from_the_checkpoint(tmp_path):
    """models/moe's keys that say what the weights are and how a token is routed travel as the Llama shape keys do;
    how the run computes (an expert's capacity, the router's losses) stays the run's."""
    path = tmp_path / "moe"
    path.mkdir()
    OmegaConf.save(OmegaConf.merge(compose_cfg("model=moe_tiny"), {"model": {
        "num_experts": 4, "top_k": 1, "expert_intermediate_size": 352, "norm_topk_prob": False,
        "shared_expert_intermediate_size": 64, "shared_expert_gate": True, "aux_loss_coef": 0.1}}),
        path / "config.yaml")
    cfg = compose_cfg("stage=sft", f"stage.init_from={path}", "model=moe_tiny", "model.top_k=2")
    notes = inherit(cfg, {"stage", "stage.init_from", "model", "model.top_k"})
    m = cfg.model
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.norm_topk_prob, m.shared_expert_intermediate_size,
            m.shared_expert_gate, m.aux_loss_coef) == (4, 2, 352, False, 64, True, 0.01)
    assert "model.num_experts=4 from the checkpoint (the preset says 8)" in notes
    assert "model.top_k=2 as typed; the checkpoint's is 1" in notes


def test_training_time_eval_tasks_prompt_alpaca_samples_in_the_checkpoints_template(tmp_path, monkeypatch):
    """trainer.eval_tasks on a stage started from an alpaca_zh checkpoint: an Alpaca task file's prompts are the
    article's template (as `python -m evaluation` on that checkpoint prompts them), not the English default."""
    from evaluation import tasks as T
    from trainer.loop import _downstream

    ckpt = saved_checkpoint(tmp_path, data={"template": {"name": "alpaca_zh"}})
    task = tmp_path / "held_out.jsonl"
    task.write_text(json.dumps({"instruction": "写出李白的《静夜思》。", "input": "", "output": "床前明月光"},
                               ensure_ascii=False) + "\n", encoding="utf-8")
    cfg = compose_cfg("stage=sft", f"stage.init_from={ckpt}", f"trainer.eval_tasks=[{task}]")
    inherit(cfg, {"stage", "stage.init_from", "trainer.eval_tasks"})
    prompts = []

    def generate(batch, max_new_tokens):
        prompts.extend(batch)
        return ["床前明月光"] * len(batch)

    monkeypatch.setattr(T, "scorers", lambda *args: (None, generate, {}))
    objective = type("Objective", (), {"token_nll": None})()
    _, score = _downstream(cfg, None, objective, type("Data", (), {"tokenizer": None})(), {})
    assert score() == {"held_out/exact_match": 1.0, "held_out/rouge_l": 1.0}
    assert prompts == ["### 指令: 写出李白的《静夜思》。\n### 输出: "]


def test_generation_and_the_export_use_the_checkpoints_template_unless_told(tmp_path, capsys):
    config = OmegaConf.create({"data": {"template": {"name": "alpaca_zh"}}})
    assert template_of(config) == parts(name="alpaca_zh")
    assert template_of(config, "alpaca") == parts(name="alpaca")
    assert "[template] alpaca, not the checkpoint's own (alpaca_zh)" in capsys.readouterr().err
    jinja = chat_template(template_of(config))
    from jinja2 import Template

    rendered = Template(jinja).render(messages=[{"role": "user", "content": "春天"}], eos_token="</s>",
                                      add_generation_prompt=True)
    assert rendered == "### 指令: 春天\n### 输出: "
    import generate as cli
    from data.samples import TEMPLATES

    for name in TEMPLATES:  # every built-in template is one generate --template takes
        assert cli.parse_args([str(tmp_path), "--instruction", "春天", "--template", name]).template == name


@pytest.mark.slow
def test_sft_on_an_alpaca_json_list_then_dpo_and_generate_keep_the_articles_template(tmp_path, monkeypatch,
                                                                                    base_checkpoint):
    """The article's workflow: SFT on an alpaca_data.json list with alpaca_zh, DPO from that checkpoint on its
    feedback records, then generate --instruction, the template never given again."""
    samples = [{"instruction": f"重复{w}", "input": "", "output": w} for w in "春夏秋冬风花雪月" * 4]
    (tmp_path / "alpaca_data.json").write_text(json.dumps(samples, ensure_ascii=False), encoding="utf-8")
    feedback = [{"prompt": f"重复{w}", "response1": w, "response2": w * 3, "preference": 1} for w in "春夏秋冬风花雪月"]
    (tmp_path / "human_feedback.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in feedback),
                                                   encoding="utf-8")
    # no held-out rows (nor an evaluation graph to compile): what is checked is the template each stage reads
    common = ["model=tiny", "trainer.max_steps=2", "trainer.eval_every=0", "optim.warmup_steps=0",
              "logger.progress_bar=false", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0",
              "data.seq_len=64", "data.val_fraction=0", "trainer.micro_batch_size=2"]
    code, out, err = train_main(tmp_path, monkeypatch, "stage=sft", f"stage.init_from={base_checkpoint}",
                                "data.template.name=alpaca_zh", f"hydra.run.dir={tmp_path / 'sft'}",
                                f"data.sources=[{{name: zh, kind: alpaca, paths: [{tmp_path / 'alpaca_data.json'}]}}]",
                                *common)
    assert code == 0, err[-2000:]
    code, out, err = train_main(tmp_path, monkeypatch, "stage=dpo", f"stage.init_from={tmp_path / 'sft'}",
                                f"hydra.run.dir={tmp_path / 'dpo'}",
                                f"data.sources=[{{name: fb, kind: feedback, paths: [{tmp_path / 'human_feedback.jsonl'}]}}]",
                                *common)
    assert code == 0, err[-2000:]
    assert "[stage] data.template: the checkpoint's (alpaca_zh)" in out
    dpo = os.path.join(tmp_path, "dpo", "checkpoints", "latest")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"instruction": "重复春"}, ensure_ascii=False) + "\n")
    # one new token: the prompt is what is checked, and the first token comes from the prefill graph alone
    result = invoke("generate", [dpo, "--prompts-file", str(tmp_path / "prompts.jsonl"), "--out",
                                 str(tmp_path / "out.jsonl"), "--max-new-tokens", "1", "--temperature", "0"])
    assert result.code == 0, result.err[-2000:]
    assert json.loads((tmp_path / "out.jsonl").read_text())["prompt"] == "### 指令: 重复春\n### 输出: "
