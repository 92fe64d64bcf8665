"""Parity scenarios for ``stage3_module_granularity_threshold`` (leaf_granularity.py), run by scenarios.py.

Granularity values of the models used (see [Note: module granularity]):
  TinyGPT(vocab=512, dim=32, heads=2, layers=2): attn 1408, block 1588, root 2870 (containers, childless
  modules: never). Threshold 1407: none; 1408..1587: the two attns; 1588..2869: the two blocks; from 2870 the
  root, which is left out (upstream is not bitwise reproducible there).
  Model B: blocks 11029, root 9517, so its smallest is the root's: 9516 selects nothing.

Besides losses and parameters, each scenario records (keys compared by test_parity.py as ``same_*``) which
modules became leaves, every module's ds_id and granularity, and what a released leaf parameter's data is
in the middle of a forward (fast sharding's placeholder).
"""

import torch

import deepspeed
from deepspeed.utils import z3_leaf_module

from deepspeed_zero3.testing.engines import batch, mse_loss, token_batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import ResidualMLPBlock, TinyGPT, model_b

STEPS = 5
PREFETCH = dict(bucket=20_000, reuse=0)
VOCAB = 512


def rank() -> int:
    return torch.distributed.get_rank()


def gpt():
    return TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=2)


def config(threshold: int) -> dict:
    return zero3_config(stage3_module_granularity_threshold=threshold, **PREFETCH)


def record_tree(run, model):
    names = list(model.named_modules())
    run.extra["same_leaves"] = [name for name, m in names if z3_leaf_module(m)]
    # Relative to the root's: upstream's numbering goes on counting from the previous engine in the process
    # (a mutable default argument), ours starts at 0 per module tree.
    root = model.ds_id
    run.extra["same_ds_ids"] = {name: getattr(m, "ds_id", root - 1) - root for name, m in names}
    run.extra["same_granularity"] = {name: getattr(m, "ds_model_granularity", None) for name, m in names}


def watch_released(run, watched_module, param):
    """From ``watched_module``'s forward, note the data shape and dtype of ``param`` when it is not gathered.

    Whether it is gathered at that point is prefetch policy, which differs from upstream's by design.
    """
    seen = run.extra.setdefault("same_released_data", [])

    def hook(module, args, output):
        entry = [list(param.data.shape), str(param.data.dtype)]
        if param.ds_status.name != "AVAILABLE" and entry not in seen:
            seen.append(entry)

    return watched_module.register_forward_hook(hook)


def gpt_steps(run, engine, eval_too: bool):
    for step in range(STEPS):
        engine.train()
        tokens, targets = token_batch(step, rank(), vocab=VOCAB)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        run.loss(loss.item())
        if eval_too:
            engine.eval()
            with torch.no_grad():
                tokens, targets = token_batch(100 + step, rank(), vocab=VOCAB)
                run.loss(engine(tokens, targets).item())
    engine.train()


def _gpt_threshold(run, threshold: int, seed: int, eval_too: bool = False):
    torch.manual_seed(seed)
    model = gpt()
    engine = run.engine(training_engine(model, config(threshold)))
    record_tree(run, model)
    handle = watch_released(run, model.lm_head, model.blocks[0].attn.qkv.weight)
    gpt_steps(run, engine, eval_too)
    handle.remove()
    run.hash_params(model)


def granularity_gpt_none_qualifies(run, args):
    """Threshold 1407, one below the smallest granularity: no leaf (a warning), fast sharding still on."""
    _gpt_threshold(run, 1407, seed=41)


def granularity_gpt_attention_leaves(run, args):
    _gpt_threshold(run, 1408, seed=42)


def granularity_gpt_block_leaves(run, args):
    """The blocks qualify (1588), so their attentions (1408) are inside leaves, not leaves; eval forwards too."""
    _gpt_threshold(run, 2000, seed=43, eval_too=True)


def granularity_user_leaves_fast_sharding(run, args):
    """Model B's blocks made leaves by the user; threshold 100 selects nothing but fast-shards those leaves."""
    torch.manual_seed(44)
    model = model_b()
    deepspeed.utils.set_z3_leaf_modules(model, [ResidualMLPBlock])
    engine = run.engine(training_engine(model, config(100)))
    record_tree(run, model)
    handle = watch_released(run, model.head, model.blocks[0].up.weight)
    for step in range(STEPS):
        run.loss(train_step(engine, batch(step, rank())))
        with torch.no_grad():
            run.loss(mse_loss(engine(batch(100 + step, rank()))).item())
    run.loss(train_step(engine, batch(STEPS, rank())))
    handle.remove()
    run.hash_params(model)


GRANULARITY_SCENARIOS = [
    granularity_gpt_none_qualifies,
    granularity_gpt_attention_leaves,
    granularity_gpt_block_leaves,
    granularity_user_leaves_fast_sharding,
]
