"""Parity scenarios: every scenario in one launcher run, results as JSON on rank 0.

Run under the DeepSpeed launcher, once with our runtime and once with upstream (DEEPSPEED_ZERO3=0):

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port P tests/parity/scenarios.py --out FILE --world 2

FILE gets {scenario: {"status": "ok"|"crash", "error": str, "losses": [float.hex()], "losses_by_rank": [[...]],
"params_sha256": str, "runtime": "overlay"|"upstream", ...}} plus a "_meta" entry naming the modules that ran; a
crash every rank raised at the same line also gets "where": "<exception type> at <file>:<line>".
tests/parity/test_parity.py compares the two files bitwise.

A crash in a scenario is recorded and the next scenario runs, unless the ranks disagree about it (one rank
crashed, another did not, or they crashed differently): then they may be out of step in the process group's
collectives, so the run stops there rather than risk a hang; the remaining scenarios are recorded as "skipped".
"""

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import deepspeed
from deepspeed.accelerator import get_accelerator
import deepspeed.runtime.zero.parameter_offload as parameter_offload
import deepspeed.runtime.zero.partitioned_param_coordinator as partitioned_param_coordinator

from deepspeed_zero3.testing.engines import (batch, inference_engine, mse_loss, token_batch, train_step,
                                             training_engine, zero3_config)
from deepspeed_zero3.testing.models import LeafBranches, ReadsAhead, ResidualMLPBlock, TinyGPT, model_b
from scenarios_differences import single_linear_root_memory_efficient, z3_leaf_root_no_grad_inputs
from scenarios_firstpass import capped_default_reuse
from scenarios_generation import (eval_then_load_weights_into_an_inference_engine, generate_default_keys, generate_half_cap, generate_ranks_stop_apart_default_keys, generate_then_load_checkpoint,
                                  generate_then_modify_in_gathered_parameters, generate_then_offload_states,
                                  generate_then_optimizer_step, generate_then_rebuild_engine,
                                  generate_with_a_second_engine_stepping)
from scenarios_lora import lora_checkpointing_nonreentrant, lora_checkpointing_reentrant
from scenarios_mics import mics_shard_2
from scenarios_moe import moe_expert_leaves_default_persistence, moe_leaf_block_default_persistence
from scenarios_nvme import nvme_param_offload
from scenarios_compile import (compile_aot_eager_llama, compile_aot_eager_llama_default_buckets, compile_aot_eager_mlp,
                               compile_aot_eager_mlp_default_buckets, compile_eager_llama,
                               compile_eager_llama_default_buckets, compile_eager_mlp,
                               compile_eager_mlp_default_buckets,
                               compile_inductor_llama, compile_inductor_llama_default_buckets, compile_inductor_mlp,
                               compile_inductor_mlp_default_buckets, deepcompile_eager_fallback)
from scenarios_granularity import (granularity_gpt_attention_leaves, granularity_gpt_block_leaves,
                                   granularity_gpt_none_qualifies, granularity_user_leaves_fast_sharding)

STEPS = 5
PREFETCH = dict(bucket=20_000, reuse=0)  # buckets small enough that Model B prefetches
UPSTREAM_DEFAULTS = dict(bucket=50_000_000, reuse=1_000_000_000)
SCENARIO_TIMEOUT_S = int(os.environ.get("ZERO3_PARITY_SCENARIO_TIMEOUT", "300"))
PG_TIMEOUT_S = int(os.environ.get("ZERO3_PARITY_PG_TIMEOUT", "120"))


def runtime_name() -> str:
    return "overlay" if "deepspeed_zero3" in (parameter_offload.__file__ or "") else "upstream"


def rank() -> int:
    return torch.distributed.get_rank()


