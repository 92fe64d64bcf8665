"""Keeping across no-grad passes ([Note: keeping across no-grad passes]): a loop of eval forwards (one per
generated token) gathers the model once at the defaults, and only what does not fit under a cap.

Model B (199,876 parameters, bucket 20,000), two ranks. Modules: inp 1,088; 6 blocks of up 16,640 + down
16,448 (33,088); head 260. The eval trace runs inp, the blocks, head; the largest module is an up (16,640).
"""

import pytest
import torch

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, gathered_copies, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import MODEL_B_NUMEL, model_b

MODEL_B = MODEL_B_NUMEL
INP, UP, DOWN, HEAD = 1_088, 16_640, 16_448, 260
BUCKET = 20_000
DEFAULT = 1_000_000_000
HALF = MODEL_B // 2  # 99,938
# Under the half cap the kept prefix is what fits in the cap: inp, two blocks and the third block's up.
KEPT_HALF = INP + 2 * (UP + DOWN) + UP  # 83,904


def run(reuse, cap=None, tokens=4):
    """One training step, ``tokens`` eval forwards, one training step; the passes' counts and the outputs."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=BUCKET, reuse=reuse, max_live=cap))

    def train(step):
        engine.backward(mse_loss(engine(batch(step, rank))))
        engine.step()

    train(0)
    deepspeed_zero3.reset_zero3_stats(engine)
    outputs = []
    with torch.no_grad():
        for token in range(tokens):
            outputs.append(engine(batch(100 + token, rank)))
    live_after_evals = deepspeed_zero3.get_zero3_stats(engine)["live_numel"]
    train(1)
    passes = [(p["kind"], p["allgather_numel"], p["demand_numel"], p["peak_live_numel"])
              for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0  # the step released everything
    params = gathered_copies(model.parameters())
    engine.destroy()
    return passes, live_after_evals, outputs, params


def test_default_keys_gather_the_model_once_for_a_loop_of_eval_forwards():
    passes, live, outputs, params = run(reuse=DEFAULT)
    assert passes == [("eval_forward", MODEL_B, 0, MODEL_B)] + [("eval_forward", 0, 0, MODEL_B)] * 3 + [
        ("forward", 0, 0, MODEL_B),  # the training forward uses what the eval forwards left gathered
        ("backward", 0, 0, MODEL_B),  # and keeps it all for its backward, as the default reuse distance does
    ]
    assert live == MODEL_B
    expected = run(reuse=0)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected[2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, expected[3], strict=True))


def test_reuse_zero_keeps_nothing_between_eval_forwards():
    passes, live, _, _ = run(reuse=0)
    evals = [p for p in passes if p[0] == "eval_forward"]
    assert [(numel, demand) for _, numel, demand, _ in evals] == [(MODEL_B, 0)] * 4
    assert live == 0


def test_a_cap_keeps_the_first_modules_and_gathers_only_the_rest():
    passes, live, outputs, params = run(reuse=DEFAULT, cap=HALF)
    evals = [p for p in passes if p[0] == "eval_forward"]
    # The kept prefix fills the cap, so what is gathered each token after it comes module by module as it runs
    # (the third block's down, then the last three blocks and the head: 49,604 of it on demand).
    assert evals == [("eval_forward", MODEL_B, 49_604, 100_544)] + [
        ("eval_forward", MODEL_B - KEPT_HALF, 49_604, 100_544)] * 3
    assert live == KEPT_HALF
    forward = passes[len(evals)]
    assert forward[0] == "forward" and forward[1] == MODEL_B - KEPT_HALF  # the kept prefix is used, not re-gathered
    expected = run(reuse=0, cap=HALF)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected[2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, expected[3], strict=True))


def modified_plain_output(x):
    """What the model computes after rank 0's change below, with no ZeRO-3 at all."""
    torch.manual_seed(0)
    plain = model_b()
    with torch.no_grad():
        plain.blocks[0].up.weight.mul_(0.5)
        return plain(x)


@pytest.mark.parametrize("invalidate", ["step", "gathered_parameters_modifier", "reset_step"])
def test_what_is_kept_is_never_stale(invalidate):
    """A kept parameter changed through its partition (the optimizer step) or through GatheredParameters with a
    modifier rank is gathered again afterwards: the next eval forward equals one with nothing kept, or, for the
    modifier, the plain model under the same change.

    The modifier's reference is not the engine at reuse 0: there
    GatheredParameters itself gathers the block, and before 0.19.8 it waits only for the last of its gloo
    all-gathers, so rank 0's write can land in a buffer a gather is still filling and be overwritten, now and
    then, under either runtime."""
    rank = torch.distributed.get_rank()
    x = batch(7, rank)

    def outputs(reuse):
        torch.manual_seed(0)
        model = model_b()
        engine = training_engine(model, zero3_config(bucket=BUCKET, reuse=reuse))
        with torch.no_grad():
            engine(x)
        if invalidate == "step":
            engine.backward(mse_loss(engine(batch(0, rank))))
            engine.step()
        elif invalidate == "gathered_parameters_modifier":
            block = list(model.blocks[0].parameters())
            assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == MODEL_B  # kept: nothing to gather
            with deepspeed.zero.GatheredParameters(block, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        model.blocks[0].up.weight.mul_(0.5)
        else:
            engine.optimizer.parameter_offload.get_param_coordinator().reset_step()
            assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0  # the carry is released
        with torch.no_grad():
            out = engine(x)
        engine.destroy()
        return out

    if invalidate == "gathered_parameters_modifier":
        assert torch.equal(outputs(DEFAULT), modified_plain_output(x))
    else:
        assert torch.equal(outputs(DEFAULT), outputs(0))


def test_a_load_into_kept_parameters_reaches_their_partitions():
    """An inference engine keeps the whole model between eval forwards; upstream's loader
    (``load_module_state_dict(fetch_z3_params=True)``, what ``load_checkpoint(load_optimizer_states=False)`` does)
    gathers only NOT_AVAILABLE parameters, so it writes the kept ones' full copies only. The load_state_dict
    post-hook makes those copies the partitions: the next forwards see the loaded weights, before and after the
    parameters are released and gathered again.

    The reference is the plain model with the load, not the same engine at reuse 0: there the loader gathers every
    parameter in one GatheredParameters, which before 0.19.8 waits only for the last of its gloo all-gathers, so the
    load could land under a gather still arriving (seen once on 0.19.6)."""
    from deepspeed_zero3.testing.engines import inference_engine

    rank = torch.distributed.get_rank()
    torch.manual_seed(5)
    loaded = {name: value * 0.5 for name, value in model_b().state_dict().items()}
    plain = model_b()
    plain.load_state_dict(loaded)
    with torch.no_grad():
        expected = plain(batch(9, rank))

    torch.manual_seed(0)
    model = model_b()
    engine = inference_engine(model, zero3_config(bucket=BUCKET, reuse=DEFAULT))
    with torch.no_grad():
        for token in range(3):
            engine(batch(token, rank))
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == MODEL_B  # all kept: the loader gathers nothing
    engine.load_module_state_dict({"module": loaded}, fetch_z3_params=True)
    with torch.no_grad():
        first = engine(batch(9, rank))
        engine.empty_partition_cache()  # released and gathered again: the partitions hold the load
        second = engine(batch(9, rank))
    params = gathered_copies(model.parameters())
    engine.destroy()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert all(torch.equal(a, b) for a, b in zip(params, loaded.values(), strict=True))
