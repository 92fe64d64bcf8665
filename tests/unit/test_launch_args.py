"""The benchmark and the soak refuse a --world the machine cannot launch, before launching anything."""

import argparse

import pytest

from deepspeed_zero3.bench.__main__ import check_world_fits


def test_cuda_world_larger_than_the_gpu_count_is_refused_with_what_to_use(capsys):
    parser = argparse.ArgumentParser(prog="bench")
    with pytest.raises(SystemExit) as info:
        check_world_fits(parser, 2, "cuda")  # this CPU machine has no GPU
    assert info.value.code == 2
    assert ("--world 2 needs 2 GPUs and this machine has 0: use --world 1 with a GPU, or DS_ACCELERATOR=cpu "
            "for CPU ranks") in capsys.readouterr().err


def test_cpu_ranks_are_not_limited_by_gpus():
    check_world_fits(argparse.ArgumentParser(), 4, "cpu")
