"""From a planned layout to the commands that start it: train.py on each node (or scripts/slurm_msrun.sbatch), and the
MindFormers parallel_config of the same layout, to compare with MindFormers' own recipes.

How ranks map to nodes: msrun gives node r the ranks [r * devices_per_node, (r + 1) * devices_per_node), and
planner/layout.py orders ranks tp fastest, then dp, then pp, so a tensor-parallel group (tp <= devices_per_node)
never leaves its node; data-parallel and pipeline neighbours may.
"""
import shlex
from typing import Any, List, Sequence

from base.schema import ulysses_degree
from planner.advisor import Candidate

MASTER_PORT = 8118  # scripts/slurm_msrun.sbatch's default
# what the planned layout sets, dropped from the user's own overrides
LAYOUT_KEYS = ("parallel", "nodes", "dry_run", "trainer.micro_batch_size", "trainer.grad_accum", "model.recompute")
MINDFORMERS_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def run_overrides(user: Sequence[str], c: Candidate, nodes: int) -> List[str]:
    """The user's overrides with the planned layout's in place of their layout keys (and of dry_run)."""
    def planned(item: str) -> bool:
        key = item.lstrip("+~").split("=", 1)[0]
        return any(key == k or key.startswith(k + ".") for k in LAYOUT_KEYS)

    kept = [o for o in user if not planned(o)]
    return kept + c.overrides() + ([f"nodes={nodes}"] if nodes > 1 else [])


def commands(overrides: Sequence[str], c: Candidate, devices_per_node: int) -> List[str]:
    """The command on each node (train.py starts msrun itself, with that node's workers) and the sbatch line that
    runs it on each node under Slurm."""
    args = " ".join(shlex.quote(o) for o in overrides)
    if c.world <= devices_per_node:
        return [f"python train.py {args}"]
    nodes = c.world // devices_per_node
    return [f"# on node r = 0..{nodes - 1}, with RUN_DIR on a filesystem every node shares and HEAD node 0's address:",
            f"python train.py {args} node_rank=$r master_addr=$HEAD master_port={MASTER_PORT} hydra.run.dir=$RUN_DIR",
            "# or under Slurm (scripts/slurm_msrun.sbatch runs the line above on each node):",
            f"sbatch --nodes={nodes} scripts/slurm_msrun.sbatch {args}"]


def mindformers_parallel_config(c: Candidate, dtype: str, devices_per_node: int = 8, experts: bool = False) -> str:
    """The same layout in a MindFormers YAML (its run_*.yaml keys), for comparing with its published recipes:
    context_parallel with its algorithm (colossalai_cp: the ring; ulysses_cp; hybrid_cp with the Ulysses degree
    inside it), the interleaved pipeline (pipeline_config and pp_interleave_num), ZeRO-3 (MindSpore's
    parallel_optimizer_config optimizer_level) and tensor-parallel overlap (fine_grain_interleave), except for a
    mixture of experts (`experts`): MindFormers' interleaved decoder layer (LLamaDecodeLayerInterleave) builds a
    dense feed-forward and takes no moe_config, so the key would turn the experts into one FFN; a comment says so."""
    recompute = {"none": "recompute: False\n  select_recompute: False",
                 "selective": "recompute: False\n  select_recompute: True",
                 "full": "recompute: True\n  select_recompute: False"}[c.recompute]
    algo = {"ring": "colossalai_cp", "ulysses": "ulysses_cp", "hybrid": "hybrid_cp"}[c.cp_algo]
    context = [f"  context_parallel: {c.cp}", f"  context_parallel_algo: {algo}"] if c.cp > 1 else []
    if c.cp > 1 and c.cp_algo == "hybrid":
        context.append(f"  ulysses_degree_in_cp: {ulysses_degree(c.cp, c.cp_algo, c.tp, devices_per_node)}")
    return "\n".join([
        "parallel:",
        f"  enable_parallel_optimizer: {c.optimizer_shard}",
        *(["  parallel_optimizer_config:", "    optimizer_level: level3"] if c.zero3 else []),
        *(["  pipeline_config:", "    pipeline_interleave: True", "    pipeline_scheduler: '1f1b'"] if c.vp > 1 else []),
        "parallel_config:",
        f"  data_parallel: {c.dp}",
        f"  model_parallel: {c.tp}",
        *context,
        f"  pipeline_stage: {c.pp}",
        *([f"  expert_parallel: {c.ep}"] if c.ep > 1 else []),
        f"  use_seq_parallel: {c.sequence_parallel}",
        f"  micro_batch_num: {c.micro_batches if c.pp > 1 else 1}",
        "  vocab_emb_dp: False" if c.tp > 1 else "  vocab_emb_dp: True",
        "recompute_config:",
        f"  {recompute}",
        "runner_config:",
        f"  batch_size: {c.micro_batch_size}",
        *([f"  gradient_accumulation_steps: {c.micro_batches}"] if c.pp == 1 and c.micro_batches > 1 else []),
        "model:",
        "  model_config:",
        f"    compute_dtype: \"{MINDFORMERS_DTYPE[dtype]}\"",
        *([f"    pp_interleave_num: {c.vp}"] if c.vp > 1 else []),
        *((["    # fine_grain_interleave: not set, its decoder layer has no MoE feed-forward"] if experts else
           ["    fine_grain_interleave: 2"]) if c.tp_overlap else []),
    ])


def format_launch(user: Sequence[str], c: Candidate, device: Any, nodes: int, dtype: str,
                  experts: bool = False) -> str:
    overrides = run_overrides(user, c, nodes)
    return "\n".join(["launch it:", *commands(overrides, c, device.devices_per_node),
                      "the same layout as a MindFormers config:",
                      mindformers_parallel_config(c, dtype, device.devices_per_node, experts)])
