"""SeqQueue against a plain list kept sorted by (priority, insertion order), as the scheduler used."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from offline_paged.core.seq_queue import SeqQueue
from offline_paged.core.sequence import Sequence, SequenceGroup


def _seq(seq_id: int, arrival: int, sample_index: int) -> Sequence:
    group = SequenceGroup(f"r{arrival}", arrival, None, [1], None, [0])
    return Sequence(seq_id, group, sample_index, 0, [1], 1)


_ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 4), st.integers(0, 2)),  # few keys: many ties
    st.tuples(st.just("remove"), st.integers(0, 1000), st.just(0)),
    st.tuples(st.just("pop"), st.just(0), st.just(0)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_queue_matches_a_sorted_list_model(ops):
    queue, model = SeqQueue(), []  # model: oldest first; equal keys in insertion order
    for number, (op, a, b) in enumerate(ops):
        if op == "insert":
            seq = _seq(number, a, b)
            queue.insert(seq)
            position = sum(1 for s in model if s.priority <= seq.priority)
            model.insert(position, seq)
        elif op == "remove" and model:
            seq = model.pop(a % len(model))
            queue.remove(seq)
        elif op == "pop" and model:
            assert queue.head() is model[0]
            assert queue.pop_head() is model.pop(0)
        assert [s.seq_id for s in queue] == [s.seq_id for s in model]
        assert [s.seq_id for s in queue.youngest_first()] == [s.seq_id for s in reversed(model)]
        assert len(queue) == len(model) and bool(queue) == bool(model)


def test_removing_an_absent_sequence_is_a_value_error():
    queue = SeqQueue()
    queue.insert(_seq(0, 1, 0))
    twin = _seq(1, 1, 0)  # same key, another sequence
    try:
        queue.remove(twin)
    except ValueError as exc:
        assert "sequence 1" in str(exc)
    else:
        raise AssertionError("removing a sequence that is not queued must raise")
