"""The waiting queue: round-robin across groups, arrival order within one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from attnserve.engine.waiting import FairQueue


@dataclass(eq=False)
class Item:
    id: str
    group: str | None = None


def ids(queue: FairQueue[Item]) -> list[str]:
    return [r.id for r in queue]


def test_groups_take_turns_and_singles_keep_arrival_order() -> None:
    queue: FairQueue[Item] = FairQueue()
    for i in range(4):
        queue.append(Item(f"a{i}", "A"))
    queue.append(Item("s1"))
    for i in range(2):
        queue.append(Item(f"b{i}", "B"))
    queue.append(Item("s2"))
    assert ids(queue) == ["a0", "s1", "b0", "s2", "a1", "b1", "a2", "a3"]
    assert len(queue) == 8 and queue[2].id == "b0"


def test_popleft_takes_the_order_it_shows() -> None:
    queue: FairQueue[Item] = FairQueue()
    for name, group in [("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B"), ("b1", "B")]:
        queue.append(Item(name, group))
    shown = ids(queue)
    popped = []
    while queue:
        head = queue[0].id
        popped.append(queue.popleft().id)
        assert popped[-1] == head
        if len(popped) == 2:  # a newcomer waits for one round, not for the groups
            queue.append(Item("late"))
            shown = popped + ids(queue)
    assert popped == shown
    assert popped == ["a0", "b0", "a1", "b1", "late", "a2"]
    with pytest.raises(IndexError):
        queue.popleft()


def test_remove_and_clear() -> None:
    queue: FairQueue[Item] = FairQueue()
    items = [Item("a0", "A"), Item("a1", "A"), Item("b0", "B")]
    for item in items:
        queue.append(item)
    queue.remove(items[0])
    assert ids(queue) == ["a1", "b0"]
    queue.remove(items[2])
    assert ids(queue) == ["a1"] and len(queue) == 1
    queue.clear()
    assert not queue and ids(queue) == []
