"""Recipes (recipe/): stages parsed and checked before anything runs, chained checkpoints, content-addressed stage
directories shared by variants, resumable runs, one report."""
import json
import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from base.errors import ConfigError
from base.paths import REPO_ROOT
from conftest import absent
from recipe import runner
from recipe.spec import flatten, parse
from sweeps.recipe_report import markdown, variants

PRESETS = sorted(p.stem for p in (REPO_ROOT / "conf" / "stage").glob("*.yaml"))


def recipe(stages: dict, **extra):
    return OmegaConf.create({"name": "r", "metric": None, "goal": "max", "common": {}, "stages": stages, **extra})


def stages_of(stages: dict, **extra):
    return parse(recipe(stages, **extra), list(stages), PRESETS)


def test_a_mapping_becomes_train_py_overrides():
    assert flatten({"data": "instructions", "optim": {"lr": 3e-4}, "trainer": {"eval_tasks": ["a", "b"]},
                    "model": {"rope_scaling": {"type": "yarn"}}, "stage": {"allow_random_init": True}}) == [
        "data=instructions", "optim.lr=0.0003", "trainer.eval_tasks=[a,b]", "model.rope_scaling.type=yarn",
        "stage.allow_random_init=true"]


def test_a_preset_and_keys_of_the_same_group_make_both():
    stages = stages_of({"pretrain": {"stage": "tiny_pretrain", "model": {"recompute": "full"}, "data": "wiki"}},
                       common={"model": "small", "data": {"seq_len": 128}})
    assert stages[0].overrides == ["stage=tiny_pretrain", "model=small", "model.recompute=full", "data=wiki",
                                   "data.seq_len=128"]


def test_stages_chain_in_order_with_common_keys_under_their_own():
    stages = stages_of({"pretrain": {"stage": "tiny_pretrain"}, "sft": {"model": "small", "optim": {"lr": 1e-4}},
                        "evaluate": {"kind": "evaluate", "data": "default", "eval": {"batches": 2}}},
                       common={"model": "tiny", "optim": {"weight_decay": 0.0}})
    assert [(s.dirname, s.kind, s.source) for s in stages] == [("01-pretrain", "train", None),
                                                              ("02-sft", "train", "pretrain"),
                                                              ("03-evaluate", "evaluate", "sft")]
    assert stages[0].overrides == ["stage=tiny_pretrain", "model=tiny", "optim.weight_decay=0.0"]
    assert stages[1].overrides == ["stage=sft", "model=small", "optim.weight_decay=0.0", "optim.lr=0.0001"]
    assert stages[2].overrides == ["data=default", "eval.batches=2"]


@pytest.mark.parametrize("stages, declared, key, message", [
    ({"pretrain": {}, "sft": {"optim": {"lr": 1}}}, ["pretrain"], "recipe.stages.sft",
     "recipe r has no stage sft; its stages are pretrain"),
    ({"pretrain": {"stage": "pretrian"}}, None, "recipe.stages.pretrain.stage", "no stage preset 'pretrian'"),
    ({"warmup": {}}, None, "recipe.stages.warmup.stage", "no stage preset 'warmup'"),
    ({"evaluate": {"kind": "evaluate"}}, None, "recipe.stages.evaluate", "scores a training stage's checkpoint"),
    ({"pretrain": {}, "evaluate": {"kind": "evaluate", "of": "sft"}}, None, "recipe.stages.evaluate.of",
     "'sft' is not a training stage before it"),
    ({"pretrain": {"kind": "build"}}, None, "recipe.stages.pretrain.kind", "choose one of train, evaluate"),
    ({}, None, "recipe.stages", "lists no stages"),
])
def test_a_recipe_that_cannot_work_is_refused_naming_the_stage(stages, declared, key, message):
    with pytest.raises(ConfigError) as err:
        parse(recipe(stages), declared if declared is not None else list(stages), PRESETS)
    assert err.value.key == key and message in str(err.value)


