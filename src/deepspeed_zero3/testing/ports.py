"""Ports for the launches our tests and benchmarks start, and the shared memory those launches leave behind.

On the CPU accelerator, upstream DeepSpeed's TorchBackend builds its shm allreduce op, and every rank of
every launch creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (66 MB each with
deepspeed 0.19.8) and never unlinks it. /dev/shm is memory: a session of launches on fresh ports filled
24 GB of it, and the next test run was killed by the OOM killer (launcher exit 247) or lost its compiler
mid-build. So whoever picks a launch's port also removes that port's buffers once the launch has ended.
"""

import contextlib
import glob
import os
import socket

SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_allreduce_buffer"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shm_buffers(port="*", addr: str = "*") -> list:
    """Paths of DeepSpeed's shm allreduce buffers for launches on ``port`` (all ports by default) of this user."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_*")))


def release_shm_buffers(port, addr: str = "*") -> int:
    """Unlink the buffers a finished launch on ``port`` left; returns the bytes given back.

    Only for a launch that has ended: a rank still starting opens its peers' buffers by name.
    """
    freed = 0
    for path in shm_buffers(port, addr):
        size = _size(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        freed += size
    return freed


def _size(path: str) -> int:
    """Bytes of ``path``; 0 if it went away meanwhile (another launch's cleanup)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


class LaunchPort:
    """``with LaunchPort() as lp``: ``lp.port`` is free for one launch; when the block ends, however it ends,
    that port's shm buffers are released and ``lp.shm_freed`` holds the bytes given back."""

    def __init__(self):
        self.port = free_port()
        self.shm_freed = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shm_freed = release_shm_buffers(self.port)
        return False


def memory_hint() -> str:
    """One line for a failed launch's message: a rank killed with SIGKILL (launcher exit 247) is usually the
    OOM killer, and leftover shm buffers from other launches are the first thing to rule out."""
    leftovers = shm_buffers()
    held = sum(_size(path) for path in leftovers)
    available = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    line = f"memory: {len(leftovers)} DeepSpeed shm buffers in {SHM_DIR} hold {held / 2**30:.1f} GiB"
    if available is not None:
        line += f"; {available / 2**30:.1f} GiB available"
    if leftovers:
        line += f" (with no DeepSpeed job running: rm {os.path.join(SHM_DIR, SHM_PREFIX)}_*)"
    return line
