"""scheduler.wrap / the chain runtime on CPU: plans executed exactly, gradients bit-identical to
plain training (dropout included), activation bytes held within the simulator's peak."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import scheduler
from scheduler import InvalidPlanError, Plan, simulate
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.profile import meta_chain, measure_chain

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import (ConvBN, loss_of, mlp_blocks, plain_step, random_rotor_plan, token_batch,
                         transformer_blocks, twins, wrapped_step)

D = 16


def same(a, b) -> bool:
    la, ga = a
    lb, gb = b
    return torch.equal(la, lb) and len(ga) == len(gb) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def mlp_chain(L: int, batch: int = 8, input_grad: bool = True):
    return meta_chain(mlp_blocks(L, D), (batch, D), loss="mse", cuda_dropout=False,
                      input_grad=input_grad)


def held_only(chain):
    """The chain without transient memory, with a free loss and without gradients: what the
    runner holds between ops (the loss lives outside the wrapped chain; the gradients between
    blocks are autograd's, the runtime being non-reentrant)."""
    n = len(chain)
    return chain.replace(fw_tmp=[0] * n, fck_tmp=[0] * n, bw_tmp=[0] * n,
                         xbar=tuple(chain.xbar[:-1]) + (0,),
                         delta=[0] * n)


HAND_PLANS = {
    "all": lambda L: plan_from_checkpoints(L, []),
    "ck_first": lambda L: plan_from_checkpoints(L, [0]),
    "ck_all": lambda L: plan_from_checkpoints(L, range(L)),
    # seed 002's example sequence, shifted to 0-based stages (stage 4 is the loss)
    "paper_example": lambda L: Plan([("F_ck", 0), ("F_none", 1), ("F_ck", 2), ("F_all", 3),
                                     ("F_all", 4), ("B", 4), ("B", 3), ("F_all", 2), ("B", 2),
                                     ("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)]),
    # offload a checkpoint while the next forward still reads it, prefetch it for the backward
    # offload x[2] while F_all 2 reads it (its graph saves it): the storage leaves and returns
    "offload_saved_input": lambda L: Plan([
        ("F_ck", 0), ("F_ck", 1), ("offload", 2), ("F_all", 2), ("F_all", 3), ("F_all", 4),
        ("B", 4), ("B", 3), ("prefetch", 2), ("B", 2), ("F_all", 1), ("B", 1), ("F_all", 0),
        ("B", 0)]),
    # offload what F_all 1 keeps (xbar[1]: its output is the input of stage 2)
    "offload_xbar": lambda L: Plan([
        ("F_ck", 0), ("F_all", 1), ("offload", 2), ("F_ck", 2), ("F_all", 3), ("F_all", 4),
        ("B", 4), ("B", 3), ("prefetch", 2), ("F_all", 2), ("B", 2), ("B", 1), ("F_all", 0),
        ("B", 0)]),
    "offload": lambda L: Plan([("F_ck", 0), ("F_ck", 1), ("offload", 1), ("F_all", 2),
                               ("F_all", 3), ("F_all", 4), ("B", 4), ("B", 3), ("B", 2),
                               ("prefetch", 1), ("F_all", 1), ("B", 1), ("F_all", 0), ("B", 0)]),
}


@pytest.mark.parametrize("name", sorted(HAND_PLANS))
def test_hand_plans_match_plain_training(name):
    L = 4
    blocks, ref = twins(lambda: mlp_blocks(L, D))
    x = torch.randn(8, D, requires_grad=True)
    plan = HAND_PLANS[name](L)
    model = scheduler.wrap(blocks, None, planner=plan, track_memory=True)
    expect = plain_step(ref, (x,))
    gx_ref = x.grad.clone()
    x.grad = None
    got = wrapped_step(model, (x,))
    assert same(got, expect)
    assert torch.equal(x.grad, gx_ref)  # the gradient reaches an input that requires it
    # activation bytes really held stay within the simulator's peak on the measured chain
    chain = mlp_chain(L)
    res = simulate(chain, plan, bandwidth=float("inf"))
    assert 0 < model.stats()["last_peak_bytes"] <= res.peak_memory
    # and exactly the simulator's peak once transient memory is left out
    held = simulate(held_only(chain), plan, bandwidth=float("inf")).peak_memory
    assert model.stats()["last_peak_bytes"] == held


@settings(max_examples=12, deadline=None)
@given(L=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_random_rotor_shaped_plans(L, seed):
    plan = random_rotor_plan(L, random.Random(seed))
    blocks, ref = twins(lambda: mlp_blocks(L, D, seed=seed % 7))
    x = torch.randn(8, D)
    model = scheduler.wrap(blocks, None, planner=plan, track_memory=True)
    assert same(wrapped_step(model, (x,), seed=seed), plain_step(ref, (x,), seed=seed))
    chain = mlp_chain(L, input_grad=False)  # x does not require grad: no delta[0]
    assert model.stats()["last_peak_bytes"] <= simulate(chain, plan).peak_memory
    assert model.stats()["last_peak_bytes"] == simulate(held_only(chain), plan).peak_memory
    # every forward after the first of its stage is a recomputation
    forwards = sum(1 for op in plan if op.kind in ("F_all", "F_ck", "F_none"))
    assert model.last_stats.recomputed_forwards == forwards - (L + 1)


def test_tuples_int_inputs_and_dropout_in_attention():
    """Token ids (no grad) -> (hidden, mask) tuples between blocks -> logits."""
    blocks, ref = twins(lambda: transformer_blocks(3, D))
    ids = token_batch(4, 12)
    L = len(blocks)
    for ck in ([], [1], [0, 2, 3], range(L)):
        plan = plan_from_checkpoints(L, ck)
        model = scheduler.wrap(blocks, None, planner=plan, track_memory=True)
        for b in ref:
            b.zero_grad(set_to_none=True)
        assert same(wrapped_step(model, (ids,)), plain_step(ref, (ids,))), ck
    chain = meta_chain(transformer_blocks(3, D), (4, 12), input_dtype=torch.long, loss="mse",
                       cuda_dropout=False, input_grad=False)
    res = simulate(chain, plan)
    assert model.stats()["last_peak_bytes"] <= res.peak_memory
    # the mask passes through every block: one storage really, one per stage in the chain
    mask_bytes = ids.numel()
    assert model.stats()["last_peak_bytes"] == \
        simulate(held_only(chain), plan).peak_memory - (L - 2) * mask_bytes


def test_batchnorm_statistics_updated_once():
    torch.manual_seed(0)
    blocks, ref = twins(lambda: [ConvBN(3) for _ in range(3)])
    x = torch.randn(2, 3, 6, 6)
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, [0, 1, 2]))
    assert same(wrapped_step(model, (x,)), plain_step(ref, (x,)))
    for b, r in zip(blocks, ref):
        assert torch.equal(b.bn.running_mean, r.bn.running_mean)
        assert b.bn.num_batches_tracked.item() == 1


def test_backward_called_inside_autocast_recomputes_as_the_forward_ran():
    # autocast is thread-local and the backward inherits it (its own ops autocast, as in plain
    # training); a recomputation must run as the forward ran (without autocast here), not in
    # the caller's low precision
    blocks, ref = twins(lambda: mlp_blocks(4, D))
    x = torch.randn(8, D)
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(4, range(4)))
    grads = []
    for run in (model, nn.Sequential(*ref)):
        torch.manual_seed(1)
        loss = loss_of(run(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()
        grads.append([p.grad for p in run.parameters()])
    assert model.last_stats.recomputed_forwards == 4
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_several_steps_with_optimizer_match():
    blocks, ref = twins(lambda: mlp_blocks(5, D))
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(5, [1, 3]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD([p for b in ref for p in b.parameters()], lr=0.1)
    for step in range(3):
        x = torch.randn(8, D)
        opt.zero_grad()
        opt_ref.zero_grad()
        got = wrapped_step(model, (x,), seed=step)
        exp = plain_step(ref, (x,), seed=step)
        assert same(got, exp)
        opt.step()
        opt_ref.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                 [p for b in ref for p in b.parameters()]))


def test_in_place_on_block_input_is_rejected_clearly():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x.relu_())

    blocks = [nn.Linear(D, D), Bad(), nn.Linear(D, D)]
    for ck in ([1], [0, 1]):
        model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, ck))
        with pytest.raises(RuntimeError, match="block 1 .*in place"):
            loss_of(model(torch.randn(4, D))).backward()
    # nothing recomputed from that input: plain autograd's rules (this one is legal)
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, []))
    loss_of(model(torch.randn(4, D))).backward()


