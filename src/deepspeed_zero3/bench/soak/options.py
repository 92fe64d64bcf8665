"""The soak's flags, shared by the driver (which validates them before launching anything) and the worker."""

import argparse
import math

DEFAULT_STEPS = 500
# Why 4 KiB/step (1 MiB over the default second half): the smallest thing the runtime holds per step is
# a gathered parameter, and the smallest one here besides the LayerNorms' is the position table, 1,024
# fp32 = 4 KiB: a runtime that kept one per step reaches the line; one that kept a forward's autograd
# graph (dozens of 4 x 16 x 32 fp32 activations, 8 KiB each) crosses it many times over. Below it is what
# the allocators do without leaking: on this model about 2 KiB/step over steps 251-500 with malloc's
# in-use bytes flat on ordinary steps, falling to 0.3-1.1 KiB/step per 250-step window after step 1000 of
# a 1,500-step run (docs/benchmarks.md, "Soak"). Smaller leaks (a LayerNorm weight, a stats record) are
# below what RSS can show in 250 steps; the live-numel, hook and trace-record checks cover those.
DEFAULT_MAX_RSS_SLOPE_KIB = 4.0
MAX_SEQ = 32  # the soak model's position table
PROMPT_LEN = 4


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"training steps (default {DEFAULT_STEPS}); every other event hangs off them")
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--eval-every", type=int, default=5,
                        help="an eval forward every N steps, alternating engine.eval() and training mode "
                        "(default 5; 0: none)")
    parser.add_argument("--generate-every", type=int, default=25,
                        help="a greedy generation loop through the second engine every N steps (default 25; 0: none)")
    parser.add_argument("--generate-tokens", type=int, default=8,
                        help="tokens per generation loop, one no-grad forward each (default 8)")
    parser.add_argument("--engine-every", type=int, default=50,
                        help="create, use and destroy a third (inference) engine every N steps (default 50; 0: none)")
    parser.add_argument("--bucket", type=int, default=5000,
                        help="stage3_prefetch_bucket_size (default 5000, a sixth of the 30,592-parameter model)")
    parser.add_argument("--max-rss-slope", type=float, default=DEFAULT_MAX_RSS_SLOPE_KIB,
                        help=f"RSS slope limit over the second half, KiB/step (default {DEFAULT_MAX_RSS_SLOPE_KIB})")
    parser.add_argument("--relaxed", action="store_true",
                        help="report the slope and trace-record criteria but do not fail on them "
                        "(for smoke runs too short to have a steady state)")
    parser.add_argument("--out", default="soak-out/", help="output folder (default soak-out/)")
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> argparse.Namespace:
    """Reject flags that would make the run meaningless, with the flag's name in the message."""
    if args.steps < 4:
        parser.error(f"--steps must be >= 4 (a slope needs a second half of at least 2 steps), got {args.steps}")
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    for flag in ("eval_every", "generate_every", "engine_every", "bucket"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if not 1 <= args.generate_tokens <= MAX_SEQ - PROMPT_LEN:
        parser.error(f"--generate-tokens must be between 1 and {MAX_SEQ - PROMPT_LEN} (the model's positions "
                     f"hold {MAX_SEQ} tokens, the prompt takes {PROMPT_LEN}), got {args.generate_tokens}")
    if not args.max_rss_slope > 0:
        parser.error(f"--max-rss-slope must be > 0 KiB/step, got {args.max_rss_slope}")
    return args


def cycle_length(args) -> int:
    """Steps after which the schedule repeats: every kind of pass and engine event has run at least once.

    Eval forwards alternate between two kinds, so their period is twice ``--eval-every``.
    """
    periods = [p for p in (2 * args.eval_every, args.generate_every, args.engine_every) if p > 0]
    return math.lcm(*periods) if periods else 1
