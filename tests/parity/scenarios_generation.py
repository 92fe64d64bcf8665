"""Parity scenarios for generation under ZeRO-3 ([Note: keeping across no-grad passes]), both runtimes.

A tiny HF Llama generates with ``synced_gpus=True`` between training steps; what our runtime keeps gathered between
tokens must never be stale, so each scenario changes the parameters or their partitions in one of the ways a user
can between two ``generate()`` calls. Recorded: the losses, the generated tokens (``same_tokens``, compared
bitwise) and a hash of every parameter.

Self-contained: they use only the ``run`` object scenarios.py passes in.
"""

import os
import shutil
from pathlib import Path

import torch

import deepspeed

from deepspeed_zero3.testing.engines import inference_engine, token_batch, training_engine, zero3_config

DEFAULT_KEYS = dict(bucket=50_000_000, reuse=1_000_000_000)  # DeepSpeed's defaults (and live cap 1e9)
NEW_TOKENS = 6


def tiny_llama():
    """Two Llama layers from a config (never downloaded): 98,624 parameters, the largest 8,192."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _train(run, engine, step):
    tokens, _ = token_batch(step, _rank(), batch_size=2, seq=12)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    run.loss(loss.item())


def _generate(run, model, step):
    """Greedy generation on every rank (each its own prompt); the tokens of every rank are recorded."""
    prompt, _ = token_batch(200 + step, _rank(), batch_size=2, seq=5)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, synced_gpus=True, pad_token_id=0)
    tokens = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(tokens, out.tolist())
    run.extra.setdefault("same_tokens", []).append(tokens)
    run.loss(float(out.sum()))


def _engine(run, seed, **config):
    torch.manual_seed(seed)
    model = tiny_llama()
    engine = run.engine(training_engine(model, zero3_config(**config)))
    return model, engine


def generate_default_keys(run, args):
    """Train, generate, train, generate: at DeepSpeed's defaults ours gathers the model once per generate()."""
    model, engine = _engine(run, 31, **DEFAULT_KEYS)
    for step in range(2):
        _train(run, engine, step)
        _generate(run, model, step)
        _generate(run, model, 10 + step)  # a second generate() with nothing in between
    run.hash_params(model)


def generate_half_cap(run, args):
    """The same under a live-parameter cap of half the model: ours keeps the budget gathered between tokens."""
    model, engine = _engine(run, 32, bucket=2_000, reuse=1_000_000_000, max_live=49_312)
    for step in range(3):
        _train(run, engine, step)
        _generate(run, model, step)
    run.hash_params(model)


def generate_ranks_stop_apart_default_keys(run, args):
    """``synced_gpus=False`` with rank 0 stopping after 6 new tokens and rank 1 after 18, then a training step. At
    DeepSpeed's defaults the first token gathers the model and the later ones gather nothing, so both runtimes go on
    ([Note: ranks in different passes]: ours exchanges nothing for a pass that gathers nothing)."""
    model, engine = _engine(run, 33, **DEFAULT_KEYS)
    for step in range(2):
        _train(run, engine, step)
    new = 6 if _rank() == 0 else 18
    prompt, _ = token_batch(300, _rank(), batch_size=2, seq=5)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, synced_gpus=False,
                             pad_token_id=0)
    tokens = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(tokens, out.tolist())
    run.extra.setdefault("same_tokens", []).append(tokens)
    run.loss(float(out.sum()))
    for step in range(2, 4):
        _train(run, engine, step)
    run.hash_params(model)


def generate_then_optimizer_step(run, args):
    """A step through ``engine.optimizer.step()`` called directly between two generate() calls."""
    model, engine = _engine(run, 33, **DEFAULT_KEYS)
    _generate(run, model, 0)
    tokens, _ = token_batch(5, _rank(), batch_size=2, seq=12)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    run.loss(loss.item())
    _generate(run, model, 1)
    _train(run, engine, 6)
    _generate(run, model, 2)
    run.hash_params(model)


