"""``python -m deepspeed_zero3.bench``: upstream's ZeRO-3 parameter runtime and ours, side by side, in one run.

Launches ``deepspeed_zero3.bench.worker`` through the DeepSpeed launcher next to this interpreter, once
with ``DEEPSPEED_ZERO3=0`` (upstream 0.19.8, untouched) and once with ``DEEPSPEED_ZERO3=1`` (ours), one
launch at a time, then merges the two workers' JSON into ``<out>/results.json``, prints one table per
scenario, and writes ``<out>/timeline.png`` and ``<out>/volume.png``. Launcher output goes to
``<out>/logs/<runtime>.log``.

Exit status: 0 when both launches produced results and every scenario ran ``ok`` on our runtime
(upstream is allowed to crash: that is one of the things measured); 1 otherwise.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from deepspeed_zero3.testing.launching import accelerator, deepspeed_command, read_json, run, runtime_env
from deepspeed_zero3.testing.ports import memory_hint
from deepspeed_zero3.bench import DEFAULT_BUCKET, DEFAULT_STEPS, DEFAULT_WARMUP, RUNTIMES, SCENARIOS

LAUNCH_TIMEOUT_S = 1800


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m deepspeed_zero3.bench",
                                     description="Benchmark upstream DeepSpeed's ZeRO-3 parameter runtime against "
                                     "deepspeed-zero3's, side by side.")
    parser.add_argument("--model", choices=("a", "b"), default="b",
                        help="Model A (residual MLP, 6.3M params) or Model B (0.2M, default; fast)")
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--bucket", type=int, default=None,
                        help="stage3_prefetch_bucket_size (default: 100000 for a, 20000 for b)")
    parser.add_argument("--reuse", type=int, default=0, help="stage3_max_reuse_distance (default 0)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"measured cycles per scenario (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help=f"warm-up cycles per scenario before the measured ones (default {DEFAULT_WARMUP})")
    parser.add_argument("--out", default="bench-out/", help="output folder (default bench-out/)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated subset of: " + ", ".join(SCENARIOS) + " (default: all)")
    parser.add_argument("--timeout", type=int, default=LAUNCH_TIMEOUT_S,
                        help=f"seconds allowed per launch (default {LAUNCH_TIMEOUT_S})")
    parser.add_argument("--frontier", action="store_true",
                        help="instead of the scenarios: Model A training at caps {default, 50%%, 25%%, 10%%} x reuse "
                        "{0, default}; writes frontier.md and frontier.png (bench/frontier.py)")
    parser.add_argument("--generate", action="store_true",
                        help="instead of the scenarios: generate() of a tiny Llama at default keys, caps 50%%/25%% and "
                        "reuse 0, both runtimes; writes <out>/generate/ (bench/generate.py)")
    parser.add_argument("--export", action="store_true",
                        help="instead of the scenarios: copying every full weight out three ways (per-parameter "
                        "GatheredParameters, whole model, iter_gathered_parameters); writes <out>/export/ "
                        "(bench/export.py)")
    parser.add_argument("--save", action="store_true",
                        help="instead of the scenarios: a bf16 Llama to disk, upstream's engine.save_16bit_model "
                        "against deepspeed_zero3.save_16bit_model in 4 MB shards; writes <out>/save/ (bench/save.py)")
    parser.add_argument("--sync", action="store_true",
                        help="instead of the scenarios: a bf16 Llama's weights to a receiver process, WeightSender "
                        "against one GatheredParameters and broadcast per tensor, one raw broadcast and the local "
                        "shards; writes <out>/sync/ (bench/sync.py)")
    from deepspeed_zero3.bench import export, generate, save
    generate.add_arguments(parser)
    export.add_arguments(parser)
    save.add_arguments(parser)
    parser.add_argument("--no-run", action="store_true",
                        help="launch nothing: redo the tables and plots from the raw JSON already in --out")
    parser.add_argument("--planner", action="store_true",
                        help="launch nothing: time the prefetch planner per fetch at windows of 2..500 parameters, "
                        "in this process (writes <out>/planner.json)")
    args = parser.parse_args(argv)
    if args.frontier:
        from deepspeed_zero3.bench.frontier import FRONTIER_SCENARIOS
        args.model, args.scenarios = "a", ",".join(FRONTIER_SCENARIOS)
        known = FRONTIER_SCENARIOS
    else:
        known = SCENARIOS
    if args.bucket is None:
        args.bucket = DEFAULT_BUCKET[args.model]
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in known]
    if unknown or not wanted:
        parser.error(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SCENARIOS)}")
    if args.steps < 1 or args.warmup < 0 or args.world < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, --world >= 1")
    if sum((args.frontier, args.generate, args.export, args.save, args.sync, args.planner)) > 1:
        parser.error("--frontier, --generate, --export, --save, --sync and --planner are separate runs: pick one")
    if args.tokens < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error(f"--tokens, --rounds and --repeats must be >= 1 (got {args.tokens}, {args.rounds}, "
                     f"{args.repeats})")
    args.scenarios = [s for s in known if s in wanted]  # canonical order: validate_fit last
    if not args.no_run and not args.planner:
        check_world_fits(parser, args.world, accelerator())
    return args


def check_world_fits(parser, world: int, accel: str) -> None:
    """On GPUs the launcher starts one rank per GPU: refuse a --world this machine cannot launch, up front."""
    if accel != "cuda":
        return
    import torch
    count = torch.cuda.device_count()
    if world > count:
        parser.error(f"--world {world} needs {world} GPUs and this machine has {count}: use --world {max(count, 1)}"
                     f"{'' if count else ' with a GPU'}, or DS_ACCELERATOR=cpu for CPU ranks")


class Launch:
    """One worker launch: its command, its log, the JSON its rank 0 keeps up to date, and how it ended."""

    def __init__(self, runtime: str, args, out: Path):
        self.runtime = runtime
        self.world = args.world
        self.raw_path = out / "raw" / f"{runtime}.json"
        self.log_path = out / "logs" / f"{runtime}.log"
        self.target = [
            "--module", "deepspeed_zero3.bench.worker",
            "--out", str(self.raw_path), "--model", args.model, "--bucket", str(args.bucket),
            "--reuse", str(args.reuse), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--scenarios", ",".join(args.scenarios),
        ]
        self.launched = None  # how it ended (a Launched), once run

    def run(self, bar, timeout: int) -> int:
        """Launch and wait, moving ``bar`` as the worker reports scenarios done; returns how many it finished."""
        for path in (self.raw_path, self.log_path):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        done, shown = 0, None

        def show_progress():
            nonlocal done, shown
            progress = (read_json(self.raw_path) or {}).get("progress") or {}
            finished = len(progress.get("done") or [])
            if finished > done:
                bar.update(finished - done)
                done = finished
            postfix = f"{self.runtime}: {progress.get('running') or ('starting' if not done else 'finishing')}"
            if postfix != shown:  # redraw on change only: a log file gets a line per change, not per poll
                bar.set_postfix_str(postfix)
                shown = postfix

        self.launched = run(lambda port: deepspeed_command(self.world, port, self.target),
                            runtime_env(self.runtime, self.world), timeout, log=self.log_path, on_poll=show_progress)
        return done

    def result(self):
        raw = read_json(self.raw_path)
        if raw is not None and raw.get("meta", {}).get("runtime") != self.runtime:
            raise SystemExit(f"the {self.runtime} launch ran the {raw['meta'].get('runtime')} runtime "
                             f"(parameter_offload from {raw['meta'].get('parameter_offload')}); is the overlay "
                             f"installed (`pip install .`, not -e)? `python -m deepspeed_zero3` says")
        return raw

    def log_tail(self, lines=40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def run_launches(args, out: Path):
    """Both launches, one at a time, under one progress bar; returns ({runtime: raw JSON or None}, failures, launches)."""
    from tqdm import tqdm

    launches = [Launch(rt, args, out) for rt in RUNTIMES]
    raw, failures = {}, []
    with tqdm(total=len(launches) * len(args.scenarios), desc="bench", unit="scenario", dynamic_ncols=True,
              file=sys.stderr) as bar:
        for launch in launches:
            done = launch.run(bar, args.timeout)
            bar.update(len(args.scenarios) - done)  # a failed launch still moves the bar to its end
            raw[launch.runtime] = launch.result()
            launched = launch.launched
            if launched.returncode != 0 or raw[launch.runtime] is None or launched.timed_out:
                why = "timed out" if launched.timed_out else f"exit status {launched.returncode}"
                failures.append(f"{launch.runtime} launch: {why}")
                tqdm.write(f"{launch.runtime} launch failed ({why}); last lines of {launch.log_path}:\n"
                           f"{launch.log_tail()}\n{memory_hint()}", file=sys.stderr)
    return raw, failures, launches, accelerator()


def write_frontier(summary, out: Path) -> dict:
    """frontier.md (the table) and frontier.png (the two curves) next to the other results."""
    from deepspeed_zero3.bench import frontier

    (out / "frontier.md").write_text(frontier.markdown(summary))
    print(frontier.markdown(summary))
    try:
        return {"frontier": frontier.plot(summary, out / "frontier.png")}
    except ImportError as exc:
        print(f"frontier plot skipped: {exc} (pip install matplotlib)", file=sys.stderr)
        return {}


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.generate or args.export or args.save or args.sync:
        from deepspeed_zero3.bench import export, generate, save, sync
        return (generate if args.generate else export if args.export else save if args.save else sync).main(args)
    if args.planner:
        from deepspeed_zero3.bench import planner
        return planner.main(["--out", str(out / "planner.json")])
    started = time.time()
    previous = read_json(out / "results.json") if args.no_run else None

    if args.no_run:
        raw = {rt: read_json(out / "raw" / f"{rt}.json") for rt in RUNTIMES}
        present = {name for r in raw.values() if r for name in r.get("scenarios", {})}
        args.scenarios = [s for s in args.scenarios if s in present]
        failures = [f"{rt}: no {out / 'raw' / (rt + '.json')}" for rt in RUNTIMES if raw[rt] is None]
        launches, accel = [], (previous or {}).get("meta", {}).get("accelerator")
    else:
        raw, failures, launches, accel = run_launches(args, out)

    from deepspeed_zero3.bench import plots, report

    summary = report.summarize(raw, args.scenarios)
    versions = (raw.get("ours") or raw.get("upstream") or {}).get("meta") or {}
    meta = dict(dict(world=args.world, bucket=args.bucket, reuse=args.reuse), **versions)
    table = report.text_table(summary, meta)
    (out / "table.txt").write_text(table + "\n")
    (out / "table.md").write_text(report.markdown_table(summary, meta))

    plot_paths = {}
    try:
        plot_paths["timeline"] = plots.plot_timeline(raw, out / "timeline.png")
        plot_paths["volume"] = plots.plot_volume(summary, out / "volume.png")
    except ImportError as exc:  # matplotlib comes with the [test] extra
        print(f"plots skipped: {exc} (pip install matplotlib)", file=sys.stderr)

    if args.frontier:
        plot_paths.update(write_frontier(summary, out))
    for name in args.scenarios:
        status = summary[name]["ours"].get("status")
        if status != "ok":
            failures.append(f"ours {name}: {status} {summary[name]['ours'].get('error') or ''}".strip())
    if previous is not None:  # --no-run keeps what the launches measured (wall time, date, command)
        run_meta = dict(previous.get("meta") or {}, failures=failures)
    else:
        run_meta = {
            "command": " ".join(["python -m deepspeed_zero3.bench", *(argv if argv is not None else sys.argv[1:])]),
            "args": vars(args),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "accelerator": accel,
            "wall_seconds": round(time.time() - started, 1),
            "launch_seconds": {launch.runtime: launch.launched.seconds for launch in launches},
            "loadavg_1min": {launch.runtime: launch.launched.loadavg for launch in launches},
            "runtimes": {rt: (raw.get(rt) or {}).get("meta") for rt in RUNTIMES},
            "failures": failures,
        }
    results = {
        "meta": run_meta,
        "summary": summary,
        "raw": raw,
        "plots": {k: str(v) for k, v in plot_paths.items() if v is not None},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))

    print(table)
    print(f"torch {versions.get('torch', '?')}, deepspeed {versions.get('deepspeed', '?')}, "
          f"{versions.get('backend', '?')}, {os.cpu_count()} CPU cores"
          + (f", {versions.get('device')}" if versions.get("device") not in (None, "cpu") else "")
          + "".join(f"; {rt} launch {run_meta['launch_seconds'].get(rt, 0):.0f}s, load average {load[0]} -> {load[1]}"
                    for rt, load in (run_meta.get("loadavg_1min") or {}).items() if load))
    print(f"results: {out / 'results.json'}; plots: {', '.join(str(p) for p in plot_paths.values() if p) or 'none'}; "
          f"wall time {run_meta.get('wall_seconds', 0):.0f}s")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
