"""Train a tiny GPT with ZeRO stage 3 and report what the deepspeed-zero3 runtime gathered.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29700 examples/train_gpt.py

The token embedding and the first block are frozen and stay in eval mode while the rest
trains (a partially frozen model, as LoRA or a frozen vision tower makes), and an eval pass
runs every 10 steps: each kind of pass keeps its own prefetch trace here, where upstream's one
trace spans them all and fetches on demand whenever the kind changes. After training, a second (inference) engine is built over the same model, the
validate-then-fit pattern, and the training engine must still step afterwards.
"""

import argparse
import copy
import os
import time
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm

import deepspeed
from deepspeed_zero3.testing.models import TinyGPT, count_params

# torch deprecates two collectives that upstream DeepSpeed's ZeRO-3 calls: nothing a user of this demo can change.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                        r"deprecated", category=FutureWarning)

# Character-level corpus: short and repetitive, so a model this small learns it in ~60 steps.
CORPUS = ("the cat sat on the mat. the dog sat on the log. the cat saw the dog. "
          "the dog saw the cat. a cat and a dog sat on a mat and a log. ") * 8
SPARKS = "▁▂▃▄▅▆▇█"


class PartlyFrozenGPT(TinyGPT):
    """TinyGPT whose token embedding and first block are frozen and always in eval mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.frozen = [self.tok, self.blocks[0]]
        for module in self.frozen:
            module.requires_grad_(False)
        self.train()

    def train(self, mode=True):
        # engine.train() calls module.train() on the whole tree; re-freeze after it.
        super().train(mode)
        for module in getattr(self, "frozen", []):
            module.eval()
        return self


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default="demo-out/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--local_rank", type=int, default=-1)  # appended by the launcher
    args, _ = parser.parse_known_args()
    return args


def ds_config(args, cuda: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            # 0 = nothing stays resident: every parameter is gathered, so the stats show the runtime at work.
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 20000,
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cuda:  # CPUs get fp32: bf16 matmuls there are slow and gain nothing for the demo
        config["bf16"] = {"enabled": True}
    return config


def make_batch(step: int, rank: int, args, split_seed: int):
    """Random windows of the corpus, the same for the same (seed, step, rank) in every run."""
    data = torch.tensor([ord(c) for c in CORPUS], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + split_seed + 7919 * step + 104729 * rank)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch, ), generator=gen)
    windows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def mean_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def evaluate(engine, args, rank: int, batches: int = 2) -> float:
    engine.eval()
    losses = []
    with torch.no_grad():
        for i in range(batches):
            x, y = (t.to(engine.device) for t in make_batch(i, rank, args, split_seed=555))
            losses.append(engine(x, y).float().item())
    engine.train()
    return mean_over_ranks(sum(losses) / len(losses), engine.device)


def sparkline(values, width=60) -> str:
    if len(values) > width:  # average into `width` buckets
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))] for v in values)


def save_plot(path, train_losses, eval_points) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: skipping the loss plot"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(train_losses) + 1), train_losses, label="train (rank 0)")
    if eval_points:
        ax.plot(*zip(*eval_points), "o-", label="eval (mean of ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("TinyGPT, ZeRO stage 3")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss plot: {path}"


def print_stats(stats, model_numel: int):
    if stats is None:
        print("gather statistics need the deepspeed-zero3 overlay (inactive here, e.g. DEEPSPEED_ZERO3=0)")
        return
    print(f"gather statistics (model: {model_numel:,} params, rank 0):")
    print(f"  {'pass':<13}{'all-gathers':>12}{'gathered':>11}{'on demand':>11}{'peak live':>11}{'traces':>8}")
    for kind in ("forward", "eval_forward", "backward"):
        last = next((p for p in reversed(stats["passes"]) if p["kind"] == kind), None)
        if last is None:
            print(f"  {kind:<13}(no pass)")
            continue
        traces = stats["totals"].get(kind, {}).get("trace_records", 0)
        print(f"  {kind:<13}{last['allgather_calls']:>12}{last['allgather_numel'] / model_numel:>10.2f}x"
              f"{last['demand_numel']:>11,}{100 * last['peak_live_numel'] / model_numel:>10.1f}%{traces:>8}")
    print("  (last pass of each kind; gathered = numel / model size; traces = records over the whole run)")


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # ranks share the cores; oversubscribed OpenMP threads make every op ~20x slower
        local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()

    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model = PartlyFrozenGPT(vocab=128, dim=64, heads=4, layers=4, max_seq=args.seq)
    config = ds_config(args, cuda)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))
    model_numel = count_params(model)

    train_losses, eval_points = [], []
    started = time.time()
    bar = tqdm(range(1, args.steps + 1), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        x, y = (t.to(engine.device) for t in make_batch(step, rank, args, split_seed=0))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        train_losses.append(loss.float().item())
        postfix = {"loss": f"{train_losses[-1]:.3f}"}
        if step % args.eval_every == 0 or step == args.steps:
            eval_points.append((step, evaluate(engine, args, rank)))
            postfix["eval"] = f"{eval_points[-1][1]:.3f}"
        bar.set_postfix(postfix)
    bar.close()
    train_seconds = time.time() - started
    assert all(not m.training for m in model.frozen), "frozen modules left eval mode"

    try:  # taken before the second engine adds its passes
        import deepspeed_zero3
        stats = deepspeed_zero3.get_zero3_stats(engine)
    except (ImportError, ValueError):  # overlay not installed, or disabled with DEEPSPEED_ZERO3=0
        stats = None

    # Validate with a separate inference engine over the same (already partitioned) model, then fit on.
    infer_engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config))
    infer_engine.eval()
    with torch.no_grad():
        x, y = (t.to(infer_engine.device) for t in make_batch(0, rank, args, split_seed=555))
        val_loss = mean_over_ranks(infer_engine(x, y).float().item(), infer_engine.device)
    engine.train()
    x, y = (t.to(engine.device) for t in make_batch(args.steps + 1, rank, args, split_seed=0))
    extra_loss = engine(x, y)
    engine.backward(extra_loss)
    engine.step()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"\n=== summary: {args.steps} steps in {train_seconds:.1f}s on {dist.get_world_size()} ranks "
              f"({'cuda, bf16' if cuda else 'cpu, fp32'}) ===")
        print(f"train loss  {train_losses[0]:.3f} -> {train_losses[-1]:.3f}   {sparkline(train_losses)}")
        print("eval loss   " + "  ".join(f"step {s}: {v:.3f}" for s, v in eval_points))
        print(save_plot(os.path.join(args.out, "loss.png"), train_losses, eval_points))
        print_stats(stats, model_numel)
        print(f"second engine: inference engine validation loss {val_loss:.3f}; "
              f"training engine stepped again afterwards (loss {extra_loss.float().item():.3f}) -- both work")
    dist.barrier()


if __name__ == "__main__":
    main()
