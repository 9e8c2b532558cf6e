"""How the sub-cells a converter adds to a linear cell (a twin's own matmuls: LoRA's lora_A and lora_B) follow the
tensor-parallel split of that cell, so a family's plan (models/<family>/plan.py) lays them out without knowing the
converter: the converter registers a rule per sub-cell name (`follow`), and the plan asks `followers` for the
strategies of a converted cell's sub-cells and `followed_split` for the split of their weights in a checkpoint.

A rule maps the base matmul's strategy ((tokens, k), (out, k)) (x [tokens, in] split k ways, W [out, in] split
out x k ways) to the sub-cell's matmul strategy; the sub-cell's weight splits as that strategy's second tuple.
Importing this module is cheap (no MindSpore).
"""
from typing import Callable, Dict, Optional, Tuple

Strategy = Tuple[Tuple[int, ...], ...]
RULES: Dict[str, Callable[[Strategy], Strategy]] = {}  # sub-cell attribute name -> its strategy from its base's


def follow(child: str, rule: Callable[[Strategy], Strategy]) -> None:
    """Sub-cells named `child` (`<linear path>.<child>.matmul`) take `rule(base strategy)`."""
    RULES[child] = rule


def followers(path: str, cell, strategy: Strategy) -> Dict[str, Strategy]:
    """`<path>.<child>.matmul` -> strategy for each registered sub-cell the linear cell at `path` holds."""
    children = getattr(cell, "_cells", {})
    return {f"{path}.{child}.matmul": rule(strategy) for child, rule in RULES.items() if child in children}


def followed_split(name: str, base_split: Callable[[str], Tuple[int, ...]]) -> Optional[Tuple[int, ...]]:
    """How tensor parallelism splits parameter `name` when it is a registered sub-cell's weight
    (`<linear path>.<child>.weight`), from `base_split` of its base weight (`<linear path>.weight`); None otherwise."""
    for child, rule in RULES.items():
        suffix = f".{child}.weight"
        if name.endswith(suffix):
            split = base_split(name[: -len(suffix)] + ".weight")
            return rule(((1, split[1]), split))[1]
    return None
