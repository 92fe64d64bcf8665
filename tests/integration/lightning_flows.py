"""Lightning flows with DeepSpeedStrategy(stage=3), run on 2 ranks by the tests:

    torchrun --nproc_per_node 2 --master_port P tests/integration/lightning_flows.py --out DIR --flows a,b

Each rank writes DIR/<flow>.rank<R>.json: the runtime that ran (overlay or upstream), "ok" or the
crash (type, message, traceback), and the flow's events in order: every validation and training
batch with the sample ids it used and the loss this rank computed, and every optimizer Lightning
built. Rank 0 also saves the final full parameters (DIR/<flow>.params.pt). The tests replay the
events on a plain-PyTorch reference. The flows run in the order given; after a crash the run
stops (the ranks may no longer be in step).
"""

import datetime
import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402

from common import (crash_record, finish_flow, full_copies, parse_flow_args, make_net, net_loss, runtime_name,  # noqa: E402
                    sample)
from cpu_shims import cpu_deepspeed_strategy  # noqa: E402

FLOW_TIMEOUT_S = int(os.environ.get("ZERO3_INTEGRATION_FLOW_TIMEOUT", "150"))
TRAIN_BATCHES = 4
VAL_BATCHES = 3
BATCH = 4


class RankData(torch.utils.data.Dataset):
    """This rank's own samples (Lightning's distributed sampler is off): rank r always gets the same batches."""

    def __init__(self, split, rank, batches):
        self.split, self.rank, self.n = split, rank, batches * BATCH

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        x, y = sample(self.split, self.rank, index)
        return x, y, index


class FlowModule(pl.LightningModule):
    """Steps call the submodule (`self.net(x)`), the common Lightning pattern."""

    def __init__(self, frozen_mid=False, call_self=False):
        super().__init__()
        self.net = make_net(frozen_mid=frozen_mid)
        self.frozen_mid = frozen_mid
        self.call_self = call_self
        self.events = []

    def forward(self, x):
        return self.net(x)

    def _step(self, kind, batch):
        x, y, ids = batch
        loss = net_loss(self(x) if self.call_self else self.net(x), y)
        self.events.append({"kind": kind, "ids": ids.tolist(), "loss": loss.item(), "mid_training": self.net.mid.training,
                            "grad_enabled": torch.is_grad_enabled()})
        return loss

    def training_step(self, batch, batch_idx):
        return self._step("train", batch)

    def validation_step(self, batch, batch_idx):
        self._step("val", batch)

    def configure_optimizers(self):
        self.events.append({"kind": "optimizer"})
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RankData("train", self.global_rank, TRAIN_BATCHES), batch_size=BATCH)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(RankData("val", self.global_rank, VAL_BATCHES), batch_size=BATCH)


def trainer(**overrides):
    kwargs = dict(accelerator="cpu", devices=2, strategy=cpu_deepspeed_strategy(stage=3,
                                                                                timeout=datetime.timedelta(seconds=120)),
                  max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


# ---------------------------------------------------------------- the flows


def validate_fit_1(model):
    """The reported failure: trainer.validate(model) with one validation batch, then trainer.fit(model)."""
    t = trainer(limit_val_batches=1)
    t.validate(model, verbose=False)
    t.fit(model)


def validate_fit_1_call_self(model):
    """validate_fit_1 with steps that call `self(x)`: the LightningModule, which is the engines' root module,
    is entered a second time inside each step (Lightning runs the step through the root's forward)."""
    validate_fit_1(model)


def validate_fit_3(model):
    t = trainer(limit_val_batches=3)
    t.validate(model, verbose=False)
    t.fit(model)


def frozen_mid(model):
    """net.mid frozen (requires_grad False) and in eval mode for the whole fit; 2 epochs."""
    t = trainer(max_epochs=2, limit_val_batches=2)
    t.fit(model)


def sanity_interval(model):
    """Sanity validation (2 batches) before training, then validation every 2 training batches."""
    t = trainer(num_sanity_val_steps=2, val_check_interval=2, limit_val_batches=2)
    t.fit(model)


def fit_fit(model):
    """fit, then a second Trainer fitting the same module."""
    trainer(limit_val_batches=1).fit(model)
    trainer(limit_val_batches=1).fit(model)


def validate_fit_validate_fit(model):
    """validate -> fit with one Trainer, then validate -> fit with a second one (its validate builds a
    third engine after removing every module hook, as Lightning's inference setup does)."""
    for _ in range(2):
        t = trainer(limit_val_batches=2)
        t.validate(model, verbose=False)
        t.fit(model)


FLOWS = {f.__name__: f for f in (validate_fit_1, validate_fit_1_call_self, validate_fit_3, frozen_mid, sanity_interval, fit_fit,
                                 validate_fit_validate_fit)}


def save_params(model, path):
    copies = full_copies(list(model.net.named_parameters()))
    if int(os.environ["RANK"]) == 0:
        torch.save(copies, path)


def main():
    args = parse_flow_args()
    for name in args.flows.split(","):
        faulthandler.dump_traceback_later(FLOW_TIMEOUT_S, exit=True)
        model = FlowModule(frozen_mid=(name == "frozen_mid"), call_self=name.endswith("_call_self"))
        try:
            FLOWS[name](model)
            save_params(model, os.path.join(args.out, f"{name}.params.pt"))
            record = {"status": "ok"}
        except Exception as exc:  # recorded for the test, then the run stops
            record = crash_record(exc)
        finally:
            faulthandler.cancel_dump_traceback_later()
        record.update(runtime=runtime_name(), events=model.events)
        finish_flow(args.out, name, record)


if __name__ == "__main__":
    main()
