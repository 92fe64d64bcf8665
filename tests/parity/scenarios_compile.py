"""Parity scenarios for ``engine.compile()``: backends eager, aot_eager and inductor, on Model B and a tiny HF Llama,
at a bucket small enough to prefetch and at upstream's default buckets.

Each scenario starts from a reset Dynamo (no graph of an earlier scenario is reused) and records, besides the losses
and final parameters, the graph breaks Dynamo counted while compiling it (``graph_breaks``, the sum of
``torch._dynamo.utils.counters["graph_break"]``) and the graphs it compiled (``unique_graphs``). test_parity asserts
that ours breaks no more often than upstream in the same scenario ([Note: what Dynamo may trace] in
``src/deepspeed_zero3/runtime/zero/eager.py``).

Few steps and small models: compiling dominates, inductor's C++ above all.
"""

import torch

from deepspeed_zero3.testing.engines import batch, mse_loss, token_batch, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

STEPS = 5
DEFAULT_BUCKETS = dict(bucket=50_000_000, reuse=1_000_000_000)  # upstream's defaults
MLP_SMALL_BUCKET = dict(bucket=20_000, reuse=0)  # Model B prefetches
LLAMA_SMALL_BUCKET = dict(bucket=3_000, reuse=0)  # the tiny Llama prefetches (its largest parameter is 4,096)


def tiny_llama():
    """One Llama layer built from a config (never downloaded), 18,528 parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config)


def mlp_loss(engine, step):
    return mse_loss(engine(batch(step, torch.distributed.get_rank())))


def llama_loss(engine, step):
    tokens, _ = token_batch(step, torch.distributed.get_rank(), batch_size=2, seq=16)
    return engine(input_ids=tokens, labels=tokens).loss  # the model shifts the labels itself


MODELS = {"mlp": (model_b, mlp_loss, MLP_SMALL_BUCKET), "llama": (tiny_llama, llama_loss, LLAMA_SMALL_BUCKET)}


def reset_dynamo():
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    reset()
    counters.clear()
    return counters


def compiled_training(run, model_name: str, backend: str, default_buckets: bool, seed: int):
    build, loss_of, small_bucket = MODELS[model_name]
    counters = reset_dynamo()
    if backend == "inductor":
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1  # two CPU cores: no pool of compile workers per rank
    torch.manual_seed(seed)
    model = build()
    engine = run.engine(training_engine(model, zero3_config(**(DEFAULT_BUCKETS if default_buckets else small_bucket))))
    engine.compile(backend=backend)
    for step in range(STEPS):
        loss = loss_of(engine, step)
        engine.backward(loss)
        engine.step()
        run.loss(loss.item())
    run.extra["graph_breaks"] = sum(counters["graph_break"].values())
    run.extra["unique_graphs"] = counters["stats"]["unique_graphs"]
    run.hash_params(model)


def scenario(model_name: str, backend: str, default_buckets: bool, seed: int):

    def run_scenario(run, args):
        compiled_training(run, model_name, backend, default_buckets, seed)

    run_scenario.__name__ = f"compile_{backend}_{model_name}" + ("_default_buckets" if default_buckets else "")
    run_scenario.__doc__ = (f"engine.compile(backend={backend!r}) on {model_name}, "
                            f"{'default buckets' if default_buckets else 'small bucket'}, {STEPS} training steps")
    return run_scenario


compile_eager_mlp = scenario("mlp", "eager", False, 41)
compile_eager_mlp_default_buckets = scenario("mlp", "eager", True, 42)
compile_aot_eager_mlp = scenario("mlp", "aot_eager", False, 43)
compile_aot_eager_mlp_default_buckets = scenario("mlp", "aot_eager", True, 44)
compile_inductor_mlp = scenario("mlp", "inductor", False, 45)
compile_inductor_mlp_default_buckets = scenario("mlp", "inductor", True, 46)
compile_eager_llama = scenario("llama", "eager", False, 47)
compile_eager_llama_default_buckets = scenario("llama", "eager", True, 48)
compile_aot_eager_llama = scenario("llama", "aot_eager", False, 49)
compile_aot_eager_llama_default_buckets = scenario("llama", "aot_eager", True, 50)
compile_inductor_llama = scenario("llama", "inductor", False, 51)
compile_inductor_llama_default_buckets = scenario("llama", "inductor", True, 52)


def deepcompile_eager_fallback(run, args):
    """DeepCompile's ZeRO-3 eager fallback, as its engine.compile() sets it up, without the compiled graph.

    ``"compile": {"deepcompile": true}`` itself does not run on CPU under upstream: engine.compile() builds the
    ``dc`` op, whose headers include ATen/cuda (``fatal error: cuda.h: No such file or directory``). What runs is the
    path DeepCompile takes for what it leaves eager: module hooks removed (``_remove_module_hooks``), every
    parameter read in the forward gathered by ``ZeROOrderedDict`` for the active fallback, kept until the backward
    of that forward completes, then released by the fallback. 0.19.3's fallback has no per-forward graph record
    (``record_forward_graph``, from 0.19.4): there DeepCompile releases what it gathered after every backward, with
    ``release_gathered_params`` as a post-backward hook, and so does this scenario.
    """
    try:
        from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback
    except ImportError:
        run.release_lacks("has no DeepCompile eager fallback (deepspeed.compile.z3_eager_fallback, from 0.19.3)")
    from deepspeed.runtime.utils import register_output_backward_hooks

    torch.manual_seed(53)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(**MLP_SMALL_BUCKET)))
    engine.optimizer.parameter_offload._remove_module_hooks()
    fallback = DeepCompileZ3EagerFallback(engine)
    per_forward = hasattr(fallback, "record_forward_graph")
    gathered, released = [], []
    for step in range(STEPS):
        with fallback.forward_context():
            output = model(batch(step, torch.distributed.get_rank()))
        loss = mse_loss(output)
        if per_forward:
            graph = []
            register_output_backward_hooks(loss, preprocess_once_fn=lambda: fallback.record_backward_start(graph[0]))
            graph.append(fallback.record_forward_graph())
        gathered.append(len(fallback.stats()["last_gathered_param_ids"]))
        engine.backward(loss)
        if per_forward:
            fallback.complete_backward()
        else:
            fallback.release_gathered_params()
        released.append(len(fallback.stats()["last_released_param_ids"]))
        engine.step()
        run.loss(loss.item())
    run.extra["fallback_gathered"] = gathered
    run.extra["fallback_released"] = released
    run.hash_params(model)
