"""The error contract, as a table: every bad input to every entry point exits non-zero with one
`error: ...` line (`config error: ...` for config values) naming the key or file, no traceback, and nothing
written earlier (a run dir, checkpoints, a data cache) changed.

Each case runs its CLI's `main(argv)` in this process (conftest.invoke), as `python -m <module> ARGS` would
(train.py: sys.argv). test_troubleshooting_shows_the_table checks that docs/troubleshooting.md's table is the one
these cases print (`MINDLAB_WRITE_DOCS=1 pytest tests/test_errors.py -k troubleshooting` rewrites it).
"""
import contextlib
import gzip
import hashlib
import importlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import pytest
from omegaconf import OmegaConf

from conftest import ENTRIES, ROOT, invoke

TROUBLESHOOTING = os.path.join(ROOT, "docs", "troubleshooting.md")


@dataclass
class Case:
    id: str
    entry: str
    argv: Callable  # (World) -> list of arguments
    names: Callable  # (World) -> strings the error line must contain (the key / file)
    code: int = 1
    cause: str = ""  # what the user did, for docs/troubleshooting.md's table
    env: dict = field(default_factory=dict)  # environment for the case (None: unset)
    max_file_bytes: int = 0  # > 0: no file may grow past this during the case (RLIMIT_FSIZE: a disk that fills)


