"""S-LoRA-style adapter prefetch: which adapters to load now, and which resident ones they may replace.

Pure policy over host-side sets, no tensors and no GPU: the scheduler passes its waiting queue (one
adapter id per request, in scheduling order, None = no LoRA) and the pool's state, and gets back a
`PrefetchPlan` (adapters to load, nearest need first, each with the slot's current adapter it replaces
or None for a free slot). It then issues the loads through `AdapterLoader`.

Rules (DESIGN.md §6):
- an adapter is wanted in order of the first waiting request that needs it (needed soonest first);
- never evict an adapter that is loading, used by a running request (`in_use`), or needed by a waiting
  request nearer the head of the queue than the one the load is for (a farther one may lose its adapter
  to a nearer one: it is reloaded later, as in Belady's rule);
- victims are taken first among adapters no waiting request needs (least recently used first), then
  among those needed farthest away;
- at most `max_inflight` loads are in flight at once (those already loading count), so far-ahead
  prefetches do not queue in front of loads the batch needs soon on the one copy stream.

When to call it: at every scheduler step, and also when a request arrives (between steps). The host stage
and the copy need neither the GPU nor a step boundary, so a load planned at the arrival starts up to a
step earlier; serve-sim's overlap+prefetch does this (`Scheduler.on_arrival`), and in a cold-start trace
most loads are first uses, which nothing can plan before the request arrives.

The overlap rule lives in the scheduler: a request whose adapter is still loading stays waiting and does
not stall the batch; it joins the first step after `AdapterLoader.is_ready` says so (`split_ready`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Hashable, Iterable, Sequence

AdapterId = Hashable


@dataclass(frozen=True)
class PrefetchPlan:
    """loads[i] is to be loaded now, replacing resident adapter victims[i] (None: into a free slot)."""

    loads: tuple[AdapterId, ...] = ()
    victims: tuple[AdapterId | None, ...] = ()

    def __iter__(self):
        return iter(zip(self.loads, self.victims))

    def __len__(self) -> int:
        return len(self.loads)


def first_need(waiting: Iterable[AdapterId | None]) -> dict[AdapterId, int]:
    """Adapter -> position of the first waiting request that needs it (insertion order = need order)."""
    first: dict[AdapterId, int] = {}
    for pos, a in enumerate(waiting):
        if a is not None and a not in first:
            first[a] = pos
    return first


def plan_prefetch(waiting: Sequence[AdapterId | None], *, resident: Collection[AdapterId],
                  loading: Collection[AdapterId] = (), in_use: Collection[AdapterId] = (), num_slots: int,
                  lru: Sequence[AdapterId] = (), max_inflight: int | None = None,
                  horizon: int | None = None) -> PrefetchPlan:
    """Chooses the adapters to load now for `waiting` and the resident adapters they replace.

    waiting:      adapter id per waiting request in scheduling order (None: request without LoRA).
    resident:     adapters holding a slot, ready or still loading (`loading` ⊆ resident is allowed).
    loading:      adapters whose load has not completed (never evicted; count toward `max_inflight`).
    in_use:       adapters of running requests and of the batch being formed (never evicted).
    num_slots:    slots of the pool; slots not held by `resident ∪ loading` are free.
    lru:          resident adapters, least recently used first (tie-break among victims; adapters
                  missing from it count as oldest).
    max_inflight: loads in flight allowed after this plan (None: no bound but the slots).
    horizon:      only requests waiting[:horizon] may have their adapter loaded (on-demand loading
                  passes the requests it is admitting); the whole queue still protects adapters.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if max_inflight is not None and max_inflight < 0:
        raise ValueError(f"max_inflight must be >= 0 or None, got {max_inflight}")
    held = set(resident) | set(loading)
    if len(held) > num_slots:
        raise ValueError(f"{len(held)} resident/loading adapters exceed num_slots={num_slots}")
    loading_set = set(loading)
    protected = set(in_use) | loading_set
    budget = (num_slots if max_inflight is None else max_inflight) - len(loading_set)
    free = num_slots - len(held)
    need = first_need(waiting)
    far = len(waiting)  # position of "never needed"
    age = {a: i for i, a in enumerate(lru)}

    # Victim candidates, best first: not needed by any waiting request (oldest first), then needed
    # farthest away. A candidate is usable for a load at position p only if its own need is beyond p.
    candidates = sorted((a for a in held if a not in protected),
                        key=lambda a: (-need.get(a, far), age.get(a, -1), str(a)))
    loads: list[AdapterId] = []
    victims: list[AdapterId | None] = []
    limit = len(waiting) if horizon is None else min(horizon, len(waiting))
    for a, pos in need.items():
        if budget <= 0 or pos >= limit:
            break
        if a in held:
            continue
        if free > 0:
            free -= 1
            victims.append(None)
        elif candidates and need.get(candidates[0], far) > pos:
            victims.append(candidates.pop(0))
        else:
            break  # every later adapter is needed later still: no victim can qualify for it either
        loads.append(a)
        held.add(a)
        budget -= 1
    return PrefetchPlan(tuple(loads), tuple(victims))


def split_ready(adapters: Iterable[AdapterId | None], is_ready: Callable[[AdapterId], bool]
                ) -> tuple[list[int], list[int]]:
    """The overlap rule: indices of requests that may join the batch now (no LoRA, or adapter ready)
    and of those that keep waiting for their adapter's load, both in the given order."""
    ready, wait = [], []
    for i, a in enumerate(adapters):
        (ready if a is None or is_ready(a) else wait).append(i)
    return ready, wait
