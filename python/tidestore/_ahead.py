"""A sharded ``tidestore.offload`` rank's collectives beside its compute: parameters'
all-gathers started ahead of the binds that use them, gradients' reduce-scatters left
running behind the backward that made them (the Rust trainer's ``ranks::ahead``, over
``torch.distributed``'s asynchronous collectives).

The all-gathers follow the order the last iteration bound parameters in — the lifetime
plan the store learns its prefetches from, one level up: an iteration is the binds
between two steps, and the next is expected to bind alike. While it does, each bind
starts the gathers of the next ``depth`` binds (their shards read from the store now), so
that by the time a module asks for one, the collective ran while the modules before it
computed (gloo runs it on its own thread; NCCL on its own stream). A bind that differs
from the order (an evaluation, a shorter batch) waits out the gathers in flight, drops
them and gathers at the bind for the rest of the iteration, which becomes the next
order.

Every rank binds the same parameters in the same order (the same model, the same hooks),
so every rank starts the same collectives at the same points: they match. Nothing is
gathered across a step: a parameter's shard changes only in the step (a step deferred
into the next forward is made by the read of the shard, ahead or not).

Gradients are reduce-scattered in the order they come and put into the store in that
order, at the latest ``depth`` gradients later, and all before anything reads them
(``flush``): the same sums, in the same order, as waiting at each. ``tidestore.AdamW``
leaves its reduce-scatters and its write-back's all-gathers behind alike. With ``depth``
0 every collective waits where it is asked for.
"""

import collections
import time

from ._tidestore import DEFAULT_COLLECTIVES_AHEAD as DEFAULT_AHEAD
from ._tidestore import MAX_COLLECTIVES_AHEAD as MAX_AHEAD

__all__ = ["DEFAULT_AHEAD", "MAX_AHEAD", "Overlapped", "check_ahead"]


def check_ahead(depth):
    """``collectives_ahead`` checked: a whole number from 0 to ``MAX_AHEAD``."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_AHEAD:
        raise ValueError(f"collectives_ahead: {depth!r} is not a whole number from 0 to "
                         f"{MAX_AHEAD}")
    return depth


class Overlapped:
    """One rank's collectives in flight over ``shards`` (a ``_shards.Shards``); a key
    names a bind (a parameter and whether it is bound in backward) as the engine does."""

    def __init__(self, shards, depth):
        self.shards = shards
        self.depth = depth
        self._order = []  # the last whole iteration's binds
        self._seen = []  # this iteration's binds so far
        self._following = False  # whether this iteration binds as _order says so far
        self._gathers = collections.deque()  # (place in _order, Pending), oldest first
        self._next = 0  # the place in _order of the next gather to start
        self._behind = collections.deque()  # (Pending, what to do with its result)
        # What it did so far; collective_wait_ns: time this rank spent waiting for its
        # collectives to finish (what overlap hides shrinks it).
        self.stats = {"gathers_ahead": 0, "gathers_at_call": 0, "gathers_discarded": 0,
                      "scatters_behind": 0, "collective_wait_ns": 0}

    def report(self):
        """What a sharded engine adds to its ``stats()``: the world size, the bytes this
        rank sent into each kind of collective, the depth, and what it did so far."""
        return {"world_size": self.shards.world,
                **{f"sent_{k}_bytes": v for k, v in self.shards.sent.items()},
                "collectives_ahead": self.depth, **self.stats}

    def whole(self, key, read):
        """The whole parameter ``key[0]``, flat: gathered ahead when the order foresaw
        this bind, else gathered now from the shard ``read(key)`` gives. Then starts the
        gathers of the next binds the order expects, reading their shards through
        ``read``."""
        place = len(self._seen)
        self._seen.append(key)
        if self._following and (place >= len(self._order) or self._order[place] != key):
            self.discard_gathers()
        if self._following and self._gathers and self._gathers[0][0] == place:
            self.stats["gathers_ahead"] += 1
            whole = self._wait(self._gathers.popleft()[1])
        else:
            self.stats["gathers_at_call"] += 1
            whole = self._wait(self.shards.gather_later(key[0], read(key)))
        if self._following:
            self._next = max(self._next, place + 1)
            end = min(len(self._order), place + 1 + self.depth)
            while self._next < end:
                ahead = self._order[self._next]
                self._gathers.append(
                    (self._next, self.shards.gather_later(ahead[0], read(ahead))))
                self._next += 1
        return whole

    def discard_gathers(self):
        """Waits out the gathers in flight and drops them; the rest of the iteration
        gathers at each bind."""
        self._following = False
        while self._gathers:
            self.stats["gathers_discarded"] += 1
            self._wait(self._gathers.popleft()[1])

    def scatter(self, i, grad, first, last, put):
        """Starts reduce-scattering ``grad`` (a part of parameter ``i``'s gradient,
        ``first`` and ``last`` as the store's ``put_grad`` takes them), to be handed to
        ``put(i, shard, first, last)`` at most ``depth`` collectives later (``behind``)."""
        self.behind(self.shards.grad_later(i, grad), lambda shard: put(i, shard, first, last))
        if self._behind:
            self.stats["scatters_behind"] += 1

    def behind(self, pending, then):
        """Leaves the collective ``pending`` running; ``then(its result)`` is called once
        it is waited for: in the order given, when more than ``depth`` are left behind
        or at the ``flush``."""
        self._behind.append((pending, then))
        while len(self._behind) > self.depth:
            self._finish_oldest()

    def flush(self):
        """Waits for every collective left behind and hands each its result, in order:
        before anything reads what they make (the step reads the gradients; the end of
        a backward, the values)."""
        while self._behind:
            self._finish_oldest()

    def _finish_oldest(self):
        pending, then = self._behind.popleft()
        then(self._wait(pending))

    def _wait(self, pending):
        start = time.perf_counter_ns()
        try:
            return pending.wait()
        finally:
            self.stats["collective_wait_ns"] += time.perf_counter_ns() - start

    def end_iteration(self):
        """The iteration ended (the step): its binds are the order the next one is
        expected to follow. Gathers still in flight (it bound less than the order
        foresaw) are waited out and dropped."""
        self.discard_gathers()
        self._order, self._seen = self._seen, []
        self._following = self.depth > 0
        self._next = 0
