"""The `jaxk3` command line: one module per subcommand (info, bench, demo, generate), the shared
parts in jaxk3.cli.common.

  jaxk3 info [--json]                  versions, FFI handlers built, devices, gather default
  jaxk3 bench gather [options]         FFI gather vs lax.all_gather, same run (table + JSON)
  jaxk3 bench decode [options]         decode step of a layer slice: stock / sharded+lax /
                                       sharded+one-shot, vs the weight-bandwidth floor
  jaxk3 demo [--cpu-devices N]         the embedded default: a tiny random K3 model on N CPU
                                       devices decoding through the one-shot gathers
  jaxk3 generate --checkpoint DIR ...  greedy decoding from a safetensors checkpoint (K3, Kimi-Linear)
  jaxk3 init-checkpoint --config tiny DIR   a small random checkpoint to try generate / info / load_model

`--cpu-devices N` (any command) runs on N fake CPU devices; it must be handled before JAX
starts, so it is read here, first thing.

Misuse is a named error, never a traceback: exit status 2 and one line on stderr
(`jaxk3 <command>: error: ...`), from the parser (`Parser`, the type functions of
jaxk3.cli.common), from `check_args` (what needs more than one option), or from the command
itself before it reads any weight where it can (`jaxk3 generate`: context length, cache memory,
gather path; a bad JAXK3_* environment variable, for every command).  Ctrl-C ends any command with one
line and exit status 130 (`jaxk3 generate` first prints the tokens it has), a stdout closed by its
reader (`| head`) with one line and 141.
"""
from __future__ import annotations

import argparse
import sys

from jaxk3.cli import bench, demo, generate, info, init_checkpoint
from jaxk3.cli.common import (BROKEN_PIPE, INTERRUPTED, Parser, command, early_cpu_devices,
                              environment_problem, fail, quiet_stdout, writable_file)

SUBCOMMANDS = {"info": info, "bench": bench, "demo": demo, "generate": generate, "init-checkpoint": init_checkpoint}


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
    """The `jaxk3` command: its exit status.  2: a misuse (one line on stderr), 130: Ctrl-C, 141: stdout
    closed by its reader (both end with one line on stderr, never a traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "jaxk3"
    try:
        try:
            early_cpu_devices(argv)
        except ValueError as e:
            return fail(prog, e)
        args = parse_args(argv)
        prog = command(args)
        problem = environment_problem()
        if problem is not None:
            return fail(prog, problem)
        status = SUBCOMMANDS[args.cmd].run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:
        quiet_stdout()
        print(f"{prog}: stdout was closed before the output was written (broken pipe)", file=sys.stderr,
              flush=True)
        return BROKEN_PIPE
