"""SeqQueue: the scheduler's waiting / running / swapped queues, kept in priority order.

Data structure: one Python list sorted by *descending* priority key (youngest first), so the head (the
oldest sequence, scheduled first) is the last element: peeking and popping it are O(1), inserting is a
binary search plus one memmove, and removing a given sequence is a binary search over its key plus one
memmove (no O(n) scan of Python comparisons). Iteration yields the oldest first.
Keys are Sequence.priority (request arrival, sample index); beam children may briefly share a key
with their parent, so removal confirms identity among equal keys.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator

from offline_paged.core.sequence import Sequence


def _descending(seq: Sequence) -> tuple[int, int]:
    arrival, index = seq.priority
    return (-arrival, -index)


class SeqQueue:
    """Sequences in FCFS order (oldest first when iterated)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[Sequence] = []  # youngest first: the head is at the end

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return reversed(self._items)

    def youngest_first(self) -> Iterator[Sequence]:
        return iter(self._items)

    def head(self) -> Sequence:
        """The oldest sequence. IndexError when empty."""
        return self._items[-1]

    def pop_head(self) -> Sequence:
        return self._items.pop()

    def insert(self, seq: Sequence) -> None:
        """Insert after every sequence of an equal key (a later insert of an equal key is younger)."""
        bisect.insort_left(self._items, seq, key=_descending)

    def remove(self, seq: Sequence) -> None:
        """Remove `seq` (by identity). ValueError if it is not queued here."""
        key = _descending(seq)
        low = bisect.bisect_left(self._items, key, key=_descending)
        high = bisect.bisect_right(self._items, key, lo=low, key=_descending)
        for index in range(low, high):
            if self._items[index] is seq:
                del self._items[index]
                return
        raise ValueError(f"sequence {seq.seq_id} is not in this queue")

    def as_list(self) -> list[Sequence]:
        """A copy, oldest first."""
        return self._items[::-1]
