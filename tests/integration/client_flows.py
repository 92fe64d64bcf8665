"""RL and PEFT client flows (TRL, peft, HF generate) on a ZeRO-3 engine made by Accelerate, on 2 ranks:

    torchrun --nproc_per_node 2 --master_port P tests/integration/client_flows.py --out DIR --flows a,b

The model is the tiny Llama of common.py (built from a config, nothing downloaded). Each flow runs a
few steps of its own hand-written loop, the way RL and PEFT libraries drive an Accelerate-prepared
DeepSpeed engine. Each rank writes DIR/<flow>.rank<R>.json as the other flow scripts do (runtime,
"ok" or the crash, events); rank 0 saves the final full parameters (DIR/<flow>.params.pt).
"""

import copy
import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_shims import allow_accelerate_deepspeed_on_cpu  # noqa: E402

allow_accelerate_deepspeed_on_cpu()

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from client_common import (advantages, generate, grpo_loss, make_lora_llama, make_merge_llama,  # noqa: E402
                           modules_in_training_mode, prompts, sampling_seed, set_lora_modes, train_batch)
from common import crash_record, finish_flow, full_copies, make_llama, parse_flow_args, runtime_name  # noqa: E402
from deepspeed_zero3.testing.instrument import GatherMeter  # noqa: E402

FLOW_TIMEOUT_S = int(os.environ.get("ZERO3_INTEGRATION_FLOW_TIMEOUT", "150"))
STEPS = 3
LR = 1e-3

# The Trainer's "auto" values for hidden size 64, written out (no Trainer fills them in here): every
# weight matrix stays partitioned (persistence 640), and the prefetch bucket holds less than one layer.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 640,
        "stage3_prefetch_bucket_size": 3686,
        "reduce_bucket_size": 4096,
    },
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


def rank():
    return int(os.environ["RANK"])


def prepare(model):
    """A fresh Accelerator (state reset, as TrainingArguments does) and its DeepSpeed engine over ``model``."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(DS_CONFIG)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    engine, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, engine, optimizer


def train_step(accelerator, optimizer, loss):
    accelerator.backward(loss)  # Accelerate's DeepSpeed backward: engine.backward, then engine.step
    optimizer.step()
    optimizer.zero_grad()


def hook_counts(engine):
    """The lengths of the two ZeRO-3 hook lists TRL removes and puts back, and every forward (pre-)hook on
    the module tree (the runtime's, TRL's and the engine's own)."""
    offload = engine.optimizer.parameter_offload
    on_modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules())
    return [len(offload.forward_hooks), len(offload.backward_hooks)], on_modules


# ---------------------------------------------------------------- the flows


def grpo(events, gather):
    """GRPO's loop with TRL's unwrap_model_for_generation: sample a group of completions per prompt from
    the unwrapped model, score them, then one policy-gradient step of the engine on those sequences."""
    from trl.models.utils import unwrap_model_for_generation

    model = make_llama()
    model.gradient_checkpointing_enable()  # GRPOConfig's default; TRL turns it off while generating
    accelerator, engine, optimizer = prepare(model)
    for step in range(STEPS):
        prompt_ids = prompts(rank(), step)
        hooks = {"before": hook_counts(engine)}
        with unwrap_model_for_generation(engine, accelerator, gather_deepspeed3_params=gather) as unwrapped:
            hooks["inside"] = hook_counts(engine)
            assert unwrapped is engine.module and not unwrapped.is_gradient_checkpointing
            partitioned = sum(p.ds_numel for p in engine.module.parameters() if p.ds_status.name == "NOT_AVAILABLE")
            with GatherMeter(engine.module) as meter, meter.phase("generate"):
                sequences = generate(unwrapped, prompt_ids, sample=True, seed=sampling_seed(rank(), step))
        hooks["after"] = hook_counts(engine)
        assert engine.module.is_gradient_checkpointing
        advantage = advantages(sequences)
        loss, logp = grpo_loss(engine, sequences, advantage)
        train_step(accelerator, optimizer, loss)
        events.append({"kind": "grpo", "prompts": prompt_ids.tolist(), "sequences": sequences.tolist(),
                       "advantages": advantage.tolist(), "loss": loss.item(), "logp": logp.item(),
                       "hook_lists": {k: v[0] for k, v in hooks.items()},
                       "module_hooks": {k: v[1] for k, v in hooks.items()},
                       "generate_gathered": meter.snapshot()["generate"]["allgather_numel"],
                       "partitioned_numel": partitioned})
    return engine


