"""Several engines over one module share its parameter state (issue: model-keyed registry).

Upstream 0.19.8, measured: scenario 1 dies with `IndexError: pop from an empty deque`, the
Lightning fresh-wrapper pattern with `AssertionError ... 'status': 'INFLIGHT'`.
"""

import gc
import weakref

import psutil
import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.runtime.zero.param_registry import find_registry
from deepspeed_zero3.testing.engines import (batch, inference_engine, train_step, training_engine,
                                             zero3_config)
from deepspeed_zero3.testing.models import Wrapper, model_b

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def zero_hooks(model):
    registry = find_registry(model)
    return 0 if registry is None else registry.hook_count()


def hooks_per_model(model):
    """One set: four hooks per module of the model; the root hooks sit on the (dropped) wrappers."""
    return 4 * len(list(model.modules()))


def torch_hooks(model):
    """ZeRO-3 hooks found on the modules themselves (not the registry's view): bound to a HookRouter."""
    hooks = [getattr(hook, "_torchdynamo_orig_callable", hook)  # unwrap torch.compiler.disable
             for m in model.modules() for hook in list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values())]
    return sum(1 for hook in hooks if type(getattr(hook, "__self__", None)).__name__ == "HookRouter")


def all_partitioned(model):
    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())


def rank():
    return torch.distributed.get_rank()


def reference_losses(steps, config):
    torch.manual_seed(0)
    engine = training_engine(model_b(), config)
    losses = [train_step(engine, batch(s, rank())) for s in range(steps)]
    engine.destroy()
    return losses


CONFIG = zero3_config(bucket=20_000, reuse=0)


def test_inference_engine_then_training_engine_then_both():
    expected = reference_losses(6, CONFIG)
    torch.manual_seed(0)
    model = model_b()
    a = inference_engine(model, CONFIG)
    with torch.no_grad():
        a(batch(100, rank()))
    b = training_engine(model, CONFIG)
    losses = [train_step(b, batch(s, rank())) for s in range(3)]
    with torch.no_grad():
        a(batch(101, rank()))
    losses += [train_step(b, batch(s, rank())) for s in range(3, 6)]
    assert losses == expected  # the inference forwards change nothing
    assert find_registry(model) is find_registry(b.module)
    b.destroy()
    a.destroy()


@pytest.mark.world_size(2, 4)
def test_lightning_fresh_wrapper_validate_fit_repeated():
    # Reference: the same fits (a fresh optimizer each round, as Lightning builds) without validation engines.
    torch.manual_seed(0)
    reference_model = model_b()
    expected = []
    for round_ in range(2):
        engine = training_engine(Wrapper(reference_model), CONFIG)
        expected += [train_step(engine, batch(s, rank())) for s in range(2 * round_, 2 * round_ + 2)]
        engine.destroy()
    torch.manual_seed(0)
    model = model_b()
    losses = []
    for round_ in range(2):
        validator = inference_engine(Wrapper(model), CONFIG)
        with torch.no_grad():
            validator(batch(200 + round_, rank()))
        trainer = training_engine(Wrapper(model), CONFIG)
        losses += [train_step(trainer, batch(s, rank())) for s in range(2 * round_, 2 * round_ + 2)]
        # Lightning destroys neither engine explicitly; they are dropped.
        del validator, trainer
        gc.collect()
    assert losses == expected
    # Dropped inference engines are collected (weak ownership). Upstream's stage 3 optimizer pins itself
    # into the parameters' attributes, so dropped training engines live on until destroy(); whatever
    # the number of engines, the model carries one set of hooks.
    registry = find_registry(model)
    owners = registry.live_owners()
    assert 1 <= len(owners) <= 2
    assert all(type(o.module).__name__ == "Wrapper" and o.__class__.__name__ == "DeepSpeedZeRoOffload" for o in owners)
    assert zero_hooks(model) == hooks_per_model(model) + 6 * len(owners)  # + each live wrapper: 4 module + 2 root hooks
    for owner in owners:
        owner.destroy()
    assert zero_hooks(model) == 0 and all_partitioned(model)


def test_training_and_inference_engine_alternate_20_steps():
    expected = reference_losses(20, CONFIG)
    torch.manual_seed(0)
    model = model_b()
    trainer = training_engine(model, CONFIG)
    evaluator = inference_engine(model, CONFIG)
    losses = []
    for step in range(20):
        losses.append(train_step(trainer, batch(step, rank())))
        with torch.no_grad():
            evaluator(batch(500 + step, rank()))
    assert losses == expected
    later = deepspeed_zero3.get_zero3_stats(trainer)["passes"][-6:]
    assert all(p["demand_numel"] == 0 and p["trace_records"] == 0 for p in later), later
    evaluator.destroy()
    trainer.destroy()


