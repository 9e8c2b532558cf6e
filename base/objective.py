"""The objective contract: what an objective module (objectives/<name>.py) must and may provide, checked when it
registers (base/registry.py OBJECTIVES), as base/family.py is for model families. A module lacking a required member
is refused at import in one line naming every missing one; the registry holds an `ObjectivePlugin` whose optional
members are None where absent, and the module's `Objective` class subclasses `ObjectiveBase`, whose optional hooks
are None until the objective defines them. So the layers that use an objective ask `objective.token_nll is not
None`, never the object by name. objectives/__init__.py says what each member does.
"""
from base.family import ContractError, bind

REQUIRED = ("Config", "check", "row_spec", "Objective")
OPTIONAL = ("memory", "PROVIDES", "NEEDS")
CLASS_REQUIRED = ("batch", "loss_tokens", "loss_cell")  # and, on the class or set by __init__, inputs and metrics


class ObjectiveBase:
    """The base of every objective's `Objective`: the optional hooks, None (or empty) until it defines them."""

    console: tuple = ()  # the metrics (or `logged` numbers) the console shows beside the loss
    logged = None  # a dict of host-side numbers logged with each step (PPO's rollout)
    attach = None  # attach(model, cfg) -> the cell trained and saved
    token_nll = None  # token_nll(model) -> a causal LM's per-token NLL cell (evaluation's measures)
    fill_mask = None  # fill_mask(model, k) -> a masked LM's predictions (fill-mask accuracy)
    next_inputs = None  # next_inputs(draw) -> the next micro-batch's inputs (an objective making its own batches)
    timings = None  # timings() -> {phase: seconds} spent making inputs since the last call (PPO's rollout phases)
    state_dict = None  # state_dict() -> what a checkpoint holds besides the weights (JSON), with load_state_dict
    load_state_dict = None


class ObjectivePlugin:
    """A registered objective module: its members by their contract names, the optional ones None where absent."""

    def __init__(self, name: str, module):
        missing = [key for key in REQUIRED if not hasattr(module, key)]
        cls = getattr(module, "Objective", None)
        if cls is not None:
            if not (isinstance(cls, type) and issubclass(cls, ObjectiveBase)):
                missing.append("Objective (a subclass of base.objective.ObjectiveBase)")
            missing += [f"Objective.{key}" for key in CLASS_REQUIRED if not hasattr(cls, key)]
        if missing:
            raise ContractError(f"objective {name!r} ({module.__name__}) lacks {', '.join(missing)}: an objective "
                                "provides what base/objective.py REQUIRED lists (objectives/__init__.py)")
        bind(self, name, module, REQUIRED, OPTIONAL)
