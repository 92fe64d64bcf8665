"""The launch-port helper gives back the /dev/shm buffers upstream's CPU allreduce leaves per launch port."""

import os

import pytest

from deepspeed_zero3.testing import ports


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "SHM_DIR", str(tmp_path))
    return tmp_path


def fake_buffer(shm_dir, port, rank, size=1000, addr="127.0.0.1"):
    path = shm_dir / f"{ports.SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"
    path.touch()
    os.truncate(path, size)  # sparse: the size is what is counted
    return path


def test_release_removes_only_that_ports_buffers(shm_dir):
    mine = [fake_buffer(shm_dir, 29511, rank) for rank in range(2)]
    other = fake_buffer(shm_dir, 29512, 0)
    prefix_of_mine = fake_buffer(shm_dir, 2951, 0)  # port 2951 is not port 29511

    assert ports.release_shm_buffers(29511) == 2000
    assert not any(path.exists() for path in mine)
    assert other.exists() and prefix_of_mine.exists()
    assert ports.release_shm_buffers(29511) == 0


def test_launch_port_releases_even_when_the_launch_raises(shm_dir):
    with pytest.raises(RuntimeError):
        with ports.LaunchPort() as launch:
            fake_buffer(shm_dir, launch.port, 0, size=10, addr="10.0.0.1")
            raise RuntimeError("launch failed")
    assert launch.shm_freed == 10
    assert ports.shm_buffers(launch.port) == []


def test_memory_hint_counts_leftovers_and_says_how_to_remove_them(shm_dir):
    assert ports.memory_hint().startswith("memory: 0 DeepSpeed shm buffers")
    fake_buffer(shm_dir, 29513, 0, size=2**29)
    fake_buffer(shm_dir, 29513, 1, size=2**29)
    hint = ports.memory_hint()
    assert hint.startswith(f"memory: 2 DeepSpeed shm buffers in {shm_dir} hold 1.0 GiB; ")
    assert hint.endswith(f"(with no DeepSpeed job running: rm {shm_dir}/{ports.SHM_PREFIX}_*)")