def test_tiny_chat_zh_evaluates_the_held_out_chinese_tasks_of_its_data_dir(tmp_path, monkeypatch):
    """The recipe's evaluate stage names builders/chat_zh.py's four tasks, looked up in <data dir>/chat_zh/tasks
    (MINDLAB_DATA_DIR resolved as the data presets resolve it), and `python -m evaluation` gets that directory."""
    from builders.chat_zh import TASKS

    monkeypatch.setenv("MINDLAB_DATA_DIR", str(tmp_path / "data"))
    node = OmegaConf.load(REPO_ROOT / "conf" / "recipe" / "tiny_chat_zh.yaml")
    stages = parse(node, list(node.stages), PRESETS)
    evaluate = stages[-1]
    assert evaluate.tasks == list(TASKS) and evaluate.tasks_dir == str(tmp_path / "data" / "chat_zh" / "tasks")
    checkpoint = tmp_path / "ppo" / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (tmp_path / "ppo" / "checkpoints" / "latest").write_text("step_000001\n")
    source = runner.Planned(stages[-2], "k", tmp_path / "ppo", [])
    [command, _] = runner.stage_commands(runner.Planned(evaluate, "e", tmp_path / "ev", evaluate.overrides,
                                                        source=source), tmp_path, "v")
    assert command[command.index("--tasks-dir") + 1] == evaluate.tasks_dir
    assert f"tasks=[{','.join(TASKS)}]" in command


def test_plan_keys_a_stage_by_its_config_and_the_stages_before_it(tmp_path):
    base = {"pretrain": {"stage": "tiny_pretrain"}, "sft": {"data": "instructions"}}
    a = runner.plan(stages_of(base), tmp_path)
    b = runner.plan(stages_of({**base, "sft": {"data": "instructions", "optim": {"lr": 5e-4}}}), tmp_path)
    c = runner.plan(stages_of({**base, "pretrain": {"stage": "tiny_pretrain", "optim": {"lr": 1e-3}}}), tmp_path)
    assert a[0].key == b[0].key and a[1].key != b[1].key  # the same pretraining, another SFT
    assert c[0].key != a[0].key and c[1].key != a[1].key  # another pretraining: every stage after it differs
    assert f"stage.init_from={a[0].dir}" in a[1].args
    assert a[1].config.optim.lr == 1e-4 and b[1].config.optim.lr == 5e-4
    assert runner.plan(stages_of(base), tmp_path)[1].key == a[1].key  # stable


def test_a_fine_tuning_stage_with_nothing_to_start_from_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError) as err:
        runner.plan(stages_of({"dpo": {"data": "preferences"}}), tmp_path)
    assert err.value.key == "recipe.stages.dpo" and "put a training stage before it" in str(err.value)
    with pytest.raises(ConfigError) as err:
        runner.plan(stages_of({"pretrain": {"stage": "tiny_pretrain"}, "ppo": {"data": "instructions"}}), tmp_path)
    assert err.value.key == "recipe.stages.ppo" and str(err.value) == (
        "recipe.stages.ppo: objective=ppo takes a reward_model from an earlier stage: put a stage that trains one "
        "before it, or set recipe.stages.ppo.objective.reward_model=<checkpoint>")
    with pytest.raises(ConfigError) as err:
        runner.plan(stages_of({"pretrain": {"stage": "tiny_pretrain", "optim": {"lr": 7}}}), tmp_path)
    assert err.value.key == "recipe.stages.pretrain" and "optim.lr: must be in (0, 1]" in str(err.value)
    assert not os.listdir(tmp_path)


def test_a_stage_takes_what_it_needs_from_the_last_stage_that_provides_it(tmp_path):
    """PPO needs a reward model (objectives/ppo.py NEEDS); the rm stage's objective provides one (PROVIDES): its
    directory is the PPO stage's objective.reward_model, planned before either has run."""
    planned = runner.plan(stages_of({"pretrain": {"stage": "tiny_pretrain"}, "sft": {"data": "instructions"},
                                     "rm": {"data": "preferences"}, "ppo": {"data": "instructions"}}), tmp_path)
    rm, ppo = planned[2], planned[3]
    assert f"objective.reward_model={rm.dir}" in ppo.args and ppo.config.objective.reward_model == str(rm.dir)
    assert f"stage.init_from={planned[1].dir}" in ppo.args  # the policy starts from SFT's, not the reward model's
    assert f"stage.init_from={planned[1].dir}" in rm.args


