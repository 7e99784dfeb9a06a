"""The waiting queue: requests taken round-robin across their groups.

The sentences of one document (one API request) are one group, queued together. Taken in plain
arrival order, a 500-sentence document would hold every request behind it for the whole
document; taken round-robin, groups share the batch: the next request to admit is the oldest
waiting one of the group whose turn it is, and a group that had a turn goes to the back. A
request without a group is a group of its own, so requests of one sentence each keep arrival
order among themselves, and no request waits for more than one round of the groups ahead of it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Grouped(Protocol):
    id: str
    group: str | None


R = TypeVar("R", bound=Grouped)


class FairQueue(Generic[R]):
    """A deque's interface (append, popleft, remove, index, iteration) in round-robin order."""

    def __init__(self) -> None:
        self._groups: dict[str, collections.deque[R]] = {}  # in turn order
        # the queue's order, rebuilt after an append or a removal, not after popleft
        self._order: collections.deque[R] | None = collections.deque()
        self._size = 0

    def append(self, request: R) -> None:
        self._groups.setdefault(request.group or request.id, collections.deque()).append(request)
        self._size += 1
        self._order = None

    def popleft(self) -> R:
        """The head: the oldest request of the group whose turn it is; that group goes last."""
        if not self._groups:
            raise IndexError("pop from an empty queue")
        key = next(iter(self._groups))
        group = self._groups.pop(key)
        request = group.popleft()
        if group:
            self._groups[key] = group  # to the back of the round
        self._size -= 1
        if self._order is not None:
            self._order.popleft()  # the rest keeps its order (the group went to the back)
        return request

    def remove(self, request: R) -> None:
        key = request.group or request.id
        group = self._groups[key]
        group.remove(request)
        if not group:
            del self._groups[key]
        self._size -= 1
        self._order = None

    def clear(self) -> None:
        self._groups.clear()
        self._size = 0
        self._order = collections.deque()

    def _ordered(self) -> collections.deque[R]:
        """Round k holds every group's k-th request, groups in turn order."""
        if self._order is None:
            queues = [list(g) for g in self._groups.values()]
            longest = max((len(q) for q in queues), default=0)
            self._order = collections.deque(
                q[k] for k in range(longest) for q in queues if k < len(q)
            )
        return self._order

    def __getitem__(self, index: int) -> R:
        return self._ordered()[index]

    def __iter__(self) -> Iterator[R]:
        return iter(self._ordered())  # callers do not change the queue while they iterate

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0