class Run:
    """What one scenario records; it also owns the scenario's engines so they are destroyed even after a crash."""

    def __init__(self):
        self.losses = []
        self.engines = []
        self.extra = {}
        self.params_sha256 = None

    def engine(self, engine):
        self.engines.append(engine)
        return engine

    def release_lacks(self, reason: str):
        """Stop the scenario: the installed deepspeed release cannot run it, under either runtime. Recorded, and the
        parity test skips it naming ``reason`` (in CI too: no install step can add it)."""
        self.extra["release_lacks"] = reason
        raise RuntimeError(f"this deepspeed release {reason}")

    def loss(self, value: float):
        self.losses.append(float(value).hex())

    def hash_params(self, model, key="params_sha256"):
        """sha256 over every parameter's full value, in named order; every rank takes part in the gather."""
        named = list(model.named_parameters())
        digest = hashlib.sha256()
        for name, p in named:
            # One parameter per gather: before 0.19.8, upstream's GatheredParameters over several parameters waits
            # only for the last of its gloo all-gathers, so the others could still be arriving here.
            with deepspeed.zero.GatheredParameters([p]):
                value = p.detach().to("cpu", copy=True).contiguous()
            digest.update(name.encode())
            digest.update(str(tuple(value.shape)).encode())
            digest.update(str(value.dtype).encode())
            # numpy has no bfloat16: hash its bytes
            raw = value.view(torch.uint8) if value.dtype == torch.bfloat16 else value
            digest.update(raw.numpy().tobytes())
        if key == "params_sha256":
            self.params_sha256 = digest.hexdigest()
        else:
            self.extra[key] = digest.hexdigest()

    def destroy(self):
        while self.engines:
            engine = self.engines.pop()
            try:
                engine.destroy()
            except Exception:  # already crashed; the scenario's error is what gets recorded
                traceback.print_exc()


def x(step: int, shape=(4, 16)):
    return batch(step, rank(), shape=shape)


def eval_loss(engine, step: int) -> float:
    with torch.no_grad():
        return mse_loss(engine(x(step))).item()


# ---------------------------------------------------------------------------------------------- scenarios


def plain_mlp(run: Run, args):
    torch.manual_seed(1)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def default_buckets(run: Run, args):
    """Model B under upstream's default bucket size and reuse distance."""
    torch.manual_seed(2)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**UPSTREAM_DEFAULTS)))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step)))
        run.loss(eval_loss(engine, 100 + step))
    run.hash_params(model)


def frozen_eval_submodules(run: Run, args):
    """The input layer and the first two blocks frozen and kept in eval mode while the rest trains."""
    torch.manual_seed(3)
    model = model_b()
    frozen = [model.inp, model.blocks[0], model.blocks[1]]
    for module in frozen:
        module.requires_grad_(False)
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        engine.train()
        for module in frozen:
            module.eval()
        assert not any(m.training for f in frozen for m in f.modules())
        assert model.head.training
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def whole_model_eval(run: Run, args):
    """Training steps (backward included) through a model that is in eval mode throughout."""
    torch.manual_seed(4)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    engine.eval()
    for step in range(STEPS):
        assert not model.training
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def alternate_train_eval(run: Run, engine) -> None:
    """STEPS times: a training step, then a no-grad eval forward; both losses recorded."""
    for step in range(STEPS):
        engine.train()
        run.loss(train_step(engine, x(step)))
        engine.eval()
        run.loss(eval_loss(engine, 100 + step))


def train_eval_alternation(run: Run, args):
    """Train step, no-grad eval forward, repeated; a last train step (see gathered_after_eval_forward)."""
    torch.manual_seed(5)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    alternate_train_eval(run, engine)
    engine.train()
    run.loss(train_step(engine, x(STEPS)))
    run.hash_params(model)


def gathered_after_eval_forward(run: Run, args):
    """GatheredParameters over the whole model right after a no-grad eval forward that followed training.

    Upstream 0.19.8 leaves prefetched parameters in flight after such an eval forward, and partitioning them
    at the end of GatheredParameters asserts ("Cannot partition a param in flight").
    """
    torch.manual_seed(17)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    alternate_train_eval(run, engine)
    run.hash_params(model)


def training_only_branch(run: Run, args):
    """Model B with a Linear that runs only in training mode, alternating with no-grad eval forwards."""
    torch.manual_seed(6)
    model = model_b(training_branch=True)
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    alternate_train_eval(run, engine)
    run.hash_params(model)


