"""Keep the memory a forward frees in the process, for the next forward.

glibc's malloc serves a block above its mmap threshold (128 KiB at first,
raised as such blocks are freed, to 32 MiB at most) with a fresh mapping, and
gives a heap's free top back to the system past its trim threshold. A
forward's activations are such blocks, so every forward's pages were new and
each first touch faulted: on a 2-vCPU Intel Xeon (AMX) one bf16
``transformers`` forward of the 1.5B target over a 2,150-token prompt took
0.3-1.1 million minor faults and 3.6-4.4 s; with both thresholds raised, under
30 thousand faults and 3.2-3.4 s. The engine's own prefill pays the same.

The cost: freed memory up to ``RETAINED_BYTES`` stays with the process (its
resident size stays near its peak), which an engine that runs the same
forwards all day reuses anyway. What a process freed once and will not need
again (the loader's buffers, a benchmark's finished models) goes back with
``release_free_heap``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

log = logging.getLogger(__name__)

RETAINED_BYTES = 1 << 30  # above any one tensor of a forward here (the largest: ~40 MiB)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Raise this process's malloc thresholds to ``RETAINED_BYTES`` (once); False
    where the C library is not glibc (nothing changed)."""
    global _applied
    if _applied is None:
        _applied = _mallopt(_M_MMAP_THRESHOLD, RETAINED_BYTES) and _mallopt(_M_TRIM_THRESHOLD, RETAINED_BYTES)
        log.info("heap: freed memory %s", "kept up to %d MiB" % (RETAINED_BYTES >> 20) if _applied
                 else "left to the C library's defaults (no glibc mallopt)")
    return _applied


def release_free_heap() -> bool:
    """Give the heap memory freed while loading (checkpoint buffers, the
    quantization's temporaries) back to the OS. glibc keeps freed pages
    resident: without this an engine started up to a GB larger than it needed
    to, and that slack hid its later growth from RSS. False outside glibc."""
    gc.collect()
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim") and bool(libc.malloc_trim(0))


def _mallopt(parameter: int, value: int) -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) == 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
