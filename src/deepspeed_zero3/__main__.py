"""`python -m deepspeed_zero3`: say whether the overlay is active and where each module comes from."""

import sys

from deepspeed_zero3 import __version__
from deepspeed_zero3.activation import overlay_status


def main():
    status = overlay_status()
    state = "ACTIVE" if status["active"] else "INACTIVE"
    print(f"deepspeed-zero3 {__version__}: overlay {state} ({status['reason']})")
    print(f"upstream deepspeed: {status['deepspeed_version'] or 'not installed'} "
          f"(supported: {', '.join(status['supported_versions'])})")
    for name, origin in status["modules"].items():
        print(f"  {name} -> {origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
