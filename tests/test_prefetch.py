"""Prefetch policy over scripted queues (pure host logic, CPU)."""

import random

import pytest

from lora_kernels.adapters.prefetch import PrefetchPlan, first_need, plan_prefetch, split_ready


def test_loads_in_order_of_first_need_into_free_slots():
    plan = plan_prefetch(["c", None, "a", "c", "b", "d"], resident={"a"}, num_slots=3)
    assert plan == PrefetchPlan(("c", "b"), (None, None))


def test_never_evicts_in_use_loading_or_nearer_needed():
    # 3 slots: x running, y loading, z needed by the head of the queue. Nothing may be evicted for w.
    plan = plan_prefetch(["z", "w"], resident={"x", "y", "z"}, loading={"y"}, in_use={"x"}, num_slots=3)
    assert plan.loads == ()


def test_evicts_unneeded_lru_first_then_farthest_needed():
    # Slots hold p, q (not needed; q older) and f (needed last). Two new adapters fit by evicting q, p.
    plan = plan_prefetch(["n1", "n2", "f"], resident={"p", "q", "f"}, lru=["q", "p", "f"], num_slots=3)
    assert plan.loads == ("n1", "n2") and plan.victims == ("q", "p")
    # Only f left to evict: n1 (position 0) may take f (first needed at 2); f is not reloaded in the
    # same plan because nothing farther than it can be evicted.
    plan = plan_prefetch(["n1", "n2", "f"], resident={"f"}, num_slots=1)
    assert plan == PrefetchPlan(("n1",), ("f",))


def test_farther_request_cannot_evict_nearer_ones_adapter():
    # f is needed at position 0; n (position 1) must not replace it.
    plan = plan_prefetch(["f", "n"], resident={"f"}, num_slots=1)
    assert plan.loads == ()


def test_max_inflight_counts_loads_already_in_flight():
    waiting = ["a", "b", "c", "d"]
    assert plan_prefetch(waiting, resident=set(), num_slots=8, max_inflight=2).loads == ("a", "b")
    assert plan_prefetch(waiting, resident={"a"}, loading={"a"}, num_slots=8, max_inflight=2).loads == ("b",)
    assert plan_prefetch(waiting, resident={"a", "b"}, loading={"a", "b"}, num_slots=8, max_inflight=2).loads == ()
    assert plan_prefetch(waiting, resident=set(), num_slots=8, max_inflight=0).loads == ()


def test_horizon_limits_loads_but_whole_queue_protects():
    # Only the first request's adapter may be loaded; g (needed at 2) outranks the unneeded u as victim.
    plan = plan_prefetch(["a", "b", "g"], resident={"g", "u"}, lru=["g", "u"], num_slots=2, horizon=1)
    assert plan == PrefetchPlan(("a",), ("u",))


def test_first_need_and_split_ready():
    assert first_need(["b", None, "a", "b"]) == {"b": 0, "a": 2}
    ready, wait = split_ready(["a", None, "b", "a"], lambda a: a == "a")
    assert ready == [0, 1, 3] and wait == [2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_slots"):
        plan_prefetch([], resident=set(), num_slots=0)
    with pytest.raises(ValueError, match="exceed num_slots"):
        plan_prefetch([], resident={"a", "b"}, num_slots=1)
    with pytest.raises(ValueError, match="max_inflight"):
        plan_prefetch([], resident=set(), num_slots=1, max_inflight=-1)


@pytest.mark.parametrize("seed", range(100))
def test_random_queues_keep_every_invariant(seed):
    """Random pool states and queues: every plan respects capacity, protection and need order."""
    rng = random.Random(seed)
    ids = list(range(12))
    num_slots = rng.randint(1, 6)
    held = rng.sample(ids, rng.randint(0, num_slots))
    loading = set(rng.sample(held, rng.randint(0, len(held))))
    in_use = set(rng.sample(held, rng.randint(0, len(held))))
    waiting = [rng.choice(ids + [None]) for _ in range(rng.randint(0, 15))]
    lru = rng.sample(held, len(held))
    max_inflight = rng.choice([None, 0, 1, 2, 4])
    plan = plan_prefetch(waiting, resident=set(held), loading=loading, in_use=in_use, num_slots=num_slots,
                         lru=lru, max_inflight=max_inflight)
    need = first_need(waiting)
    assert len(set(plan.loads)) == len(plan.loads)
    assert not set(plan.loads) & set(held), "re-loads a resident adapter"
    assert all(a in need for a in plan.loads), "loads an adapter nobody waits for"
    victims = [v for v in plan.victims if v is not None]
    assert len(set(victims)) == len(victims) and set(victims) <= set(held)
    assert not set(victims) & (loading | in_use), "evicts a loading or in-use adapter"
    for a, v in plan:
        if v is not None:
            assert need.get(v, len(waiting)) > need[a], "evicts an adapter a nearer request needs"
    assert len(held) - len(victims) + len(plan.loads) <= num_slots
    if max_inflight is not None:
        assert len(loading) + len(plan.loads) <= max(max_inflight, len(loading))
    # loads follow need order, and stop only for a reason: no budget or no slot for the next one
    order = [a for a in need if a not in held]
    k = len(plan.loads)
    assert list(plan.loads) == order[:k]
    budget_left = (num_slots if max_inflight is None else max_inflight) - len(loading) - k
    if k < len(order) and budget_left > 0:
        after = (set(held) - set(victims)) | set(plan.loads)
        assert len(after) == num_slots, "stopped with a free slot left"
        usable = [v for v in after - loading - in_use - set(plan.loads)
                  if need.get(v, len(waiting)) > need[order[k]]]
        assert not usable, f"stopped although {usable} could make room for {order[k]}"