def fake_execute(calls):
    """Stands in for the stage commands: a training stage leaves a finished run with one checkpoint."""

    def execute(command, log_file, stream):
        calls.append(command)
        if command[1].endswith("train.py"):
            run_dir = Path(next(a for a in command if a.startswith("hydra.run.dir=")).split("=", 1)[1])
            (run_dir / "checkpoints" / "step_000002").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / "latest").write_text("step_000002\n")
            (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 1.5}) + "\n" +
                                                   json.dumps({"step": 2, "val_loss": 1.25}) + "\n")
            (run_dir / "status.json").write_text(json.dumps({"status": "finished", "step": 2}))
        elif command[2] == "evaluation":
            out = Path(command[command.index("--out") + 1])
            out.write_text(json.dumps({"data_eval": {"all": {"loss": 2.0, "bits_per_byte": 1.1}}}))
        return 0

    return execute


CHAIN = {"pretrain": {"stage": "tiny_pretrain"}, "sft": {"data": "instructions"},
         "evaluate": {"kind": "evaluate", "data": "default"}}


def test_a_recipe_runs_each_stage_once_and_a_rerun_reuses_them(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "execute", fake_execute(calls))
    planned = runner.plan(stages_of(CHAIN), tmp_path)
    records = runner.run(planned, tmp_path, "v")
    assert [r["state"] for r in records] == ["ran", "ran", "ran"] and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01-pretrain", "02-sft", "03-evaluate", "stages"]
    assert os.readlink(tmp_path / "02-sft") == f"stages/{planned[1].dir.name}"
    evaluate = calls[2]
    assert evaluate[3] == str(planned[1].dir / "checkpoints" / "step_000002")  # the SFT stage's final checkpoint
    assert [r["state"] for r in runner.run(runner.plan(stages_of(CHAIN), tmp_path), tmp_path, "v")] == ["reused"] * 3
    assert len(calls) == 3


def test_variants_share_the_stages_they_have_in_common(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "execute", fake_execute(calls))
    for num, lr in enumerate([1e-4, 3e-4]):
        stages = stages_of({**CHAIN, "sft": {"data": "instructions", "optim": {"lr": lr}}})
        runner.run(runner.plan(stages, tmp_path), tmp_path / str(num), str(num))
    trained = [c for c in calls if c[1].endswith("train.py")]
    assert len(trained) == 3  # one pretraining, two SFTs
    assert os.path.realpath(tmp_path / "0" / "01-pretrain") == os.path.realpath(tmp_path / "1" / "01-pretrain")
    assert os.path.realpath(tmp_path / "0" / "02-sft") != os.path.realpath(tmp_path / "1" / "02-sft")


def test_a_changed_stage_in_an_existing_recipe_directory_is_refused_and_nothing_is_replaced(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "execute", fake_execute(calls))
    runner.run(runner.plan(stages_of(CHAIN), tmp_path), tmp_path, "v")
    before = os.readlink(tmp_path / "02-sft")
    with pytest.raises(ConfigError) as err:
        runner.run(runner.plan(stages_of({**CHAIN, "sft": {"data": "instructions", "optim": {"lr": 5e-4}}}), tmp_path), tmp_path, "v")
    assert err.value.key == "recipe.stages.sft" and "already ran this stage with another config" in str(err.value)
    assert os.readlink(tmp_path / "02-sft") == before and len(calls) == 3


def test_a_failed_stage_stops_the_recipe_with_one_line_and_keeps_what_finished(tmp_path, monkeypatch):
    calls = []
    done = fake_execute(calls)

    def failing(command, log_file, stream):
        return 1 if "stage=sft" in command else done(command, log_file, stream)

    monkeypatch.setattr(runner, "execute", failing)
    planned = runner.plan(stages_of(CHAIN), tmp_path)
    with pytest.raises(runner.StageFailed, match="stage sft failed \\(exit 1; its log: .*sft-.*\\.log\\)"):
        runner.run(planned, tmp_path, "v")
    assert runner.finished(planned[0]) and not runner.finished(planned[1])


