"""Background threads that keep batches ready: the one prefetcher of both training loaders
(:class:`gptspeed.data.loader.TokenLoader`, several threads over memory-mapped shards;
:class:`gptspeed.data.stream.StreamLoader`, one thread over a tokenized stream).

Each thread runs one *source* (an iterator of batches) into its own bounded queue, and the
consumer takes from the queues in turn, so the order of batches is the sources' round-robin order
whatever the threads' timing. An exception raised by a source is handed to the consumer and raised
there. Numpy slicing, ``astype`` and ``pin_memory`` release the GIL, so the threads overlap the
training step. (A ``torch.utils.data.DataLoader`` with worker processes would copy each batch
between processes, and its position is not resumable without torchdata's ``StatefulDataLoader``;
the loaders' own state counts consumed batches, which is all an exact resume needs.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any


def put_until_stopped(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` into a bounded queue, waiting for room, unless ``stop`` is set meanwhile.
    Returns True if it was put. (A plain blocking put would never notice ``stop``.)"""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class Prefetcher:
    """``sources[k]`` run in thread ``k``, up to ``depth`` items ahead each; :meth:`get` returns
    the next item in round-robin order (source 0, 1, ..., 0, ...) or raises what its source raised
    (a source that ends raises RuntimeError at the consumer: the loaders' sources never end).
    :meth:`close` stops the threads; the items they made ahead are dropped."""

    def __init__(self, sources: list[Iterator[Any]], depth: int, name: str):
        self._stop = threading.Event()
        self._queues: list[queue.Queue] = [queue.Queue(max(1, depth)) for _ in sources]
        self._next = 0
        self._threads = [
            threading.Thread(target=self._run, args=(src, q), name=f"{name}-{k}", daemon=True)
            for k, (src, q) in enumerate(zip(sources, self._queues))
        ]
        for t in self._threads:
            t.start()

    def _run(self, source: Iterator[Any], q: queue.Queue) -> None:
        try:
            for item in source:
                if not put_until_stopped(q, item, self._stop):
                    return
            item = RuntimeError("a prefetch source ended")
        except BaseException as e:  # handed to get(), raised there
            item = e
        put_until_stopped(q, item, self._stop)

    def get(self) -> Any:
        item = self._queues[self._next].get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._next = (self._next + 1) % len(self._queues)
        return item

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout)