def test_in_place_inside_a_block_is_fine():
    blocks, ref = twins(lambda: [nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=True))
                                 for _ in range(3)])
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, [0, 1]))
    x = torch.randn(4, D)
    assert same(wrapped_step(model, (x,)), plain_step(ref, (x,)))


def test_invalid_plans_are_rejected_with_the_op():
    blocks = mlp_blocks(3, D)
    bad = {
        "no B": Plan([("F_all", 0), ("F_all", 1), ("F_all", 2), ("F_all", 3)]),
        "skips a stage": Plan([("F_all", 0), ("F_all", 2), ("F_all", 3), ("B", 3), ("B", 2),
                               ("B", 0)]),
        "B before F_all": Plan([("F_ck", 0), ("F_ck", 1), ("F_all", 2), ("F_all", 3), ("B", 3),
                                ("B", 2), ("B", 1), ("B", 0)]),
    }
    for name, plan in bad.items():
        model = scheduler.wrap(blocks, None, planner=plan)
        with pytest.raises(InvalidPlanError):
            loss_of(model(torch.randn(4, D))).backward()


def test_no_grad_and_eval_run_plainly():
    blocks = mlp_blocks(3, D)
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, [0]))
    model.eval()
    x = torch.randn(4, D)
    with torch.no_grad():
        y = model(x)
    v = x
    for b in blocks:
        v = b(v)
    assert torch.equal(y, v)


