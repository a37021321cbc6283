"""``lightning-scale``: the package's command, one subcommand per tool.

Each tool registers a subcommand (``COMMANDS``: name -> a function that adds its parser and
sets ``run``, a function of the parsed arguments that prints and returns the exit status).
Bad input (a path that holds no run, an unknown run, an argument outside what is allowed)
ends with one line on standard error and exit status 2, as argparse's own errors do.

Example::

    lightning-scale runs lightning_logs
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional, Sequence

from lightning_scale.dashboard.logdir import LogDir
from lightning_scale.tools.compare_command import add_compare
from lightning_scale.tools.advise_command import add_advise

__all__ = ["COMMANDS", "main", "parser"]

#: Exit status of bad input (argparse's own).
BAD_INPUT = 2


def _add_runs(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "runs",
        help="list the runs ScaleMonitor wrote under a log directory",
        description="List every run ScaleMonitor wrote under LOGDIR: its tag prefixes, tracked steps, nodes "
        "and statistics.",
    )
    p.add_argument("logdir", metavar="LOGDIR", help="a TensorBoard log directory, or one run's directory")
    p.set_defaults(run=_runs)


def _runs(args: argparse.Namespace) -> int:
    logs = LogDir(args.logdir)
    for name, prefixes in sorted(logs.runs.items()):
        for prefix in prefixes:
            run = logs.load(name, prefix)
            steps = f"{len(run.steps)} tracked steps ({run.steps[0]}..{run.steps[-1]})" if run.steps else "no step"
            kind = f" [{prefix}]" if prefix else ""
            print(f"{name}{kind}: {steps}, {len(run.labels)} nodes, statistics {', '.join(sorted(run.stats))}")
    return 0


#: Subcommand name -> the function that registers it.
COMMANDS: Dict[str, Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]] = {
    "runs": _add_runs,
    "compare": add_compare,
    "advise": add_advise,
}


def parser() -> argparse.ArgumentParser:
    """The command's argument parser, every subcommand of ``COMMANDS`` registered."""
    top = argparse.ArgumentParser(
        prog="lightning-scale",
        description="Tools over the statistics ScaleMonitor logged: list runs, compare two runs, advise a "
        "low-precision recipe.",
    )
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(sub)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    p = parser()
    args = p.parse_args(None if argv is None else list(argv))
    try:
        return int(args.run(args))
    except ValueError as err:  # bad input: one line, argparse's status
        sub: List[str] = [] if args.command is None else [args.command]
        print(f"{' '.join([p.prog, *sub])}: error: {err}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":  # pragma: no cover - the console script calls main()
    sys.exit(main())
