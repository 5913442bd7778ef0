"""The probe of Megatron-LM's loop reads ahead of the training data without changing it
(hdet_megatron/megatron/training_probe.py; the torchrun runs are in test_training_patch.py)."""

from __future__ import annotations

import pytest
import torch

from hdet_megatron.megatron.layout import HDETSetupError
from hdet_megatron.megatron.training_probe import PeekableIterator, TrainingLoopProbe, _WindowBatches


class Rerun:
    """Stands in for Megatron's ``RerunDataIterator``: ``next()`` reads ``.iterable``."""

    def __init__(self, items):
        self.iterable = iter(items)

    def __next__(self):
        return next(self.iterable)


def _batches(n: int) -> list[dict]:
    return [{"tokens": torch.tensor([i, i + 1]), "meta": (i,)} for i in range(n)]


def _bind(probe: TrainingLoopProbe, data) -> None:
    probe.bind(forward_step_func=None, data_iterator=data, model=[], forward_backward_func=None)


def _tokens(batch) -> list[int]:
    return batch["tokens"].tolist()


def test_peekable_iterator_reads_ahead_without_consuming():
    it = PeekableIterator(iter(range(4)))
    assert it.peek(1) == 1 and it.peek(0) == 0 and it.buffered == 2
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    assert it.peek(0) == 3
    with pytest.raises(StopIteration):
        it.peek(1)
    assert list(it) == [3]  # what was read before the end is still handed out


def test_probe_reads_the_next_training_batches_and_training_still_takes_them():
    data = Rerun(_batches(6))
    assert _tokens(next(data)) == [0, 1]  # iteration 1, before any probe
    probe = TrainingLoopProbe("average")
    _bind(probe, data)
    probe.new_window(0)
    reader = _WindowBatches(probe, 0)
    first, second = next(reader), next(reader)
    assert (_tokens(first), _tokens(second)) == ([1, 2], [2, 3])
    first["tokens"].add_(100)  # a forward step modifying its batch
    again = _WindowBatches(probe, 0)  # the next line point: fresh copies of the same batches
    assert _tokens(next(again)) == [1, 2]
    probe.new_window(0)  # the same window again: nothing new is read
    assert _tokens(next(_WindowBatches(probe, 0))) == [1, 2]
    # Training takes every batch in order, the read-ahead ones unmodified.
    assert [_tokens(next(data)) for _ in range(5)] == [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]
    # The data ended: the next window probes the previous window's batches again.
    probe.new_window(1)
    reader = _WindowBatches(probe, 0)
    assert [_tokens(next(reader)), _tokens(next(reader))] == [[1, 2], [2, 3]]
    with pytest.raises(HDETSetupError, match="training data ended"):
        next(reader)


def test_probe_streams_follow_the_loop_iterators():
    """Interleaved pipelines pass a list of iterators (one per model chunk); ranks without data
    (a middle stage, TP ranks that receive a broadcast) pass None."""
    data = [Rerun(_batches(3)), None]
    probe = TrainingLoopProbe("line")
    _bind(probe, data)
    probe.new_window(0)
    assert isinstance(data[0].iterable, PeekableIterator)
    assert _tokens(next(_WindowBatches(probe, 0))) == [0, 1]
    assert probe._streams[1] is None
    assert _tokens(next(data[0])) == [0, 1]


def test_probe_errors():
    probe = TrainingLoopProbe("average")
    with pytest.raises(HDETSetupError, match="before train_step bound it"):
        probe.new_window(0)
    with pytest.raises(HDETSetupError, match="before new_window"):
        probe()
    _bind(probe, iter([1, 2]))  # not a RerunDataIterator: no .iterable to read ahead of
    with pytest.raises(HDETSetupError, match="RerunDataIterator"):
        probe.new_window(0)
    _bind(probe, Rerun([]))  # no data at all
    probe.new_window(1)
    with pytest.raises(HDETSetupError, match="training data ended"):
        next(_WindowBatches(probe, 0))


def test_training_may_change_its_batches_after_the_probe():
    data = Rerun(_batches(2))
    probe = TrainingLoopProbe("average")
    _bind(probe, data)
    probe.new_window(0)
    assert _tokens(next(_WindowBatches(probe, 0))) == [0, 1]
    taken = next(data)  # training reassigns an entry of the batch it took (as get_batch may)
    taken["tokens"] = taken["tokens"] * 0
    next(data)
    probe.new_window(1)  # end of data: window 0's batch again, as it was read
    assert _tokens(next(_WindowBatches(probe, 0))) == [0, 1]
