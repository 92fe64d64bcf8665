"""Giving the C allocator's retained free memory back to the system while a save streams the model.

[Note: the save's resident memory]
A save gathers the model bucket by bucket and frees each bucket once written. glibc's allocator keeps
freed blocks of that size in its heap (above its adaptive mmap threshold they come from the heap, not
from mmap), and small live objects between them keep the heap's top from shrinking: rank 0's resident
memory rose with the number of buckets, not with what it held (docs/benchmarks.md, "Rank 0's resident
memory during the save"). So the save trims the heap each time it has streamed
``min(max_shard_size, 64 MiB)`` since the last trim: the rise is then at most that interval + two
buckets + one tensor's staging copy on a GPU + a fixed overhead, whatever the model's size. A trim
costs a few milliseconds; at 64 MiB intervals a 10 GB save makes about 150. Where the C library has no
``malloc_trim`` (not glibc) nothing is done.
"""

import ctypes
import ctypes.util
from typing import Callable, Optional

TRIM_INTERVAL_CAP = 64 * 2**20


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        library = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return library.malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrim:
    """Counts the bytes a save streams and trims the heap each ``interval`` bytes ([Note: the save's resident
    memory])."""

    def __init__(self, interval: int, trim: Optional[Callable[[int], int]] = None):
        self.interval = max(1, interval)
        self.trim = trim if trim is not None else _malloc_trim()
        self.since = 0
        self.trims = 0

    def streamed(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since >= self.interval and self.trim is not None:
            self.trim(0)
            self.trims += 1
            self.since = 0