class CheckpointedMLP(nn.Module):
    """Model B's blocks each under torch.utils.checkpoint; blocks 1 and 3 frozen."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.inner = model_b()
        self.use_reentrant = use_reentrant
        for index in (1, 3):
            self.inner.blocks[index].requires_grad_(False)

    def forward(self, inp):
        h = self.inner.inp(inp)
        for block in self.inner.blocks:
            h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.inner.head(h)


def _activation_checkpointing(run: Run, use_reentrant: bool, seed: int):
    torch.manual_seed(seed)
    model = CheckpointedMLP(use_reentrant)
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def activation_checkpointing_frozen(run: Run, args):
    _activation_checkpointing(run, use_reentrant=True, seed=7)


def activation_checkpointing_frozen_nonreentrant(run: Run, args):
    _activation_checkpointing(run, use_reentrant=False, seed=8)


def activation_checkpointing_no_early_stop(run: Run, args):
    """Non-reentrant checkpointing with torch's early stop off: every recompute runs its block to the end."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _activation_checkpointing(run, use_reentrant=False, seed=18)


def zero_init(run: Run, args):
    config = zero3_config(**PREFETCH)
    torch.manual_seed(9)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_b()
    engine = run.engine(training_engine(model, config))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def tied_weights(run: Run, args):
    """TinyGPT with the LM head's weight tied to the token embedding."""
    torch.manual_seed(10)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2)
    model.lm_head.weight = model.tok.weight
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        tokens, targets = token_batch(step, rank(), vocab=64)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        run.loss(loss.item())
    run.extra["tied"] = model.lm_head.weight is model.tok.weight
    run.hash_params(model)


def z3_leaf_modules(run: Run, args):
    torch.manual_seed(11)
    model = model_b()
    leaves = deepspeed.utils.set_z3_leaf_modules(model, [ResidualMLPBlock])
    assert len(leaves) == len(model.blocks)
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    alternate_train_eval(run, engine)
    engine.train()
    run.loss(train_step(engine, x(STEPS)))
    run.hash_params(model)


def z3_leaf_container_user_backward(run: Run, args):
    """A ModuleList made a z3 leaf, loss.backward() without engine.backward, gradients accumulated over the
    micro-batches. No optimizer step: stage 3's zero_grad raises "unknown parameter type" for this model under
    both runtimes. Compared: losses and each parameter's full accumulated gradient."""
    torch.manual_seed(13)
    model = LeafBranches()
    deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.ModuleList])
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        loss = mse_loss(engine(x(step)))
        loss.backward()
        run.loss(loss.item())
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        grad = deepspeed.utils.safe_get_full_grad(param)
        digest.update(name.encode())
        digest.update(grad.detach().to("cpu").contiguous().numpy().tobytes())
    run.extra["same_grads_sha256"] = digest.hexdigest()
    run.hash_params(model)


def read_ahead_of_its_module(run: Run, args):
    """A parameter read (ZeROOrderedDict's getter) while a prefetch for its own module has it in flight
    ([Note: a parameter read while in flight])."""
    torch.manual_seed(14)
    model = ReadsAhead()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def grad_accumulation_2(run: Run, args):
    """gradient_accumulation_steps=2: backward and step every micro-batch, DeepSpeed finds the boundary."""
    torch.manual_seed(12)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(grad_accum=2, **PREFETCH)))
    for micro in range(2 * STEPS):
        run.loss(train_step(engine, x(micro)))
    assert engine.global_steps == STEPS, engine.global_steps
    run.hash_params(model)


def gathered_parameters_in_loop(run: Run, args):
    """Every other step rank 0 rewrites a weight inside GatheredParameters(modifier_rank=0)."""
    torch.manual_seed(13)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**PREFETCH)))
    for step in range(2 * STEPS):
        if step % 2 == 1:
            target = model.blocks[2].up.weight
            with deepspeed.zero.GatheredParameters(target, modifier_rank=0):
                if rank() == 0:
                    with torch.no_grad():
                        target.mul_(0.5).add_(0.01)
        run.loss(train_step(engine, x(step)))
    run.hash_params(model)