def generate_then_load_checkpoint(run, args):
    """Generate, save, train, generate, load the checkpoint back, generate: the last tokens are the first ones."""
    model, engine = _engine(run, 34, **DEFAULT_KEYS)
    ckpt_dir = Path(args.out).resolve().parent / f"parity_gen_ckpt_{os.environ.get('DEEPSPEED_ZERO3', '1')}_w{args.world}"
    if _rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    torch.distributed.barrier()
    _train(run, engine, 0)
    _generate(run, model, 0)
    engine.save_checkpoint(str(ckpt_dir), tag="saved")
    _train(run, engine, 1)
    _generate(run, model, 0)
    engine.load_checkpoint(str(ckpt_dir), tag="saved")
    _generate(run, model, 0)
    tokens = run.extra["same_tokens"]
    run.extra["same_reloaded_equals_saved"] = tokens[-1] == tokens[0]
    run.hash_params(model)
    torch.distributed.barrier()
    if _rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def generate_then_modify_in_gathered_parameters(run, args):
    """Rank 0 rewrites a weight inside GatheredParameters(modifier_rank=0) between two generate() calls."""
    model, engine = _engine(run, 35, **DEFAULT_KEYS)
    _train(run, engine, 0)
    _generate(run, model, 0)
    target = model.model.layers[0].mlp.up_proj.weight
    with deepspeed.zero.GatheredParameters(target, modifier_rank=0):
        if _rank() == 0:
            with torch.no_grad():
                target.mul_(0.5)
    _generate(run, model, 1)
    _train(run, engine, 1)
    _generate(run, model, 2)
    run.hash_params(model)


def generate_then_offload_states(run, args):
    """``engine.offload_states()`` then ``reload_states()`` between two generate() calls: the low-precision
    parameters and gradients (the optimizer states need DeepSpeed's FusedAdam, a CUDA op, under both runtimes)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    model, engine = _engine(run, 36, **DEFAULT_KEYS)
    _train(run, engine, 0)
    _generate(run, model, 0)
    try:
        engine.offload_states(include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads])
    except AssertionError as error:  # stage 3's own check, before any state moved
        if "Offloading is supported only for DeepSpeed FusedAdam" not in str(error):
            raise
        run.release_lacks("offloads no state without DeepSpeed's FusedAdam, a CUDA op (until 0.19.0)")
    engine.reload_states()
    _generate(run, model, 1)
    _train(run, engine, 1)
    _generate(run, model, 2)
    run.hash_params(model)


def generate_then_rebuild_engine(run, args):
    """``destroy()`` between two generate() calls, then a new engine over the same model trains it."""
    model, engine = _engine(run, 37, **DEFAULT_KEYS)
    _train(run, engine, 0)
    _generate(run, model, 0)
    engine.destroy()
    run.engines.remove(engine)
    engine = run.engine(training_engine(model, zero3_config(**DEFAULT_KEYS)))
    _generate(run, model, 1)
    _train(run, engine, 1)
    _generate(run, model, 2)
    run.hash_params(model)


def generate_with_a_second_engine_stepping(run, args):
    """An inference engine and a training engine over one model: generate through the first, step the second."""
    torch.manual_seed(38)
    model = tiny_llama()
    engine = run.engine(training_engine(model, zero3_config(**DEFAULT_KEYS)))
    run.engine(inference_engine(model, zero3_config(**DEFAULT_KEYS)))
    for step in range(3):
        _generate(run, model, step)
        _train(run, engine, step)
    _generate(run, model, 3)
    run.hash_params(model)


def eval_then_load_weights_into_an_inference_engine(run, args):
    """An inference engine keeps the model gathered between eval forwards (ours); upstream's loader
    (``load_module_state_dict(fetch_z3_params=True)``, as ``load_checkpoint(load_optimizer_states=False)`` calls it)
    gathers only partitioned parameters, then more eval forwards, the parameters released and used again."""
    from deepspeed_zero3.testing.engines import batch, inference_engine
    from deepspeed_zero3.testing.models import model_b

    torch.manual_seed(39)
    loaded = {name: value * 0.5 for name, value in model_b().state_dict().items()}
    plain = model_b()
    plain.load_state_dict(loaded)
    torch.manual_seed(40)
    model = model_b()
    engine = run.engine(inference_engine(model, zero3_config(**DEFAULT_KEYS)))
    with torch.no_grad():
        for step in range(3):
            run.loss(engine(batch(step, _rank())).square().mean().item())
        run.extra["losses_before_load"] = len(run.losses)
        engine.load_module_state_dict({"module": loaded}, fetch_z3_params=True)
        after_load = [engine(batch(step, _rank())).square().mean().item() for step in (3, 4)]
        for value in after_load:
            run.loss(value)
        engine.empty_partition_cache()
        run.loss(engine(batch(5, _rank())).square().mean().item())
        # Whether the load reached the model on every rank: the plain model under the same load, bitwise.
        # Before 0.19.8 upstream's loader (GatheredParameters over every parameter) waits only for the last gloo
        # all-gather, so under upstream a load can land in a buffer a gather is still filling.
        reached = torch.tensor([int(after_load == [plain(batch(s, _rank())).square().mean().item() for s in (3, 4)])])
    torch.distributed.all_reduce(reached, op=torch.distributed.ReduceOp.MIN)
    run.extra["load_reached_the_model"] = bool(reached.item())
    run.hash_params(model)
