"""The variable sequence, the swap schedule, the one accounting (replay), and the follower of
offload plans. No torch in the planning modules."""
import subprocess
import sys

import pytest

from _subproc import python_env
from scheduler.chain import Chain
from scheduler.errors import InvalidPlanError
from scheduler.plan import Plan
from scheduler.planners.offload_follow import (chain_from_sequence, schedule_from_plan,
                                               stage_variables)
from scheduler.planners.swap_schedule import (SwapSchedule, VariableSequence, random_sequence,
                                              replay)

# forward packs a(4) b(2) a again, c(8); backward unpacks c, a, b, a
SEQ = VariableSequence(steps=((0,), (1,), (0,), (2,), (2,), (0,), (1,), (0,)),
                       sizes=(4, 2, 8), phases="FFFFBBBB")


def sched(n, swap_in=(), swap_out=(), release=()):
    def per_step(pairs):
        steps = [[] for _ in range(n)]
        for step, var in pairs:
            steps[step].append(var)
        return steps
    return SwapSchedule(per_step(swap_in), per_step(swap_out), per_step(release))


def test_sequence_validation_names_the_field():
    with pytest.raises(ValueError, match=r"steps\[1\]"):
        VariableSequence(steps=((0,), ()), sizes=(1,))
    with pytest.raises(ValueError, match="variable 3"):
        VariableSequence(steps=((3,),), sizes=(1,))
    with pytest.raises(ValueError, match="never used"):
        VariableSequence(steps=((0,),), sizes=(1, 2))
    with pytest.raises(ValueError, match=r"free_after\[0\]"):
        VariableSequence(steps=((0,), (0,)), sizes=(1,), free_after=(0,))
    with pytest.raises(ValueError, match="phases"):
        VariableSequence(steps=((0,),), sizes=(1,), phases="X")
    with pytest.raises(ValueError, match=r"sizes\[0\]"):
        VariableSequence(steps=((0,),), sizes=(-1,))


def test_sequence_helpers_and_json_round_trip():
    assert SEQ.use_steps == ((0, 2, 5, 7), (1, 6), (3, 4))
    assert SEQ.next_use(0, 2) == 5 and SEQ.next_use(2, 4) is None
    assert SEQ.free_after == (7, 6, 4)  # default: the last use
    assert SEQ.min_budget() == (8, 3) and SEQ.largest_tensor() == (8, 2)
    again = VariableSequence.from_dict(SEQ.to_dict())
    assert again == SEQ and again.signature == SEQ.signature
    assert random_sequence(20, seed=3) == random_sequence(20, seed=3)


def test_replay_without_swaps_counts_every_saved_byte_until_freed():
    r = replay(SEQ, SwapSchedule.empty(len(SEQ)))
    assert r.resident == (4, 6, 6, 14, 14, 6, 6, 4)  # c freed after step 4, b after 6
    assert r.peak == 14 and r.swapped_out_bytes == 0 and r.host_peak == 0


def test_replay_hand_computed_swaps():
    # a out after step 2 (its last forward use), released before 3, back in before 5
    s = sched(len(SEQ), swap_out=[(2, 0)], release=[(3, 0)], swap_in=[(5, 0)])
    r = replay(SEQ, s)
    assert r.resident == (4, 6, 6, 10, 10, 6, 6, 4)
    assert r.host == (0, 0, 4, 4, 4, 4, 4, 4)
    assert (r.swapped_out_bytes, r.swapped_in_bytes, r.swap_outs, r.swap_ins) == (4, 4, 1, 1)
    # a swap-in before the release lands cancels the swap-out: nothing moves back
    s = sched(len(SEQ), swap_out=[(2, 0)], swap_in=[(5, 0)])
    r = replay(SEQ, s)
    assert r.resident == (4, 6, 6, 14, 14, 6, 6, 4) and r.swapped_in_bytes == 0


def test_second_swap_out_reuses_the_host_copy():
    seq = VariableSequence(steps=((0,), (1,), (0,), (1,), (0,)), sizes=(5, 1), phases="FFBBB")
    s = sched(5, swap_out=[(0, 0), (2, 0)], release=[(1, 0), (3, 0)], swap_in=[(2, 0), (4, 0)])
    r = replay(seq, s)
    assert r.swapped_out_bytes == 5 and r.swapped_in_bytes == 10
    assert r.resident == (5, 1, 6, 1, 5)