def _jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _training(path: Path, seed: int, val_keys: tuple, logged: tuple) -> None:
    """A training stage's metrics.jsonl: training steps (loss, the objective's logged numbers) and evaluations
    (val_loss, val_bpb per source, the objective's val_ numbers) every 2 steps, as trainer/callbacks.py writes."""
    rows = []
    for step in range(0, 7, 2):
        if step:
            rows.append({"step": step, "loss": 3.0 - 0.1 * step - seed / 100, "lr": 1e-4, "tokens_seen": 64 * step,
                         **{k: 0.5 + step / 10 + seed / 10 for k in logged}, "tokens_seen/a": 32 * step})
        rows.append({"step": step, "val_loss": 3.1 - 0.1 * step - seed / 50, "val_loss/a": 3.2 - step / 20,
                     "val_ppl": 20.0, "val_bpb": 1.5 - step / 100, "val_bpb/a": 1.6,
                     **{f"val_{k}": 0.25 + step / 20 + seed / 7 for k in val_keys}})
    _jsonl(path / "metrics.jsonl", rows)


DPO = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
       "logps/rejected", "kl")


@pytest.fixture
def dpo_sweep(tmp_path):
    """What `python -m recipe -m recipe=tiny_chat recipe.stages.dpo.objective.beta=0.05,0.2` leaves, written by hand:
    pretraining and SFT shared (one stage directory each), DPO and the evaluation once per variant; answers in
    Chinese."""
    _training(tmp_path / "stages/pretrain-p", 0, (), ())
    _training(tmp_path / "stages/sft-s", 1, ("mean_token_accuracy",), ("mean_token_accuracy",))
    for num, beta in enumerate(("0.05", "0.2")):
        _training(tmp_path / f"stages/dpo-d{num}", num + 2, DPO, DPO)
        evaluate = tmp_path / f"stages/evaluate-e{num}"
        evaluate.mkdir(parents=True)
        (evaluate / "eval.json").write_text(json.dumps({"data_eval": {"all": {
            "loss": 2.5 + num, "ppl": 12.2, "bits_per_byte": 1.25 + num / 8, "top1_accuracy": 0.3}},
            "tasks": {"define": {"acc": 0.5 - num / 10, "exact_match": 0.0}}}))
        _jsonl(evaluate / "samples.jsonl", [{"instruction": "海洋是什么？", "completion": f"海洋是一片水。{num}"}])
        job = tmp_path / str(num)
        job.mkdir()
        stages = []
        for index, (name, kind, key) in enumerate((("pretrain", "train", "p"), ("sft", "train", "s"),
                                                   ("dpo", "train", f"d{num}"), ("evaluate", "evaluate", f"e{num}")), 1):
            (job / f"{index:02d}-{name}").symlink_to(f"../stages/{name}-{key}")
            stages.append({"name": name, "kind": kind, "key": key, "link": f"{index:02d}-{name}",
                           "state": "ran" if num == 0 or name in ("dpo", "evaluate") else "reused"})
        (job / "recipe.json").write_text(json.dumps({
            "recipe": "tiny_chat", "variant": f"recipe.stages.dpo.objective.beta={beta}",
            "metric": "dpo/val_rewards/accuracies", "goal": "max", "stages": stages}))
    return tmp_path


