"""Hugging Face Trainer flows with a ZeRO-3 DeepSpeed config, run on 2 ranks by the tests:

    torchrun --nproc_per_node 2 --master_port P tests/integration/hf_flows.py --out DIR --flows a,b

The model is a tiny Llama built from a config (nothing is downloaded); the data are random token
tensors (no tokenizer). Each rank writes DIR/<flow>.rank<R>.json like lightning_flows.py does:
runtime, "ok" or the crash, and the events: every optimizer the Trainer created, and every
training/evaluation batch with this rank's token ids and the loss this rank computed.
"""

import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_shims import allow_accelerate_deepspeed_on_cpu  # noqa: E402

allow_accelerate_deepspeed_on_cpu()

from transformers import Trainer, TrainingArguments  # noqa: E402

from common import crash_record, finish_flow, parse_flow_args, make_llama, runtime_name, token_sample  # noqa: E402

FLOW_TIMEOUT_S = int(os.environ.get("ZERO3_INTEGRATION_FLOW_TIMEOUT", "150"))
EVENTS = []

# A usual ZeRO-3 config for the Trainer: "auto" values are filled in from the model and the arguments
# (persistence threshold 10 * hidden = 640, so every weight matrix stays partitioned).
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    },
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


class Tokens(torch.utils.data.Dataset):

    def __init__(self, split, n):
        self.split, self.n = split, n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        ids = token_sample(self.split, index)
        return {"input_ids": ids, "labels": ids}


class RecordingTrainer(Trainer):

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        EVENTS.append({"kind": "train" if torch.is_grad_enabled() else "eval",
                       "input_ids": inputs["input_ids"].tolist(), "loss": loss.item()})
        return result

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            EVENTS.append({"kind": "optimizer"})
        return super().create_optimizer(model)


def arguments(out, **overrides):
    """A fresh TrainingArguments: the Trainer's own way of starting a new Accelerator state."""
    kwargs = dict(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  learning_rate=1e-3, lr_scheduler_type="constant", max_steps=4, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, deepspeed=DS_CONFIG, dataloader_num_workers=0, seed=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def trainer(model, out, eval_samples=16, **overrides):
    """16 evaluation samples: 2 batches of 4 per rank; 8: a single batch per rank."""
    return RecordingTrainer(model=model, args=arguments(out, **overrides), train_dataset=Tokens("train", 64),
                            eval_dataset=Tokens("eval", eval_samples))


# ---------------------------------------------------------------- the flows


def evaluate_then_train(model, out):
    """evaluate() (a single batch per rank) with one Trainer, which builds an inference engine, then train()
    with a second Trainer over the same model (a training engine): the Lightning failure's twin."""
    trainer(model, out, eval_samples=8).evaluate()
    trainer(model, out, eval_samples=8).train()


def train_periodic_eval(model, out):
    """train() for 6 steps with an evaluation every 2 steps."""
    trainer(model, out, max_steps=6, eval_strategy="steps", eval_steps=2).train()


def evaluate_then_train_same_trainer(model, out):
    """evaluate() then train() on one Trainer: fails inside transformers/accelerate whatever the runtime
    (recorded by the tests, see test_hf.py)."""
    t = trainer(model, out)
    t.evaluate()
    t.train()


FLOWS = {f.__name__: f for f in (evaluate_then_train, train_periodic_eval, evaluate_then_train_same_trainer)}


def main():
    args = parse_flow_args()
    for name in args.flows.split(","):
        faulthandler.dump_traceback_later(FLOW_TIMEOUT_S, exit=True)
        EVENTS.clear()
        model = make_llama()  # before any TrainingArguments of this flow: built outside zero.Init, like the reference
        try:
            FLOWS[name](model, args.out)
            record = {"status": "ok"}
        except Exception as exc:  # recorded for the test, then the run stops
            record = crash_record(exc)
        finally:
            faulthandler.cancel_dump_traceback_later()
        record.update(runtime=runtime_name(), events=list(EVENTS))
        finish_flow(args.out, name, record)


if __name__ == "__main__":
    main()
