"""One GPU run at world size 1: ``python -m deepspeed_zero3.bench.gpu.worker --model b --out r.json``.

The runtime is the one the environment selects (``DEEPSPEED_ZERO3=0`` gives upstream's); the parent
(``runs.py``) sets the rendezvous variables for one rank. In one process, after ``--warmup`` training
steps (the first records the traces):

* ``parity``: the loss of every step and every no-grad forward (as ``float.hex``) and a digest of the
  final parameters, gathered;
* ``syncs``: host syncs of one training step and of one no-grad forward, counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronizing call);
* ``time``: ``--steps`` training steps timed between two device syncs, and their peak
  ``torch.cuda.max_memory_allocated``;
* ``profile``: ``torch.profiler`` over ``--profile-steps`` steps, and the fraction of gathering time
  (host-to-device copies, NCCL kernels) under compute (``overlap.py``).

Every phase runs the same training steps in both runtimes, so the parity digest covers them all. With
``--zenflow`` the config adds ZenFlow (offloaded optimizer); a runtime without ZenFlow support says so
in ``unsupported`` instead of failing. ``--device cpu`` is a dry run on gloo (still bf16, still offloaded) for
developing without a GPU: the parity phase only.
"""

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import warnings

PHASES = ("parity", "syncs", "time", "profile")
SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("b", "llama", "llama-bench"), default="b")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps (phase time)")
    parser.add_argument("--eval-passes", type=int, default=3, help="no-grad forwards after the warm-up")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--zenflow", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace-dir", default=None, help="where the profiler trace goes (default: beside --out)")
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        parser.error(f"--phases {','.join(unknown)} is not allowed: choose from {', '.join(PHASES)}")
    return args


def build_model(name: str):
    import torch
    torch.manual_seed(0)
    if name == "b":
        from deepspeed_zero3.testing.models import model_b
        return model_b()
    from deepspeed_zero3.testing.models import llama_from_config
    small = name == "llama"
    # Eager attention: a deterministic backward, for bitwise parity across processes.
    return llama_from_config(attn_implementation="eager",
                             vocab_size=128 if small else 4096,
                             hidden_size=64 if small else 1024,
                             intermediate_size=128 if small else 2816,
                             num_hidden_layers=2 if small else 8,
                             num_attention_heads=4 if small else 16,
                             num_key_value_heads=2 if small else 8,
                             max_position_embeddings=256,
                             tie_word_embeddings=False)


def ds_config(args) -> dict:
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 200_000 if args.model != "llama-bench" else 20_000_000,
        "stage3_max_reuse_distance": 0,
    }
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    config["bf16"] = {"enabled": True}
    if args.zenflow:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["zenflow"] = {"topk_ratio": 0.1, "update_interval": 2, "full_warm_up_rounds": 0, "overlap_step": False}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        config["zero_allow_untested_optimizer"] = True
    return config


class Data:
    """The same inputs in every run: Model B gets ``batch``, the Llamas token batches."""

    def __init__(self, model: str, device, dtype):
        self.model, self.device, self.dtype = model, device, dtype
        self.vocab = 128 if model == "llama" else 4096
        self.seq = 16 if model != "llama-bench" else 256

    def loss(self, engine, step: int, seq=None):
        from deepspeed_zero3.testing.engines import batch, mse_loss, token_batch
        if self.model == "b":
            return mse_loss(engine(batch(step, 0).to(self.device, self.dtype)).float())
        inputs, labels = token_batch(step, 0, seq=seq or self.seq, vocab=self.vocab)
        return engine(input_ids=inputs.to(self.device), labels=labels.to(self.device), use_cache=False).loss


def served() -> bool:
    from deepspeed_zero3.bench.runtime import runtime_name
    return runtime_name() == "ours"


def digest(module) -> str:
    import deepspeed
    import torch
    sha = hashlib.sha256()
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for param in params:
            sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


@contextlib.contextmanager
def counted_syncs(counts: list):
    """Append the number of synchronizing CUDA calls made in the block to ``counts``."""
    import torch
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts.append(sum(1 for w in caught if SYNC_WARNING in str(w.message)))


def run(args) -> dict:
    import torch
    import deepspeed

    cuda = args.device == "cuda"
    result = {"runtime": "ours" if served() else "upstream", "model": args.model, "torch": torch.__version__,
              "deepspeed": deepspeed.__version__, "phases": args.phases}
    if cuda:
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)
        result["device_name"] = torch.cuda.get_device_name(0)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    model = build_model(args.model)
    result["params"] = sum(p.numel() for p in model.parameters())
    config = ds_config(args)
    optimizer = None if args.zenflow else torch.optim.AdamW([p for p in model.parameters()], lr=1e-3)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except NotImplementedError as exc:
        if args.zenflow and "ZenFlow" in str(exc) and "not supported by deepspeed-zero3" in str(exc):
            result["unsupported"] = str(exc)
            return result
        raise
    data = Data(args.model, device, dtype)
    losses = []
    step = 0

    def train():
        nonlocal step
        loss = data.loss(engine, step)
        engine.backward(loss)
        engine.step()
        step += 1
        return loss

    def no_grad_forward(index):
        with torch.no_grad():
            return data.loss(engine, 1000 + index, seq=None if args.model == "b" else 4 + index)

    for _ in range(args.warmup):
        losses.append(train().item())
    for index in range(args.eval_passes):
        losses.append(no_grad_forward(index).item())

    if "syncs" in args.phases and cuda:
        train_syncs, eval_syncs = [], []
        for index in range(2):
            with counted_syncs(train_syncs):
                loss = train()
            losses.append(loss.item())
            with counted_syncs(eval_syncs):
                loss = no_grad_forward(index)
            losses.append(loss.item())
        result["syncs_per_step"] = train_syncs
        result["syncs_per_no_grad_forward"] = eval_syncs

    if "time" in args.phases and cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step_losses = [train() for _ in range(args.steps)]
        torch.cuda.synchronize()
        result["step_ms"] = round((time.perf_counter() - start) * 1000 / args.steps, 3)
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
        losses.extend(loss.item() for loss in step_losses)

    if "profile" in args.phases and cuda:
        from torch.profiler import ProfilerActivity, profile

        from deepspeed_zero3.bench.gpu.overlap import overlap_of_file
        trace_dir = args.trace_dir or os.path.dirname(os.path.abspath(args.out))
        path = os.path.join(trace_dir, f"trace-{result['runtime']}-{args.model}.json")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step_losses = [train() for _ in range(args.profile_steps)]
            torch.cuda.synchronize()
        losses.extend(loss.item() for loss in step_losses)
        prof.export_chrome_trace(path)
        result["overlap"] = overlap_of_file(path)
        result["trace"] = path

    result["losses"] = [float(loss).hex() for loss in losses]
    result["param_digest"] = digest(engine.module)
    engine.destroy()
    return result


def main(argv=None):
    args = parse(argv)
    result = run(args)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
