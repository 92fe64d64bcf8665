"""One side of the checkpoint cross-loading test: save a ZeRO-3 checkpoint and/or resume from the other side's.

Run under the DeepSpeed launcher, with our runtime or upstream's (DEEPSPEED_ZERO3=0):

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port P tests/parity/checkpoint_cross.py --out FILE \
        [--load DIR] [--save DIR [--then-continue]]

* ``--load DIR``: a fresh engine loads tag "step3" from DIR and trains steps 3..5 ("resumed").
* ``--save DIR``: a fresh engine trains steps 0..2 ("trained") and saves tag "step3" to DIR; with
  ``--then-continue`` the same engine trains steps 3..5 ("continued", the uninterrupted reference).

Each part records the losses of every rank (float.hex) and a sha256 of the final full parameters; rank 0
writes them to FILE with the modules that ran. tests/parity/test_checkpoint_cross.py compares the launches.
"""

import argparse
import datetime
import faulthandler
import os
import sys
import traceback
from pathlib import Path

import torch

import deepspeed
import deepspeed.runtime.zero.parameter_offload as parameter_offload
import deepspeed.runtime.zero.partitioned_param_coordinator as partitioned_param_coordinator

from deepspeed_zero3.testing.engines import train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b
from scenarios import PREFETCH, Run, finish, runtime_name, write, x

TAG = "step3"
SAVE_AT = 3  # steps trained before the checkpoint; as many follow it
SEED = 21
# The loading engine starts from other weights than the saved run did: equal results then prove the load.
LOAD_SEED = 22
RANK_TIMEOUT_S = int(os.environ.get("ZERO3_CKPT_CROSS_RANK_TIMEOUT", "150"))
PG_TIMEOUT_S = 60


def record(run: Run) -> dict:
    """The part's losses of every rank (each rank trains on its own batches) and its parameter hash."""
    by_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(by_rank, run.losses)
    return {"losses_by_rank": by_rank, "params_sha256": run.params_sha256}


def resume(ckpt_dir: str) -> dict:
    run = Run()
    try:
        torch.manual_seed(LOAD_SEED)
        model = model_b()
        engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
        load_path, _ = engine.load_checkpoint(ckpt_dir, tag=TAG)
        assert load_path is not None, f"load_checkpoint found no checkpoint {TAG} in {ckpt_dir}"
        for step in range(SAVE_AT, 2 * SAVE_AT):
            run.loss(train_step(engine, x(step)))
        run.hash_params(model)
        return record(run)
    finally:
        run.destroy()


def train_and_save(ckpt_dir: str, then_continue: bool) -> dict:
    parts = {}
    run = Run()
    try:
        torch.manual_seed(SEED)
        model = model_b()
        engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
        for step in range(SAVE_AT):
            run.loss(train_step(engine, x(step)))
        engine.save_checkpoint(ckpt_dir, tag=TAG)
        run.hash_params(model)
        parts["trained"] = record(run)
        if then_continue:
            run.losses = []
            for step in range(SAVE_AT, 2 * SAVE_AT):
                run.loss(train_step(engine, x(step)))
            run.hash_params(model)
            parts["continued"] = record(run)
        return parts
    finally:
        run.destroy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--then-continue", action="store_true")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank=N

    torch.set_num_threads(1)
    # A rank stuck in a collective dumps its stacks and exits instead of holding the launch until pytest's limit.
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    results = {
        "runtime": runtime_name(),
        "parameter_offload": parameter_offload.__file__,
        "parameter_offload_name": parameter_offload.__name__,
        "partitioned_param_coordinator": partitioned_param_coordinator.__file__,
        "deepspeed": deepspeed.__version__,
        "world": torch.distributed.get_world_size(),
    }
    out = Path(args.out)
    rank = torch.distributed.get_rank()
    try:
        # Loading first: launch 2 resumes from ours before it saves its own.
        if args.load:
            results["resumed"] = resume(args.load)
        if rank == 0:
            write(out, results)
        if args.save:
            results.update(train_and_save(args.save, args.then_continue))
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        sys.stderr.write(f"[rank {rank}] checkpoint_cross failed:\n{traceback.format_exc()}\n")
        finish(out, results, barrier=False, status=1)
    finish(out, results)


if __name__ == "__main__":
    main()
