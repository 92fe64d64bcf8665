"""``python -m deepspeed_zero3.bench --generate``: generation under ZeRO-3, upstream's runtime against ours.

A tiny HF Llama (853,120 parameters, 4 layers, ``stage3_param_persistence_threshold: 0``) on 2 ranks generates
``--tokens`` tokens with ``synced_gpus=True`` after a training step, for ``--warmup`` + ``--rounds`` rounds (a
training step, then one ``generate()``), at each of four settings: DeepSpeed's default prefetch keys, the live
cap at 50% and at 25% of the model, and reuse distance 0. One launch per runtime runs every setting.

Measured by the same outside instrument for both runtimes (``GatherMeter``: all-gathers counted at
``deepspeed.comm``, peak = the non-persistent numel AVAILABLE after each module's fetch), over the measured
rounds' ``generate()`` calls only: gathered numel and all-gathers per token, peak, and the median over rounds of
wall and CPU seconds per token on rank 0; the generated tokens of every rank, hashed, must be equal.

A third launch runs ours with ``DEEPSPEED_ZERO3_PASS_AGREEMENT=0``, in the same run: what the ranks' agreement on
each gathering pass ([Note: ranks in different passes]) costs per token, against the same runtime without it.
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

SETTINGS = {  # name -> (live cap as a fraction of the model or None, reuse distance)
    "default keys": (None, 1_000_000_000),
    "cap 50%": (0.5, 1_000_000_000),
    "cap 25%": (0.25, 1_000_000_000),
    "reuse 0": (None, 0),
}
RUNTIMES = ("upstream", "ours")
# Launch name -> (runtime, extra environment): the two runtimes, then ours without the pass agreement.
LAUNCHES = {"upstream": ("upstream", {}), "ours": ("ours", {}),
            "ours, pass check off": ("ours", {"DEEPSPEED_ZERO3_PASS_AGREEMENT": "0"})}
MODEL_NUMEL = 853_120


def tiny_llama():
    """Four Llama layers from a config (never downloaded): 853,120 parameters, the largest module 98,304."""
    from deepspeed_zero3.testing.models import llama_from_config

    return llama_from_config(vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, bos_token_id=0,
                             eos_token_id=1, pad_token_id=0)


# ---------------------------------------------------------------------------------------------- worker


def _engine(setting: str):
    import torch

    from deepspeed_zero3.testing.engines import training_engine, zero3_config

    fraction, reuse = SETTINGS[setting]
    torch.manual_seed(41)
    model = tiny_llama()
    cap = None if fraction is None else int(MODEL_NUMEL * fraction)
    # DeepSpeed's default bucket (50M): as large as the model, so both runtimes may prefetch all of it.
    engine = training_engine(model, zero3_config(bucket=50_000_000, reuse=reuse, max_live=cap))
    return model, engine


def _measure(setting: str, args, rank: int) -> dict:
    import torch

    from deepspeed_zero3.testing.engines import token_batch
    from deepspeed_zero3.testing.instrument import GatherMeter

    model, engine = _engine(setting)
    tokens_hash = hashlib.sha256()
    wall, cpu = [], []
    pass_checks = 0  # ours: the ranks' agreements on a pass in the measured generate() calls
    try:
        with GatherMeter(model) as meter:
            for round_ in range(args.warmup + args.rounds):
                measured = round_ >= args.warmup
                with meter.phase("train"):
                    ids, _ = token_batch(round_, rank, batch_size=2, seq=16, vocab=768)
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                prompt, _ = token_batch(500 + round_, rank, batch_size=2, seq=8, vocab=768)
                torch.distributed.barrier()
                checks_before = _pass_checks(engine)
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                with meter.phase("generate" if measured else "warmup"), torch.no_grad():
                    out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                         do_sample=False, synced_gpus=True, pad_token_id=0)
                torch.distributed.barrier()
                if measured:
                    wall.append((time.perf_counter() - start_wall) / args.tokens)
                    cpu.append((time.thread_time() - start_cpu) / args.tokens)
                    pass_checks += _pass_checks(engine) - checks_before
                everyone = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(everyone, out.tolist())
                tokens_hash.update(json.dumps(everyone).encode())
        counts = meter.snapshot()["generate"]
    finally:
        engine.destroy()
    generated = args.rounds * args.tokens
    return {
        "gathered_per_token": counts["allgather_numel"] / generated / MODEL_NUMEL,
        "allgathers_per_token": counts["allgather_calls"] / generated,
        "peak": counts["peak_live_numel"] / MODEL_NUMEL,
        "seconds_per_token": statistics.median(wall),
        "cpu_seconds_per_token": statistics.median(cpu),
        "seconds_per_token_rounds": wall,
        "tokens_sha256": tokens_hash.hexdigest(),
        "pass_checks_per_token": pass_checks / generated,
    }


def _pass_checks(engine) -> int:
    """Pass checks so far in eval forwards (ours; 0 under upstream's runtime, which has no such counter)."""
    import deepspeed_zero3

    try:
        totals = deepspeed_zero3.get_zero3_stats(engine)["totals"]
    except ValueError:
        return 0
    return totals.get("eval_forward", {}).get("pass_checks", 0)


def worker(argv) -> None:
    import datetime

    import torch

    import deepspeed
    from deepspeed_zero3.bench.runtime import runtime_name

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    rank = torch.distributed.get_rank()
    runtime = runtime_name()
    results = {"runtime": runtime, "torch": torch.__version__, "deepspeed": deepspeed.__version__, "settings": {}}
    for setting in SETTINGS:
        try:
            results["settings"][setting] = _measure(setting, args, rank)
        except Exception as exc:  # a crash is a result; the ranks raise together or the launch times out
            results["settings"][setting] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if rank == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------- driver


def table(results: dict) -> str:
    from deepspeed_zero3.bench.tables import markdown_table

    rows = []
    for setting in SETTINGS:
        up, ours = (results.get(rt, {}).get("settings", {}).get(setting, {}) for rt in RUNTIMES)

        def cell(side, key, pattern):
            return side["error"][:40] if "error" in side else (pattern.format(side[key]) if key in side else "-")

        same = ("yes" if up.get("tokens_sha256") and up.get("tokens_sha256") == ours.get("tokens_sha256") else "NO")
        ratio = (f"{ours['seconds_per_token'] / up['seconds_per_token']:.2f}"
                 if "seconds_per_token" in up and "seconds_per_token" in ours else "-")
        rows.append([setting,
                     cell(up, "gathered_per_token", "{:.3f}x"), cell(ours, "gathered_per_token", "{:.3f}x"),
                     cell(up, "allgathers_per_token", "{:.2f}"), cell(ours, "allgathers_per_token", "{:.2f}"),
                     cell(up, "peak", "{:.1%}"), cell(ours, "peak", "{:.1%}"),
                     cell(up, "seconds_per_token", "{:.4f}"), cell(ours, "seconds_per_token", "{:.4f}"), ratio, same])
    header = ["setting", "gathered/token upstream", "ours", "all-gathers/token upstream", "ours", "peak upstream",
              "ours", "s/token upstream", "ours", "ours/upstream", "tokens equal"]
    return markdown_table(header, rows)


def check_table(results: dict) -> str:
    """Ours with the pass agreement and without, launched in the same run: seconds and pass checks per token."""
    from deepspeed_zero3.bench.tables import markdown_table

    rows = []
    for setting in SETTINGS:
        on, off = (results.get(launch, {}).get("settings", {}).get(setting, {})
                   for launch in ("ours", "ours, pass check off"))
        ratio = (f"{on['seconds_per_token'] / off['seconds_per_token']:.2f}"
                 if "seconds_per_token" in on and "seconds_per_token" in off else "-")
        same = "yes" if on.get("tokens_sha256") and on.get("tokens_sha256") == off.get("tokens_sha256") else "NO"
        rows.append([setting, f"{on.get('pass_checks_per_token', float('nan')):.2f}",
                     f"{off.get('pass_checks_per_token', float('nan')):.2f}",
                     f"{on.get('seconds_per_token', float('nan')):.4f}", f"{off.get('seconds_per_token', float('nan')):.4f}",
                     ratio, same])
    header = ["setting", "pass checks/token, check on", "off", "s/token, check on", "off", "on/off", "tokens equal"]
    return markdown_table(header, rows)


def plot(results: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot([0, 1], [1, 0], color="0.6", linestyle="--", linewidth=1, label="1 - B (gather only what does not fit)")
    for runtime, color, marker, offset in (("upstream", "tab:red", "s", (-6, 8)), ("ours", "tab:blue", "o", (-6, -12))):
        points = {}
        for setting in SETTINGS:
            side = results.get(runtime, {}).get("settings", {}).get(setting, {})
            if "peak" in side:
                points.setdefault((round(side["peak"], 3), round(side["gathered_per_token"], 3)), []).append(setting)
        for index, ((x, y), settings) in enumerate(points.items()):
            ax.scatter(x, y, color=color, marker=marker, s=40, label=runtime if index == 0 else None, zorder=3)
            # Settings that land on one point share one label.
            ax.annotate(", ".join(settings), (x, y), fontsize=7, color=color, xytext=offset, textcoords="offset points",
                        ha="right")
    ax.set_xlabel("peak gathered, fraction of the model (B)")
    ax.set_ylabel("gathered per generated token, x model")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(-0.05, 1.1)
    ax.set_title("generate() under ZeRO-3: tiny Llama, 2 ranks", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> int:
    """The driver: one launch per runtime, then the table (``generate.md``), ``generate.json`` and the plot."""
    from deepspeed_zero3.testing import launching

    out = Path(args.out) / "generate"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results, failures = {}, []
    for launch, (runtime, extra) in LAUNCHES.items():
        stem = launch.replace(", ", "_").replace(" ", "_")
        raw = out / f"{stem}.json"
        raw.unlink(missing_ok=True)
        print(f"generate: {launch} launch, {len(SETTINGS)} settings x {args.warmup + args.rounds} rounds "
              f"(log {out / 'logs' / (stem + '.log')})", file=sys.stderr, flush=True)
        launched = launching.run(
            lambda port: launching.deepspeed_command(2, port, [
                "--module", "deepspeed_zero3.bench.generate", "--worker", "--out", str(raw), "--tokens",
                str(args.tokens), "--rounds", str(args.rounds), "--warmup", str(args.warmup)]),
            launching.runtime_env(runtime, 2, **extra), args.timeout, log=out / "logs" / f"{stem}.log")
        if launched.returncode != 0 or not raw.exists():
            failures.append(f"{launch} launch: exit {launched.returncode}{' (timed out)' if launched.timed_out else ''}")
        results[launch] = json.loads(raw.read_text()) if raw.exists() else {}
    text = table(results) + "\n\n" + check_table(results)
    (out / "generate.md").write_text(text + "\n")
    (out / "generate.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, out / "generate.png")
    except ImportError as exc:
        print(f"plot skipped: {exc}", file=sys.stderr)
    print(text)
    for setting in SETTINGS:
        side = results.get("ours", {}).get("settings", {}).get(setting, {})
        if "error" in side:
            failures.append(f"ours {setting}: {side['error']}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=24, help="--generate: new tokens per generate() (default 24)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="--generate: measured rounds of a training step then generate() (default 5)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        # Out at once, as the parity scenarios leave: the results are written, and an interpreter shutdown with
        # gloo's threads still up sometimes aborts ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
