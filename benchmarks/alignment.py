"""The alignment pipeline on the shared corpora, measured: SFT from a pretrained checkpoint, then a reward model
and DPO from the SFT checkpoint on the rule-built preference set (builders/preferences.py), then PPO from the
SFT checkpoint against that reward model, with held-out preference accuracy and the PPO reward along the way.

    scripts/venv.sh python -m builders.instructions && scripts/venv.sh python -m builders.preferences   # once
    scripts/venv.sh python -m benchmarks.alignment --base CKPT [--model tiny] [--sft-steps 300] [--steps 200]
        [--ppo-steps 100] [--workdir DIR]     # DIR keeps the runs (default: a temporary directory)

With --workdir, a stage whose run already holds its last checkpoint there is read, not re-run, so an interrupted
benchmark picks up where it stopped (a stage killed half-way is re-run from its start).

CKPT is a pretraining checkpoint of --model (e.g. `make train`'s last one for tiny). Each run is its own
train.py process with the stage preset's recipe, except the learning rates below (small models take larger
ones than the 7B recipes the presets cite). Printed: each held-out evaluation of the RM (pair accuracy vs
chance 0.5, loss) and of DPO (rewards/accuracies, margins, KL to the reference), PPO's RM score and KL per
rollout, with tokens/s and peak RSS; and the rule-based check of each policy (SFT, after DPO, after PPO): greedy
answers to the first --rule-items held-out instructions scored by exact match and ROUGE-L against the corpus
answer (`python -m evaluation CKPT tasks=[<instructions>/val.jsonl]`).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

from benchmarks.measure import ROOT, summarize, time_shares, train_and_measure
from benchmarks.results import recorded

COMMON = ["trainer.micro_batch_size=8", "trainer.log_every=10", "trainer.eval_batches=16", "logger.progress_bar=false"]


def evals(run_dir: str) -> list:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"val_loss"' in line]


def rule_check(ckpt: str, items: int, workdir: str) -> dict:
    """Exact match and ROUGE-L of `ckpt`'s greedy answers to the held-out instructions (python -m evaluation)."""
    data = os.environ.get("MINDLAB_DATA_DIR", os.path.expanduser("~/.cache/mindlab/data"))
    out = os.path.join(workdir, os.path.basename(os.path.dirname(os.path.dirname(ckpt))) + "_rules.json")
    subprocess.run([sys.executable, "-m", "evaluation", ckpt, f"tasks=[{data}/instructions/val.jsonl]", "data=default",
                    "eval.data=false", f"eval.max_items={items}", "--out", out], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return json.load(open(out))["tasks"]["val"]


def finished_or_run(name: str, overrides: list, steps: int, workdir: str) -> dict:
    """train_and_measure, unless <workdir>/<name> already holds the run's last checkpoint (see the docstring)."""
    run_dir = os.path.join(workdir, name)
    if os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{steps:06d}")):
        return summarize(run_dir)
    return train_and_measure(name, overrides, workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a pretraining checkpoint of --model")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200, help="RM and DPO steps")
    parser.add_argument("--sft-lr", default="1e-3")
    parser.add_argument("--rm-lr", default="1e-4")
    parser.add_argument("--dpo-lr", default="5e-5")
    parser.add_argument("--ppo-steps", type=int, default=100)
    parser.add_argument("--ppo-lr", default="1e-4")
    parser.add_argument("--rule-items", type=int, default=200, help="held-out instructions of the rule check")
    parser.add_argument("--workdir")
    args, overrides = parser.parse_known_args()
    model = f"model={args.model}"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        sft = finished_or_run("sft", ["stage=sft", model, "data=instructions", f"stage.init_from={args.base}",
                                      "data.seq_len=256", "objective.truncate=true",
                                      f"trainer.max_steps={args.sft_steps}",
                                      f"trainer.eval_every={args.sft_steps}", f"optim.lr={args.sft_lr}",
                                      *COMMON, *overrides], args.sft_steps, workdir)
        sft_ckpt = os.path.join(workdir, "sft", "checkpoints", f"step_{args.sft_steps:06d}")
        sft_val = evals(os.path.join(workdir, "sft"))[-1]
        every = max(args.steps // 4, 1)
        runs = {}
        for stage, lr in (("rm", args.rm_lr), ("dpo", args.dpo_lr)):
            runs[stage] = finished_or_run(stage, [f"stage={stage}", model, "data=preferences",
                                                  f"stage.init_from={sft_ckpt}", f"trainer.max_steps={args.steps}",
                                                  f"trainer.eval_every={every}", f"optim.lr={lr}", *COMMON,
                                                  *overrides], args.steps, workdir)
            runs[stage]["evals"] = evals(os.path.join(workdir, stage))
        rm_ckpt = os.path.join(workdir, "rm", "checkpoints", f"step_{args.steps:06d}")
        ppo = finished_or_run("ppo", ["stage=ppo", model, f"stage.init_from={sft_ckpt}",
                                      f"objective.reward_model={rm_ckpt}", f"trainer.max_steps={args.ppo_steps}",
                                      f"optim.lr={args.ppo_lr}", "objective.max_new_tokens=48",
                                      "trainer.log_every=4", "logger.progress_bar=false", *overrides],
                              args.ppo_steps, workdir)
        ppo_logs = [json.loads(line) for line in open(os.path.join(workdir, "ppo", "metrics.jsonl"))]
        rules = {name: rule_check(os.path.join(workdir, name, "checkpoints", f"step_{steps:06d}"), args.rule_items,
                                  workdir)
                 for name, steps in (("sft", args.sft_steps), ("dpo", args.steps), ("ppo", args.ppo_steps))}
    print(f"{args.model}: SFT {args.sft_steps} steps (lr {args.sft_lr}) from {args.base}: held-out response loss "
          f"{sft_val['val_loss']:.4f}, token accuracy {sft_val['val_mean_token_accuracy']:.4f}; "
          f"{sft['tokens_per_sec']:.0f} tokens/s, {sft['peak_rss_gb']:.2f} GiB")
    rm, dpo = runs["rm"], runs["dpo"]
    print(f"\nreward model ({args.steps} steps, lr {args.rm_lr}; {rm['tokens_per_sec']:.0f} tokens/s, "
          f"{rm['peak_rss_gb']:.2f} GiB): held-out pairs ({COMMON[2].split('=')[1]} batches of 8)")
    print(f"{'step':>6} {'accuracy':>9} {'loss':>8} {'margin':>8} {'mean reward':>12}")
    for m in rm["evals"]:
        print(f"{m['step']:>6} {m['val_accuracy']:>9.3f} {m['val_loss']:>8.4f} {m['val_margin']:>8.3f} "
              f"{m['val_mean_reward']:>12.3f}")
    print(f"\nDPO ({args.steps} steps, lr {args.dpo_lr}, beta 0.1; {dpo['tokens_per_sec']:.0f} tokens/s, "
          f"{dpo['peak_rss_gb']:.2f} GiB): held-out pairs; step 0 is the SFT model (loss ln 2, margins 0)")
    print(f"{'step':>6} {'rewards/acc':>11} {'margins':>8} {'loss':>8} {'kl':>9} {'logps/chosen':>13} "
          f"{'logps/rejected':>15}")
    for m in dpo["evals"]:
        print(f"{m['step']:>6} {m['val_rewards/accuracies']:>11.3f} {m['val_rewards/margins']:>8.3f} "
              f"{m['val_loss']:>8.4f} {m['val_kl']:>9.5f} {m['val_logps/chosen']:>13.2f} "
              f"{m['val_logps/rejected']:>15.2f}")
    print(f"\nPPO ({args.ppo_steps} steps = {args.ppo_steps // 4} rollouts of 8 prompts x 4 epochs, lr {args.ppo_lr}, "
          f"kl_coef 0.05; {ppo['tokens_per_sec']:.0f} tokens/s, {ppo['peak_rss_gb']:.2f} GiB): per logged step, the "
          f"rollout it trained on")
    print(f"{'step':>6} {'RM score':>9} {'KL':>8} {'rlhf reward':>12} {'gen_len':>8} {'eos':>6} {'clipfrac':>9}")
    for m in ppo_logs:
        print(f"{m['step']:>6} {m['objective/scores']:>9.3f} {m['objective/kl']:>8.3f} "
              f"{m['objective/rlhf_reward']:>12.3f} {m['gen_len']:>8.1f} {m['eos_fraction']:>6.2f} "
              f"{m['policy/clipfrac']:>9.3f}")

    print(time_shares(ppo_logs))
    print(f"\nrule-based check on {args.rule_items} held-out instructions (greedy)")
    print(f"{'policy':>8} {'exact match':>12} {'ROUGE-L':>8}")
    for name, r in rules.items():
        print(f"{name:>8} {r['exact_match']:>12.3f} {r['rouge_l']:>8.3f}")


if __name__ == "__main__":
    with recorded("benchmarks.alignment", "The alignment pipeline: SFT, reward model, DPO on the shared corpora"):
        main()
