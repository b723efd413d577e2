"""The `mmdispatch` command: one subcommand per role, each implemented in its own module.

Subcommand modules are imported only when chosen, so `mmdispatch read` on a data node never
pays for (or needs) the trainer's dependencies. Each module provides `add_arguments(parser)`
and `run(args) -> int`; its docstring's first paragraph is the subcommand's description.
"""

from __future__ import annotations

import re
import sys


def _interrupted_line(argv: list[str]) -> str:
    """What a Ctrl-C during start-up prints: the command, no traceback (nothing to unwind yet)."""
    command = argv[0] if argv and re.fullmatch(r"[a-z][a-z-]*", argv[0]) else ""
    return f"mmdispatch {command}".rstrip() + ": interrupted"


try:  # loading the subcommands' libraries takes seconds; a Ctrl-C meanwhile is no bug
    import argparse
    import importlib

    from dispatcher_server.cliopts import (
        HelpFormatter, OneLineParser, add_config_argument, add_logging_arguments, interrupt_exits,
        run_reporting_errors, say, setup_logging,
    )
    from mmdispatch import __version__
    from mmdispatch.settings import ConfigError, apply_file
except KeyboardInterrupt:
    print(_interrupted_line(sys.argv[1:]), file=sys.stderr, flush=True)
    sys.exit(130)

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "gen-data": ("pipeline.gendata", "write reproducible synthetic multimodal WebDataset shards"),
    "inspect": ("mmdispatch.inspecting", "count tokens per modality in shards or a dataset's sources and print statistics"),
    "serve": ("mmdispatch.serve", "run the dispatcher: collect counts, plan every step, stream to trainers"),
    "read": ("pipeline.service", "run a data-node reader that streams counted samples to the dispatcher"),
    "keygen": ("dispatcher_server.security", "create a CurveZMQ key pair for the dispatcher, a reader or a trainer"),
    "demo": ("mmdispatch.demo", "run data, dispatcher, readers and torchrun trainers locally, then report"),
    "report": ("mmdispatch.report", "render a step log as a table and figures"),
    "calibrate": ("mmdispatch.calibrate", "measure each phase of your model on this device and write a cost file"),
}

#: commands that take `--config FILE` (the tables they read: mmdispatch.settings.TABLES)
CONFIGURABLE = ("serve", "read", "inspect")


def _overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines) + "\n\nRun 'mmdispatch COMMAND --help' for a command's options."


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand, with the options every command shares."""
    module_name, help_ = COMMANDS[command]
    module = importlib.import_module(module_name)
    doc = (module.__doc__ or help_).strip().split("\n\n")[0]
    parser = OneLineParser(prog=f"mmdispatch {command}", description=doc,
                           formatter_class=HelpFormatter)
    module.add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    if command in CONFIGURABLE and "--config" not in flags:
        add_config_argument(parser)
    add_logging_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # importing the command's module and reading --config take seconds on a cold host
        return _main(argv)
    except KeyboardInterrupt:
        say(_interrupted_line(argv))
        return 130


def _main(argv: list[str]) -> int:
    top = OneLineParser(
        prog="mmdispatch",
        description="Streaming data service that feeds multimodal LLM trainers with balanced work.",
        epilog=_overview(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"mmdispatch {__version__}")
    top.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND", help="see below")
    top.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    if not argv:
        top.print_help()
        return 2
    ns = top.parse_args(argv[:1])
    # a library interrupted halfway through its import can bury the Ctrl-C in another error
    with interrupt_exits(f"mmdispatch {ns.command}"):
        parser = build_parser(ns.command)
        if ns.command in CONFIGURABLE:
            try:
                apply_file(parser, ns.command, argv[1:])
            except ConfigError as e:
                parser.refuse(argv[1:], str(e))
        args = parser.parse_args(argv[1:])
        setup_logging(args.log_format, getattr(args, "log_level", "INFO"))
        module = importlib.import_module(COMMANDS[ns.command][0])
    return run_reporting_errors(lambda: module.run(args), parser.prog, debug=args.debug,
                                args=args)


if __name__ == "__main__":
    sys.exit(main())
