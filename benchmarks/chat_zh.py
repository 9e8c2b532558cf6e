"""The article's pipeline in Chinese, end to end: `python -m recipe recipe=tiny_chat_zh` (pretrain on
../shared/corpora/zh -> SFT in alpaca_zh -> reward model on the feedback records -> PPO -> evaluate), then what
each stage did, on held-out data:

- SFT: held-out response token accuracy and loss before (step 0) and after;
- the reward model: held-out preference accuracy and margin before and after;
- PPO: the reward model's score and the KL to the SFT policy across training, and whether its answers to the
  held-out instructions stay close to the corpus references (exact match, ROUGE-L) against the SFT model's:
  a score that rises while ROUGE-L falls is the reward model being gamed;
- pretraining: held-out bits per byte on the Chinese documents against the unigram baseline.

    scripts/venv.sh python -m benchmarks.chat_zh [--run-dir DIR] [--max-items 40]

--run-dir reuses a finished run of the recipe (else it runs in a temporary directory). The held-out answers are
greedy, from `python -m evaluation CKPT tasks=[<chat_zh>/val.jsonl]` on the SFT and the PPO checkpoints.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from base.paths import data_dir
from benchmarks.measure import time_shares
from benchmarks.results import recorded
from recipe.report import variants


def lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evals(stage: Path) -> list:
    return [m for m in lines(stage / "metrics.jsonl") if "val_loss" in m]


def held_out_answers(ckpt: Path, val: Path, max_items: int, work: Path, name: str) -> dict:
    """exact match and ROUGE-L of greedy answers to the held-out instructions (python -m evaluation's task)."""
    out = work / f"{name}.eval.json"
    subprocess.run([sys.executable, "-m", "evaluation", str(ckpt), f"tasks=[{val}]", "eval.data=false",
                    f"eval.max_items={max_items}", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text(encoding="utf-8"))["tasks"][val.stem]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, default=None, help="a finished `python -m recipe recipe=tiny_chat_zh`")
    parser.add_argument("--max-items", type=int, default=40, help="held-out instructions answered per checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run_dir, wall = args.run_dir, None
        if run_dir is None:
            run_dir, start = work / "tiny_chat_zh", time.perf_counter()
            with open(work / "recipe.log", "w", encoding="utf-8") as log:
                subprocess.run([sys.executable, "-m", "recipe", "recipe=tiny_chat_zh", f"hydra.run.dir={run_dir}"],
                               check=True, stdout=log, stderr=subprocess.STDOUT)
            wall = time.perf_counter() - start
        variant, = variants(run_dir)
        stage = {s["name"]: run_dir / s["link"] for s in variant["stages"]}
        sft, rm = evals(stage["sft"]), evals(stage["rm"])
        ppo = [m for m in lines(stage["ppo"] / "metrics.jsonl") if "objective/scores" in m]
        val = data_dir() / "chat_zh" / "val.jsonl"
        answers = {name: held_out_answers(stage[name] / "checkpoints" / "latest", val, args.max_items, work, name)
                   for name in ("sft", "ppo")}
        evaluated = json.loads((stage["evaluate"] / "eval.json").read_text(encoding="utf-8"))["data_eval"]
        samples = lines(stage["evaluate"] / "samples.jsonl") if (stage["evaluate"] / "samples.jsonl").is_file() else []
    print("| stage | held-out measure | before | after |")
    print("|---|---|---:|---:|")
    for key in ("val_mean_token_accuracy", "val_loss"):
        print(f"| SFT (alpaca_zh) | {key} | {sft[0][key]:.4f} | {sft[-1][key]:.4f} |")
    for key in ("val_accuracy", "val_margin"):
        print(f"| reward model (feedback records) | {key} | {rm[0][key]:.4f} | {rm[-1][key]:.4f} |")
    for key in ("exact_match", "rouge_l"):
        print(f"| PPO against SFT: answers to {args.max_items} held-out instructions | {key} | "
              f"{answers['sft'][key]:.4f} | {answers['ppo'][key]:.4f} |")
    print()
    print("PPO across training (the reward model's mean score of each rollout, the KL to the SFT policy):")
    print()
    print("| step | objective/scores | objective/kl |")
    print("|---:|---:|---:|")
    shown = ppo[::max(len(ppo) // 8, 1)]
    for m in shown + ppo[len(ppo) - 1:] if ppo and ppo[-1] is not shown[-1] else shown:
        print(f"| {m['step']} | {m['objective/scores']:.4f} | {m['objective/kl']:.4f} |")
    print()
    print(time_shares(ppo) + " (rollout: sampling and the policy's own log-probabilities; reward: the reward model; "
          "reference: the frozen reference)")
    rose, closer = ppo[-1]["objective/scores"] > ppo[0]["objective/scores"], \
        answers["ppo"]["rouge_l"] >= answers["sft"]["rouge_l"]
    print()
    print("The reward model's score " + ("rose" if rose else "did not rise") + " over PPO while the held-out answers "
          + ("stayed as close to the references or closer (no sign of the reward being gamed)" if closer else
             "moved further from the references (ROUGE-L fell): the policy gains reward the references do not "
             "support, reward hacking, or noise at this size") + ".")
    print()
    print("| pretraining documents (held out) | bits per byte | unigram bits per byte |")
    print("|---|---:|---:|")
    for name, r in evaluated["sources"].items():
        print(f"| {name} | {r['bits_per_byte']:.4f} | {r['unigram_bits_per_byte']:.4f} |")
    if samples:
        print()
        print("The final model's greedy answers (the evaluate stage's prompts, in alpaca_zh):")
        print()
        for s in samples:
            print(f"- {s.get('instruction', s.get('prompt'))!s}: {s.get('completion', '')!r}")
    if wall is not None:
        print(f"\npython -m recipe recipe=tiny_chat_zh: {wall / 60:.1f} min wall; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    with recorded("benchmarks.chat_zh", "The article's pipeline in Chinese (recipe=tiny_chat_zh), held out"):
        main()
