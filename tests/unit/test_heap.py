"""The engine's process keeps the memory a forward frees and gives back what it
loaded once (cpu_engine/heap.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_engine.heap import release_free_heap, retain_freed_memory
from tools.soak import process_memory

# In a fresh process (no earlier test's thresholds): where glibc serves a 48 MiB block
# (a forward's activations are such blocks) and what it keeps once the block is freed,
# from mallinfo2: hblkhd, bytes in blocks mapped on their own (returned to the system
# on free, so their pages fault afresh next time); keepcost, the free top of the heap
# kept in the process.
_TAKE_AND_FREE = """
import ctypes, sys
from cpu_engine.heap import retain_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
if sys.argv[1] == "retain":
    assert retain_freed_memory()
block = libc.malloc(48 << 20)
mapped = libc.mallinfo2().hblkhd
libc.free(ctypes.c_void_p(block))
print(mapped >> 20, libc.mallinfo2().keepcost >> 20)
"""


def _mapped_and_kept_mib(mode: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", _TAKE_AND_FREE, mode], capture_output=True, text=True,
                          timeout=60, check=True, cwd=Path(__file__).resolve().parents[2])
    mapped, kept = done.stdout.split()
    return int(mapped), int(kept)


def test_a_forward_sized_block_comes_from_the_heap_and_stays_there_when_freed():
    if not retain_freed_memory():
        pytest.skip("not glibc: the C library's defaults stay")
    mapped, kept = _mapped_and_kept_mib("default")
    assert mapped >= 48 and kept < 48  # the premise: glibc's defaults map it apart and give it back
    mapped, kept = _mapped_and_kept_mib("retain")
    assert mapped < 48 and kept >= 48


def _rss_mib() -> float:
    return process_memory(os.getpid())[1] / 1024


def test_freed_heap_memory_goes_back_to_the_os():
    """What the engine does after loading: without the trim, glibc keeps the
    holes left by freed allocations resident."""
    blocks = [bytes(4000) + bytes([i % 256]) for i in range(60_000)]  # ~240 MB of heap blocks
    kept = blocks[::64]  # pins the heap so it cannot shrink from the top by itself
    del blocks
    before = _rss_mib()
    if not release_free_heap():
        pytest.skip("not glibc: nothing to trim")
    assert before - _rss_mib() > 50, "the freed blocks stayed resident"  # ~110 MB measured, 0 without the trim
    del kept  # alive until after the trim