def test_two_models_keep_separate_state():
    torch.manual_seed(0)
    actor_model, reference_model = model_b(), model_b()
    actor = training_engine(actor_model, CONFIG)
    reference = inference_engine(reference_model, CONFIG)
    assert find_registry(actor_model) is not find_registry(reference_model)
    for step in range(3):
        with torch.no_grad():
            reference(batch(step, rank()))
        train_step(actor, batch(step, rank()))
    actor_passes = deepspeed_zero3.get_zero3_stats(actor)["passes"]
    reference_passes = deepspeed_zero3.get_zero3_stats(reference)["passes"]
    assert [p["kind"] for p in reference_passes] == ["eval_forward"] * 3
    assert [p["kind"] for p in actor_passes] == ["forward", "backward"] * 3
    assert all(p["allgather_numel"] == 199_876 for p in reference_passes)
    actor.destroy()
    reference.destroy()


def test_destroy_semantics_and_rebuild():
    torch.manual_seed(0)
    model = model_b()
    before = torch_hooks(model)
    a = inference_engine(model, CONFIG)
    b = training_engine(model, CONFIG)
    hooks_with_two = zero_hooks(model)
    assert before == 0
    assert hooks_with_two == torch_hooks(model) == hooks_per_model(model) + 2  # one set, not one per engine
    a.destroy()
    assert zero_hooks(model) == hooks_with_two  # b still owns them
    train_step(b, batch(0, rank()))
    b.destroy()
    assert zero_hooks(model) == 0 and torch_hooks(model) == before
    assert all_partitioned(model)
    c = training_engine(model, CONFIG)
    assert train_step(c, batch(1, rank())) > 0
    c.destroy()


def test_no_double_work_with_two_engines():
    torch.manual_seed(0)
    single_model = model_b()
    single = training_engine(single_model, CONFIG)
    for step in range(3):
        train_step(single, batch(step, rank()))
    single_passes = deepspeed_zero3.get_zero3_stats(single)["passes"][-2:]
    single.destroy()

    torch.manual_seed(0)
    model = model_b()
    other = inference_engine(model, CONFIG)
    engine = training_engine(model, CONFIG)
    for step in range(3):
        train_step(engine, batch(step, rank()))
    double_passes = deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]
    for one, two in zip(single_passes, double_passes, strict=True):
        for key in ("allgather_calls", "allgather_numel", "demand_numel", "peak_live_numel"):
            assert one[key] == two[key], key
    other.destroy()
    engine.destroy()


def test_settings_rules_between_engines():
    torch.manual_seed(0)
    model = model_b()
    a = inference_engine(model, zero3_config(bucket=20_000, reuse=0))
    b = training_engine(model, zero3_config(bucket=0, reuse=0))
    # The most recently joined owner's prefetch settings apply ...
    assert find_registry(model).coordinator.settings.bucket_numel == 0
    b.destroy()
    # ... and when it leaves, the previous owner's come back.
    assert find_registry(model).coordinator.settings.bucket_numel == 20_000
    with pytest.raises(ValueError, match=r"stage3_param_persistence_threshold=0; the new engine asks for "
                       r"stage3_param_persistence_threshold=100"):
        training_engine(model, zero3_config(persistence=100))
    a.destroy()


def test_create_use_drop_cycles_stay_flat():
    torch.manual_seed(0)
    model = model_b()
    baseline_hooks = torch_hooks(model)
    one_engine_hooks = None
    rss = []
    for cycle in range(200):
        engine = inference_engine(Wrapper(model), CONFIG)
        with torch.no_grad():
            engine(batch(cycle, rank()))
        one_engine_hooks = one_engine_hooks or torch_hooks(model)
        last = weakref.ref(engine)
        del engine
        # An engine sits in reference cycles (upstream's closures hold it), so only the cyclic collector frees it,
        # and when that runs can differ between ranks: a rank whose old engine still lives joins its registry while
        # the other starts a new one. Seen on deepspeed 0.19.4 (rank 1 at pass 7 of a kept registry, rank 0 at
        # pass 0 of a new one: the order check fired). Dropped here means collected, on every rank alike.
        gc.collect()
        if cycle % 50 == 49:
            if last() is None:
                assert torch_hooks(model) == baseline_hooks, cycle
                assert find_registry(model) is None
            else:
                # deepspeed 0.19.4-0.19.6 keep the most recent engine alive (it goes when the next one is built;
                # measured, gone from 0.19.7): it alone may still own the registry, none before it.
                assert [type(o).__name__ for o in find_registry(model).live_owners()] == ["DeepSpeedZeRoOffload"]
                assert torch_hooks(model) == one_engine_hooks, cycle
            assert all_partitioned(model)
            rss.append(psutil.Process().memory_info().rss)
    # Flat after warm-up: the last 150 cycles may not grow the process by more than 20 MB
    # (the allocator keeps some slack; a leaked engine per cycle would be far more).
    growth = rss[-1] - rss[0]
    print(f"[rank {rank()}] RSS at cycles 50/100/150/200: {[r // 2**20 for r in rss]} MiB, growth {growth / 2**20:.1f} MiB")
    assert growth < 20 * 2**20, rss
