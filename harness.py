"""EleutherAI's lm-evaluation-harness (`lm_eval`) drives a mindlab checkpoint: `MindlabLM` is its model
interface (loglikelihood, loglikelihood_rolling, generate_until) over the scorers `python -m evaluation` uses.

    python -m harness CKPT --tasks definitions_mc,cloze_code [--limit 100] [--batch-size 8] [--out results.json]
    python -m harness SFT_CKPT data=default --tasks definitions_mc     # train.py overrides, as python -m evaluation
    python -m harness CKPT --tasks my_task --include-path MY_TASKS/     # any lm_eval task whose data is local

A name that is a mindlab task file (`python -m builders.tasks build`, or a path ending in .jsonl) becomes an lm_eval
task: a YAML written to a temporary include path (data files: that JSONL; text: the context; choices; gold), so
lm_eval's acc and acc_norm can be checked against python -m evaluation's on the same items (tests/test_harness.py does).
Other names are lm_eval's own tasks, whose datasets come from the Hugging Face hub: this machine has no route to
it, so only tasks with local data run here.

lm_eval is pinned in requirements.txt (its dependencies in requirements.lock, huggingface-hub at the version
transformers accepts), so the comparison runs in CI; nothing else in mindlab imports it.

`MindlabLM` itself does not need lm_eval: its methods take objects with `.args` (lm_eval's Instance), and
`MindlabLM.registered()` subclasses lm_eval's LM and registers it as `--model mindlab` when lm_eval is there.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import json
import os
import sys
import tempfile
from argparse import RawDescriptionHelpFormatter
from typing import List, Optional, Sequence, Tuple

from base.errors import ArgumentParser, ConfigError, UserError, entry_point, number
from plugins import register

register()


def rolling_windows(tokens: Sequence[int], prefix: int, max_len: int) -> List[Tuple[List[int], int]]:
    """A document's tokens -> rows (ids, n) scoring each token once: chunks of `max_len` targets, each row the
    chunk and as much context before it as fits in max_len + 1 ids (lm_eval's rolling windows with
    context_len=1, made disjoint); `prefix` (eos) conditions the first token."""
    full = [prefix] + list(tokens)
    rows = []
    for start in range(1, len(full), max_len):
        stop = min(start + max_len, len(full))
        rows.append((full[max(0, stop - max_len - 1):stop], stop - start))
    return rows


class MindlabLM:
    """lm_eval's model interface over a mindlab checkpoint (a causal decoder): `checkpoint` in any form (a run, its
    checkpoints/, `latest` or a step), `max_length` the context (default: the checkpoint's data.seq_len)."""

    def __init__(self, checkpoint: str, batch_size: int = 8, max_length: Optional[int] = None,
                 overrides: Sequence[str] = ()):
        from base.checkpoint import resolve
        from base.registry import OBJECTIVES
        from data import Tokenizer
        from evaluation.config import compose_config
        from evaluation.model import load_model
        from evaluation.scorer import LoglikelihoodScorer
        from trainer.runtime import init_runtime

        checkpoint = resolve(checkpoint)  # a run, its checkpoints/, `latest` or a step
        cfg = compose_config(checkpoint, list(overrides))
        self.tokenizer = Tokenizer(os.path.join(checkpoint, "tokenizer.model"))
        objective = OBJECTIVES[cfg.objective.name].Objective(cfg.objective, self.tokenizer, cfg.trainer.seed)
        if objective.token_nll is None:
            raise ConfigError("checkpoint", f"lm_eval scores a causal LM's log-likelihoods; {checkpoint} is a "
                              f"{cfg.model.family} model scored as objective={cfg.objective.name}, which has no "
                              f"per-token NLL (token_nll)")
        init_runtime(cfg)
        self.checkpoint, self.cfg, self.model = checkpoint, cfg, load_model(cfg, checkpoint)
        self.max_length = int(max_length or cfg.data.seq_len)
        self.batch_size = int(batch_size)
        self.scorer = LoglikelihoodScorer(objective.token_nll(self.model), self.tokenizer, self.batch_size,
                                          self.max_length)
        self._generate = None  # models/generation.py make_generate_fn's, built on first use

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        """(context, continuation) -> (log P(continuation | eos + context), whether it is the greedy one)."""
        return self.scorer.score([self.scorer.encode(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> List[float]:
        """(text,) -> log P(text | eos), every token scored once (rolling_windows)."""
        out = []
        for request in requests:
            rows = rolling_windows(self.tokenizer.encode(request.args[0]), self.tokenizer.eos_id, self.max_length)
            out.append(sum(logp for logp, _ in self.scorer.score(rows)))
        return out

    def generate_until(self, requests) -> List[str]:
        """(context, {until, max_gen_toks, do_sample, temperature}) -> the continuation, cut before the first
        stop string; greedy unless do_sample (then the temperature, seeded by trainer.seed)."""
        from models.generation import SamplingOptions, generator, make_generate_fn

        if self._generate is None:
            gen = generator(self.cfg.model.family, self.model)
            if gen is None:
                raise ConfigError("checkpoint", f"generate_until needs a generator; model.family="
                                  f"{self.cfg.model.family} has none")
            self._generate = make_generate_fn(gen, self.tokenizer)
        out = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            sample = kwargs.get("do_sample", False)
            (text,) = self._generate([context], int(kwargs.get("max_gen_toks", 256)),
                                     stop=[until] if isinstance(until, str) else list(until),
                                     sampling=SamplingOptions(
                                         temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                                         seed=self.cfg.trainer.seed))
            out.append(text)
        return out

    @classmethod
    def registered(cls):
        """This class as an lm_eval LM subclass, registered as `--model mindlab` (lm_eval must be installed)."""
        from lm_eval.api.model import LM
        from lm_eval.api.registry import MODEL_REGISTRY, register_model

        if "mindlab" not in MODEL_REGISTRY:
            register_model("mindlab")(type("MindlabHarnessLM", (cls, LM), {"__init__": _lm_init}))
        return MODEL_REGISTRY["mindlab"]


def _lm_init(self, checkpoint: str, batch_size=8, max_length=None, overrides=(), **_):
    from lm_eval.api.model import LM

    LM.__init__(self)
    MindlabLM.__init__(self, checkpoint, batch_size, max_length, overrides)


# --------------------------------------------------------------------------------------------- mindlab tasks

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def mindlab_task_yaml(name: str, path: str, directory: str) -> None:
    """Write <directory>/<name>.yaml: the mindlab multiple-choice task file `path` as an lm_eval task. The
    continuation is the choice as written (target_delimiter ""), as evaluation/tasks.py scores it."""
    with open(os.path.join(directory, f"{name}.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK_YAML.format(name=name, path=json.dumps(os.path.abspath(path))))


def run(checkpoint: str, tasks: List[str], include_path: Optional[str], limit: Optional[int], batch_size: int,
        max_length: Optional[int], overrides: Sequence[str] = ()) -> dict:
    try:
        import lm_eval
    except ImportError:
        raise UserError("lm_eval is not installed: run through scripts/venv.sh, whose venv has requirements.txt's "
                        "lm_eval (or `python -m evaluation CKPT tasks=[...]`, which needs nothing more)") from None
    from base.paths import task_path
    from evaluation.tasks import load_task
    from lm_eval.tasks import TaskManager

    names, paths = [], [include_path] if include_path else []
    with tempfile.TemporaryDirectory() as own:
        for name in tasks:
            path = task_path(name)
            if path.is_file():
                task = load_task(path, name=path.stem)  # checked: file:line errors as in python -m evaluation
                if task.kind != "multiple_choice":
                    raise ConfigError("--tasks", f"{path} holds {task.kind} items; only multiple-choice mindlab "
                                      "tasks are written as lm_eval tasks (score the others with python -m evaluation)")
                mindlab_task_yaml(f"mindlab_{path.stem}", str(path), own)
                names.append(f"mindlab_{path.stem}")
            else:
                names.append(name)
        if len(names) > len([n for n in names if not n.startswith("mindlab_")]):
            paths.append(own)
        lm = MindlabLM.registered()(checkpoint, batch_size, max_length, overrides)
        # lm_eval's own thousands of task YAMLs are indexed only when a task may need them (an lm_eval task
        # name, --include-path): indexing them is most of a short run's time, and a mindlab task's YAML is
        # self-contained
        builtin = include_path is not None or not all(n.startswith("mindlab_") for n in names)
        manager = TaskManager(include_path=paths or None, include_defaults=builtin)
        results = lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager)
    return results["results"]


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0],
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint: a run directory, its checkpoints/ or latest, or a step "
                        "directory (.../checkpoints/step_NNNNNN)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides, as python -m evaluation takes them")
    parser.add_argument("--tasks", required=True, help="comma-separated: mindlab task names/files or lm_eval tasks")
    parser.add_argument("--include-path", default=None, help="a directory of your own lm_eval task YAMLs")
    parser.add_argument("--limit", type=number(int, 1), default=None, help="items per task (default: all)")
    parser.add_argument("--batch-size", type=number(int, 1), default=8)
    parser.add_argument("--max-length", type=number(int, 2), default=None, help="context (default: the checkpoint's seq_len)")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_intermixed_args(argv)
    results = run(args.checkpoint, [t for t in args.tasks.split(",") if t], args.include_path, args.limit,
                  args.batch_size, args.max_length, args.overrides)
    for task, metrics in results.items():
        print(task + ": " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
