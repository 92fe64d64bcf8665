"""The benchmark and the soak refuse a --world the machine cannot launch, and the benchmark bad --layers and two
separate runs at once, before launching anything."""

import argparse

import pytest
import torch

from deepspeed_zero3.bench.__main__ import check_world_fits, parse_args


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


@pytest.mark.parametrize("layers", ["0", "48,-1", "x", ""])
def test_save_layers_must_be_positive_integers(capsys, layers):
    with pytest.raises(SystemExit) as info:
        parse_args(["--save", "--layers", layers])
    assert info.value.code == 2
    assert f"--layers {layers!r}: expected positive integers separated by commas, e.g. 48,96" in capsys.readouterr().err


def test_save_layers_are_read_in_order():
    assert parse_args(["--save", "--layers", "96,48", "--no-run"]).layers == [96, 48]


def test_save_and_sync_are_separate_runs(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--save", "--sync", "--no-run"])
    assert "--frontier, --generate, --export, --save, --sync and --planner are separate runs: pick one" in (
        capsys.readouterr().err)
