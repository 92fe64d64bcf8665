"""The soak's worker: runs the workload on every rank under the DeepSpeed launcher; rank 0 reports.

Started by ``python -m deepspeed_zero3.bench.soak``, equivalent to

    DEEPSPEED_ZERO3=1 DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 --master_port P \\
        --module deepspeed_zero3.bench.soak.worker --steps 500 --out soak-out/

Every rank samples its own process (``probe.py``) at the end of each step. After the last step the
engines are destroyed, the samples go to rank 0, and rank 0 writes ``<out>/soak.json`` and
``<out>/soak.png`` and prints the table.

Flatness criteria, judged on every rank (``report.py``):

* live gathered numel is exactly 0 at every step end;
* the number of ZeRO hooks at step ends is constant, and 0 once every engine is destroyed;
* the RSS slope over the second half of the run (least squares) is below ``--max-rss-slope``,
  4 KiB/step by default (why that number: ``options.py``);
* no trace is recorded after the first full cycle of the schedule.

Exit status: 0 when every enforced criterion holds (``--relaxed`` enforces only the first two), 1 when
one fails, 2 when our runtime is not the one running.
"""

import os
import sys
import time
from array import array
from pathlib import Path

import torch

import deepspeed

from deepspeed_zero3.bench.soak import options, plot, report
from deepspeed_zero3.bench.soak.probe import Probe, module_hooks
from deepspeed_zero3.bench.soak.workload import Workload, event_names
from deepspeed_zero3.bench.worker import init_process_group, runtime_name, write_json
from deepspeed_zero3.runtime.zero.param_registry import find_registry
from deepspeed_zero3.testing.models import count_params


def parse_args(argv=None):
    parser = options.build_parser("deepspeed_zero3.bench.soak.worker", "deepspeed-zero3 soak worker (run by the driver)")
    parser.add_argument("--local_rank", type=int, default=-1)  # appended by the launcher
    args, _ = parser.parse_known_args(argv)
    return options.check_args(parser, args)


def run(args, rank: int, device: torch.device) -> dict:
    """The soak loop on this rank; returns its samples."""
    from tqdm import tqdm

    workload = Workload(args, rank, device)
    probe = Probe(workload.model, workload.trainer, args.steps)
    seconds, events = array("d", [0.0]) * args.steps, array("B", [0]) * args.steps
    with tqdm(total=args.steps, desc="soak", unit="step", disable=rank != 0, dynamic_ncols=True, mininterval=1.0,
              file=sys.stderr) as bar:
        for step in range(args.steps):
            start = time.perf_counter()
            events[step] = workload.run_step(step)
            seconds[step] = time.perf_counter() - start
            sample = probe.sample(step)
            if rank == 0:
                bar.set_postfix(rss_mib=f"{sample['rss_kib'] / 1024:.1f}", live=sample["live_numel"],
                                hooks=sample["zero_hooks"], refresh=False)
                bar.update(1)
    model, numel = workload.model, count_params(workload.model)
    workload.close()
    registry = find_registry(model)
    after_close = {"zero_hooks": 0 if registry is None else registry.hook_count(), "module_hooks": module_hooks(model)}
    return {"series": probe.as_lists(), "seconds": seconds.tolist(), "events": [event_names(m) for m in events],
            "after_close": after_close, "losses": workload.losses.tolist(), "numel": numel}


def main(argv=None):
    args = parse_args(argv)
    if runtime_name() != "ours":
        sys.stderr.write("the soak measures the deepspeed-zero3 runtime, but upstream's is running "
                         "(DEEPSPEED_ZERO3=0, or an editable install?); `python -m deepspeed_zero3` says why\n")
        os._exit(2)
    rank, world, device, backend = init_process_group()
    record = run(args, rank, device)
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, record)
    status = 0
    if rank == 0:
        meta = {
            "steps": args.steps, "world": world, "backend": backend,
            "model": f"TinyGPT ({record['numel']:,} params)",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "args": {k: v for k, v in vars(args).items() if k != "local_rank"},
        }
        result = report.build(per_rank, meta, options.cycle_length(args), args.max_rss_slope, args.relaxed)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "soak.json", result)
        try:
            plot.plot(result, out / "soak.png")
        except ImportError as exc:  # matplotlib comes with the [test] extra
            print(f"plot skipped: {exc} (pip install matplotlib)", file=sys.stderr)
        print(report.table(result), flush=True)
        status = 0 if result["passed"] else 1
    sys.stdout.flush()
    sys.stderr.flush()
    # As the bench worker: nothing torn down at interpreter exit (process group, engines) may change the status.
    os._exit(status)


if __name__ == "__main__":
    main()
