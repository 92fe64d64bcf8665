"""``python -m deepspeed_zero3.bench.soak``: the soak, launched on ``--world`` ranks with our runtime on.

Runs ``deepspeed_zero3.bench.soak.worker`` through the DeepSpeed launcher next to this interpreter
(``DS_ACCELERATOR=cpu`` and gloo without a GPU, NCCL with), with the launcher's output on this terminal
(rank 0 shows a progress bar), then adds the wall time and load average to ``<out>/soak.json``.

Exit status: 0 when the launch finished and every enforced flatness criterion held; 1 otherwise.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from deepspeed_zero3.bench.__main__ import Launch, accelerator, check_world_fits, find_launcher, read_json
from deepspeed_zero3.bench.soak import options
from deepspeed_zero3.bench.worker import write_json
from deepspeed_zero3.testing.ports import LaunchPort

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


def worker_command(args, launcher: str, port: int) -> list:
    flags = ["--steps", args.steps, "--world", args.world, "--eval-every", args.eval_every,
             "--generate-every", args.generate_every, "--generate-tokens", args.generate_tokens,
             "--engine-every", args.engine_every, "--bucket", args.bucket, "--max-rss-slope", args.max_rss_slope,
             "--out", args.out]
    return ([launcher, "--num_gpus", str(args.world), "--master_port", str(port),
             "--module", "deepspeed_zero3.bench.soak.worker"] + [str(f) for f in flags]
            + (["--relaxed"] if args.relaxed else []))


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").unlink(missing_ok=True)  # a failed launch must not leave the last run's verdict behind
    env = dict(os.environ, DEEPSPEED_ZERO3="1", DS_ACCELERATOR=accelerator(), LOCAL_SIZE=str(args.world),
               PYTHONUNBUFFERED="1")
    load_before, start = os.getloadavg()[0], time.time()
    with LaunchPort() as port:
        proc = subprocess.Popen(worker_command(args, find_launcher(), port.port), env=env,
                                start_new_session=True)  # its own session: stopped as a group
        try:
            returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            Launch._stop(proc)
            print(f"soak: the launch ran past --timeout {args.timeout}s and was stopped", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            Launch._stop(proc)
            raise
    wall = time.time() - start
    result = read_json(out / "soak.json")
    if result is None:
        print(f"soak: the launch exited {returncode} without writing {out / 'soak.json'} (see the output above)",
              file=sys.stderr)
        return 1
    result["meta"].update(wall_seconds=round(wall, 1), loadavg_1min=[round(load_before, 2),
                                                                    round(os.getloadavg()[0], 2)],
                          command=" ".join(["python -m deepspeed_zero3.bench.soak", *(argv or sys.argv[1:])]))
    write_json(out / "soak.json", result)
    print(f"soak: wall time {wall:.0f}s (launch included), 1-min load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPU cores; results {out / 'soak.json'}, plot {out / 'soak.png'}")
    return 0 if returncode == 0 and result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
