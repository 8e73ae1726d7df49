"""Decoupled BLS response streams, held until the Python backend's stub lets go of them.

The Python backend of Triton 2.51 (r24.10; python_backend before PR 390,
"Hold GIL when deleting numpy array", first in r25.01) frees a tensor's numpy
arrays wherever its last owner lets go, with or without the interpreter lock.
A decoupled BLS call's ``ResponseIterator`` has two owners: the Python object
the caller reads, and an entry in the stub's own map, which the stub's utils
thread erases once the final response has been read. When the caller drops
its object first, the erase frees the iterator, every response it read and
their tensors on that thread, without the lock, racing the allocator of every
thread that runs Python: a coordinator under load died of a segmentation fault
in libpython's allocator every few minutes.

Holding each finished stream until the utils thread has passed its erase makes
Python the last owner, so everything is freed under the lock. The utils thread
serves one queue in order, and a request's ``is_cancelled()`` goes through it
and waits for the answer: once such a question, asked after a stream was held,
comes back (False: a cancelled request answers from a cache, without the
queue), the erase queued when that stream's final response was read is done.
The coordinator asks after every round, so a stream is held for about one
round. Imports nothing from Triton: tested without it.
"""

from __future__ import annotations

import threading
from collections import deque


class HeldStreams:
    """Finished streams in the order they were held; ``mark`` and ``release_through``
    bracket a question that went through the stub's queue."""

    def __init__(self) -> None:
        self._held: deque[tuple[int, object]] = deque()
        self._count = 0
        self._lock = threading.Lock()

    def hold(self, stream: object) -> None:
        """Keep ``stream`` (read to its end, or abandoned) until a later mark is released."""
        with self._lock:
            self._count += 1
            self._held.append((self._count, stream))

    def mark(self) -> int:
        """Taken just before a question is queued: the streams held so far."""
        with self._lock:
            return self._count

    def release_through(self, mark: int) -> int:
        """The question asked after ``mark`` was answered: let go of the streams held
        up to it (dropped here, on the caller's thread, which runs Python and so holds
        the interpreter lock). Returns how many."""
        released = []
        with self._lock:
            while self._held and self._held[0][0] <= mark:
                released.append(self._held.popleft())
        count = len(released)
        released.clear()  # the last references go here, outside the lock
        return count

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
