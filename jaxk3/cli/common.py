"""What every subcommand of the `jaxk3` command line shares: one-line errors (`fail`, `Parser`), the
argparse types, `--cpu-devices` (applied before jax starts), and the checks of output files."""
from __future__ import annotations

import argparse
import os
import re
import sys


MAX_CPU_DEVICES = 1024  # fake CPU devices: XLA makes each one up front
USAGE = 2  # exit status of a misuse: a bad argument, input file or environment variable (one line on stderr)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports a command killed by it
BROKEN_PIPE = 141  # stdout closed by its reader (128 + SIGPIPE), e.g. `jaxk3 generate ... | head -1`
_DIGITS = re.compile(r"[0-9]+")  # ASCII digits only: int() would also take "٣", "1_0", "+1", " 1"


def one_line(message: object) -> str:
    """`message` as one printable line: newlines and other control characters escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(message))


def fail(prog: str, message: object) -> int:
    """Prints `prog: error: message` (one line) on stderr; returns the exit status 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return USAGE


def environment_problem() -> str | None:
    """A bad JAXK3_* variable of the collectives (JAXK3_GATHER=foo, JAXK3_GATHER_MAX_ROWS=abc, ...),
    named with its value, or None.  Checked before a command starts, so that no subcommand meets it
    later as a traceback from inside a trace."""
    from jaxk3.collectives import settings

    try:
        settings.default_impl()
        settings.max_rows()
        settings.max_bytes("cpu")
        settings.timeout_s()
    except ValueError as e:
        return f"environment: {e}"
    return None


def quiet_stdout() -> None:
    """After a broken pipe: stdout goes to /dev/null, so that the interpreter's last flush at exit
    finds nothing to write and prints no second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`jaxk3 bench gather: error: ...`, exit 2): no usage block, which
    `--help` prints.  Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def int_in(lo: int, hi: int, what: str = "an integer"):
    """An argparse type: an integer in lo..hi, decimal ASCII digits only."""

    def parse(text: str) -> int:
        t = text.strip()
        neg = t.startswith("-")
        if not _DIGITS.fullmatch(t[1:] if neg else t) or not lo <= (v := int(t)) <= hi:
            raise argparse.ArgumentTypeError(f"need {what} in {lo}..{hi}, got {text!r}")
        return v

    parse.__name__ = f"integer {lo}..{hi}"
    return parse


positive = int_in(1, 2**31 - 1, "a positive integer")


def cpu_devices_from_argv(argv: list[str]) -> int | None:
    """The value of the last --cpu-devices (or an unambiguous prefix of it: --cp, --cpu-dev, ...) in
    `argv`, without jax; ValueError when it is not an integer in 1..MAX_CPU_DEVICES."""
    n = None
    for i, a in enumerate(argv):
        if a == "--":
            break
        name, eq, value = a.partition("=")
        if len(name) < 4 or not "--cpu-devices".startswith(name):
            continue
        if eq:
            n = value
        elif i + 1 < len(argv):
            n = argv[i + 1]
        else:
            raise ValueError("argument --cpu-devices: expected one argument")
    if n is None:
        return None
    try:
        return int_in(1, MAX_CPU_DEVICES)(n)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"argument --cpu-devices: {e}") from None


def early_cpu_devices(argv: list[str]) -> None:
    """Applies --cpu-devices before jax starts a backend (XLA reads its flags once)."""
    n = cpu_devices_from_argv(argv)
    if n is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"


MAX_GATHER_BYTES = 1 << 30  # per rank; --sizes


def parse_sizes(text: str) -> tuple[int, ...]:
    units = {"k": 1024, "kb": 1024, "m": 1 << 20, "mb": 1 << 20, "b": 1}
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        num = p.rstrip("kmb")
        unit = p[len(num):] or "b"
        if not _DIGITS.fullmatch(num) or unit not in units or not 1 <= int(num) * units[unit] <= MAX_GATHER_BYTES:
            raise argparse.ArgumentTypeError(
                f"bad size {part!r}: use positive byte counts up to 1024m, like 64,1k,256k")
        out.append(int(num) * units[unit])
    return tuple(out)


def parse_ints(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1024 if p.endswith("k") else 1
        num = p[:-1] if p.endswith("k") else p
        if not _DIGITS.fullmatch(num) or not 1 <= int(num) * mult <= 2**31 - 1:
            raise argparse.ArgumentTypeError(f"bad value {part!r}: use positive integers like 1,8 or 4k,32k")
        out.append(int(num) * mult)
    return tuple(out)


def cpu_devices_arg(parser: argparse.ArgumentParser, **kw) -> None:
    parser.add_argument("--cpu-devices", type=int_in(1, MAX_CPU_DEVICES), metavar="N",
                        help=f"use N fake CPU devices (1..{MAX_CPU_DEVICES})", **kw)


def choices_list(allowed: tuple[str, ...]):
    """An argparse type: a comma list of some of `allowed`, in the order given."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(","))
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma separated)")
        return tuple(dict.fromkeys(items))

    return parse


def command(args) -> str:
    """`jaxk3 bench gather`, `jaxk3 generate`, ...: the prefix of this command's error lines."""
    return " ".join(["jaxk3", args.cmd] + ([args.bench_cmd] if getattr(args, "bench_cmd", None) else []))


CONFIG_PRESETS = ("k3", "kimi-linear-48b", "tiny")


def config_problem(value: str, option: str = "--config", presets: tuple[str, ...] = CONFIG_PRESETS) -> str | None:
    """What is wrong with a `--config` value (a preset name, a config.json file or a directory holding
    one), or None.  Only whether the file is there: its contents are checked when it is read."""
    if value in presets:
        return None
    path = os.path.join(value, "config.json") if os.path.isdir(value) else value
    if not os.path.exists(path):
        what = "a config.json file or a directory holding one"
        return f"{option} {value!r}: not {', '.join(presets)}, {what}" if not os.path.isdir(value) else \
            f"{option} {value!r}: the directory has no config.json"
    if not os.path.isfile(path):
        return f"{option} {value!r}: {path} is not a file"
    return None


def writable_file(path: str, option: str) -> str | None:
    """A problem with writing `path` later (after minutes of work), or None."""
    if not path.strip():
        return f"{option}: needs a file name, got {path!r}"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option} {path}: is a directory"
    if not os.path.isdir(parent):
        return f"{option} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{option} {path}: the directory {parent} is not writable"
    return None


def write_json(write, result: dict, path: str, cmd: str) -> int:
    try:
        write(result, path)
    except OSError as e:
        return fail(cmd, f"--json {path}: cannot write ({e.strerror or e})")
    print(f"wrote {path}")
    return 0


def progress(msg: str) -> None:
    """A long run's progress line, on stderr."""
    print(f"  .. {msg}", file=sys.stderr, flush=True)