def test_plan_cache_per_shape_and_budget():
    chains = []

    def chain_of(x):
        c = meta_chain(mlp_blocks(3, D), tuple(x.shape), loss="mse", cuda_dropout=False)
        chains.append(c)
        return c

    # a planner callable: checkpoint everything when the budget is tight
    def planner(chain, budget):
        return plan_from_checkpoints(chain.L, range(chain.L) if budget < 10_000 else [])

    model = scheduler.wrap(mlp_blocks(3, D), "1MiB", planner=planner, chain=chain_of)
    for batch in (4, 8, 4, 8, 4):
        loss_of(model(torch.randn(batch, D))).backward()
    st_ = model.stats()
    assert (st_["misses"], st_["hits"]) == (2, 3) and len(chains) == 2
    model.budget = 5000                       # a new budget plans again
    loss_of(model(torch.randn(4, D))).backward()
    assert model.stats()["misses"] == 3
    assert model.last_plan.count("F_ck") == 3
    with pytest.raises(ValueError, match="budget"):
        model.budget = "lots"


def test_bad_arguments():
    with pytest.raises(ValueError, match="planner"):
        scheduler.wrap(mlp_blocks(2, D), "1MiB", planner="magic")
    with pytest.raises(ValueError, match="budget"):
        scheduler.wrap(mlp_blocks(2, D), "-3")
    with pytest.raises(TypeError, match="blocks"):
        scheduler.wrap([], "1MiB")
    with pytest.raises(TypeError, match="nn.Sequential"):
        scheduler.wrap(nn.Linear(3, 3), "1MiB")
    with pytest.raises(TypeError, match="option"):
        scheduler.wrap(mlp_blocks(2, D), "1MiB", colour="red")

    class Dicty(nn.Module):
        def forward(self, x):
            return {"x": x}
    model = scheduler.wrap([Dicty(), nn.Linear(D, D)], None,
                           planner=plan_from_checkpoints(2, []))
    with pytest.raises(TypeError, match="block 0 returned dict"):
        model(torch.randn(2, D, requires_grad=True))


def test_nn_sequential_accepted():
    seq = nn.Sequential(*mlp_blocks(3, D))
    model = scheduler.wrap(seq, None, planner="none")
    assert len(model.blocks) == 3
    assert model.plan_for(torch.randn(2, D)).count("F_all") == 4


def test_gradient_accumulation_and_hooks():
    """Two backward passes accumulate into .grad as plain training does; gradient hooks fire."""
    blocks, ref = twins(lambda: mlp_blocks(3, D))
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(3, [0, 2]))
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    xs = [torch.randn(4, D) for _ in range(2)]
    for i, x in enumerate(xs):
        torch.manual_seed(i)
        loss_of(model(x)).backward()
        torch.manual_seed(i)
        v = x
        for b in ref:
            v = b(v)
        loss_of(v).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in
               zip(model.parameters(), [p for b in ref for p in b.parameters()]))
    assert len(fired) == 2 * len(list(model.parameters()))


def _alive_steps() -> int:
    import gc
    from scheduler.runtime.chain_exec import ChainStep
    gc.collect()  # what is left is held through autograd's C++ graph, unseen by the collector
    return sum(isinstance(o, ChainStep) for o in gc.get_objects())


@pytest.mark.parametrize("name", ["paper_example", "ck_all", "all"])
def test_steps_are_freed(name):
    """Neither a recomputation's graph (never run backward) nor a forward dropped without its
    backward keeps the step alive: a pack hook that kept an op's own output with its
    ``grad_fn`` made a cycle through C++ (node -> value -> node) that leaked every step."""
    L = 4
    blocks, _ = twins(lambda: mlp_blocks(L, D))
    model = scheduler.wrap(blocks, None, planner=HAND_PLANS[name](L))
    x = torch.randn(8, D)
    before = _alive_steps()
    for seed in range(3):
        wrapped_step(model, (x,), seed=seed)
    loss_of(model(x))  # a forward whose graph is dropped without backward
    assert _alive_steps() == before


class Around(nn.Module):
    """A head, a chain, and a tail around it: compiled code on both sides of the chain."""

    def __init__(self, chain: nn.Module):
        super().__init__()
        self.head, self.chain = nn.Linear(D, D), chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.chain(self.head(x) * 2)) + 1