def checkpoint_round_trip(run: Run, args):
    """3 steps, save, 3 more (A); a fresh engine loads the checkpoint and runs the same 3 steps (B); A == B."""
    config = zero3_config(**PREFETCH)
    ckpt_dir = Path(args.out).resolve().parent / f"parity_ckpt_{runtime_name()}_w{args.world}"
    if rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    torch.distributed.barrier()

    torch.manual_seed(14)
    model = model_b()
    engine = run.engine(training_engine(model, config))
    for step in range(3):
        run.loss(train_step(engine, x(step)))
    engine.save_checkpoint(str(ckpt_dir), tag="step3")
    continued = [train_step(engine, x(step)) for step in range(3, 6)]
    run.hash_params(model, key="continued_params_sha256")

    torch.manual_seed(14)
    fresh = model_b()
    resumed_engine = run.engine(training_engine(fresh, config))
    load_path, _ = resumed_engine.load_checkpoint(str(ckpt_dir), tag="step3")
    assert load_path is not None, "load_checkpoint found no checkpoint"
    resumed = [train_step(resumed_engine, x(step)) for step in range(3, 6)]
    run.hash_params(fresh)

    for value in continued + resumed:
        run.loss(value)
    run.extra["losses_continued"] = [v.hex() for v in continued]
    run.extra["losses_resumed"] = [v.hex() for v in resumed]
    run.extra["resumed_equals_continued"] = (continued == resumed
                                            and run.params_sha256 == run.extra["continued_params_sha256"])
    assert run.extra["resumed_equals_continued"], (
        f"resumed run differs from the continued one: {continued} vs {resumed}, params "
        f"{run.extra['continued_params_sha256']} vs {run.params_sha256}")


