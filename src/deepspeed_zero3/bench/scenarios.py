"""The benchmark's scenarios: each builds a model and its engine(s) and returns one repeatable cycle.

A scenario function takes the worker's ``Bench`` context and returns a ``Plan``. The worker runs the
plan's ``cycle(i)`` ``warmup + measured`` times with the gather instrument installed; inside a cycle
every pass is wrapped in ``bench.phase(name)`` (forward, backward, step, eval_forward, setup) so both
runtimes' traffic lands in the same buckets.

Every scenario seeds torch the same way in both runs, so upstream and ours see the same data.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from deepspeed_zero3.testing.engines import training_engine, zero3_config
from deepspeed_zero3.testing.models import TinyGPT, Wrapper, model_a, model_b

GENERATION_STEPS = 16  # no-grad forwards per generation cycle
PROMPT = (4, 4)  # batch, prompt length (it grows to 4 + 16 tokens)
VALIDATE_FIT_TRAIN_STEPS = 3
TINY_MODULES = 2000  # Linear(TINY_WIDTH, TINY_WIDTH) each
TINY_WIDTH = 8
DEEPSPEED_DEFAULT_BUCKET = 50_000_000  # DeepSpeed's own stage3_prefetch_bucket_size default


@dataclass
class Plan:
    """What the worker needs to run and measure a scenario."""
    model: torch.nn.Module  # the module whose parameters are metered (a Wrapper's inner model)
    cycle: Callable[[int], None]
    label: str  # "Model B", "TinyGPT", ...
    engines: List = field(default_factory=list)  # destroyed after the scenario, crash or not
    warmup: Optional[int] = None  # None: the --warmup flag
    measured: Optional[int] = None  # None: the --steps flag
    numel: int = 0  # model size; set by the worker once the engine has partitioned it


def _mlp(bench, **kwargs):
    return (model_a if bench.args.model == "a" else model_b)(**kwargs)


def _mlp_label(bench):
    return "Model A" if bench.args.model == "a" else "Model B"


def steady_training(bench) -> Plan:
    """Training steps, nothing else."""
    torch.manual_seed(1)
    model = _mlp(bench)
    engine = bench.training_engine(model)
    return Plan(model, lambda i: bench.train_step(engine, i), _mlp_label(bench), [engine])


def train_eval(bench) -> Plan:
    """One training step, then one eval forward (``engine.eval()``, ``torch.no_grad()``)."""
    torch.manual_seed(2)
    model = _mlp(bench)
    engine = bench.training_engine(model)

    def cycle(i):
        bench.train_step(engine, i)
        bench.eval_forward(engine, 1000 + i)

    return Plan(model, cycle, _mlp_label(bench), [engine])


def training_branch(bench) -> Plan:
    """Train/eval alternation through a model with a Linear that runs only in training mode."""
    torch.manual_seed(3)
    model = _mlp(bench, training_branch=True)
    engine = bench.training_engine(model)

    def cycle(i):
        bench.train_step(engine, i)
        bench.eval_forward(engine, 1000 + i)

    return Plan(model, cycle, _mlp_label(bench) + " + training-only branch", [engine])


def frozen_bottom(bench) -> Plan:
    """The input layer and the bottom half of the blocks frozen and kept in eval mode; the rest trains."""
    torch.manual_seed(4)
    model = _mlp(bench)
    frozen = [model.inp, *model.blocks[:len(model.blocks) // 2]]
    for module in frozen:
        module.requires_grad_(False)
    engine = bench.training_engine(model)

    def cycle(i):
        engine.train()
        for module in frozen:
            module.eval()
        bench.train_step(engine, i)

    return Plan(model, cycle, _mlp_label(bench) + ", bottom half frozen + eval", [engine])


def _gpt(bench):
    """A TinyGPT about the size of the selected MLP: 0.22M parameters for --model b, 6.6M for --model a."""
    if bench.args.model == "a":
        return TinyGPT(vocab=512, dim=256, heads=8, layers=8, max_seq=64)
    return TinyGPT(vocab=128, dim=64, heads=4, layers=4, max_seq=64)


def generation(bench) -> Plan:
    """RLHF-style generate-then-train: 16 no-grad forwards of growing length, then one training step."""
    torch.manual_seed(5)
    model = _gpt(bench)
    vocab = model.lm_head.out_features
    engine = bench.training_engine(model)

    def cycle(i):
        generator = torch.Generator().manual_seed(7919 * i + 104729 * bench.rank)
        tokens = torch.randint(0, vocab, PROMPT, generator=generator).to(bench.device)
        engine.eval()
        with torch.no_grad():
            for _ in range(GENERATION_STEPS):
                with bench.phase("eval_forward"):
                    logits = engine(tokens)
                tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        engine.train()
        with bench.phase("forward"):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
        with bench.phase("backward"):
            engine.backward(loss)
        with bench.phase("step"):
            engine.step()

    return Plan(model, cycle, "TinyGPT", [engine])


def validate_fit(bench) -> Plan:
    """Lightning's validate-then-fit: an inference engine over ``Wrapper(model)`` runs a no-grad forward,
    then a training engine over a new ``Wrapper(model)`` trains 3 steps.

    Cycle 0 builds both engines, validates and trains the first step (warm-up); cycles 1 and 2 are the
    2nd and 3rd training steps (measured). Upstream 0.19.8 crashes in the 2nd training step.
    """
    torch.manual_seed(6)
    model = _mlp(bench)
    plan = Plan(model, None, _mlp_label(bench) + ", two engines", warmup=1, measured=VALIDATE_FIT_TRAIN_STEPS - 1)
    engines = {}

    def cycle(i):
        if i == 0:
            with bench.phase("setup"):
                engines["validator"] = validator = bench.inference_engine(Wrapper(model))
                plan.engines.append(validator)
            bench.eval_forward(validator, 2000)
            with bench.phase("setup"):
                engines["trainer"] = trainer = bench.training_engine(Wrapper(model))
                plan.engines.append(trainer)
        bench.train_step(engines["trainer"], i)

    plan.cycle = cycle
    return plan


def tiny_modules(bench) -> Plan:
    """2,000 ``Linear(8, 8)`` in a row with DeepSpeed's default prefetch bucket: one gather covers the model,
    so a step is almost all host work per module fetch and release (the row "host time per module")."""
    torch.manual_seed(8)
    model = torch.nn.Sequential(*(torch.nn.Linear(TINY_WIDTH, TINY_WIDTH) for _ in range(TINY_MODULES)))
    engine = training_engine(model, zero3_config(bucket=DEEPSPEED_DEFAULT_BUCKET, reuse=bench.args.reuse))

    def cycle(i):
        bench.train_step(engine, i, shape=(4, TINY_WIDTH))

    # 8,000 fetches a cycle, each averaged: a few cycles are enough, and the meter's per-fetch walk over the
    # model's 4,000 parameters makes every cycle long (seconds), so this scenario runs fewer than the flags say.
    return Plan(model, cycle, f"{TINY_MODULES} x Linear({TINY_WIDTH}, {TINY_WIDTH}), bucket {DEEPSPEED_DEFAULT_BUCKET:,}",
                [engine], warmup=min(bench.args.warmup, 1), measured=min(bench.args.steps, 3))


SCENARIO_FUNCTIONS = {
    f.__name__: f
    for f in (steady_training, train_eval, training_branch, frozen_bottom, generation, tiny_modules, validate_fit)
}

