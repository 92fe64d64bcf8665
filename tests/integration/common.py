"""Shared by the flow scripts (inside each launched rank) and the tests (in the pytest process).

Nothing here imports Lightning, transformers or DeepSpeed: the plain-PyTorch reference runs with
none of them.
"""

import argparse
import json
import os
import sys
import traceback

import torch
from torch import nn

WORLD = 2
SEED = 0


# ---------------------------------------------------------------- Lightning's model and data


class Net(nn.Module):
    """A residual-free MLP whose four big weights (>= 147,456 elements) stay partitioned under
    Lightning's DeepSpeedStrategy(stage=3) defaults (stage3_param_persistence_threshold 1e5)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(32, 384)
        self.block1 = nn.Sequential(nn.Linear(384, 384), nn.ReLU())
        # `mid` is the submodule that the frozen flow freezes and keeps in eval mode; its dropout
        # only matters if it were (wrongly) run in training mode.
        self.mid = nn.Sequential(nn.LayerNorm(384), nn.Linear(384, 384), nn.Dropout(dropout))
        self.block2 = nn.Sequential(nn.Linear(384, 384), nn.ReLU())
        self.head = nn.Linear(384, 8)

    def forward(self, x):
        h = self.block1(self.inp(x))
        h = h + self.mid(h)
        return self.head(self.block2(h))


def make_net(frozen_mid: bool = False) -> Net:
    """The same initial weights in every process: seeded right before construction."""
    torch.manual_seed(SEED)
    net = Net(dropout=0.5 if frozen_mid else 0.0)
    if frozen_mid:
        net.mid.requires_grad_(False)
        net.mid.eval()
    return net


def sample(split: str, rank: int, index: int):
    """One (x, y) sample of a split ("train" or "val") for a rank, the same in every process."""
    offset = {"train": 0, "val": 1_000_000}[split]
    generator = torch.Generator().manual_seed(offset + 104_729 * rank + index)
    return torch.randn(32, generator=generator), torch.randn(8, generator=generator)


def net_loss(output, target):
    return nn.functional.mse_loss(output, target)


# ---------------------------------------------------------------- Hugging Face's model and data


def make_llama(**config_overrides):
    """A 2-layer Llama built from a config (never downloaded; no dropout in Llama by default).

    A ``...ForCausalLM`` class on purpose: the Trainer (5.x) knows from the class name that the loss
    shifts the labels and counts the 15 predicted tokens per sequence, so the loss each rank
    reports is the model's own mean token loss, which the reference computes. (For GPT2LMHeadModel
    it would divide the summed loss by 16 tokens per sequence.)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=1, pad_token_id=None, **config_overrides)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def token_sample(split: str, index: int, seq: int = 16):
    offset = {"train": 0, "eval": 1_000_000}[split]
    generator = torch.Generator().manual_seed(offset + index)
    return torch.randint(0, 128, (seq,), generator=generator)


# ---------------------------------------------------------------- results written by each rank


def full_copies(named):
    """Copies of full parameters, ``{name: tensor}``, gathered one at a time: before 0.19.8, upstream's
    ``GatheredParameters`` over several parameters waits on gloo only for the last all-gather, under either
    runtime, so a copy taken inside one over many could read a gather still in flight."""
    import deepspeed

    copies = {}
    for name, param in named:
        with deepspeed.zero.GatheredParameters([param]):
            copies[name] = param.detach().clone()
    return copies


def runtime_name() -> str:
    import deepspeed.runtime.zero.parameter_offload as parameter_offload

    return "overlay" if "deepspeed_zero3" in (parameter_offload.__file__ or "") else "upstream"


def write_result(out_dir: str, flow: str, record: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{flow}.rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def crash_record(exc: BaseException) -> dict:
    return {
        "status": "crash",
        "error_type": type(exc).__name__,
        "error": str(exc),
        "traceback": traceback.format_exc(),
    }


# ---------------------------------------------------------------- shared by the flow scripts and the tests


def parse_flow_args():
    """``--out DIR --flows a,b`` of a flow script; makes DIR and keeps each rank to one thread (2 ranks, 2 cores)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--flows", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    return args


def assert_upstream_deque_crash(results, events):
    """Upstream 0.19.8's crash when a second engine meets the first one's unfinished trace, on every rank."""
    for rank, result in enumerate(results):
        assert result["runtime"] == "upstream"
        assert result["status"] == "crash", f"rank {rank}: upstream no longer crashes"
        assert result["error_type"] == "IndexError"
        assert result["error"] == "pop from an empty deque"
        assert "in reset_step" in result["traceback"] and "record_parameters" in result["traceback"]
        assert [e["kind"] for e in result["events"]] == events


def finish_flow(out, name, record):
    """Write one flow's result; a failed flow ends the rank at once, so the other rank stops instead of hanging."""
    write_result(out, name, record)
    if record["status"] != "ok":
        sys.stderr.write(record["traceback"])
        sys.stderr.flush()
        os._exit(1)


def assert_flows_ok(results, runtime, expected_events):
    """Every rank ran the flow on ``runtime`` to the end, through exactly the expected events."""
    for rank, result in enumerate(results):
        assert result["runtime"] == runtime, result["runtime"]
        assert result["status"] == "ok", f"rank {rank}: {result.get('traceback')}"
        assert [e["kind"] for e in result["events"]] == expected_events
