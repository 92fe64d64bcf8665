"""``python -m deepspeed_zero3.bench.soak``: the soak, launched on ``--world`` ranks with our runtime on.

Runs ``deepspeed_zero3.bench.soak.worker`` through the DeepSpeed launcher next to this interpreter
(``DS_ACCELERATOR=cpu`` and gloo without a GPU, NCCL with), with the launcher's output on this terminal
(rank 0 shows a progress bar), then adds the wall time and load average to ``<out>/soak.json``.

Exit status: 0 when the launch finished and every enforced flatness criterion held; 1 otherwise.
"""

import os
import sys
from pathlib import Path

from deepspeed_zero3.bench.__main__ import check_world_fits
from deepspeed_zero3.bench.soak import options
from deepspeed_zero3.bench.worker import write_json
from deepspeed_zero3.testing.launching import accelerator, deepspeed_command, read_json, run, runtime_env

LAUNCH_TIMEOUT_S = 1800


def parse_args(argv=None):
    parser = options.build_parser("python -m deepspeed_zero3.bench.soak",
                                  "Soak the deepspeed-zero3 runtime: training, eval forwards, generation and extra "
                                  "engines over one model; live gathered numel, hooks and RSS must stay flat.")
    parser.add_argument("--timeout", type=int, default=LAUNCH_TIMEOUT_S,
                        help=f"seconds allowed for the launch (default {LAUNCH_TIMEOUT_S})")
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error(f"--timeout must be >= 1 second, got {args.timeout}")
    args = options.check_args(parser, args)
    check_world_fits(parser, args.world, accelerator())
    return args


def worker_target(args) -> list:
    """What the launcher runs on every rank: the soak worker with this run's flags."""
    flags = ["--steps", args.steps, "--world", args.world, "--eval-every", args.eval_every,
             "--generate-every", args.generate_every, "--generate-tokens", args.generate_tokens,
             "--engine-every", args.engine_every, "--bucket", args.bucket, "--max-rss-slope", args.max_rss_slope,
             "--out", args.out]
    return ["--module", "deepspeed_zero3.bench.soak.worker", *flags] + (["--relaxed"] if args.relaxed else [])


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").unlink(missing_ok=True)  # a failed launch must not leave the last run's verdict behind
    launched = run(lambda port: deepspeed_command(args.world, port, worker_target(args)),
                   runtime_env("ours", args.world), args.timeout)
    if launched.timed_out:
        print(f"soak: the launch ran past --timeout {args.timeout}s and was stopped", file=sys.stderr)
        return 1
    result = read_json(out / "soak.json")
    if result is None:
        print(f"soak: the launch exited {launched.returncode} without writing {out / 'soak.json'} (see the output "
              "above)", file=sys.stderr)
        return 1
    result["meta"].update(wall_seconds=launched.seconds, loadavg_1min=launched.loadavg,
                          command=" ".join(["python -m deepspeed_zero3.bench.soak", *(argv or sys.argv[1:])]))
    write_json(out / "soak.json", result)
    load_before, load_after = launched.loadavg
    print(f"soak: wall time {launched.seconds:.0f}s (launch included), 1-min load average {load_before:.1f} -> "
          f"{load_after:.1f}, {os.cpu_count()} CPU cores; results {out / 'soak.json'}, plot {out / 'soak.png'}")
    return 0 if launched.returncode == 0 and result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
