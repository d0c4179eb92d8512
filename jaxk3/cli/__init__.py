"""The `jaxk3` command line: one module per subcommand (info, bench, demo, generate), the shared
parts in jaxk3.cli.common.

  jaxk3 info [--json]                  versions, FFI handlers built, devices, gather default
  jaxk3 bench gather [options]         FFI gather vs lax.all_gather, same run (table + JSON)
  jaxk3 bench decode [options]         decode step of a layer slice: stock / sharded+lax /
                                       sharded+one-shot, vs the weight-bandwidth floor
  jaxk3 demo [--cpu-devices N]         the embedded default: a tiny random K3 model on N CPU
                                       devices decoding through the one-shot gathers
  jaxk3 generate --checkpoint DIR ...  greedy decoding from a safetensors checkpoint (K3, Kimi-Linear)

`--cpu-devices N` (any command) runs on N fake CPU devices; it must be handled before JAX
starts, so it is read here, first thing.

Misuse is a named error, never a traceback: exit status 2 and one line on stderr
(`jaxk3 <command>: error: ...`), from the parser (`Parser`, the type functions of
jaxk3.cli.common), from `check_args` (what needs more than one option), or from the command
itself before it reads any weight where it can (`jaxk3 generate`: context length, cache memory,
gather path).
"""
from __future__ import annotations

import argparse
import sys

from jaxk3.cli import bench, demo, generate, info
from jaxk3.cli.common import Parser, command, early_cpu_devices, fail, writable_file

SUBCOMMANDS = {"info": info, "bench": bench, "demo": demo, "generate": generate}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxk3",
        description="Kimi-K3 / Kimi-Linear decode layers in JAX with one-shot FFI all-gathers.",
        epilog="Environment: JAXK3_GATHER=auto|ffi|lax picks the default gather path; "
        "JAXK3_GATHER_TIMEOUT_S bounds how long a rank waits for its peers.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What argparse's per-option types cannot see: the problem, one line, or None."""
    for name, lo in (("num_processes", 1), ("process_id", 0), ("heartbeat_timeout", 1)):
        v = getattr(args, name, None)
        if v is not None and v < lo:
            return f"--{name.replace('_', '-')}: must be >= {lo}, got {v}"
    for name, option in (("json_path", "--json"), ("plot", "--plot")):
        path = getattr(args, name, None)
        if path is not None and (problem := writable_file(path, option)):
            return problem
    check = getattr(SUBCOMMANDS[args.cmd], "check_args", None)
    return None if check is None else check(args)


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parsed and checked arguments; SystemExit(2) with one line on stderr for any misuse."""
    args = (parser or build_parser()).parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        raise SystemExit(fail(command(args), problem))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        early_cpu_devices(argv)
    except ValueError as e:
        return fail("jaxk3", e)
    args = parse_args(argv)
    return SUBCOMMANDS[args.cmd].run(args)
