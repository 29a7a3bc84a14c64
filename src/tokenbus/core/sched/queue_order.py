"""Where a request stands in the scheduler's queues, under its policy (L1, no torch).

fcfs: an arrival joins the back of `waiting`, a preempted request goes back to its front (first
in line to recompute), and `running` keeps admission order. priority: both queues stay ordered
by (priority, arrival time), equals in insertion order, so a preempted request gets its place
back (no later arrival of its priority overtakes it) and the last of `running` is the lowest
priority, latest arrival: the one preempted.
"""

from __future__ import annotations

import bisect
from collections import deque

from tokenbus.core.request import Request


class QueueOrder:
    def __init__(self, scheduling_policy: str) -> None:
        self.by_priority = scheduling_policy == "priority"

    def arrive(self, waiting: deque[Request], request: Request) -> None:
        if self.by_priority:
            _insert_by_priority(waiting, request)
        else:
            waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request, back in line to recompute."""
        if self.by_priority:
            _insert_by_priority(waiting, request)
        else:
            waiting.appendleft(request)

    def admit(self, running: list[Request], request: Request) -> None:
        if self.by_priority:
            _insert_by_priority(running, request)
        else:
            running.append(request)


def _insert_by_priority(queue: deque[Request] | list[Request], request: Request) -> None:
    """Keep `queue` ordered by (priority, arrival time); equals keep their insertion order."""
    position = bisect.bisect_right(
        queue, (request.priority, request.arrival_time), key=_priority_key
    )
    queue.insert(position, request)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
