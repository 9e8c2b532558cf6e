"""Where every rank sits in the dp x tp x pp device grid, in Megatron-LM's rank order.

tp varies fastest (a tensor-parallel group is consecutive ranks, i.e. inside one node), then dp, then pp:

    rank = pp_rank * dp * tp + dp_rank * tp + tp_rank

Pipeline stage s holds the contiguous layers [s * L/pp, (s+1) * L/pp); the first stage also holds the
embedding, the last the final norm and lm head. L % pp == 0 is checked by the config validation.
"""
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Sequence


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    num_layers: int
    ep: int = 1  # a mixture of experts' experts split over ep consecutive dp ranks (ep divides dp)

    @classmethod
    def from_config(cls, parallel: Any, num_layers: int) -> "Layout":
        return cls(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, num_layers=num_layers, ep=parallel.ep)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def coords(self, rank: int) -> Coords:
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def tp_groups(self) -> List[List[int]]:
        """Ranks that shard the same layers' weights (all-reduce/all-gather every layer)."""
        return [[self.rank(s, d, t) for t in range(self.tp)] for s in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> List[List[int]]:
        """Ranks that hold the same weight shard on different data (gradient all-reduce)."""
        return [[self.rank(s, d, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]

    def ep_groups(self) -> List[List[int]]:
        """Ranks that hold different experts of the same layers and exchange tokens by all-to-all: ep consecutive
        dp ranks at one tp rank (so a group spans ep x tp consecutive ranks)."""
        return [[self.rank(s, d0 + d, t) for d in range(self.ep)] for s in range(self.pp)
                for d0 in range(0, self.dp, self.ep) for t in range(self.tp)]

    def pp_groups(self) -> List[List[int]]:
        """Ranks that pass activations from stage to stage (point-to-point send/recv)."""
        return [[self.rank(s, d, t) for s in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def ranks_of_stage(self, stage: int) -> range:
        size = self.dp * self.tp
        return range(stage * size, (stage + 1) * size)

    def layers_of_stage(self, stage: int) -> range:
        per_stage = self.num_layers // self.pp
        return range(stage * per_stage, (stage + 1) * per_stage)

    def describe(self, max_groups: int = 4) -> str:
        """A few lines: the grid, what each stage holds, and the tp/dp/pp groups (elided past max_groups)."""
        lines = [f"world {self.world_size} = dp {self.dp} x tp {self.tp} x pp {self.pp}  "
                 f"(rank = pp_rank*{self.dp * self.tp} + dp_rank*{self.tp} + tp_rank)"]
        stages = [self._describe_stage(s) for s in range(self.pp)]
        lines += _elide(stages, max_groups)
        kinds = [("tp", self.tp_groups()), ("dp", self.dp_groups())] + ([("ep", self.ep_groups())] if self.ep > 1 else [])
        for name, groups in kinds + [("pp", self.pp_groups())]:
            shown = _elide([_format_group(g, 2 * max_groups) for g in groups], max_groups)
            lines.append(f"{name} groups ({len(groups)} x {len(groups[0])} ranks): " + " ".join(shown))
        return "\n".join(lines)

    def _describe_stage(self, stage: int) -> str:
        ranks, layers = self.ranks_of_stage(stage), self.layers_of_stage(stage)
        first = " + embedding" if stage == 0 else ""
        last = " + final norm + lm head" if stage == self.pp - 1 else ""
        return f"stage {stage}: ranks {_span(ranks)}  layers {_span(layers)} ({len(layers)}){first}{last}"


def _span(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def _elide(items: Sequence[str], limit: int) -> List[str]:
    """The first limit-1 items, "…", the last one; all of them when there are at most `limit`."""
    if len(items) <= limit:
        return list(items)
    return list(items[:limit - 1]) + ["…", items[-1]]


def _format_group(ranks: Sequence[int], limit: int) -> str:
    return "[" + " ".join(_elide([str(r) for r in ranks], limit)) + "]"
