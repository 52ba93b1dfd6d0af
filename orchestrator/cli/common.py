"""What the tools that take a profile share: the parser for its Hydra overrides."""

from __future__ import annotations

import argparse


def profile_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser whose positional arguments are the Hydra overrides of a profile."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides selecting the profile, e.g. mem_pool=INTRA_NODE_NVLINK")
    return parser
