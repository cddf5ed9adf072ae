"""Per request, which copy of each group answers it (pure: no I/O, no clock).

With redundancy every group lives on several workers.  The first copy to arrive wins and later
ones are dropped; in vote mode a group is decided when ``need`` copies agree, so up to
``need - 1`` wrong copies are outvoted.  The decoder also knows when a group can no longer be
decided (its copies were lost), so a request fails at once instead of at its deadline.  Without
redundancy it reduces to "wait for every group".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np


def outputs_agree(a: np.ndarray, b: np.ndarray, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Two copies of one subnet agree: same shape, same values up to float noise."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


@dataclass
class Decision:
    worker: int  # the copy whose output is used (the first of the agreeing copies)
    output: Any
    voters: list[int]  # workers whose copies agreed (just ``[worker]`` without voting)
    outvoted: list[int] = field(default_factory=list)  # copies that disagreed before the decision


class CoverageDecoder:
    """Decides, for one request, which copy of each group to use (no I/O, no clock).

    ``hosts[g]``: workers holding a copy of group ``g``.  ``need``: agreeing copies required
    (1 = first arrival wins; ``r + 1`` of ``2r + 1`` in vote mode).  Copies arrive with
    :meth:`add` and are lost with :meth:`lose` (worker dead or down, subnet raised).
    """

    __slots__ = ("hosts", "need", "agree", "pending", "arrivals", "decided", "lost_reasons",
                 "lost", "dropped")

    def __init__(self, hosts: Sequence[Sequence[int]], *, need: int = 1,
                 agree: Callable[[Any, Any], bool] = outputs_agree):
        # One is made per request: ``hosts`` is kept, not copied (callers never change it).
        if need < 1:
            raise ValueError("need must be >= 1")
        self.hosts = hosts
        self.need = need
        self.agree = agree
        self.pending: list[set[int]] = list(map(set, hosts))
        self.arrivals: dict[int, list[tuple[int, Any]]] = {}  # kept only when copies vote
        self.decided: dict[int, Decision] = {}
        self.lost_reasons: dict[int, list[str]] = {}
        self.lost = 0  # copies lost
        self.dropped = 0  # copies that arrived after their group was decided

    # -- events

    def add(self, group: int, worker: int, output: Any) -> bool:
        """A copy arrived; True when it decided its group."""
        if worker not in self.pending[group]:
            return False  # unknown or duplicate copy, or one already counted as lost
        self.pending[group].discard(worker)
        if group in self.decided:
            self.dropped += 1
            return False
        if self.need == 1:  # the first copy decides (every request takes this path)
            self.decided[group] = Decision(worker, output, [worker])
            return True
        arrived = self.arrivals.setdefault(group, [])
        arrived.append((worker, output))
        agreeing = [w for w, o in arrived if w == worker or self.agree(o, output)]
        if len(agreeing) < self.need:
            return False
        first = agreeing[0]
        first_out = next(o for w, o in arrived if w == first)
        outvoted = [w for w, _ in arrived if w not in agreeing]
        self.decided[group] = Decision(first, first_out, agreeing, outvoted)
        return True

    def lose(self, worker: int, group: int | None = None, reason: str | None = None) -> list[int]:
        """``worker``'s copies (of ``group``, or of all its groups) will not arrive.

        Returns the groups that can no longer be decided because of it."""
        became = []
        for g, pend in enumerate(self.pending):
            if (group is not None and g != group) or worker not in pend:
                continue
            pend.discard(worker)
            self.lost += 1
            if reason:
                self.lost_reasons.setdefault(g, []).append(reason)
            if g not in self.decided and not self._reachable(g):
                became.append(g)
        return became

    # -- state

    def _best_cluster(self, group: int) -> int:
        arr = self.arrivals.get(group, ())  # none without voting: the first copy decided
        return max((sum(1 for _, o2 in arr if self.agree(o2, o)) for _, o in arr), default=0)

    def _reachable(self, group: int) -> bool:
        return self._best_cluster(group) + len(self.pending[group]) >= self.need

    def undecided(self) -> list[int]:
        return [g for g in range(len(self.hosts)) if g not in self.decided]

    def unreachable(self) -> list[int]:
        """Undecided groups that can no longer be decided."""
        return [g for g in self.undecided() if not self._reachable(g)]

    @property
    def complete(self) -> bool:
        return len(self.decided) == len(self.hosts)

    @property
    def _intact(self) -> bool:
        """Every undecided group can still be decided: the first copy decides it, and none of
        its copies is lost (the request path asks on every event; this answers in O(1))."""
        return self.need == 1 and not self.lost

    @property
    def blocked(self) -> bool:
        """Some group can no longer be decided: the full answer is out of reach."""
        return not self._intact and bool(self.unreachable())

    @property
    def settled(self) -> bool:
        """Nothing more can change: every group is decided or out of reach."""
        return all(g in self.decided or not self._reachable(g) for g in range(len(self.hosts)))

    def finished(self, allow_partial: bool) -> bool:
        """Time to answer: complete, out of reach (full answers), or settled (partial allowed)."""
        if self.complete:
            return True
        if self._intact:
            return False
        return (self.blocked and not allow_partial) or self.settled

    def waiting_on(self, group: int) -> list[int]:
        return sorted(self.pending[group])
