"""Recipes: a chain of stages (pretrain -> SFT -> DPO/PPO -> evaluation) as one Hydra command.

    python -m recipe recipe=tiny_chat                                          # -> recipes/<date>/<time>/
    python -m recipe recipe=tiny_chat recipe.stages.sft.optim.lr=3e-4          # one stage's key
    python -m recipe recipe=tiny_chat recipe.common.model=small                # every training stage's
    python -m recipe -m recipe=tiny_chat recipe.stages.pretrain.data=mix_code_heavy,mix_books_heavy

A recipe (conf/recipe/<name>.yaml, spec.py) lists stages in order; a training stage is train.py run with its
stage preset and keys, starting from the previous training stage's final checkpoint (a PPO stage's reward model
is the last reward-model stage's); an evaluation stage scores the previous training stage's checkpoint with
`python -m evaluation` and samples a few generations. runner.py runs them into one directory:

    <run>/01-pretrain/  02-sft/  03-dpo/  04-evaluate/   each a link into <root>/stages/<stage>-<key>/
    <run>/recipe.json   the stages, their keys and where they are; report.html (report.py)

A stage's key hashes its composed train.py config (and so the keys of the stages it starts from): variants of a
sweep that share a prefix of identical stages share those stages' directories, computed once. Every stage is
resumable: a rerun skips the finished ones and resumes the one that was interrupted from its checkpoint.
"""