@pytest.mark.parametrize("kwargs, index, match", [
    (dict(swap_out=[(2, 0)], release=[(3, 0)]), 5, "only on the host"),
    (dict(release=[(3, 0)]), 3, "no swap-out in flight"),
    (dict(swap_in=[(3, 0)]), 3, "swap-in of variable 0, which is device"),
    (dict(swap_out=[(4, 2)]), 4, "frees right after"),
    (dict(swap_out=[(0, 2)]), 0, "swap-out of variable 2, which is unborn"),
    (dict(swap_in=[(1, 7)]), 1, "unknown variable 7"),
])
def test_replay_rejects_impossible_schedules(kwargs, index, match):
    with pytest.raises(InvalidPlanError, match=match) as err:
        replay(SEQ, sched(len(SEQ), **kwargs))
    assert err.value.index == index


def test_replay_rejects_a_schedule_of_the_wrong_length():
    with pytest.raises(InvalidPlanError, match="steps"):
        replay(SEQ, SwapSchedule.empty(3))


def test_planning_modules_do_not_import_torch(tmp_path):
    code = ("import sys, scheduler.planners.window, scheduler.planners.lms, "
            "scheduler.planners.offload_follow, scheduler.planners.swap_schedule; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=python_env(), cwd=str(tmp_path))


# ------------------------------------------------------------------ offload plans
LINEAR = VariableSequence(steps=tuple((v,) for v in (0, 1, 2, 3, 3, 2, 1, 0)),
                          sizes=(5, 6, 7, 8), phases="FFFFBBBB",
                          times=(1.0, 1.0, 2.0, 1.0, 3.0, 2.0, 2.0, 1.0))


def test_chain_from_sequence_keeps_the_saved_bytes():
    chain, stage_vars = chain_from_sequence(LINEAR)
    assert stage_vars == [0, 1, 2, 3] == stage_variables(LINEAR)
    assert isinstance(chain, Chain) and chain.L == 4
    assert chain.x == (5, 6, 7, 8, 0) and chain.xbar == (6, 7, 8, 0, 0)
    assert chain.x[0] + sum(chain.xbar) == LINEAR.total_bytes()
    assert chain.fw == (1.0, 2.0, 1.0, 0.0, 3.0)  # creation to creation; the turn is the loss
    assert chain.bw == (1.0, 2.0, 2.0, 0.0, 0.0)
    assert sum(chain.fw) + sum(chain.bw) == sum(LINEAR.times[1:])  # all but before step 0
    untimed, _ = chain_from_sequence(VariableSequence(LINEAR.steps, LINEAR.sizes, LINEAR.phases))
    assert untimed.fw[0] == pytest.approx(6e-9)  # x[1] = 6 bytes  # bytes / 1 GB/s without measured times


def test_hand_written_offload_plan_is_followed():
    # what offload.greedy would return for "offload the first two activations"
    plan = Plan(ops=[("F_all", 0), ("offload", 0), ("F_all", 1), ("offload", 1), ("F_all", 2),
                     ("F_all", 3), ("F_all", 4), ("B", 4), ("B", 3), ("prefetch", 1), ("B", 2),
                     ("prefetch", 0), ("B", 1), ("B", 0)], planner="greedy")
    s = schedule_from_plan(LINEAR, plan)
    assert s.swap_out[0] == (0,) and s.swap_out[1] == (1,)
    assert s.release[1] == (0,) and s.release[2] == (1,)
    assert s.swap_in[5] == (1,) and s.swap_in[6] == (0,)
    r = replay(LINEAR, s)
    assert r.swapped_out_bytes == 11 and r.swapped_in_bytes == 11
    assert r.peak < replay(LINEAR, SwapSchedule.empty(len(LINEAR))).peak
    assert s.planner == "greedy" and not s.blocking_release


def test_offload_plan_with_no_room_between_transfers_is_dropped():
    plan = Plan(ops=[("F_all", 0), ("F_all", 1), ("F_all", 2), ("F_all", 3), ("offload", 3),
                     ("prefetch", 3), ("B", 4), ("B", 3), ("B", 2), ("B", 1), ("B", 0)])
    s = schedule_from_plan(LINEAR, plan)
    assert s.counts() == {"swap_in": 0, "swap_out": 0, "release": 0}


def test_offload_plans_on_random_sequences_are_valid():
    for seed in range(40):
        seq = random_sequence(10, seed=seed)
        chain, stage_vars = chain_from_sequence(seq)
        # offload every other stage right after its forward, prefetch before the loss turns
        ops = []
        for s in range(chain.L):
            ops.append(("F_all", s))
            if s % 2 == 0:
                ops.append(("offload", s))
        ops.append(("F_all", chain.L))
        for s in range(chain.L, -1, -1):
            if s < chain.L and s % 2 == 0:
                ops.append(("prefetch", s))
            ops.append(("B", s))
        replay(seq, schedule_from_plan(seq, Plan(ops=ops), stage_vars))  # raises if invalid
