"""The probe of Megatron-LM's own training loop (``megatron.training`` patched for HDET).

The probe signals (``--hdet-signal probe``, ``line``, ``average``) score the arms at a window's end
on a batch that no arm has trained on. In Megatron-LM's loop that batch is the *next* training
batch, read ahead of the training stream without consuming it:

* the training data iterator Megatron passes to ``train_step`` is a ``RerunDataIterator``
  (``megatron/training/training.py`` ``build_train_valid_test_data_iterators``) that draws from
  its ``iterable``; :class:`PeekableIterator` replaces that ``iterable`` by a wrapper that can
  read ahead. Read-ahead batches stay buffered and are the ones the following training steps
  take, so the data order, ``consumed_train_samples`` and a resume are exactly those of a run
  without probes (the validation iterator is not used: Megatron sizes it for its evaluations
  and resumes it from ``consumed_valid_samples``);
* :class:`TrainingLoopProbe` runs Megatron's own ``forward_backward_func(forward_only=True)``
  with the ``forward_step_func`` of the run on those batches, so TP, PP (also interleaved) and CP
  work as in Megatron's ``evaluate``; it returns the per-microbatch loss dicts, as
  :class:`~hdet_megatron.megatron.runtime.HDET` expects of a probe's ``loss_fn``. It is a
  :class:`~hdet_megatron.probe.BatchProbe`: the window engine asks for the window's batch once
  (:meth:`TrainingLoopProbe.new_window`) and scores it at every point. Only the batches a
  forward step actually asks for are read (a middle pipeline stage reads none), and each score
  of one window hands out fresh copies of the same batches (the line signals score once per
  point); the batch fingerprint is taken from what was read.

With ``--hdet-signal probe`` every arm must score the *same* batch: each batch is replaced by data
parallel rank 0's (one ``broadcast_object_list`` per microbatch and window over the DP group);
the ranks still train on their own. With ``line``/``average`` each replica probes its own next
shard and HDET averages the points over all replicas.

At the end of the data (a ``single`` dataloader read to its last sample) the previous window's
batches are probed again: already trained on, so that one window's signal is weaker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hdet_megatron.megatron.layout import HDETSetupError
from hdet_megatron.probe import BatchProbe, batch_fingerprint

__all__ = ["PeekableIterator", "TrainingLoopProbe"]


class PeekableIterator:
    """An iterator that can read ahead of itself: :meth:`peek` reads items into a buffer that
    ``next()`` hands out first, so reading ahead never changes what ``next()`` returns."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._buffer: deque = deque()

    def __iter__(self) -> PeekableIterator:
        return self

    def __next__(self) -> Any:
        if self._buffer:
            return self._buffer.popleft()
        return next(self._source)

    def peek(self, index: int) -> Any:
        """The item ``index`` places ahead (0: what ``next()`` returns next), not consumed.
        Raises ``StopIteration`` when the source ends first (what was read stays buffered)."""
        while len(self._buffer) <= index:
            self._buffer.append(next(self._source))
        return self._buffer[index]

    @property
    def buffered(self) -> int:
        """Items read ahead and not yet taken by ``next()``."""
        return len(self._buffer)

    def __getattr__(self, name: str) -> Any:
        # Anything else is the source's (e.g. a dataloader iterator's attributes).
        if name.startswith("__") or name in ("_source", "_buffer"):
            raise AttributeError(name)
        return getattr(self._source, name)


def _peekable(data_iterator: Any) -> PeekableIterator:
    """The read-ahead view of one training data iterator (installed on first use)."""
    if isinstance(data_iterator, PeekableIterator):
        return data_iterator
    source = getattr(data_iterator, "iterable", None)
    if source is None:
        raise HDETSetupError(
            "the HDET probe of megatron.training reads ahead of the training data iterator "
            "through its .iterable (Megatron's RerunDataIterator, which "
            f"build_train_valid_test_data_iterators returns); got {type(data_iterator).__name__}"
        )
    if not isinstance(source, PeekableIterator):
        if not hasattr(source, "__next__"):
            source = iter(source)
        source = PeekableIterator(source)
        data_iterator.iterable = source
    return source