def grpo_gather(events):
    """gather_deepspeed3_params=True: all parameters gathered, the ZeRO-3 hooks removed while generating."""
    return grpo(events, gather=True)


def grpo_no_gather(events):
    """gather_deepspeed3_params=False: generation runs through the ZeRO-3 hooks (no-grad forwards)."""
    return grpo(events, gather=False)


def lora(events, eval_base):
    accelerator, engine, optimizer = prepare(make_lora_llama(eval_base))
    if not eval_base:
        engine.module.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    set_lora_modes(engine.module, eval_base)
    for step in range(STEPS + 1):
        ids = train_batch(rank(), step)
        loss = engine(input_ids=ids, labels=ids).loss
        train_step(accelerator, optimizer, loss)
        events.append({"kind": "train", "input_ids": ids.tolist(), "loss": loss.item(),
                       "training": modules_in_training_mode(engine.module)})
    with torch.no_grad():
        ids = train_batch(rank(), STEPS + 1)
        events.append({"kind": "eval", "input_ids": ids.tolist(), "loss": engine(input_ids=ids, labels=ids).loss.item(),
                       "training": modules_in_training_mode(engine.module)})
    return engine


def lora_eval_base(events):
    """peft LoRA on q_proj/v_proj: only the adapters train, and every non-LoRA module stays in eval mode
    for the whole run (the base has attention dropout, which eval mode turns off)."""
    return lora(events, eval_base=True)


def lora_checkpointing(events):
    """peft LoRA with every module in training mode and gradient checkpointing (transformers' default,
    non-reentrant): the checkpoint recompute in backward runs frozen base weights through ZeRO-3 again."""
    return lora(events, eval_base=False)


def generate_interleaved(events):
    """HF generate() (greedy) on the engine's module before, between and after training steps, and once
    between a step's forward and its backward."""
    accelerator, engine, optimizer = prepare(make_llama())

    def record_generation(step):
        prompt_ids = prompts(rank(), step)
        events.append({"kind": "generate", "prompts": prompt_ids.tolist(),
                       "sequences": generate(engine.module, prompt_ids, sample=False).tolist()})

    for step in range(STEPS):
        record_generation(step)
        ids = train_batch(rank(), step)
        loss = engine(input_ids=ids, labels=ids).loss
        if step == 1:
            record_generation(100 + step)
        train_step(accelerator, optimizer, loss)
        events.append({"kind": "train", "input_ids": ids.tolist(), "loss": loss.item()})
    record_generation(STEPS)
    return engine


def lora_merge_stream(events):
    """Two LoRA training steps, then the merged weights streamed out one layer at a time
    (``iter_gathered_parameters(engine, merge_adapters=True)``), against peft's own ``merge_and_unload()`` on a
    plain copy of the whole-model-gathered module; the adapters must be untouched. Ours only (the stream is ours)."""
    import deepspeed_zero3

    accelerator, engine, optimizer = prepare(make_merge_llama())
    for step in range(2):
        ids = train_batch(rank(), step)
        train_step(accelerator, optimizer, engine(input_ids=ids, labels=ids).loss)
    named = list(engine.module.named_parameters())

    before = full_copies(named)
    available_before = [name for name, p in named if p.ds_status.name != "NOT_AVAILABLE"]
    stream = deepspeed_zero3.iter_gathered_parameters(engine, merge_adapters=True)
    # What the merged model is made of (not lm_head's original, which modules_to_save replaces), still partitioned.
    wanted = {id(p): p for unit in stream.units for p in unit.params}
    partitioned = sum(p.ds_numel for p in wanted.values() if p.ds_status.name == "NOT_AVAILABLE")
    metadata = [(m.name, str(m.dtype), list(m.shape)) for m in stream.metadata()]
    merged = {name: tensor.clone() for name, tensor in stream}
    available_after = [name for name, p in named if p.ds_status.name != "NOT_AVAILABLE"]
    after = full_copies(named)

    plain = make_merge_llama()  # no ZeRO: peft merges it as it merges any model
    plain.load_state_dict(before)
    reference = plain.merge_and_unload()
    expected = dict(reference.named_parameters())
    largest = max(p.ds_numel for _, p in named)
    events.append({
        "kind": "merge",
        "names": list(merged) == list(expected),
        "metadata": metadata == [(n, str(t.dtype), list(t.shape)) for n, t in expected.items()],
        "bitwise": list(merged) == list(expected) and all(torch.equal(merged[n], expected[n]) for n in expected),
        "adapters_untouched": all(torch.equal(before[n], after[n]) for n in before),
        "left_as_found": available_after == available_before,
        "stats": {"allgather_calls": stream.stats.allgather_calls, "allgather_numel": stream.stats.allgather_numel,
                  "peak_gathered_numel": stream.stats.peak_gathered_numel},
        "bucket": stream.bucket_numel, "largest_unit": stream.largest_unit, "largest_param": largest,
        "partitioned_numel": partitioned, "model_numel": sum(p.ds_numel for _, p in named),
    })
    return engine


