"""``python -m moe_fn`` (or ``moe-fn``): command-line entry point."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, demo

    p = argparse.ArgumentParser(
        prog="python -m moe_fn",
        description="moe_fn: fast, provably correct Mixture-of-Experts layers for PyTorch.")
    p.add_argument("--version", action="version", version=f"moe_fn {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "demo", help="train a small random Qwen3-MoE with every optimisation on, with "
                     "every option off and as transformers' own model (expert parallel "
                     "over gloo by default), and check that the runs agree",
        description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return 2
    if args.command == "demo":
        from . import demo
        return demo.demo(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
