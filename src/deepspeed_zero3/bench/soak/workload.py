"""What the soak does to one model, step after step: what a long fine-tuning job with evaluation,
sampling and a serving engine does.

One TinyGPT (30,592 parameters) whose token embedding is frozen and kept in eval mode (the LoRA /
frozen-tower pattern), a training engine over it, and a second, inference engine over the same module
(the registry shares the module's parameter state between them). One step:

* a training step through the training engine (forward, ``engine.backward``, ``engine.step``);
* every ``--eval-every`` steps a no-grad forward through the training engine, alternately after
  ``engine.eval()`` and in training mode (the frozen embedding still in eval): the pass kind must
  come from grad mode, not ``.training``;
* every ``--generate-every`` steps a greedy generation loop through the second engine after
  ``engine.eval()``: ``--generate-tokens`` no-grad forwards of a growing sequence;
* every ``--engine-every`` steps a third inference engine is created over the module, runs one
  no-grad forward, is destroyed and dropped, followed by ``gc.collect()`` as after any engine teardown.

The events run after the training step, so the probe that follows sees whatever a no-grad pass or an
engine's destroy left behind, instead of stage 3's ``step()`` releasing it first.
"""

import gc
from array import array

import torch

from deepspeed_zero3.bench.soak.options import MAX_SEQ, PROMPT_LEN
from deepspeed_zero3.testing.engines import inference_engine, token_batch, training_engine, zero3_config
from deepspeed_zero3.testing.models import TinyGPT

VOCAB = 64
BATCH, SEQ = 4, 16
GENERATE_BATCH = 2
EVENTS = ("train", "eval", "eval_train_mode", "generate", "third_engine")  # bit i of a step's event mask


def soak_model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=2, max_seq=MAX_SEQ)
    model.tok.requires_grad_(False)
    return model


def due(step: int, every: int) -> bool:
    """Whether an event with period ``every`` runs at the end of ``step`` (0-based; 0 turns it off)."""
    return every > 0 and (step + 1) % every == 0


def event_names(mask: int) -> list:
    return [name for bit, name in enumerate(EVENTS) if mask >> bit & 1]


class Workload:
    """The model and its two long-lived engines; ``run_step`` does one step and says which events it ran."""

    def __init__(self, args, rank: int, device: torch.device):
        self.args = args
        self.rank = rank
        self.device = device
        self.config = zero3_config(bucket=args.bucket, reuse=0)
        self.model = soak_model()
        self.trainer = training_engine(self.model, self.config)
        self.server = inference_engine(self.model, self.config)
        self.losses = array("d", [0.0]) * args.steps

    def tokens(self, step: int, salt: int = 0):
        x, y = token_batch(step + salt, self.rank, batch_size=BATCH, seq=SEQ, vocab=VOCAB)
        return x.to(self.device), y.to(self.device)

    def training_mode(self):
        self.trainer.train()
        self.model.tok.eval()

    def train_step(self, step: int):
        self.training_mode()
        x, y = self.tokens(step)
        loss = self.trainer(x, y)
        self.trainer.backward(loss)
        self.trainer.step()
        self.losses[step] = loss.item()

    def eval_forward(self, step: int) -> str:
        in_eval_mode = (step + 1) // self.args.eval_every % 2 == 1
        if in_eval_mode:
            self.trainer.eval()
        else:
            self.training_mode()
        x, y = self.tokens(step, salt=100_000)
        with torch.no_grad():
            self.trainer(x, y)
        return "eval" if in_eval_mode else "eval_train_mode"

    def generate(self, step: int):
        generator = torch.Generator().manual_seed(7919 * step + 104729 * self.rank)
        tokens = torch.randint(0, VOCAB, (GENERATE_BATCH, PROMPT_LEN), generator=generator).to(self.device)
        self.server.eval()
        with torch.no_grad():
            for _ in range(self.args.generate_tokens):
                logits = self.server(tokens)
                tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)

    def third_engine(self, step: int):
        engine = inference_engine(self.model, self.config)
        x, _ = self.tokens(step, salt=200_000)
        engine.eval()
        with torch.no_grad():
            engine(x)
        engine.destroy()
        # What users do after tearing an engine down (Accelerate's release_memory does the same); the only
        # collection the soak forces: every other step leaves collecting to Python's automatic collector.
        del engine
        gc.collect()

    def run_step(self, step: int) -> int:
        """One step; returns the mask of the events it ran (bits in ``EVENTS`` order)."""
        self.train_step(step)
        ran = ["train"]
        if due(step, self.args.eval_every):
            ran.append(self.eval_forward(step))
        if due(step, self.args.generate_every):
            self.generate(step)
            ran.append("generate")
        if due(step, self.args.engine_every):
            self.third_engine(step)
            ran.append("third_engine")
        return sum(1 << EVENTS.index(name) for name in ran)

    def close(self):
        self.server.destroy()
        self.trainer.destroy()
