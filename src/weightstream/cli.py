"""The `weightstream` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightstream` and `python -m weightstream`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="weightstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offload a built-in model, generate, compare with the resident run")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--fraction", type=float, default=0.4,
                      help="GPU budget as a fraction of the weight bytes (default 0.4)")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        if not 0 < args.fraction <= 1:
            parser.error("--fraction must be in (0, 1]")
        from .demo import run_demo

        return 0 if run_demo(args.device, args.fraction, args.new_tokens) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