def save_from_pretrained(events):
    """``deepspeed_zero3.save_16bit_model`` of a tied tiny Llama (in 40 KB shards) and of the merged LoRA model,
    each with its config and the gathered parameters beside it; the test loads them with transformers'
    ``from_pretrained`` in its own process (here HF's ZeRO-3 integration is on, and a model built on rank 0 alone
    would run zero.Init's collectives alone). Ours only (the save is ours)."""
    import tempfile

    import deepspeed_zero3

    event = {"kind": "save"}
    accelerator, engine, optimizer = prepare(make_llama(tie_word_embeddings=True))
    box = [tempfile.mkdtemp(prefix="ds_zero3_save_") if rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)  # one directory, rank 0's, as a job's save_dir is
    root = event["root"] = box[0]
    for step in range(2):
        ids = train_batch(rank(), step)
        train_step(accelerator, optimizer, engine(input_ids=ids, labels=ids).loss)
    full = full_copies(list(engine.module.named_parameters()))
    event["files"] = deepspeed_zero3.save_16bit_model(engine, os.path.join(root, "plain"), max_shard_size="40KB")
    if rank() == 0:
        engine.module.config.save_pretrained(os.path.join(root, "plain"))
        torch.save(full, os.path.join(root, "plain_gathered.pt"))
    engine.destroy()

    accelerator, engine, optimizer = prepare(make_merge_llama())
    for step in range(2):
        ids = train_batch(rank(), step)
        train_step(accelerator, optimizer, engine(input_ids=ids, labels=ids).loss)
    before = full_copies(list(engine.module.named_parameters()))
    deepspeed_zero3.save_16bit_model(engine, os.path.join(root, "merged"), merge_adapters=True)
    if rank() == 0:
        engine.module.base_model.model.config.save_pretrained(os.path.join(root, "merged"))
        torch.save(before, os.path.join(root, "merged_gathered.pt"))
    events.append(event)
    return engine


FLOWS = {f.__name__: f for f in (grpo_gather, grpo_no_gather, lora_eval_base, lora_checkpointing, generate_interleaved,
                                 lora_merge_stream, save_from_pretrained)}


def save_params(engine, path):
    copies = full_copies(list(engine.module.named_parameters()))
    if rank() == 0:
        torch.save(copies, path)


def main():
    args = parse_flow_args()
    for name in args.flows.split(","):
        faulthandler.dump_traceback_later(FLOW_TIMEOUT_S, exit=True)
        events = []
        try:
            engine = FLOWS[name](events)
            save_params(engine, os.path.join(args.out, f"{name}.params.pt"))
            engine.destroy()
            record = {"status": "ok"}
        except Exception as exc:  # recorded for the test, then the run stops
            record = crash_record(exc)
        finally:
            faulthandler.cancel_dump_traceback_later()
        record.update(runtime=runtime_name(), events=events)
        finish_flow(args.out, name, record)


if __name__ == "__main__":
    main()
