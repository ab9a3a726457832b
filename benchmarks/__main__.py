"""The benchmark harness's command line (also reached as `autopar bench ...` from a checkout):

    python -m benchmarks [suite] gpt|moe|wrn --cluster PRESET|cluster.json
                         [--max-devices N] [--output-dir DIR]
    python -m benchmarks [suite] toy [--output-dir DIR]

gpt/moe/wrn price the Alpa paper's weak-scaling cases for autopar and the hand-written
strategies on a cluster preset; toy runs every strategy for real on 8 emulated CPU devices
and checks the results against the single-device step (exit status 1 if any differs).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=("gpt", "moe", "wrn", "toy"))
    p.add_argument("--cluster", default=None,
                   help="a preset (the suites were written for '8x8xV100-16GB' and "
                        "'4x8xH100-80GB') or a cluster JSON")
    p.add_argument("--max-devices", type=int, default=None, metavar="N",
                   help="only the cases with at most N devices")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where to write results (default benchmarks/results)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["suite"]:
        argv = argv[1:]
    args = _parser().parse_args(argv)
    out = {"out_dir": pathlib.Path(args.output_dir)} if args.output_dir else {}
    if args.suite == "toy":
        from autopar import demo

        demo.use_cpu_devices()  # first: before anything can start a JAX backend
        from benchmarks import toy

        rows = toy.run(**out)
        bad = [f"{r['model']}/{r['strategy']}" for r in rows if not r["equal"]]
        if bad:
            print(f"benchmarks: results differ from the single-device step: {', '.join(bad)}",
                  file=sys.stderr)
            return 1
        return 0
    if args.cluster is None:
        print(f"benchmarks: suite {args.suite} needs --cluster (e.g. 8x8xV100-16GB)",
              file=sys.stderr)
        return 2
    from autopar.cost_model import ClusterSpec
    from benchmarks import suite

    try:
        cluster = (ClusterSpec.load(args.cluster) if os.path.exists(args.cluster)
                   else ClusterSpec.preset(args.cluster))
    except ValueError as err:
        print(f"benchmarks: {err}", file=sys.stderr)
        return 2
    suite.run(args.suite, cluster, max_devices=args.max_devices, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
