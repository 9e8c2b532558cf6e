"""scripts/slurm_prepare.sbatch: the four chained jobs it submits, run here one after the other by a fake
sbatch, write the bytes one prepare writes (Slurm itself is faked; prepare.py and its parts are real)."""
import os
import stat
import subprocess

import pytest
from omegaconf import OmegaConf

from conftest import ROOT
from data.cache import prepare
from helpers import digests_of

FAKE_SBATCH = r"""#!/usr/bin/env bash
# Runs the job at once (so afterok holds), every array task in turn; logs its options; prints a job id.
array="" opts=()
while [[ $1 == --* ]]; do
  opts+=("$1")
  [[ $1 == --array=* ]] && array=${1#--array=}
  shift
done
echo "${opts[*]} $2" >> "$SBATCH_LOG"  # (the role)
id=$(( $(wc -l < "$SBATCH_LOG") + 100 ))
if [[ -n $array ]]; then
  for ((i = ${array%-*}; i <= ${array#*-}; i++)); do
    SLURM_JOB_ID=$id SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=$((${array#*-} - ${array%-*} + 1)) bash "$@" >&2
  done
else
  SLURM_JOB_ID=$id bash "$@" >&2
fi
echo $id
"""


@pytest.mark.slow
def test_the_recipe_fans_out_and_merges_to_one_prepares_bytes(many_units, tmp_path):
    cfg, _ = many_units
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(stat.S_IRWXU)
    fanned = tmp_path / "fanned"
    sources = "[" + ", ".join(f"{{name: {s.name}, kind: jsonl, paths: ['{s.paths[0]}']}}" for s in cfg.sources) + "]"
    overrides = [f"data.sources={sources}", f"data.cache_dir={fanned}", "data.num_workers=0", "data.seq_len=16",
                 "data.shard_rows=500", "data.val_fraction=0.1", "model.vocab_size=300",
                 "data.tokenizer.sample_chars=100000", "data.cleaning.min_chars=10"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SBATCH_LOG": str(tmp_path / "sbatch.log"),
           "SLURM_SUBMIT_DIR": ROOT}
    env.pop("SLURM_JOB_ID", None)
    # a clean task run alone first, as when one is resubmitted (an array of one task: Slurm's TASK_COUNT is 1)
    alone = subprocess.run(["sbatch", "--array=1", os.path.join(ROOT, "scripts", "slurm_prepare.sbatch"), "clean", "2",
                            *overrides], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert alone.returncode == 0 and "part 1/2: cleaned 1 of its 1 work units" in alone.stderr, alone.stderr[-3000:]
    (tmp_path / "sbatch.log").unlink()
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_prepare.sbatch"), "2", *overrides],
                          env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "submitted: clean 101, plan 102, tokenize 103, merge 104"
    roles = [line.split()[-1] for line in (tmp_path / "sbatch.log").read_text().splitlines()]
    options = [line.split()[:-1] for line in (tmp_path / "sbatch.log").read_text().splitlines()]
    assert roles == ["clean", "plan", "tokenize", "merge"]
    assert options == [["--parsable", "--array=0-1"], ["--parsable", "--dependency=afterok:101"],
                       ["--parsable", "--array=0-1", "--dependency=afterok:102"],
                       ["--parsable", "--dependency=afterok:103"]]
    assert "part 0/2: cleaned 1 of its 1 work units" in done.stderr  # two sources: one unit each
    assert "part 1/2: cleaned 0 of its 1 work units (1 already done)" in done.stderr
    one = prepare(OmegaConf.merge(cfg, {"cache_dir": str(tmp_path / "one"), "name": "default"}))  # data=default
    (merged,) = [p for p in fanned.iterdir() if p.is_dir()]
    assert digests_of(merged) == digests_of(one.dir)