class Uneven(nn.Module):
    """Parameters whose numel is not divisible by 4 (Linear(7, 13): 91 + 13, Linear(13, 5): 65 + 5)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, inp):
        return self.c(torch.relu(self.b(torch.relu(self.a(inp)))))


def uneven_world4(run: Run, args):
    torch.manual_seed(15)
    model = Uneven()
    engine = run.engine(training_engine(model, zero3_config(bucket=50, reuse=0)))
    for step in range(STEPS):
        run.loss(train_step(engine, x(step, shape=(4, 7))))
        run.loss(eval_loss_shape(engine, 100 + step, (4, 7)))
    # Not ending on an eval forward: see gathered_after_eval_forward.
    run.loss(train_step(engine, x(STEPS, shape=(4, 7))))
    run.hash_params(model)


def eval_loss_shape(engine, step, shape):
    with torch.no_grad():
        return mse_loss(engine(x(step, shape=shape))).item()


def inference_only(run: Run, args):
    """An engine without optimizer (DeepSpeedZeRoOffload) over Model B, eval forwards only."""
    torch.manual_seed(16)
    model = model_b()
    engine = run.engine(inference_engine(model, zero3_config(**PREFETCH)))
    engine.eval()
    for step in range(STEPS):
        run.loss(eval_loss(engine, step))
    run.hash_params(model)


SCENARIOS = {
    2: [
        plain_mlp,
        default_buckets,
        frozen_eval_submodules,
        whole_model_eval,
        train_eval_alternation,
        gathered_after_eval_forward,
        training_only_branch,
        activation_checkpointing_frozen,
        activation_checkpointing_frozen_nonreentrant,
        activation_checkpointing_no_early_stop,
        lora_checkpointing_nonreentrant,
        lora_checkpointing_reentrant,
        zero_init,
        tied_weights,
        z3_leaf_modules,
        z3_leaf_container_user_backward,
        read_ahead_of_its_module,
        grad_accumulation_2,
        gathered_parameters_in_loop,
        checkpoint_round_trip,
        inference_only,
        capped_default_reuse,
        generate_default_keys,
        generate_half_cap,
        generate_ranks_stop_apart_default_keys,
        generate_then_optimizer_step,
        generate_then_load_checkpoint,
        generate_then_modify_in_gathered_parameters,
        generate_then_offload_states,
        generate_then_rebuild_engine,
        generate_with_a_second_engine_stepping,
        eval_then_load_weights_into_an_inference_engine,
        z3_leaf_root_no_grad_inputs,
        single_linear_root_memory_efficient,
        nvme_param_offload,
        compile_eager_mlp,
        compile_eager_mlp_default_buckets,
        compile_aot_eager_mlp,
        compile_aot_eager_mlp_default_buckets,
        compile_inductor_mlp,
        compile_inductor_mlp_default_buckets,
        compile_eager_llama,
        compile_eager_llama_default_buckets,
        compile_aot_eager_llama,
        compile_aot_eager_llama_default_buckets,
        compile_inductor_llama,
        compile_inductor_llama_default_buckets,
        deepcompile_eager_fallback,
        granularity_gpt_none_qualifies,
        granularity_gpt_attention_leaves,
        granularity_gpt_block_leaves,
        granularity_user_leaves_fast_sharding,
        moe_leaf_block_default_persistence,
        moe_expert_leaves_default_persistence,
        mics_shard_2,  # last: on the CPU it stops in a collective (scenarios_mics.py)
    ],
    4: [plain_mlp, uneven_world4, mics_shard_2],
}

# ---------------------------------------------------------------------------------------------- driver


def write(path: Path, results: dict):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--only", default=None, help="comma-separated scenario names (debugging)")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank=N

    torch.set_num_threads(1)
    accelerator = get_accelerator()
    backend = accelerator.communication_backend_name()  # gloo on the CPU accelerator (ccl with oneCCL), nccl on CUDA
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    if accelerator.device_name() == "cuda":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = torch.distributed.get_world_size()
    assert world == args.world, f"launched with {world} ranks, --world {args.world}"
    # Crash agreement goes through its own group, so it never pairs with a collective a rank left half done.
    status_group = torch.distributed.new_group(backend="gloo",
                                               timeout=datetime.timedelta(seconds=2 * PG_TIMEOUT_S + 30))

    out = Path(args.out)
    scenarios = SCENARIOS[args.world]
    if args.only:
        wanted = set(args.only.split(","))
        scenarios = [s for s in scenarios if s.__name__ in wanted]
    results = {
        "_meta": {
            "runtime": runtime_name(),
            "parameter_offload": parameter_offload.__file__,
            "partitioned_param_coordinator": partitioned_param_coordinator.__file__,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "world": world,
            "backend": backend,
        }
    }
    stopped = None
    for scenario in scenarios:
        name = scenario.__name__
        if stopped is not None:
            results[name] = {"status": "skipped", "error": f"not run: ranks out of step after {stopped}",
                             "runtime": runtime_name()}
            continue
        start = time.time()
        run = Run()
        faulthandler.dump_traceback_later(SCENARIO_TIMEOUT_S, exit=True)
        error, where = None, None
        try:
            scenario(run, args)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            last = traceback.extract_tb(exc.__traceback__)[-1]
            # Ranks agree on a crash when they raise the same type at the same line (messages may hold
            # rank-local values); the path with "/" whatever the OS, as test_parity reads it.
            where = f"{type(exc).__name__} at {last.filename.replace(os.sep, '/')}:{last.lineno}"
            sys.stderr.write(f"[rank {rank()}] scenario {name} crashed:\n{traceback.format_exc()}\n")
        finally:
            run.destroy()
        record = {"status": "ok" if error is None else "crash", "error": error, "losses": run.losses,
                  "params_sha256": run.params_sha256, "runtime": runtime_name(), **run.extra}
        try:
            per_rank = [None] * world
            torch.distributed.all_gather_object(per_rank, (error, where, run.losses), group=status_group)
        except Exception as exc:
            per_rank = None
            record.update(status="crash", error=f"{error}; rank agreement failed: {type(exc).__name__}: {exc}")
        faulthandler.cancel_dump_traceback_later()
        if per_rank is None:
            stopped = name
        else:
            errors = [e for e, _, _ in per_rank]
            wheres = [w for _, w, _ in per_rank]
            record["losses_by_rank"] = [losses for _, _, losses in per_rank]
            if any(e is not None for e in errors):
                record["status"] = "crash"
                crashed = next(e for e in errors if e is not None)
                if len(set(wheres)) == 1:
                    record["error"], record["where"] = crashed, wheres[0]
                else:  # ranks crashed at different places, or not all: they may be out of step
                    record["error"] = "ranks disagree: " + "; ".join(
                        f"rank {r}: " + (f"{w}: {e[:300]}" if e else "no crash")
                        for r, (e, w) in enumerate(zip(errors, wheres)))
                    stopped = name
        record["seconds"] = round(time.time() - start, 2)
        results[name] = record
        if rank() == 0:
            print(f"[parity {runtime_name()} w{world}] {name}: {record['status']} {record['seconds']}s"
                  + (f" ({record['error']})" if record["error"] else ""), flush=True)
            write(out, results)
    finish(out, results, barrier=stopped is None)


def finish(out: Path, results: dict, barrier: bool = True, status: int = 0):
    """Rank 0 writes the results (after every rank is done, unless a rank is known stopped); the process ends.

    ``os._exit``: a crashed scenario's leftovers must not hold the process, and a failing rank must leave at once
    so the launcher stops the others instead of leaving them waiting in a collective.
    """
    if barrier:
        torch.distributed.barrier()
    if rank() == 0:
        write(out, results)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
