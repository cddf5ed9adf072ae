"""Which worker hosts which groups.

Without redundancy every group has its own worker (the identity placement).  With redundancy
``r`` (Yang et al., Asilomar 2020) :func:`cyclic_placement` puts copy ``j`` of group ``g`` on
worker ``g - j`` (mod W), so worker ``w`` hosts ``w, w+1, ..., w+r`` when W = G and the copies of
one group are always on distinct workers.  In vote mode every group has ``2r + 1`` copies and is
decided when ``r + 1`` agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sensai.errors import SensaiError


def cyclic_placement(groups: int, workers: int, redundancy: int) -> list[list[int]]:
    """Groups hosted by each worker: copy ``j`` (0..r) of group ``g`` on worker ``(g - j) mod W``.

    Each worker's list starts with the groups it is the primary for (copy 0), then its copies in
    order, which is the order the worker computes them in.  Raises :class:`SensaiError` unless
    ``0 <= redundancy < workers`` (copies of a group on distinct workers) and every worker hosts
    at least one group.
    """
    for what, v in (("groups", groups), ("workers", workers), ("redundancy", redundancy)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise SensaiError(f"{what} must be an integer, got {v!r}")
    if groups < 1:
        raise SensaiError(f"need at least one group, got {groups}")
    if workers < 1:
        raise SensaiError(f"need at least one worker, got {workers}")
    if not 0 <= redundancy < workers:
        raise SensaiError(f"redundancy must be between 0 and workers - 1 = {workers - 1} (each "
                          f"copy of a group on another worker), got {redundancy}")
    # Copy j of group g goes to worker (g - j) mod W: the workers reached are G + r consecutive
    # residues.  Checked before anything is built: workers may be any number a user typed.
    if workers > groups + redundancy:
        raise SensaiError(f"{workers} workers for {groups} groups with redundancy {redundancy} "
                          f"leave {workers - groups - redundancy} worker(s) without a subnet; "
                          f"use at most {groups + redundancy} workers")
    placement: list[list[int]] = [[] for _ in range(workers)]
    for j in range(redundancy + 1):
        for g in range(groups):
            placement[(g - j) % workers].append(g)
    return placement


def group_hosts(placement: Sequence[Sequence[int]], groups: int) -> list[list[int]]:
    """For each group, the workers holding a copy of it (primary first)."""
    hosts: list[list[int]] = [[] for _ in range(groups)]
    order = sorted(((j, w, g) for w, hosted in enumerate(placement)
                    for j, g in enumerate(hosted)), key=lambda t: (t[0], t[1]))
    for _, w, g in order:
        hosts[g].append(w)
    return hosts


def copies_for(redundancy: int, vote: bool) -> int:
    """Copies of each group: ``r + 1``, or ``2r + 1`` in vote mode (a majority of ``r + 1``)."""
    return 2 * redundancy + 1 if vote else redundancy + 1


def check_redundancy(groups: int, workers: int | None, redundancy: int, vote: bool) -> int:
    """Validate redundancy settings against the artifact's G; returns W (None: G, the
    placement callers that place one worker per group)."""
    w = groups if workers is None else workers
    if isinstance(redundancy, bool) or not isinstance(redundancy, int) or redundancy < 0:
        raise SensaiError(f"--redundancy must be an integer >= 0, got {redundancy!r}")
    if vote and redundancy < 1:
        raise SensaiError("--vote needs --redundancy >= 1 (2r+1 copies outvote r wrong ones)")
    copies = copies_for(redundancy, vote)
    if copies > w:
        what = f"vote mode with redundancy {redundancy} needs 2r+1 = {copies}" if vote else \
            f"redundancy {redundancy} needs r+1 = {copies}"
        raise SensaiError(f"{what} copies of each group on distinct workers, but there are only "
                          f"{w} workers" + (f" (W = G = {groups})" if workers is None else ""))
    cyclic_placement(groups, w, copies - 1)
    return w


@dataclass(frozen=True)
class Placement:
    """``workers[w]``: the groups worker ``w`` hosts, its own (primaries) first;
    ``hosts[g]``: the workers holding group ``g``, primary first; ``need``: agreeing copies that
    decide a group (1, or ``r + 1`` in vote mode)."""

    workers: tuple[tuple[int, ...], ...]
    hosts: tuple[tuple[int, ...], ...]
    redundancy: int = 0
    vote: bool = False

    @classmethod
    def cyclic(cls, groups: int, workers: int | None = None, redundancy: int = 0,
               vote: bool = False) -> "Placement":
        w = check_redundancy(groups, workers, redundancy, vote)
        placed = cyclic_placement(groups, w, copies_for(redundancy, vote) - 1)
        return cls(tuple(tuple(p) for p in placed),
                   tuple(tuple(h) for h in group_hosts(placed, groups)), redundancy, vote)

    @property
    def need(self) -> int:
        return self.redundancy + 1 if self.vote else 1

    def primaries(self, worker: int) -> int:
        """How many of ``worker``'s groups it is the primary (copy 0) for."""
        return sum(1 for g in self.workers[worker] if self.hosts[g][0] == worker)


def spread(placement: Placement, nodes: int) -> tuple[list[int], list[int]]:
    """Node of each worker: as even as possible over ``nodes`` nodes, with the copies of every
    group on distinct nodes whenever that is possible (then losing one node never loses a
    group).  Returns ``(node of each worker, groups whose copies must share a node)``.

    Cyclic placement puts a group's copies on consecutive workers, so this is a colouring of a
    cycle in which every r+1 consecutive workers differ: a small search finds one (the worker
    counts are small), and when none exists the least shared one is kept.
    """
    workers = len(placement.workers)
    if nodes < 1:
        raise SensaiError("need at least one node")
    quota = [workers // nodes + (1 if n < workers % nodes else 0) for n in range(nodes)]
    hosts = [list(h) for h in placement.hosts]
    of_worker: list[list[int]] = [[g for g, h in enumerate(hosts) if w in h]
                                  for w in range(workers)]
    best: list[int] | None = None
    best_shared = workers + 1
    assign = [-1] * workers
    used = [0] * nodes
    steps = [0]

    def shared(upto: int) -> int:
        """Groups whose assigned copies (among workers < upto) share a node."""
        bad = 0
        for h in hosts:
            seen = [assign[w] for w in h if w < upto]
            bad += len(seen) != len(set(seen))
        return bad

    def search(w: int) -> None:
        nonlocal best, best_shared
        steps[0] += 1
        if steps[0] > 200_000 or best_shared == 0:
            return
        if w == workers:
            s = shared(workers)
            if s < best_shared:
                best, best_shared = list(assign), s
            return
        if shared(w) >= best_shared:
            return
        for n in sorted(range(nodes), key=lambda n: used[n]):  # fill the emptiest first
            if used[n] >= quota[n]:
                continue
            assign[w] = n
            used[n] += 1
            clash = any(assign[v] == n for g in of_worker[w] for v in hosts[g] if v < w)
            if not clash or best_shared > 0:
                search(w + 1)
            used[n] -= 1
            assign[w] = -1

    search(0)
    assert best is not None
    return best, [g for g, h in enumerate(hosts) if len({best[w] for w in h}) != len(h)]