def C(id, entry, argv, names, code=1, cause="", env=None, max_file_bytes=0):
    as_fn = lambda x: x if callable(x) else (lambda w: x)
    return Case(id, entry, as_fn(argv), as_fn(names), code, cause, env or {}, max_file_bytes)


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes past `max_bytes` fail with EFBIG, as they would on a full disk with ENOSPC (0: no limit)."""
    if not max_bytes:
        yield
        return
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


class World:
    """The files the cases point at, under one tmp dir: data files, checkpoints and their broken copies, a
    previous run dir and a data cache (both must come out unchanged), sweep dirs."""

    def __init__(self, root: str, ckpt: str):
        self.root, self.ckpt = root, ckpt
        d = self.path("data")
        self.write("data/bad.jsonl", b'{"text": "fine"}\n{"text": broken\n')
        self.write("data/latin1.jsonl", b'{"text": "caf\xe9"}\n')
        self.write("data/latin1.txt", b"caf\xe9 au lait\n")
        self.write("data/empty.jsonl", b"")
        self.write("data/field.jsonl", b'{"content": "the text is here"}\n')
        self.write("data/list.jsonl", b'["not", "an", "object"]\n')
        self.write("data/number.jsonl", b'{"text": 42}\n')
        self.write("data/huge.jsonl", b'{"text": "' + b"x" * (64 << 20) + b"\n")  # a 64 MiB line, unterminated
        self.write("data/not.parquet", b"PAR1 this is not parquet")
        whole = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
        self.write("data/truncated.jsonl.gz", whole[: len(whole) // 2])
        self.write("data/mid/a.jsonl.gz", whole)  # a source whose middle file is cut short
        self.write("data/mid/b.jsonl.gz", whole[: len(whole) // 2])
        self.write("data/mid/c.jsonl.gz", whole)
        os.makedirs(self.path("data", "gone"))  # a file listed by the glob that cannot be read: a dangling link
        os.symlink(self.path("data", "gone", "moved-away.jsonl"), self.path("data", "gone", "part.jsonl"))
        self.write("data/big.jsonl", "".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * 60}) + "\n"
                                             for i in range(400)).encode())
        self.write("data/alpaca_data.jsonl", json.dumps([{"instruction": "a", "output": "b"}] * 2, indent=4).encode())
        feedback = [{"prompt": "p", "response1": "a", "response2": "b", "preference": k} for k in (1, 3)]
        self.write("data/human_feedback.jsonl", "".join(json.dumps(r) + "\n" for r in feedback).encode())
        self.write("data/prompts_bad.jsonl", b'{"prompt": "a"}\n{"prompt": \n')
        self.write("data/prompts_field.jsonl", b'{"text": "a"}\n')
        self.write("data/task_bad.jsonl", b'{"context": "x"}\n')
        self.write("afile", b"a file where a directory is expected\n")
        self.write("inst_bad/train.jsonl", b'{"instruction": "a", "output": "b", "task": "t", "entry": "e"}\n{"instr\n')
        self.write("inst_field/train.jsonl", b'{"instruction": "define x", "output": "y"}\n')
        self.data = d
        # checkpoints: the good one and its broken copies
        self.truncated = self.copy_ckpt("truncated")
        with open(os.path.join(self.truncated, "model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
        self.other_model = self.copy_ckpt("other_model", {"model": {"num_layers": 2}})
        self.other_vocab = self.copy_ckpt("other_vocab", {"model": {"vocab_size": 8192}})
        self.bert = self.copy_ckpt("bert", {"model": {"family": "bert"}})
        self.model_only = self.copy_ckpt("model_only")  # as `models.convert --to mindlab` writes it
        OmegaConf.save(OmegaConf.create({"model": OmegaConf.load(os.path.join(ckpt, "config.yaml")).model}),
                       os.path.join(self.model_only, "config.yaml"))
        self.lora = self.copy_ckpt("lora", {"peft": {"name": "lora", "r": 4}, "stage": {"init_from": self.path("gone")}})
        self.write("ckpt/lora/adapter_config.json", b'{"peft_type": "LORA"}\n')
        self.rm_no_stats = self.copy_ckpt("rm_no_stats", {"objective": {"name": "rm"}})  # a reward model from
        # before its checkpoints held the val reward statistics, its config's new size recorded
        from base.checkpoint import read_state, write_state

        write_state(self.rm_no_stats, {k: v for k, v in read_state(self.ckpt).items() if k != "file_sizes"})
        self.dangling = self.path("dangling_run")  # `latest` names a step that was deleted; step_000001 is intact
        shutil.copytree(ckpt, os.path.join(self.dangling, "checkpoints", "step_000001"))
        self.write("dangling_run/checkpoints/latest", b"step_000002\n")
        self.stranger = self.path("stranger")  # a user's own directory: no tool may write into it
        self.write("stranger/notes.txt", b"my notes\n")
        self.write("sweep_foreign_report/0/.hydra/overrides.yaml", b"- optim.lr=0.001\n")
        self.write("sweep_foreign_report/report.html", b"<p>my own report</p>\n")
        self.recipe_run = self.path("recipe_run")  # a recipe directory whose SFT stage ran with another config
        os.makedirs(os.path.join(self.recipe_run, "stages", "sft-000000000000"))
        os.symlink(os.path.join("stages", "sft-000000000000"), os.path.join(self.recipe_run, "02-sft"))
        self.no_ckpt = self.path("ckpt/not_a_checkpoint")
        os.makedirs(self.no_ckpt)
        self.write("ckpt/not_a_checkpoint/notes.txt", b"just notes\n")
        self.hf_unknown = self.path("hf_unknown")
        self.write("hf_unknown/config.json", json.dumps({"architectures": ["GPT2LMHeadModel"]}).encode())
        self.write("hf_unknown/model.safetensors", b"")
        # a previous run and a data cache: the protected state
        self.run = self.path("run")
        shutil.copytree(ckpt, os.path.join(self.run, "checkpoints", "step_000001"))
        self.write("run/config.yaml", b"model: {name: tiny}\n")
        self.write("run/metrics.jsonl", b'{"step": 1, "loss": 9.0}\n')
        self.write("run/status.json", b'{"status": "finished", "time": 0}\n')
        self.cache = self.path("cache")
        self.write("cache/0123456789ab/meta.json", b'{"built": true}\n')
        self.write("cache/0123456789ab/tokens/code.bin", b"\x00" * 64)
        # sweep dirs
        self.sweep_empty = self.path("sweep_empty")
        os.makedirs(self.sweep_empty)
        self.write("sweep_bad_metrics/0/.hydra/overrides.yaml", b"- optim.lr=0.001\n")
        self.write("sweep_bad_metrics/0/metrics.jsonl", b'{"step": 1, "loss": 9.0}\n{"step": 2, "lo\n{"step": 3}\n')
        self.write("sweep_bad_status/0/.hydra/overrides.yaml", b"- optim.lr=0.001\n")
        self.write("sweep_bad_status/0/status.json", b'{"status": "fin')
        self.write("sweep_bad_overrides/0/.hydra/overrides.yaml", b"- [unclosed\n")

    def path(self, *parts) -> str:
        return os.path.join(self.root, *parts)

    def write(self, rel: str, data: bytes) -> str:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def copy_ckpt(self, name: str, config: Optional[dict] = None) -> str:
        out = self.path("ckpt", name)
        shutil.copytree(self.ckpt, out)
        if config:
            cfg = OmegaConf.merge(OmegaConf.load(os.path.join(out, "config.yaml")), config)
            OmegaConf.save(cfg, os.path.join(out, "config.yaml"))
        return out

    def source(self, kind: str, path: str, **extra) -> str:
        """A train.py/data.prepare override replacing the data sources by one source reading `path`."""
        more = "".join(f", {k}: {v}" for k, v in extra.items())
        return f"data.sources=[{{name: mine, kind: {kind}, paths: ['{path}']{more}}}]"

    def tokenizer(self) -> str:
        return f"data.tokenizer.path={os.path.join(self.ckpt, 'tokenizer.model')}"

    def prepare(self, *overrides) -> List[str]:
        return [f"data.cache_dir={self.cache}", "data.num_workers=0", *overrides]

    def train(self, *overrides) -> List[str]:
        return [f"hydra.run.dir={self.run}", f"data.cache_dir={self.cache}", "data.num_workers=0",
                "trainer.max_steps=2", "optim.warmup_steps=0", *overrides]


CASES = [
    # ---------------------------------------------------------------------------------------- train.py: config
    C("unknown key", "train", lambda w: w.train("+model.hiden_size=512"), ["model.hiden_size", "hidden_size"], 2,
      "a typo in a key"),
    C("unknown key without +", "train", lambda w: w.train("trainer.max_step=5"), ["trainer.max_step"], 2),
    C("wrong type", "train", lambda w: w.train("trainer.micro_batch_size=abc"), ["trainer.micro_batch_size"], 2),
    C("unknown preset", "train", lambda w: w.train("data=nope"), ["data=nope", "corpora_5dom"], 2),
    C("unknown precision preset", "train", lambda w: w.train("precision=fp8"), ["precision=fp8", "bf16"], 2,
      "a preset that does not exist"),
    C("unknown stage", "train", lambda w: w.train("stage=nope"), ["stage=nope", "tiny_pretrain"], 2),
    C("override syntax", "train", lambda w: w.train("optim.lr=1e-3)"), ["optim.lr=1e-3)"], 2),
    C("batch arithmetic", "train", lambda w: w.train("trainer.global_batch_size=100"),
      ["trainer.global_batch_size"], 2),
    C("layout needs devices", "train", lambda w: w.train("model=13b", "parallel=tp8pp2"), ["parallel", "dry_run=true"], 2,
      "a layout this machine cannot run"),
    C("device not here", "train", lambda w: w.train("device=ascend910b", "model=13b", "parallel=tp8pp2"),
      ["device=ascend910b", "no Ascend devices", "dry_run=true", "device=cpu"], 2,
      "a device preset this machine does not have"),
    C("fp32 flash attention", "train", lambda w: w.train("device=ascend910b", "precision=fp32", "dry_run=true"),
      ["precision", "model.flash_attention=false", "precision=auto"], 2, "fp32 with flash attention"),
    C("no nodes", "train", lambda w: w.train("device=ascend910b", "nodes=0", "dry_run=true"), ["nodes", ">= 1"], 2,
      "an impossible cluster"),
    C("no layout fits", "train", lambda w: w.train("model=70b", "device=ascend910b", "data.seq_len=4096",
                                                   "dry_run=true"),
      ["nodes", "no layout of 8 x ascend910b fits model=70b", "needs at least 32 (nodes=4)"], 2,
      "a model no layout of the nodes fits"),
    C("layout vs nodes", "train", lambda w: w.train("model=13b", "parallel=tp8pp2", "device=ascend910b", "nodes=4",
                                                    "dry_run=true"), ["nodes", "16 devices", "nodes=2"], 2),
    C("auto across nodes", "train", lambda w: w.train("device=ascend910b", "nodes=2"), ["parallel", "dry_run=true"], 2),
    C("bf16 on CPU", "train", lambda w: w.train("precision=bf16"), ["precision"], 2),
    C("fused kernels switched off", "train", lambda w: w.train("model.layer_kernels=fused"),
      ["model.layer_kernels", "MINDLAB_KERNELS=plain"], 2, env={"MINDLAB_KERNELS": "plain"}),
    C("unknown kernel switch", "train", lambda w: w.train(), ["MINDLAB_KERNELS=fast", "plain"], 1,
      env={"MINDLAB_KERNELS": "fast"}),
    C("negative lr", "train", lambda w: w.train("optim.lr=-1"), ["optim.lr"], 2),
    C("run dir not creatable", "train", lambda w: w.train(f"hydra.run.dir={w.path('afile', 'run')}"),
      ["hydra.run.dir", "afile"], 2, "an output directory that cannot be created"),
    C("wandb online without key", "train", lambda w: w.train("logger=wandb", "logger.mode=online"),
      ["WANDB_API_KEY", "logger.mode"], 2, "W&B online without credentials",
      env={"WANDB_API_KEY": None, "NETRC": "/nonexistent/netrc", "WANDB_MODE": None}),
    C("eval tasks on BERT", "train", lambda w: w.train("stage=bert_tiny_mlm", "trainer.eval_tasks=[x]"),
      ["trainer.eval_tasks", "objective=mlm has none"], 2, "evaluation tasks for an objective without a per-token NLL"),
    C("start from LoRA adapters", "train", lambda w: w.train("stage=dpo", f"stage.init_from={w.lora}",
                                                             "data=preferences"),
      lambda w: [w.lora, "--merge-lora"], 1),
    C("moe top-k above the experts", "train", lambda w: w.train("model=moe_tiny", "model.top_k=9"),
      ["model.top_k", "num_experts=8"], 2, "a mixture of experts routing each token to more experts than it has"),
    C("moe capacity factor not positive", "train", lambda w: w.train("model=moe_tiny", "model.capacity_factor=0"),
      ["model.capacity_factor", "null for dropless"], 2),
    C("moe ep not dividing the experts", "train",
      lambda w: w.train("model=mixtral_8x7b", "device=ascend910b", "parallel=single", "parallel.dp=6", "parallel.ep=3",
                        "dry_run=true"),
      ["parallel.ep", "the 8 experts", "choose ep among 1, 2"], 2, "expert parallelism that does not divide the experts"),
    C("moe expert width not divisible by tp", "train",
      lambda w: w.train("model=mixtral_8x7b", "device=ascend910b", "parallel=single", "parallel.tp=4",
                        "model.expert_intermediate_size=14338", "dry_run=true"),
      ["model.expert_intermediate_size", "parallel.tp=4"], 2, "tensor parallelism that does not divide an expert"),
    C("moe routing bias on several devices", "train",
      lambda w: w.train("model=moe_tiny", "model.bias_update_rate=0.001", "parallel=dp2"),
      ["model.bias_update_rate", "parallel=single"], 2, "DeepSeek-V3's bias balancing on more than one device"),
    C("dpo without a checkpoint", "train", lambda w: w.train("stage=dpo"), ["stage.init_from"], 2,
      "an alignment stage without the model it starts from"),
    C("rm on instruction data", "train", lambda w: w.train("stage=rm", f"stage.init_from={w.ckpt}", "data=instructions"),
      ["data.sources", "preference"], 2, "a stage given data of the wrong kind"),
    C("ppo without a reward model", "train", lambda w: w.train("stage=ppo", f"stage.init_from={w.ckpt}"),
      ["objective.reward_model", "stage=rm"], 2),
    C("ppo with a non-reward checkpoint", "train",
      lambda w: w.train("stage=ppo", f"stage.init_from={w.ckpt}", f"objective.reward_model={w.ckpt}"),
      lambda w: ["objective.reward_model", w.ckpt, "stage=rm"], 2, "a reward model that is not one"),
    C("dpo lora_base without lora", "train",
      lambda w: w.train("stage=dpo", f"stage.init_from={w.ckpt}", "data=preferences", "objective.reference=lora_base"),
      ["objective.reference", "peft=lora"], 2),
    C("ppo with a precomputed reference", "train",
      lambda w: w.train("stage=ppo", f"stage.init_from={w.ckpt}", f"objective.reward_model={w.rm_no_stats}",
                        "objective.reference=precomputed"), ["objective.reference", "copy, lora_base"], 2,
      "a reference mode the objective cannot use"),
    C("ppo rm_val without statistics", "train",
      lambda w: w.train("stage=ppo", f"stage.init_from={w.ckpt}", f"objective.reward_model={w.rm_no_stats}",
                        "objective.score_norm=rm_val"),
      lambda w: ["objective.score_norm", os.path.join(w.rm_no_stats, "state.json"), "objective.score_norm=running"], 2,
      "reward-model statistics its checkpoint does not hold"),
    # ---------------------------------------------------------------------------------------- train.py: files
    C("eval task file missing", "train", lambda w: w.train(f"trainer.eval_tasks=[{w.path('nowhere.jsonl')}]"),
      lambda w: [w.path("nowhere.jsonl"), "builders.tasks build"], 2, "a task file that is not there"),
    C("data file missing", "train", lambda w: w.train(w.source("jsonl", w.path("data", "missing.jsonl"))),
      lambda w: ["missing.jsonl"], 1, "a data file that is not there"),
    C("run dir holding other files", "train", lambda w: w.train(f"hydra.run.dir={w.stranger}"),
      lambda w: ["hydra.run.dir", w.stranger, "notes.txt"], 2, "hydra.run.dir pointing at a directory of other files"),
    C("resume from missing dir", "train", lambda w: w.train(f"trainer.resume={w.path('nowhere')}"),
      lambda w: ["trainer.resume", w.path("nowhere")], 1),
    C("init from a dangling latest", "train", lambda w: w.train(f"stage.init_from={w.dangling}"),
      lambda w: [os.path.join(w.dangling, "checkpoints", "latest"), "step_000002",
                 os.path.join(w.dangling, "checkpoints", "step_000001")], 1,
      "a run whose `latest` names a deleted checkpoint"),
    C("init from a non-checkpoint", "train", lambda w: w.train(f"stage.init_from={w.no_ckpt}"),
      lambda w: [w.no_ckpt], 1, "a checkpoint path that is not a checkpoint"),
    # ---------------------------------------------------------------------------------------- data.prepare
    C("prepare: unknown preset", "prepare", lambda w: w.prepare("data=nope"), ["data=nope", "corpora_5dom"], 2),
    C("prepare: unknown key", "prepare", lambda w: w.prepare("data.seq_lenn=5"), ["data.seq_lenn"], 2),
    C("prepare: bad value", "prepare", lambda w: w.prepare("data.val_fraction=2"), ["data.val_fraction"], 2),
    C("prepare: bad JSON", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "bad.jsonl"))),
      lambda w: [w.path("data", "bad.jsonl") + ":2"], 1, "a JSONL line that is not JSON"),
    C("prepare: wrong encoding", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "latin1.jsonl"))),
      lambda w: [w.path("data", "latin1.jsonl") + ":1"], 1, "a file that is not UTF-8"),
    C("prepare: text not UTF-8", "prepare", lambda w: w.prepare(w.source("text", w.path("data", "latin1.txt"))),
      lambda w: [w.path("data", "latin1.txt")], 1),
    C("prepare: empty file", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "empty.jsonl"))),
      lambda w: [w.path("data", "empty.jsonl")], 1, "an empty data file"),
    C("prepare: truncated gzip", "prepare",
      lambda w: w.prepare(w.source("jsonl", w.path("data", "truncated.jsonl.gz"))),
      lambda w: [w.path("data", "truncated.jsonl.gz")], 1, "a truncated .gz file"),
    C("prepare: wrong field", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "field.jsonl"))),
      lambda w: [w.path("data", "field.jsonl") + ":1", "text_field"], 1, "JSON records without the text field"),
    C("prepare: not an object", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "list.jsonl"))),
      lambda w: [w.path("data", "list.jsonl") + ":1"], 1),
    C("prepare: field not a string", "prepare",
      lambda w: w.prepare(w.source("jsonl", w.path("data", "number.jsonl"))),
      lambda w: [w.path("data", "number.jsonl") + ":1"], 1),
    C("prepare: huge line", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "huge.jsonl"))),
      lambda w: [w.path("data", "huge.jsonl") + ":1"], 1, "a huge or unterminated line"),
    C("prepare: not parquet", "prepare", lambda w: w.prepare(w.source("parquet", w.path("data", "not.parquet"))),
      lambda w: [w.path("data", "not.parquet")], 1),
    C("prepare: glob matches nothing", "prepare",
      lambda w: w.prepare(w.source("jsonl", w.path("data", "nothing*.jsonl"))), ["nothing*.jsonl"], 1),
    C("prepare: unknown kind", "prepare", lambda w: w.prepare(w.source("csv", w.path("data", "bad.jsonl"))),
      ["csv"], 1),
    C("prepare: a JSON list as .jsonl", "prepare",
      lambda w: w.prepare(w.source("alpaca", w.path("data", "alpaca_data.jsonl")), w.tokenizer()),
      lambda w: [w.path("data", "alpaca_data.jsonl") + ":1", "name it .json"], 1, "a JSON list saved as .jsonl"),
    C("prepare: feedback that prefers neither", "prepare",
      lambda w: w.prepare(w.source("feedback", w.path("data", "human_feedback.jsonl")), w.tokenizer()),
      lambda w: [w.path("data", "human_feedback.jsonl") + ":2", "'preference' is 3", "ties=drop"], 1,
      "a feedback record whose preference is not 1 or 2"),
    C("prepare: a record of another format", "prepare",
      lambda w: w.prepare(w.source("preference", w.path("data", "human_feedback.jsonl")), w.tokenizer()),
      lambda w: [w.path("data", "human_feedback.jsonl") + ":1", "no field 'chosen'", "set kind: feedback"], 1,
      "records of another format than the source's kind"),
    C("prepare: a template field that is not filled", "prepare",
      lambda w: w.prepare(w.source("alpaca", w.path("inst_field", "train.jsonl")), w.tokenizer(),
                          'data.template.prompt_no_input="### 指令: {instrction}\\n### 输出: "'),
      ["data.template.prompt_no_input", "{instrction}", "{instruction}"], 1, "a template with a misspelt field"),
    C("prepare: truncated gzip mid-source", "prepare",
      lambda w: w.prepare(w.source("jsonl", w.path("data", "mid", "*.jsonl.gz"))),
      lambda w: [w.path("data", "mid", "b.jsonl.gz"), "cannot read it"], 1),
    C("prepare: file gone", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "gone", "*.jsonl"))),
      lambda w: [w.path("data", "gone", "part.jsonl"), "no such file"], 1,
      "a data file that vanished after prepare listed it"),
    C("prepare: disk full", "prepare", lambda w: w.prepare(w.source("jsonl", w.path("data", "big.jsonl"))),
      lambda w: [w.cache, "cannot write", w.path("data", "big.jsonl"), "data.cache_dir"], 1,
      "a disk that fills while prepare writes",
      max_file_bytes=64 << 10),
    C("prepare: bad step", "prepare", lambda w: w.prepare("step=merge"), ["step", "clean, plan, tokenize"], 2),
    C("prepare: part without a step", "prepare", lambda w: w.prepare("part=1/4"), ["part", "step=clean"], 2,
      "a fan-out part without its step"),
    C("prepare: bad part", "prepare", lambda w: w.prepare("step=clean", "part=4/4"), ["part: got 4/4", "0 <= i < n"], 2),
    # ---------------------------------------------------------------------------------------- models.convert
    C("convert: missing dir", "convert", lambda w: [w.path("nowhere"), "--to", "hf", w.path("out")],
      lambda w: [w.path("nowhere")], 2, "converting a directory that is not there"),
    C("convert: not a checkpoint", "convert", lambda w: [w.no_ckpt, "--to", "hf", w.path("out")],
      lambda w: [w.no_ckpt, "config.yaml"], 1),
    C("convert: truncated", "convert", lambda w: [w.truncated, "--to", "hf", w.path("out")],
      lambda w: [os.path.join(w.truncated, "model.safetensors")], 1, "a truncated checkpoint"),
    C("convert: adapters without base", "convert", lambda w: [w.lora, "--to", "hf", w.path("out"), "--merge-lora"],
      lambda w: [w.lora, "stage.init_from"], 1, "LoRA adapters whose base checkpoint is gone"),
    C("convert: unknown HF architecture", "convert", lambda w: [w.hf_unknown, "--to", "mindlab", w.path("out")],
      ["GPT2LMHeadModel"], 2),
    C("convert: into a user's directory", "convert", lambda w: [w.ckpt, w.stranger, "--to", "hf"],
      lambda w: [w.stranger, "notes.txt"], 2, "an output directory holding someone else's files"),
    C("convert: bad --to", "convert", lambda w: [w.ckpt, "--to", "onnx", w.path("out")], ["--to", "onnx"], 2,
      "a bad command-line argument"),
    # ---------------------------------------------------------------------------------------- distributed.reshard
    C("reshard: missing dir", "reshard", lambda w: ["split", w.path("nowhere"), w.path("out"), "--tp", "2"],
      lambda w: [w.path("nowhere")], 2),
    C("reshard: tp does not divide", "reshard", lambda w: ["split", w.ckpt, w.path("out"), "--tp", "3"],
      ["3"], 1),
    C("reshard: merge a plain checkpoint", "reshard", lambda w: ["merge", w.ckpt, w.path("out")],
      lambda w: [w.ckpt, "rank_"], 1),
    C("reshard: into a user's directory", "reshard", lambda w: ["split", w.ckpt, w.stranger, "--tp", "2"],
      lambda w: [w.stranger, "notes.txt"], 2),
    C("reshard: bad command", "reshard", lambda w: ["explode", w.ckpt, w.path("out")], ["explode"], 2),
    # ---------------------------------------------------------------------------------------- sweeps.report
    C("report: missing dir", "report", lambda w: [w.path("nowhere")], lambda w: [w.path("nowhere")], 2,
      "a sweep dir that is not there"),
    C("report: a report.html it did not write", "report", lambda w: [w.path("sweep_foreign_report")],
      lambda w: [w.path("sweep_foreign_report", "report.html")], 2, "a file of the report's name that is not its own"),
    # ---------------------------------------------------------------------------------------------- recipe
    C("recipe: none named", "recipe", lambda w: [f"hydra.run.dir={w.path('r0')}"], ["recipe", "tiny_chat"], 2),
    C("recipe: unknown", "recipe", lambda w: ["recipe=nope", f"hydra.run.dir={w.path('r0')}"],
      ["recipe=nope", "tiny_chat"], 2),
    C("recipe: override for a stage it lacks", "recipe",
      lambda w: ["recipe=tiny_chat", "recipe.stages.rm.optim.lr=1e-4", f"hydra.run.dir={w.path('r1')}"],
      ["recipe.stages.rm", "pretrain, sft, dpo, evaluate"], 2, "an override naming a stage the recipe does not have"),
    C("recipe: unknown stage preset", "recipe",
      lambda w: ["recipe=tiny_chat", "recipe.stages.sft.stage=sfft", f"hydra.run.dir={w.path('r2')}"],
      ["recipe.stages.sft.stage", "sfft"], 2),
    C("recipe: evaluation before training", "recipe",
      lambda w: ["recipe=bert_tiny", "~recipe.stages.mlm.stage", "recipe.stages.mlm.kind=evaluate",
                 f"hydra.run.dir={w.path('r3')}"],
      ["recipe.stages.mlm", "training stage"], 2, "an evaluation stage with no training stage before it"),
    C("recipe: a stage that cannot start", "recipe",
      lambda w: ["recipe=tiny_chat", "~recipe.stages.pretrain.stage", "recipe.stages.pretrain.kind=evaluate",
                 "recipe.stages.pretrain.of=dpo",
                 f"hydra.run.dir={w.path('r4')}"], ["recipe.stages.pretrain.of", "dpo"], 2),
    C("recipe: changed stage in its directory", "recipe",
      lambda w: ["recipe=tiny_chat", f"hydra.run.dir={w.recipe_run}"],
      lambda w: ["recipe.stages.sft", w.recipe_run, "another config"], 2, "rerunning a recipe directory with a "
      "stage's config changed"),
    C("report: no runs", "report", lambda w: [w.sweep_empty], lambda w: [w.sweep_empty, "overrides.yaml"], 1),
    C("report: corrupt metrics", "report", lambda w: [w.path("sweep_bad_metrics")],
      lambda w: [w.path("sweep_bad_metrics", "0", "metrics.jsonl") + ":2"], 1, "a corrupt metrics.jsonl in a sweep"),
    C("report: corrupt status", "report", lambda w: [w.path("sweep_bad_status")],
      lambda w: [w.path("sweep_bad_status", "0", "status.json")], 1),
    C("report: corrupt overrides", "report", lambda w: [w.path("sweep_bad_overrides")],
      lambda w: [w.path("sweep_bad_overrides", "0", ".hydra", "overrides.yaml")], 1),
    # ---------------------------------------------------------------------------------------- generate
    C("generate: missing checkpoint", "generate", lambda w: [w.path("nowhere"), "--prompt", "hi"],
      lambda w: [w.path("nowhere")], 2),
    C("generate: other vocab", "generate", lambda w: [w.other_vocab, "--prompt", "hi", "--max-new-tokens", "1"],
      lambda w: [os.path.join(w.other_vocab, "model.safetensors")], 1, "a checkpoint of another vocabulary"),
    C("generate: other model", "generate", lambda w: [w.other_model, "--prompt", "hi", "--max-new-tokens", "1"],
      lambda w: [os.path.join(w.other_model, "model.safetensors")], 1, "a checkpoint of another model"),
    C("generate: truncated", "generate", lambda w: [w.truncated, "--prompt", "hi", "--max-new-tokens", "1"],
      lambda w: [w.truncated], 1),
    C("generate: adapters only", "generate", lambda w: [w.lora, "--prompt", "hi"], lambda w: [w.lora, "merge"], 2),
    C("generate: BERT checkpoint", "generate", lambda w: [w.bert, "--prompt", "hi"], lambda w: [w.bert, "family"], 2),
    C("generate: bad prompts file", "generate",
      lambda w: [w.ckpt, "--prompts-file", w.path("data", "prompts_bad.jsonl")],
      lambda w: [w.path("data", "prompts_bad.jsonl") + ":2"], 2),
    C("generate: bad --top-p", "generate", lambda w: [w.ckpt, "--prompt", "hi", "--top-p", "2"], ["--top-p"], 2),
    # ---------------------------------------------------------------------------------------- evaluate
    C("harness: no tasks", "harness", lambda w: [w.ckpt], ["--tasks"], 2, "lm-eval harness without --tasks"),
    C("evaluate: missing checkpoint", "evaluate", lambda w: [w.path("nowhere")], lambda w: [w.path("nowhere")], 2),
    C("evaluate: converted model without data", "evaluate", lambda w: [w.model_only, "tasks=[]"], ["data="], 2),
    C("evaluate: a reward model", "evaluate", lambda w: [w.rm_no_stats], lambda w: [w.rm_no_stats, "reward model"], 2),
    C("evaluate: unknown task", "evaluate", lambda w: [w.ckpt, "tasks=[nope]", f"--tasks-dir={w.data}"], ["nope"], 2),
    C("evaluate: bad task file", "evaluate",
      lambda w: [w.ckpt, "tasks=[task_bad]", f"--tasks-dir={w.data}"],
      lambda w: [w.path("data", "task_bad.jsonl") + ":1"], 2),
    # ---------------------------------------------------------------------------------------- data builders
    C("instructions: missing corpora", "instructions", lambda w: ["--corpora", w.path("nowhere")],
      lambda w: [w.path("nowhere"), "--corpora"], 2),
    C("instructions: bad number", "instructions", ["--max-per-task", "many"], ["--max-per-task", "many"], 2),
    C("instructions: fraction out of range", "instructions", ["--val-fraction", "2"], ["--val-fraction", "[0.0, 1.0)"], 2,
      "a number out of range for a dataset builder"),
    C("preferences: negative count", "preferences", ["--max-pairs", "-5"], ["--max-pairs", ">= 1", "-5"], 2,
      "a negative count for a dataset builder"),
    C("tasks: zero items", "tasks", ["build", "--items", "0"], ["--items", ">= 1"], 2),
    C("reshard: zero tp", "reshard", lambda w: ["split", w.ckpt, w.path("out_tp0"), "--tp", "0"], ["--tp", ">= 1"], 2),
    C("instructions: into a user's directory", "instructions", lambda w: ["--out", w.stranger],
      lambda w: [w.stranger, "notes.txt"], 2),
    C("tasks: missing corpora", "tasks", lambda w: ["build", "--corpora", w.path("nowhere")],
      lambda w: [w.path("nowhere"), "--corpora"], 2),
    C("tasks: no command", "tasks", [], ["command"], 2),
    C("preferences: no instruction set", "preferences", lambda w: ["--instructions", w.path("nowhere"),
                                                                    "--out", w.path("prefs")],
      lambda w: [w.path("nowhere", "train.jsonl"), "builders.instructions"], 2),
    C("preferences: bad JSON", "preferences", lambda w: ["--instructions", w.path("inst_bad"), "--out", w.path("prefs")],
      lambda w: [w.path("inst_bad", "train.jsonl") + ":2"], 1),
    C("preferences: not a sample", "preferences",
      lambda w: ["--instructions", w.path("inst_field"), "--out", w.path("prefs")],
      lambda w: [w.path("inst_field", "train.jsonl") + ":1", "entry"], 1),
    C("preferences: into a user's directory", "preferences",
      lambda w: ["--instructions", w.path("inst_field"), "--out", w.stranger], lambda w: [w.stranger, "notes.txt"], 2),
    C("preferences: on-policy without a checkpoint", "preferences",
      lambda w: ["--on-policy", w.path("nowhere"), "--out", w.path("prefs")],
      lambda w: ["--on-policy", w.path("nowhere")], 2, "on-policy pairs from a checkpoint that is not there"),
    C("preferences: one sample per prompt", "preferences",
      lambda w: ["--on-policy", w.ckpt, "--samples", "1", "--out", w.path("prefs")], ["--samples", ">= 2"], 2,
      "on-policy pairs from one sample per prompt"),
    C("preferences: greedy on-policy samples", "preferences",
      lambda w: ["--on-policy", w.ckpt, "--temperature", "0", "--out", w.path("prefs")], ["--temperature"], 2),
]

ERROR_LINE = re.compile(r"^(config )?error: ")
SEEN = {}  # case id -> its error line, for docs/troubleshooting.md's table


def snapshot(*roots: str) -> dict:
    """{path: sha256} of every file under `roots`, except what a start records by design: Hydra's .hydra/
    and train.log, and status.json (a failed run says why there)."""
    files = {}
    for root in roots:
        for path, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != ".hydra"]
            for name in names:
                if name in ("status.json", "train.log"):
                    continue
                with open(os.path.join(path, name), "rb") as f:
                    files[os.path.join(path, name)] = hashlib.sha256(f.read()).hexdigest()
    return files


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_file):
    import mindspore as ms

    from base import checkpoint
    from conftest import compose_cfg
    from models import build_model

    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        cfg = compose_cfg("model=tiny")  # a whole config, as a training run saves it
        model = build_model(cfg.model, 64, "fp32", "CPU", seed=0)
        ckpt = checkpoint.save(str(tmp_path_factory.mktemp("errors_ckpt")), 1, model,
                               ms.nn.SGD(model.trainable_params()), {"optimizer": cfg.optim.name}, cfg, tokenizer_file)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    return World(str(tmp_path_factory.mktemp("errors")), ckpt)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_line(case, world):
    protected = (world.run, world.cache, world.ckpt, world.stranger, world.path("sweep_foreign_report"),
                 world.recipe_run)
    before = snapshot(*protected)
    with file_size_limit(case.max_file_bytes):
        out = invoke(case.entry, case.argv(world), case.env)
    assert not out.traceback, f"a traceback instead of one error line:\n{out.err[-3000:]}"
    lines = [line for line in out.err.splitlines() if ERROR_LINE.match(line)]
    assert len(lines) == 1, f"expected one error line, got:\n{out.err[-3000:]}"
    assert out.code == case.code, (out.code, lines[0])
    for name in case.names(world):
        assert name in lines[0], (name, lines[0])
    SEEN[case.id] = lines[0]
    assert len(lines[0]) < 600, lines[0]  # a sentence, not a dump of the input
    after = snapshot(*protected)
    changed = [path for path, digest in before.items() if after.get(path) != digest]
    assert not changed, f"files written before the failed command changed or went: {changed}"


def test_wandb_online_without_key_says_why_in_status_json(world):
    case = next(c for c in CASES if c.id == "wandb online without key")
    invoke(case.entry, case.argv(world), case.env)
    with open(os.path.join(world.run, "status.json"), encoding="utf-8") as f:
        status = json.load(f)
    assert status["status"] == "failed" and "WANDB_API_KEY" in status["error"]


def test_a_checkpoint_with_a_stage_head_still_loads(world, pynative):
    """The other-model refusal is about the model's own weights: a PPO checkpoint's value_head.weight beside
    them is left out (generate, evaluate and stage.init_from take a PPO policy)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from base import checkpoint
    from conftest import compose_cfg
    from models import build_model

    path = world.copy_ckpt("ppo")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    save_file({**weights, "value_head.weight": np.zeros((1, 128), np.float32)}, file)
    model = build_model(compose_cfg("model=tiny").model, 64, "fp32", "CPU", seed=1)
    checkpoint.load_weights(path, model)
    name = "model.tok_embeddings.embedding_weight"
    assert np.array_equal(model.parameters_dict()[name].asnumpy(), weights[name])


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """Not a user error: the contract must not swallow it."""
    prepare_cli = importlib.import_module("prepare")  # the CLI module (the function is data.cache.prepare)

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(prepare_cli, "prepare", broken)
    with pytest.raises(KeyError):
        prepare_cli.main(["data.num_workers=0"])


