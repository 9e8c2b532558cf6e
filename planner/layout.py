"""Where every rank sits in the dp x tp x cp x pp device grid, in Megatron-LM's rank order (tp-cp-dp-pp).

tp varies fastest (a tensor-parallel group is consecutive ranks, i.e. inside one node), then cp (a context-parallel
group next to it: inside the node while tp x cp fits one), then dp, then pp:

    rank = pp_rank * dp * cp * tp + dp_rank * cp * tp + cp_rank * tp + tp_rank

Pipeline stage s holds the contiguous layers [s * L/pp, (s+1) * L/pp); the first stage also holds the
embedding, the last the final norm and lm head. L % pp == 0 is checked by the config validation. With vp virtual
stages (the interleaved schedule) the layers are cut into pp x vp chunks and stage s holds chunks s, s + pp, ...

`span(kind)` says how a kind's groups meet the nodes, which decides their links (planner/timing.py).
"""
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Sequence


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int
    cp: int = 0


class Span(NamedTuple):
    """How the groups of one kind meet the nodes."""
    size: int  # ranks in a group
    per_node: int  # of a group's ranks on one node
    crosses_nodes: bool


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    num_layers: int
    cp: int = 1
    vp: int = 1
    ep: int = 1  # a mixture of experts' experts split over ep consecutive dp ranks (ep divides dp)

    @classmethod
    def from_config(cls, parallel: Any, num_layers: int) -> "Layout":
        return cls(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, num_layers=num_layers, cp=parallel.cp,
                   vp=parallel.vp, ep=parallel.ep)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return Coords(pp=pp, dp=dp, tp=tp, cp=cp)

    def _groups(self, kind: str) -> List[List[int]]:
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        others = [k for k in ("pp", "dp", "cp", "tp") if k != kind]
        groups = []
        for fixed in _product([sizes[k] for k in others]):
            where = dict(zip(others, fixed))
            groups.append([self.rank(**{**where, kind: i}) for i in range(sizes[kind])])
        return groups

    def tp_groups(self) -> List[List[int]]:
        """Ranks that shard the same layers' weights (all-reduce/all-gather every layer)."""
        return self._groups("tp")

    def cp_groups(self) -> List[List[int]]:
        """Ranks that hold the parts of the same sequences (K/V ring or all-to-alls every layer)."""
        return self._groups("cp")

    def dp_groups(self) -> List[List[int]]:
        """Ranks that hold the same weight shard on different data (gradient all-reduce; cp ranks too, which
        reduce their gradients with the dp ones: Megatron's dp-cp group)."""
        return self._groups("dp")

    def ep_groups(self) -> List[List[int]]:
        """Ranks that hold different experts of the same layers and exchange tokens by all-to-all: ep consecutive
        dp ranks at one tp (and cp) rank (so a group spans ep x cp x tp consecutive ranks), where models/moe/plan.py
        places the experts."""
        return [[self.rank(s, d0 + d, t, c) for d in range(self.ep)] for s in range(self.pp)
                for d0 in range(0, self.dp, self.ep) for c in range(self.cp) for t in range(self.tp)]

    def pp_groups(self) -> List[List[int]]:
        """Ranks that pass activations from stage to stage (point-to-point send/recv)."""
        return self._groups("pp")

    def span(self, kind: str, devices_per_node: int) -> Span:
        """How a group of `kind` (tp, cp, dp, ep, dpcp: dp and cp together, pp) meets nodes of devices_per_node ranks:
        its ranks are `stride` apart, so a node holds devices_per_node / stride of them (at least one)."""
        stride = {"tp": 1, "cp": self.tp, "dp": self.tp * self.cp, "ep": self.tp * self.cp, "dpcp": self.tp,
                  "pp": self.tp * self.cp * self.dp}
        size = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "ep": self.ep, "dpcp": self.dp * self.cp,
                "pp": self.pp}[kind]
        per_node = max(1, min(size, devices_per_node // stride[kind]))
        return Span(size, per_node, size > per_node)

    def ranks_of_stage(self, stage: int) -> range:
        size = self.dp * self.cp * self.tp
        return range(stage * size, (stage + 1) * size)

    def layers_of_stage(self, stage: int) -> List[int]:
        chunk = self.num_layers // (self.pp * self.vp)
        return [layer for v in range(self.vp) for layer in range((v * self.pp + stage) * chunk,
                                                                 (v * self.pp + stage + 1) * chunk)]

    def describe(self, max_groups: int = 4) -> str:
        """A few lines: the grid, what each stage holds, and the tp/dp/pp groups (elided past max_groups)."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        cp_rank = f" + cp_rank*{self.tp}" if self.cp > 1 else ""
        lines = [f"world {self.world_size} = dp {self.dp} x tp {self.tp}{cp} x pp {self.pp}  "
                 f"(rank = pp_rank*{self.dp * self.cp * self.tp} + dp_rank*{self.cp * self.tp}{cp_rank} + tp_rank)"]
        stages = [self._describe_stage(s) for s in range(self.pp)]
        lines += _elide(stages, max_groups)
        kinds = [("tp", self.tp_groups())] + ([("cp", self.cp_groups())] if self.cp > 1 else [])
        kinds += [("dp", self.dp_groups())] + ([("ep", self.ep_groups())] if self.ep > 1 else [])
        for name, groups in kinds + [("pp", self.pp_groups())]:
            shown = _elide([_format_group(g, 2 * max_groups) for g in groups], max_groups)
            lines.append(f"{name} groups ({len(groups)} x {len(groups[0])} ranks): " + " ".join(shown))
        return "\n".join(lines)

    def _describe_stage(self, stage: int) -> str:
        ranks, layers = self.ranks_of_stage(stage), self.layers_of_stage(stage)
        first = " + embedding" if stage == 0 else ""
        last = " + final norm + lm head" if stage == self.pp - 1 else ""
        chunk = len(layers) // self.vp
        runs = ", ".join(_span(range(layers[i], layers[i] + chunk)) for i in range(0, len(layers), chunk))
        return f"stage {stage}: ranks {_span(ranks)}  layers {runs} ({len(layers)}){first}{last}"


def _span(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def _product(sizes: Sequence[int]) -> List[tuple]:
    """Every index tuple of a grid of `sizes`, the last varying fastest."""
    out = [()]
    for n in sizes:
        out = [t + (i,) for t in out for i in range(n)]
    return out


def _elide(items: Sequence[str], limit: int) -> List[str]:
    """The first limit-1 items, "…", the last one; all of them when there are at most `limit`."""
    if len(items) <= limit:
        return list(items)
    return list(items[:limit - 1]) + ["…", items[-1]]


def _format_group(ranks: Sequence[int], limit: int) -> str:
    return "[" + " ".join(_elide([str(r) for r in ranks], limit)) + "]"
