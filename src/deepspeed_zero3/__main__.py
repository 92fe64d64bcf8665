"""`python -m deepspeed_zero3`: say whether the overlay is active and where each module comes from."""

import argparse
import sys

from deepspeed_zero3 import __version__
from deepspeed_zero3._compat import describe_supported
from deepspeed_zero3.activation import overlay_status


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_zero3",
        description="Say whether the deepspeed-zero3 overlay is active for this interpreter, which deepspeed is "
        "installed, and where each of the two ZeRO-3 runtime modules is served from.")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when the overlay is inactive (for scripts and CI)")
    args = parser.parse_args(argv)
    status = overlay_status()
    state = "ACTIVE" if status["active"] else "INACTIVE"
    print(f"deepspeed-zero3 {__version__}: overlay {state} ({status['reason']})")
    print(f"upstream deepspeed: {status['deepspeed_version'] or 'not installed'} "
          f"(supported: {describe_supported(tuple(status['supported_versions']))})")
    for name, origin in status["modules"].items():
        print(f"  {name} -> {origin}")
    return 1 if args.check and not status["active"] else 0


if __name__ == "__main__":
    sys.exit(main())