def _copy(batch: Any) -> Any:
    """A copy of a batch whose tensors are fresh (a forward step may move or modify them)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return type(batch)((k, _copy(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        items = [_copy(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


class _WindowBatches:
    """What the probe's ``forward_step_func`` reads from one stream: the window's batches, each
    a fresh copy, in training order."""

    def __init__(self, probe: TrainingLoopProbe, stream: int) -> None:
        self._probe = probe
        self._stream = stream
        self._position = 0

    def __iter__(self) -> _WindowBatches:
        return self

    def __next__(self) -> Any:
        batch = self._probe._batch(self._stream, self._position)
        self._position += 1
        return _copy(batch)


class TrainingLoopProbe(BatchProbe):
    """The probe of :class:`~hdet_megatron.megatron.runtime.HDET` in Megatron-LM's loop.

    ``train_step``'s hook calls :meth:`bind` every iteration with what ``train_step`` was given
    (forward step, data iterator, model, ``forward_backward_func``, communicators); the window
    engine asks for the window's batch (:meth:`new_window`: the read-ahead starts) and then
    scores it (:meth:`__call__`, once or once per line point) at a window's end.

    Args:
        signal: the run's ``HDETConfig.signal`` (``"probe"``: every arm scores DP rank 0's batch).
    """

    def __init__(self, signal: str) -> None:
        super().__init__(lambda _window: self(), self._start_window)
        self.signal = signal
        self._context: dict | None = None
        self._streams: list[PeekableIterator | None] = []
        self._is_list = False
        self._window: int | None = None
        self._batches: list[list[Any]] = []
        self._previous: list[list[Any]] = []
        self.calls = 0
        """Probes run (forward-only passes)."""

    # -- wiring ----------------------------------------------------------------------------------
    def bind(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: list,
        forward_backward_func: Callable,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
    ) -> None:
        """What the next probe runs with (``train_step``'s own arguments). Cheap; no reads."""
        self._context = {
            "forward_step_func": forward_step_func,
            "data_iterator": data_iterator,
            "model": model,
            "forward_backward_func": forward_backward_func,
            "p2p_communicator": p2p_communicator,
            "pg_collection": pg_collection,
        }

    def new_window(self, window: int) -> None:
        """The probes of ``window`` start: they read the batches after the last trained one."""
        if window == self._window:
            return
        if self._context is None:
            raise HDETSetupError(
                "the HDET probe of megatron.training ran before train_step bound it (a converge "
                "with a probe signal before the first training step of this process)"
            )
        data_iterator = self._context["data_iterator"]
        self._is_list = isinstance(data_iterator, (list, tuple))
        iterators = list(data_iterator) if self._is_list else [data_iterator]
        self._streams = [None if it is None else _peekable(it) for it in iterators]
        if self._batches:
            self._previous = self._batches
        self._batches = [[] for _ in self._streams]
        self._window = window

    def _start_window(self, window: int) -> int:
        """The engine's fetch of the window's batch: the read-ahead of ``window`` starts (the
        batches themselves are read by the forward steps that ask for them)."""
        self.new_window(window)
        return window

    def fingerprint(self, batch: Any, device: torch.device) -> torch.Tensor | None:
        """The fingerprint of the batches this window's forward steps read."""
        return batch_fingerprint(self._batches, device)

    # -- reading ---------------------------------------------------------------------------------
    def _batch(self, stream: int, index: int) -> Any:
        batches = self._batches[stream]
        source = self._streams[stream]
        assert source is not None  # readers exist only for streams that have a data iterator
        while len(batches) <= index:
            k = len(batches)
            try:
                batch = source.peek(k)
            except StopIteration:
                previous = self._previous[stream] if stream < len(self._previous) else []
                if k >= len(previous):
                    raise HDETSetupError(
                        "the training data ended before the HDET probe could read a batch (the "
                        "probe reads the batches after the last trained one); use a cyclic "
                        "dataloader (--dataloader-type cyclic) or more data than --train-iters needs"
                    ) from None
                batch = previous[k]
            if self.signal == "probe":
                batch = self._shared(batch)
            # Our own copy: the training step that takes this batch may change it (a forward
            # step that reassigns its dict entries), and a later window may probe it again.
            batches.append(_copy(batch))
        return batches[index]

    def _shared(self, batch: Any) -> Any:
        """Data-parallel rank 0's batch on every DP rank (``signal="probe"``: one batch for all
        arms). Collective over the DP group: its ranks read the same positions of their
        streams (same TP/PP/CP coordinates)."""
        import torch.distributed as dist

        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return batch
        holder = [batch if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(holder, group=group, group_src=0)
        return holder[0]

    # -- the probe -------------------------------------------------------------------------------
    def __call__(self) -> list:
        """A forward-only pass of the model on this window's batches through Megatron's
        ``forward_backward_func``; returns its per-microbatch loss dicts (empty off the last
        pipeline stage). HDET calls it under ``torch.no_grad()`` with the model in eval mode.
        Collective over the pipeline (every stage calls it alike)."""
        if self._context is None or self._window is None:
            raise HDETSetupError("the HDET probe of megatron.training ran before new_window()")
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
        from megatron.core.utils import get_model_config
        from megatron.training.global_vars import get_args

        ctx = self._context
        args = get_args()
        readers = [None if s is None else _WindowBatches(self, i) for i, s in enumerate(self._streams)]
        data = readers if self._is_list else readers[0]
        # As megatron.training.training.evaluate: no result validation and no timers during a
        # forward-only pass (set_mode logs a warning: only when the mode changes).
        rerun = get_rerun_state_machine()
        mode = rerun.get_mode()
        if mode != RerunMode.DISABLED:
            rerun.set_mode(RerunMode.DISABLED)
        config = get_model_config(ctx["model"][0])
        timers = config.timers
        config.timers = None
        try:
            losses = ctx["forward_backward_func"](
                forward_step_func=ctx["forward_step_func"],
                data_iterator=data,
                model=ctx["model"],
                num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
                p2p_communicator=ctx["p2p_communicator"],
                pg_collection=ctx["pg_collection"],
            )
        finally:
            config.timers = timers
            if mode != RerunMode.DISABLED:
                rerun.set_mode(mode)
        self.calls += 1
        return losses
