"""Offline dataset builders: they derive, by rule, the sets mindlab trains and evaluates on from ../shared/corpora
(or from each other), once, into ${MINDLAB_DATA_DIR:-~/.cache/mindlab/data} (base/paths.py). Not the data
pipeline (data/ reads what they write, as any other source).

    python -m builders.instructions    instruction samples (data=instructions: SFT, PPO's prompts)
    python -m builders.tasks build     evaluation tasks (python -m evaluation, trainer.eval_tasks)
    python -m builders.preferences     preference pairs (data=preferences: reward model, DPO); with --on-policy
                                       CKPT, pairs of a checkpoint's own samples (data=preferences_on_policy)
"""