def test_the_report_leads_with_what_differs_and_shows_shared_stages_once(dpo_sweep):
    from sweeps.recipe_report import MAX_COLUMNS, tables

    runs = variants(dpo_sweep)
    found = tables(runs)
    titles = [t.title for t in found]
    # the swept stages' held-out numbers first (DPO's, the recipe's metric its first column), then what they logged
    # at their last step, then the shared stages, once each
    assert titles == ["dpo: held out, per variant (first: the recipe's metric, max)", "evaluate: held out, per variant",
                      "dpo: at its last step, per variant", "pretrain: held out", "pretrain: at its last step",
                      "sft: held out", "sft: at its last step"]
    assert found[0].keys[0] == "val_rewards/accuracies" and found[0].keys[1] == "val_loss"
    assert [label for label, _ in found[0].rows] == [r["variant"] for r in runs]
    assert found[0].mark == "recipe.stages.dpo.objective.beta=0.2"  # the larger held-out preference accuracy
    for shared in found[3:]:
        assert [label for label, _ in shared.rows] == ["shared by every variant"]
    # every table fits a laptop: the label and at most MAX_COLUMNS numbers
    assert all(len(keys) <= MAX_COLUMNS for t in found for _, keys, _ in t.parts())
    # the numbers are the stage files' own
    for num, run in enumerate(runs):
        logged = [json.loads(line) for line in (dpo_sweep / f"stages/dpo-d{num}/metrics.jsonl").read_text().splitlines()]
        dpo = dict(found[0].rows[num][1])
        assert dpo == {k: v for k, v in [m for m in logged if "val_loss" in m][-1].items() if k.startswith("val_")
                       and k != "val_ppl"}
        last = dict(found[2].rows[num][1])
        assert last["loss"] == [m for m in logged if "loss" in m][-1]["loss"]
        assert last["rewards/margins"] == [m for m in logged if "loss" in m][-1]["rewards/margins"]
        evaluated = json.loads((dpo_sweep / f"stages/evaluate-e{num}/eval.json").read_text())
        assert dict(found[1].rows[num][1]) == {**evaluated["data_eval"]["all"], "define/acc": evaluated["tasks"]
                                               ["define"]["acc"], "define/exact_match": 0.0} | {"ppl": 12.2}
        # validation curves: each evaluation's val_loss over steps
        assert run["stages"][2]["val_curve"] == [(m["step"], m["val_loss"]) for m in logged if "val_loss" in m]
    sft = [json.loads(line) for line in (dpo_sweep / "stages/sft-s/metrics.jsonl").read_text().splitlines()]
    assert dict(found[5].rows[0][1])["val_mean_token_accuracy"] == [m for m in sft if "val_loss" in m][-1][
        "val_mean_token_accuracy"]
    table = markdown(runs)
    assert table.count("### sft: held out") == 1 and table.count("shared by every variant") == 4
    assert f"| recipe.stages.dpo.objective.beta=0.2 (best) | {dpo['val_rewards/accuracies']:.4f} |" in table


def test_the_report_page_shows_shared_generations_once_and_validation_curves(dpo_sweep):
    from sweeps.recipe_report import write

    page = write(dpo_sweep).read_text(encoding="utf-8")
    assert page.count("<h2>generations:") == 2 and "海洋是一片水。1" in page  # the evaluation differs per variant
    assert page.count("<h3>pretrain: held out</h3>") == 1 and "training and validation loss" in page
    assert page.count('<tr class="best">') == 4  # DPO's held out (11 numbers: two tables), last step, the evaluation's
    curves = (dpo_sweep / "curves.png").read_bytes()
    from PIL import Image
    import io

    width, height = Image.open(io.BytesIO(curves)).size
    assert width <= 1300 and height == 3 * 261  # a row of train and val loss per training stage, a laptop's width


def test_a_sweep_writes_its_own_report_of_every_variant(tmp_path, monkeypatch):
    """`python -m recipe -m ...` as typed: each variant's report, then the sweep's, written when the sweep ends."""
    import sys

    import recipe.__main__ as recipe_main

    monkeypatch.setattr(runner, "execute", fake_execute([]))
    monkeypatch.setattr(recipe_main, "build_datasets", lambda names: None)
    monkeypatch.setattr(sys, "argv", ["recipe"])
    sweep = tmp_path / "sweep"
    recipe_main.main(["-m", "recipe=tiny_chat", "recipe.stages.dpo.objective.beta=0.05,0.2",
                      f"hydra.sweep.dir={sweep}"])
    assert (sweep / "0" / "report.html").is_file() and (sweep / "1" / "report.html").is_file()
    names = [json.loads((sweep / str(n) / "recipe.json").read_text())["variant"] for n in range(2)]
    assert names == ["recipe.stages.dpo.objective.beta=0.05", "recipe.stages.dpo.objective.beta=0.2"]
    report = (sweep / "report.html").read_text(encoding="utf-8").replace("<wbr>", "")  # (names wrap after = / . _)
    assert "beta=0.05" in report and "beta=0.2" in report

