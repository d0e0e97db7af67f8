"""``scheduler.wrap(blocks, budget, ...)``: a bare chain of blocks (an ``nn.Sequential`` or a
list) as a module whose own loop calls them through a ``ChainRunner``, the runner
``scheduler.checkpoint`` installs in a model's loop."""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple, Union

from torch import nn

from ..plan import Plan
from .block_calls import as_components, block_list
from .chain_runner import ChainRunner
from .not_compiled import not_compiled
from .options import PlannerArg, check_bool, check_options_used, check_planner

WHERE = "scheduler.wrap"


class CheckpointedChain(nn.Module):
    """The blocks of a bare chain, run under a plan. See ``wrap``."""

    def __init__(self, blocks: Sequence[nn.Module], budget: Any, planner: PlannerArg = "rotor",
                 bandwidth: Any = None, **options: Any):
        super().__init__()
        blocks = block_list(blocks, "scheduler.wrap")
        self.blocks = nn.ModuleList(blocks)
        self.L = len(blocks)
        self.runner = ChainRunner(list(blocks), budget, planner, bandwidth, sequential=True,
                                  entries=self.blocks, name="scheduler.wrap", **options)

    # the runner's knobs and reports, as attributes of the module
    budget = property(lambda self: self.runner.budget,
                      lambda self, v: setattr(self.runner, "budget", v))
    track_memory = property(lambda self: self.runner.track_memory,  # from the next step on
                            lambda self, v: setattr(self.runner, "track_memory",
                                                    check_bool(v, "track_memory", WHERE)))
    planner = property(lambda self: self.runner.planner)
    cache = property(lambda self: self.runner.cache)
    mimose = property(lambda self: self.runner.mimose)
    chain_source = property(lambda self: self.runner.chain_source)  # chain= as given
    last_stats = property(lambda self: self.runner.last_stats)
    last_plan = property(lambda self: self.runner.last_plan)
    collections = property(lambda self: self.runner.collections)

    def plan_for(self, *args: Any) -> Plan:
        """The plan the next forward on ``args`` will run (planned and cached if new)."""
        return self.runner.plan_for(args)

    def stats(self) -> Dict[str, Any]:
        """The runner's figures (``ChainRunner.stats``: plan cache, last peak, offloads)."""
        return self.runner.stats()

    # torch.compile leaves the runner to run eagerly (it pushes autograd hooks, reads the
    # graph, moves storages): a graph break around the chain, compiled code around it
    @not_compiled("scheduler.wrap's chain runs eagerly through its runner, around it",
                  "the blocks given to scheduler.wrap")
    def forward(self, *args: Any) -> Any:
        """The blocks in order through the runner (which follows the plan): each block's
        output, a tensor or a tuple of them, is the next block's arguments."""
        if not args:
            raise TypeError("scheduler.wrap: the wrapped chain needs at least one input")
        value: Tuple[Any, ...] = args
        out: Any = None
        for s, block in enumerate(self.blocks):
            out = self.runner.call(s, value, {}, lambda a, k, b=block: b(*a, **k),
                                   all_inputs=True)
            comps, is_tuple = as_components(out, s)
            value = comps if is_tuple else (out,)
        return out


def wrap(blocks: Union[nn.Module, Sequence[nn.Module]], budget: Any, planner: PlannerArg = "rotor",
         bandwidth: Any = None, sample_input: Any = None, **options: Any) -> CheckpointedChain:
    """Run ``blocks`` (an ``nn.Sequential``, ``nn.ModuleList`` or list of modules: a chain)
    under an activation-memory ``budget`` (bytes or a size string such as ``"6GiB"``; ``None``:
    no limit) with the plans of ``planner``:

    - ``"rotor"`` (default): optimal checkpointing (seed 002);
    - ``"pofo"``: checkpointing + offloading (seed 001); ``bandwidth`` (bytes/s) defaults to
      ``scheduler.runtime.bandwidth.default_bandwidth()`` (measured once on a GPU, 12e9 on CPU);
    - ``"periodic"``: ``checkpoint_sequential`` with the fastest segment count that fits;
    - ``"mimose"``: input-aware checkpointing learnt online (seed 004), for dynamic shapes;
    - ``"none"``: plain training (everything saved);
    - a ``Plan`` (run as is) or a callable ``(chain, budget) -> Plan``.

    Each block's output is passed to the next as its positional arguments (a tuple is
    unpacked). The same runner as ``scheduler.checkpoint`` (non-reentrant: see README).
    ``sample_input`` (a tensor or a tuple of the block-0 arguments) plans right away, so an
    infeasible budget raises ``InfeasibleError`` here rather than on the first step (not with
    ``"mimose"``, which learns its chains in training: it raises ``ValueError``).

    Options: ``chain`` (a ``Chain``, or a callable taking the inputs and returning one,
    instead of measuring), ``track_memory`` (count activation bytes held, see ``stats()``;
    default False), ``cache_size`` (plans kept, default 64), ``samples`` (Mimose: distinct
    input sizes collected before fitting, default 10), ``input_size`` (Mimose: callable from
    the inputs to the size the estimator uses; default the first tensor's element count),
    ``mimose`` (a ``scheduler.planners.mimose.Mimose`` to use, e.g. one shared with another
    runtime; default a new one), ``loss`` (the loss stage ``measure_chain`` profiles: "sum"
    (default), "mse", "cross_entropy" or a callable on the chain's output),
    ``measure_options`` (more keyword arguments for ``measure_chain``, e.g. ``{"repeat": 1}``),
    ``on_chain`` (a callable ``Chain -> Chain`` every chain passes through before planning,
    e.g. so that all ranks plan on one agreed chain). An option ``planner`` would not read
    raises ``ValueError`` naming both.
    """
    unknown = set(options) - set(ChainRunner.OPTIONS)
    if unknown:
        raise TypeError(f"scheduler.wrap: unknown option(s) {sorted(unknown)}")
    if options.get("outputs") is not None:
        raise ValueError(f"scheduler.wrap: outputs={options['outputs']!r} has no effect: it says "
                         "how scheduler.checkpoint counts what the model's tail returns, and a "
                         "bare chain has no tail")
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise TypeError("scheduler.wrap: pass the model as an nn.Sequential or a list of blocks "
                        f"(got a single {type(blocks).__name__})")
    if not isinstance(blocks, (nn.Module, list, tuple)):
        raise TypeError("scheduler.wrap: blocks must be an nn.Sequential, an nn.ModuleList or a "
                        f"list of modules, got {blocks!r}")
    check_planner(planner, WHERE)
    check_options_used(planner, dict(options, bandwidth=bandwidth, sample_input=sample_input),
                       WHERE)
    model = CheckpointedChain(list(blocks), budget, planner, bandwidth, **options)
    if sample_input is not None:
        args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
        model.plan_for(*args)
    return model