TABLE_BEGIN = ("<!-- errors: generated from tests/test_errors.py (MINDLAB_WRITE_DOCS=1 pytest tests/test_errors.py -k "
               "troubleshooting) -->")
TABLE_END = "<!-- errors: end -->"


def troubleshooting_table(world: World) -> str:
    """docs/troubleshooting.md's table: what the user did, the command, and the line they see (tmp paths shortened)."""
    short = lambda text: text.replace(world.ckpt, "ckpt").replace(world.root + os.sep, "").replace(ROOT, ".")
    hidden = ("hydra.run.dir=" + world.run, "data.cache_dir=", "data.num_workers=", "trainer.max_steps=",
              "optim.warmup_steps=")  # the table's own plumbing
    rows = ["| you ran | you see |", "| --- | --- |"]
    for case in CASES:
        if not case.cause:
            continue
        if case.id not in SEEN:  # deselected (-k): run it here
            with file_size_limit(case.max_file_bytes):
                out = invoke(case.entry, case.argv(world), case.env)
            SEEN[case.id] = next(line for line in out.err.splitlines() if ERROR_LINE.match(line))
        argv = [short(a) for a in case.argv(world) if not a.startswith(hidden)]
        command = " ".join([ENTRIES[case.entry][1], *argv])
        cell = lambda text: "`` " + short(text).replace("|", "\\|") + " ``"  # `` allows a ` inside
        rows.append(f"| {case.cause}: {cell(command)} | {cell(SEEN[case.id])} |")
    return "\n".join(rows)