# --- real stages: train.py, evaluate and generate processes on model=tiny ---------------------------------------

def synthetic_alpaca(path: Path) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["apple", "river", "stone", "cloud", "green", "quick", "silent", "table"]
    path.write_text("".join(json.dumps({"instruction": f"Repeat {w} {n} times.", "input": "",
                                        "output": " ".join([w] * n)}) + "\n"
                            for w, n in zip(rng.choice(words, 200), rng.integers(1, 6, 200))))
    return str(path)


def real_chain(tmp: Path, sft_init_from=None) -> dict:
    sft = {"stage": "sft", "trainer": {"max_steps": 12, "save_every": 4, "eval_every": 6, "eval_batches": 2,
                                       "micro_batch_size": 4, "log_every": 2},
           "data": {"seq_len": 128, "val_fraction": 0.1},
           "overrides": [f"data.sources=[{{name: repeat, kind: alpaca, paths: [{synthetic_alpaca(tmp / 'sft.jsonl')}]}}]",
                         "data.name=repeat"]}
    if sft_init_from:
        return {"sft": {**sft, "init_from": sft_init_from}}
    return {"pretrain": {"stage": "tiny_pretrain", "trainer": {"max_steps": 16, "eval_every": 8, "save_every": 8,
                                                               "micro_batch_size": 4, "eval_batches": 1},
                         "data": {"seq_len": 64}},
            "sft": sft,
            "evaluate": {"kind": "evaluate", "data": "default", "tasks": [], "eval": {"batches": 1},
                         "prompts": ["Repeat apple 3 times."], "max_new_tokens": 8}}


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """pretrain -> SFT -> evaluate, for real, into one recipe directory."""
    root = tmp_path_factory.mktemp("recipe")
    stages = stages_of(real_chain(root), common={"logger": {"progress_bar": False}})
    planned = runner.plan(stages, root)
    records = runner.run(planned, root, "v")
    (root / "recipe.json").write_text(json.dumps({"recipe": "r", "variant": "v", "metric": "sft/val_loss",
                                                  "goal": "min", "stages": records}))
    return root, planned, records


@pytest.mark.slow
def test_a_real_chain_trains_each_stage_from_the_last_and_evaluates_the_result(chained):
    root, planned, records = chained
    assert [r["state"] for r in records] == ["ran", "ran", "ran"]
    sft_config = OmegaConf.load(root / "02-sft" / "config.yaml")
    assert sft_config.stage.init_from == str(planned[0].dir) and sft_config.objective.name == "sft"
    assert sft_config.data.tokenizer.path == str(planned[0].dir / "checkpoints" / "step_000016" / "tokenizer.model")
    evaluated = json.loads((root / "03-evaluate" / "eval.json").read_text())
    assert evaluated["checkpoint"] == str(planned[1].dir / "checkpoints" / "step_000012")
    [sample] = [json.loads(line) for line in (root / "03-evaluate" / "samples.jsonl").read_text().splitlines()]
    assert sample["instruction"] == "Repeat apple 3 times." and sample["prompt"].endswith("### Response:\n")
    [run] = variants(root)
    # the report's numbers are the stages' own: the SFT run's last logged step and evaluation, evaluate's eval.json
    logged = [json.loads(line) for line in (root / "02-sft" / "metrics.jsonl").read_text().splitlines()]
    sft = run["stages"][1]["metrics"]
    assert sft["loss"] == [m for m in logged if "loss" in m][-1]["loss"]
    assert sft["val_loss"] == [m for m in logged if "val_loss" in m][-1]["val_loss"]
    assert run["stages"][2]["metrics"]["loss"] == pytest.approx(evaluated["data_eval"]["all"]["loss"])
    assert run["stages"][2]["metrics"]["bits_per_byte"] == pytest.approx(
        evaluated["data_eval"]["all"]["bits_per_byte"])


