"""The benchmark and the soak refuse a --world the machine cannot launch, before launching anything."""

import argparse

import pytest
import torch

from deepspeed_zero3.bench.__main__ import check_world_fits


@pytest.mark.parametrize("gpus,advice", [(0, "use --world 1 with a GPU"), (1, "use --world 1,")])
def test_cuda_world_larger_than_the_gpu_count_is_refused_with_what_to_use(capsys, monkeypatch, gpus, advice):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    parser = argparse.ArgumentParser(prog="bench")
    with pytest.raises(SystemExit) as info:
        check_world_fits(parser, 2, "cuda")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--world 2 needs 2 GPUs and this machine has {gpus}: {advice}" in err
    assert err.rstrip().endswith("or DS_ACCELERATOR=cpu for CPU ranks")


def test_cuda_world_within_the_gpu_count_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_world_fits(argparse.ArgumentParser(), 2, "cuda")


def test_cpu_ranks_are_not_limited_by_gpus():
    check_world_fits(argparse.ArgumentParser(), 4, "cpu")
