"""Has a change made the step slower? bench_step.py at two commits, processes alternated.

  python benchmarks/bench_step_commits.py --base 9273a91 --pairs 8
  python benchmarks/bench_step_commits.py --base HEAD~3 --variant "adambridge sync bf16"

The base commit is checked out into a temporary git worktree; each round runs
``bench_step.py --preset cpu`` once from the base and once from this tree (A B A B ...), each
in a fresh process, and takes the variant's median step time as a ratio to torch AdamW's in
the same process: the ratio cancels most of what the machine's load does to both. Reported:
each round's ratios and the median and range of each side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ratio(tree: Path, variant: str, precision: str, max_seconds: float) -> float:
    """The variant's median step time over torch AdamW's, one bench_step run from ``tree``."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_step.py"), "--preset",
                        "cpu", "--precisions", precision, "--max-seconds", str(max_seconds),
                        "--json", str(out)], env=env, cwd=tree, capture_output=True, check=True)
        rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    if variant not in rows:
        raise SystemExit(f"bench_step_commits: --variant {variant!r} is not a row of "
                         f"bench_step.py; its rows: {', '.join(rows)}")
    return rows[variant]["median_ms"] / rows["torch AdamW"]["median_ms"]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--pairs", type=int, default=4, help="rounds of base then this tree")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp8"))
    parser.add_argument("--variant", default=None,
                        help="bench_step.py's row (default: 'adambridge async PRECISION')")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    variant = args.variant or f"adambridge async {args.precision}"
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                        args.base], check=True, capture_output=True)
        try:
            ratios: dict = {"base": [], "this tree": []}
            for _ in range(args.pairs):
                for name, tree in (("base", base), ("this tree", ROOT)):
                    ratios[name].append(ratio(tree, variant, args.precision, args.max_seconds))
                    print(f"{name:>9}: {variant} / torch AdamW {ratios[name][-1]:.3f}",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False, capture_output=True)
    for name, values in ratios.items():
        print(f"{name} ({args.base if name == 'base' else 'HEAD and its changes'}): median "
              f"{statistics.median(values):.3f}, range {min(values):.3f}-{max(values):.3f} "
              f"over {len(values)} processes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