@pytest.mark.slow
def test_a_recipe_killed_during_sft_resumes_and_ends_as_the_uninterrupted_one(chained, tmp_path):
    """SIGKILL the recipe process while its SFT stage trains (after its first checkpoint), run it again (the
    runner's call, in this process): the stage resumes from that checkpoint and its metrics equal those of the
    uninterrupted chain's SFT (which started from the same pretrained checkpoint); the killed stage's process died
    with the recipe."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    root, planned, _ = chained
    chain = real_chain(tmp_path, sft_init_from=str(planned[0].dir))
    driver = ("import json, sys; from pathlib import Path; from omegaconf import OmegaConf; "
              "from plugins import register; register(); "
              "from recipe import runner; from recipe.spec import parse; "
              "stages = json.loads(sys.argv[1]); root = Path(sys.argv[2]); "
              "runner.run(runner.plan(parse(OmegaConf.create({'name': 'r', 'common': {'logger': {'progress_bar': False}}, "
              "'stages': stages}), list(stages), json.loads(sys.argv[3])), root), root, 'v')")
    command = [sys.executable, "-c", driver, json.dumps(chain), str(tmp_path / "run"), json.dumps(PRESETS)]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "run" / "stages").glob("sft-*/metrics.jsonl"))
        if found and any(json.loads(line).get("step", 0) >= 6 for line in found[0].read_text().splitlines()
                         if line.strip()):
            metrics = found[0]
            break
        time.sleep(0.2)
    assert metrics is not None, "the SFT stage never reached step 6"
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    again = runner.run(runner.plan(stages_of(chain, common={"logger": {"progress_bar": False}}), tmp_path / "run"),
                       tmp_path / "run", "v")
    assert [r["state"] for r in again] == ["ran"]
    assert "[checkpoint] resumed from" in (metrics.parent.parent / f"{metrics.parent.name}.log").read_text()
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    reference = [json.loads(line) for line in (root / "02-sft" / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "val_loss", "val_mean_token_accuracy")
    assert [{k: m[k] for k in keys if k in m} for m in resumed] == [{k: m[k] for k in keys if k in m}
                                                                    for m in reference]


@pytest.mark.slow  # a headless Chromium, ~5 s
def test_the_report_of_two_variants_renders_in_headless_chromium_within_a_laptop_screen(dpo_sweep, tmp_path):
    """The page in a 1366-pixel-wide frame: no horizontal scrolling, Chinese answers as written, the curves' PNG
    drawn with a CJK font (matplotlib warns of every glyph it lacks)."""
    import shutil
    import subprocess
    import warnings

    from sweeps.recipe_report import cjk_fonts, write

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        absent("chromium is not installed (Debian: apt-get install -y chromium)")
    if not cjk_fonts():
        absent("no CJK font is installed (Debian: apt-get install -y fonts-wqy-microhei)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph ... missing from font(s)": Chinese drawn as boxes
        page = write(dpo_sweep)
        from sweeps.recipe_report import curves_png, variants as load

        runs = load(dpo_sweep)
        runs[0]["variant"] = "学习率=0.05"
        curves_png(runs)
    frame = tmp_path / "frame.html"
    frame.write_text(f"<!doctype html><body style=margin:0><iframe id=f src='file://{page}' "
                     "style='width:1366px;height:800px;border:0'></iframe><script>f.onload = () => {const d = "
                     "f.contentDocument.documentElement; document.body.dataset.scroll = d.scrollWidth; "
                     "document.body.dataset.text = f.contentDocument.querySelector('pre').textContent};</script>",
                     encoding="utf-8")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--allow-file-access-from-files",
             "--disable-web-security", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", f"file://{frame}"],
                         capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    scroll = re.search(r'data-scroll="(\d+)"', dom.stdout)
    assert scroll is not None, dom.stdout[-2000:]
    assert int(scroll.group(1)) <= 1366  # nothing wider than the laptop's screen
    assert 'data-text="海洋是一片水。0"' in dom.stdout
