"""Keep a plain (unsharded) copy of a ZeRO-3 model in sync after every training step, as an RL loop keeps its
inference engine's weights, through ``deepspeed_zero3.iter_gathered_parameters``.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29701 examples/weight_sync.py

Every rank trains a TinyGPT under ZeRO-3 and holds a plain copy of it (on a GPU box that copy would be the inference
engine, fed on one rank). After each step the weights stream into the copy, one bucket gathered while the previous
is copied; then both models greedily generate from the same prompt, and the tokens must be equal bitwise.
"""

import argparse
import time

import torch
import torch.distributed as dist

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.models import TinyGPT  # a small causal transformer: any nn.Module would do

MODEL = dict(vocab=128, dim=64, heads=4, layers=4, max_seq=64)


def ds_config(bucket: int) -> dict:
    """The whole DeepSpeed config: ZeRO-3, fp32 (CPUs have no fp16), no prefetch reuse."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 10**9,
    }


def token_batch(step: int, rank: int, batch_size=4, seq=16, vocab=MODEL["vocab"]):
    """Random tokens, different per step and rank, the same on every run."""
    generator = torch.Generator().manual_seed(4321 + 7919 * step + 104729 * rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding, one forward per token (every rank runs as many: each forward gathers under ZeRO-3)."""
    tokens = prompt
    for _ in range(new_tokens):
        tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--bucket", type=int, default=50_000, help="stage3_prefetch_bucket_size, also the stream's")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    plain = TinyGPT(**MODEL).eval()  # the inference side: a whole copy, never partitioned
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args.bucket))
    plain.to(engine.device)
    destination = dict(plain.named_parameters())

    for step in range(args.steps):
        inputs, targets = (t.to(engine.device) for t in token_batch(step, rank))
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()

        start = time.perf_counter()
        stream = deepspeed_zero3.iter_gathered_parameters(engine)
        with torch.no_grad():
            for name, tensor in stream:
                destination[name].copy_(tensor)
        synced = time.perf_counter() - start

        prompt = token_batch(100 + step, rank, batch_size=2, seq=4)[0].to(engine.device)
        engine.eval()
        sharded_tokens = greedy(engine.module, prompt, args.new_tokens)
        engine.train()
        plain_tokens = greedy(plain, prompt, args.new_tokens)
        if not torch.equal(sharded_tokens, plain_tokens):
            raise SystemExit(f"rank {rank}, step {step}: the synced copy generated {plain_tokens.tolist()}, the ZeRO-3 "
                             f"model {sharded_tokens.tolist()}")
        if rank == 0:
            stats = stream.stats
            print(f"step {step}: loss {loss.item():.4f}; synced {len(destination)} tensors in {synced * 1000:.1f} ms "
                  f"({stats.allgather_calls} all-gathers, {stats.allgather_numel:,} numel, peak "
                  f"{stats.peak_gathered_numel:,} gathered at once); {args.new_tokens} generated tokens equal",
                  flush=True)
    engine.destroy()
    if rank == 0:
        print("weight sync: the plain copy generated exactly what the ZeRO-3 model generated after every step")


if __name__ == "__main__":
    main()
