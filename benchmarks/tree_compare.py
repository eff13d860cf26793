"""Measuring another kvserve source tree beside this one, for before/after benchmarks.

A script adds the options (`add_tree_options`), gets the trees to measure (`compared_trees`:
this one, and `--baseline-tree DIR`, e.g. `git archive <commit> | tar -x -C DIR`), and runs its
in-process part in a child per tree (`in_tree_child`): the child is the same script with
`--child --tree DIR`, imports kvserve from DIR first and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_tree_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--baseline-tree", help="another kvserve source tree to measure, alternating with this one"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)


def compared_trees(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """{"this tree": ROOT} and, with --baseline-tree, {"baseline": its path}; a path without a
    kvserve package is the parser's error."""
    trees = {"this tree": ROOT}
    if args.baseline_tree:
        if not os.path.isfile(os.path.join(args.baseline_tree, "kvserve", "__init__.py")):
            ap.error(f"--baseline-tree: no kvserve package in {args.baseline_tree}")
        trees["baseline"] = os.path.abspath(args.baseline_tree)
    return trees


def enter_tree(args: argparse.Namespace) -> None:
    """In a child: import kvserve from its tree (call before the first kvserve import)."""
    sys.path.insert(0, args.tree)


def answer_child(args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict]) -> bool:
    """In a child (`--child`): import kvserve from its tree, print `measure(args)` as the one
    JSON line `in_tree_child` reads, and return True. Elsewhere: False, nothing done."""
    if not args.child:
        return False
    enter_tree(args)
    print(json.dumps(measure(args)))
    return True


def in_tree_child(script: str, tree: str, *argv: str) -> dict:
    """Run `script --child --tree TREE argv...` and parse the last line it prints."""
    cmd = [sys.executable, os.path.abspath(script), "--child", "--tree", tree, *argv]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