def test_troubleshooting_shows_the_table(world):
    """docs/troubleshooting.md holds the lines the table's cases print (regenerate: MINDLAB_WRITE_DOCS=1)."""
    with open(TROUBLESHOOTING, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    expected = "\n" + troubleshooting_table(world) + "\n"
    if os.environ.get("MINDLAB_WRITE_DOCS") == "1":
        with open(TROUBLESHOOTING, "w", encoding="utf-8") as f:
            f.write(text[:begin] + expected + text[end:])
        return
    assert text[begin:end] == expected, "docs/troubleshooting.md's table is stale: MINDLAB_WRITE_DOCS=1 pytest " \
                                        "tests/test_errors.py -k troubleshooting"


OTHER_ENTRIES = [module for module, _ in ENTRIES.values() if module != "train"]


@pytest.fixture(scope="module")
def mindformers_loaded():
    """Whether mindformers is in sys.modules of one fresh process (the suite's own has it) after importing train.py
    and the training loop, then after importing every other entry point as well."""
    code = "import boot, importlib, json, sys\nloaded = []\n" \
           f"for group in (['train', 'trainer.loop'], {OTHER_ENTRIES!r}):\n" \
           "    [importlib.import_module(m) for m in group]\n" \
           "    loaded.append('mindformers' in sys.modules)\n" \
           "print(json.dumps(loaded))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_native_training_run_imports_no_mindformers(mindformers_loaded):
    assert mindformers_loaded[0] is False


def test_no_entry_point_imports_mindformers(mindformers_loaded):
    """MindFormers prints two import warnings (hyper_parallel) when imported: only model.impl=mindformers and
    `models.convert --to mindformers` may load it."""
    assert mindformers_loaded[1] is False
