"""[Note: the save's resident memory]: the heap is trimmed once per interval of streamed bytes, never more."""

from deepspeed_zero3.heap_trim import HeapTrim, _malloc_trim


def test_trims_once_per_interval():
    calls = []
    heap = HeapTrim(100, trim=calls.append)
    for nbytes in (40, 40, 40, 10, 99, 1, 250):
        heap.streamed(nbytes)
    # 120 (trim), then 10 + 99 = 109 (trim), then 1 + 250 (trim)
    assert calls == [0, 0, 0] and heap.trims == 3 and heap.since == 0


def test_without_malloc_trim_nothing_happens():
    heap = HeapTrim(1, trim=None)
    heap.trim = None
    heap.streamed(10)
    assert heap.trims == 0


def test_glibc_trim_is_found_and_runs():
    trim = _malloc_trim()
    if trim is not None:  # glibc: returns 1 if memory was released, 0 if not
        assert trim(0) in (0, 1)