def test_torch_compile_of_the_wrapped_chain():
    """torch.compile over a model holding a wrapped chain: the runner runs eagerly (a graph
    break around the chain), the rest compiled (aot_eager: AOTAutograd's graphs with eager
    kernels), every block recomputed, gradients bit-identical to eager plain training."""
    torch._dynamo.reset()
    L = 4
    blocks, ref_blocks = twins(lambda: mlp_blocks(L, D))
    torch.manual_seed(0)
    ref = Around(nn.Sequential(*ref_blocks))
    chain = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(L, range(L)))
    model = Around(chain)
    model.head.load_state_dict(ref.head.state_dict())
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, D)
    for seed in range(3):
        results = []
        for m in (ref, compiled):
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(seed)
            loss = loss_of(m(x))
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
        assert same(*results), f"step {seed}"
        assert chain.last_stats.recomputed_forwards == L
    torch._dynamo.reset()


def test_track_memory_can_be_turned_on_and_off_on_the_module():
    # a knob of the runner, as budget: set on the module, it reaches the runner's next step
    model = scheduler.wrap(mlp_blocks(4, D), None, planner="none")
    x = torch.randn(8, D, requires_grad=True)
    model.track_memory = True
    loss_of(model(x)).backward()
    assert model.runner.track_memory and model.stats()["last_peak_bytes"] > 0
    model.track_memory = False
    loss_of(model(x)).backward()
    assert not model.runner.track_memory and model.stats()["last_peak_bytes"] is None


class _BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, D)

    def forward(self, x):
        return x + torch.sigmoid(self.l2(torch.relu(self.bn(self.l1(x)))))


def test_fullgraph_over_the_wrapped_chain_names_scheduler():
    torch._dynamo.reset()
    chain = scheduler.wrap(mlp_blocks(2, D), None, planner=plan_from_checkpoints(2, [0]))
    compiled = torch.compile(Around(chain), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"reason: scheduler.wrap's chain runs eagerly"):
        loss_of(compiled(torch.randn(8, D))).backward()
    torch._dynamo.reset()


def test_compiled_blocks_under_a_planner_match_compiled_plain_training():
    # each block torch.compile'd (not the chain): the runner's saved-tensor hooks must run
    # eagerly; traced inside a compiled frame, a saved weight's version read 0 and the
    # in-place check refused every step
    torch.manual_seed(0)
    raw = [_BNBlock() for _ in range(3)]
    ref = copy.deepcopy(raw)
    chain = measure_chain(copy.deepcopy(raw), torch.randn(16, D), loss="sum", repeat=1)
    budget = (simulate(chain, plan_from_checkpoints(3, [])).peak_memory +
              simulate(chain, plan_from_checkpoints(3, range(3))).peak_memory) // 2
    model = scheduler.wrap([torch.compile(b, backend="aot_eager") for b in raw], budget,
                           planner="rotor", measure_options={"repeat": 1})  # measured here
    plain = nn.Sequential(*[torch.compile(b, backend="aot_eager") for b in ref])
    for step in range(2):
        x = torch.randn(16, D, requires_grad=True)
        grads = []
        for run in (model, plain):
            for p in run.parameters():
                p.grad = None
            torch.manual_seed(step)
            run(x).sum().backward()
            grads.append([p.grad for p in run.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), f"step {step}"
    assert model.last_stats.recomputed_forwards > 0


def test_an_offloaded_value_a_backward_reads_goes_once_that_backward_ran(monkeypatch):
    # offload 2 moves xbar[1], which B 2 still reads (the simulator lets an op read an item
    # whose copy is in flight, and frees it when the copy completes): the runtime keeps it
    # through B 2 and lets it go before the next op, not after it
    from scheduler.runtime import chain_exec
    plan = Plan([("F_ck", 0), ("F_all", 1), ("F_all", 2), ("offload", 2), ("F_all", 3),
                 ("F_all", 4), ("B", 4), ("B", 3), ("B", 2), ("F_all", 0), ("prefetch", 2),
                 ("B", 1), ("B", 0)], planner="hand")
    leaving_at_recompute = []
    recompute = chain_exec.ChainStep._recompute

    def spy(self, index, kind, s):
        leaving_at_recompute.append(dict(self.offloader.leaving_xbar))
        return recompute(self, index, kind, s)

    monkeypatch.setattr(chain_exec.ChainStep, "_recompute", spy)
    blocks, ref = twins(lambda: mlp_blocks(4, D))
    x = torch.randn(8, D, requires_grad=True)
    model = scheduler.wrap(blocks, None, planner=plan)
    expect = plain_step(ref, (x,))
    x.grad = None
    assert same(wrapped_step(model, (x,)), expect)
    assert leaving_at_recompute == [{}]   # F_all 0 ran after xbar[1] was let go
