"""``python -m flexoff.commands.reference [DIR]``: search the reference policies again and write them."""

from __future__ import annotations

import argparse

from ..planner.reference import write_reference_policies
from ..planner.report import policy_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexoff.commands.reference",
                                     description="Search the reference policies again and write them as JSON.")
    parser.add_argument("directory", nargs="?", default="policies", help="where to write them (default: policies)")
    target = parser.parse_args(argv).directory
    for name, found in write_reference_policies(target).items():
        print(f"{name}: {policy_summary(found.policy)}, {found.throughput:.4g} token/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
