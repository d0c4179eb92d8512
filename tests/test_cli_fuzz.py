"""Fuzz of the `jaxk3` argument layer: random garbage argv over every subcommand's parser, in-process
(`cli.parse_args` = `build_parser().parse_args` + `check_args`, and the early `--cpu-devices` reader),
seeded, bounded in count and time; no command runs.  Each outcome is a parse, `--help` (exit 0, stdout
only), or SystemExit(2) with exactly one line on stderr: never another exception, never a traceback."""
import contextlib
import io
import random
import time

import pytest

from jaxk3 import cli

COMMANDS = [["info"], ["bench", "gather"], ["bench", "decode"], ["bench", "kernels"], ["demo"], ["generate"], ["bench"], [],
            ["init-checkpoint"], ["bench", "generate"],
            ["nope"], ["bench", "nope"], ["-x"], ["--help-me"]]

VALUES = ["0", "1", "2", "8", "-1", "-3", "65", "1e9", "1.5", "0x10", "+1", " 1", "1 ", "1_0", "٣", "²", "nan",
          "inf", "1000000000000", "99999999999999999999999", "2147483648", "", " ", "-", "--", "=", ",", ";",
          "1,,2", "1,2,", ";1", "1;;2", "1,2;3,4", "1,-1", "0,1", "4k", "0k", "k", "1m", "2048m", "64,1k,4k",
          "1,8", "4k,32k", "11-14", "14-11", "all", "x-y", "k3", "tiny", "/no/such/dir", "/no/such/dir/out.json",
          "/tmp", "auto", "ffi", "lax", "nccl", "float32", "bfloat16", "int4", "stock,sharded+lax", "bogus",
          "[BOS]hi", "hello world", "a\nb", "\x1b[2J", "\t", "\udcff", "é", "%s%(x)s", "{}", "'", '"',
          "127.0.0.1:1", ":", "@file", "--cpu-devices", "--cpu-devices=0", "--cpu-devices=2", "--tp=0",
          "--prompt-ids=1,,2", "--chain=-3", "--sizes=0", "--max-new-tokens=1000000000000"]


def _options() -> dict[tuple[str, ...], list[str]]:
    """Every subcommand's option strings (without --help), by command path: ("bench", "gather") -> [...]."""
    out: dict[tuple[str, ...], list[str]] = {}

    def walk(p, path):
        opts = out.setdefault(path, [])
        for a in p._actions:
            opts += [o for o in a.option_strings if o not in ("-h", "--help")]
            if isinstance(getattr(a, "choices", None), dict):
                for name, sub in a.choices.items():
                    walk(sub, path + (name,))

    walk(cli.build_parser(), ())
    return out


def _all_options(by_cmd) -> list[str]:
    """All option strings, and near-misses: abbreviations (some ambiguous), typos, bare dashes."""
    opts = {o for v in by_cmd.values() for o in v}
    more = {o[:n] for o in opts for n in (3, 4, 6) if len(o) > n}
    return sorted(opts | more | {"--", "-", "--x", "---chain", "--no-such-option"})


def _random_token(rng: random.Random) -> str:
    return "".join(rng.choice("abc-,;=0123456789 kKmM.\n\u00e9\x00") for _ in range(rng.randint(0, 8)))


def _argv(rng: random.Random, by_cmd, every: list[str]) -> list[str]:
    """Half the time the options of the command given (so values reach the type functions and
    check_args), else any option string or near-miss."""
    argv = list(rng.choice(COMMANDS))
    own = by_cmd.get(tuple(argv)) or every
    for _ in range(rng.randint(0, rng.choice((2, 8)))):
        opts = own if rng.random() < 0.5 else every
        r = rng.random()
        if r < 0.55:
            argv.append(rng.choice(opts))
            if rng.random() < 0.8:
                argv.append(rng.choice(VALUES))
        elif r < 0.7:
            argv.append(f"{rng.choice(opts)}={rng.choice(VALUES)}")
        elif r < 0.85:
            argv.append(rng.choice(VALUES))
        else:
            argv.append(_random_token(rng))
    if rng.random() < 0.3:  # a plausible generate, so the checks behind the required options run too
        argv = ["generate", "--checkpoint", "/no/such/dir", "--prompt-ids", "1,2"] + argv[1:]
    if rng.random() < 0.1:
        rng.shuffle(argv)
    return argv


def _outcome(argv: list[str]) -> tuple[str, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kind = "parsed"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.common.cpu_devices_from_argv(argv)
        except ValueError as e:  # what main() turns into one line and exit 2
            cli.fail("jaxk3", e)
            kind = "exit 2"
        else:
            try:
                cli.parse_args(argv)
            except SystemExit as e:
                kind = f"exit {e.code}"
    return kind, out.getvalue(), err.getvalue()


def test_fuzz_argument_parser():
    rng = random.Random(15)
    by_cmd = _options()
    every = _all_options(by_cmd)
    assert set(by_cmd) >= {("info",), ("bench", "gather"), ("bench", "decode"), ("demo",), ("generate",),
                           ("init-checkpoint",)}
    assert {"--max-new-tokens", "--chain", "--copy-mb", "--cpu-devices", "--allow-special-tokens", "--force",
            "--mxfp4"} <= set(every)
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 30
    n = 0
    while n < 2000 and time.monotonic() < deadline:
        argv = _argv(rng, by_cmd, every)
        try:
            kind, out, err = _outcome(argv)
        except BaseException as e:  # noqa: B036 - anything else is the bug this test looks for
            pytest.fail(f"argv {argv!r} raised {type(e).__name__}: {e}")
        seen[kind] = seen.get(kind, 0) + 1
        if kind == "exit 2":
            assert err.endswith("\n") and err.count("\n") == 1 and "error:" in err, (argv, err)
            assert "Traceback" not in err and out == "", (argv, err)
        elif kind == "exit 0":
            assert err == "" and "usage:" in out, (argv, out, err)  # --help through an abbreviation
        else:
            assert kind == "parsed" and err == "" and out == "", (argv, kind, out, err)
        n += 1
    assert n >= 500, f"only {n} cases in the time bound"
    assert seen.get("exit 2", 0) > n // 2 and seen.get("parsed", 0) > 0, seen


@pytest.mark.parametrize("argv", [
    ["bench", "gather", "--sizes", "0"], ["bench", "gather", "--repeats", "0"], ["bench", "gather", "--chain", "0"],
    ["bench", "gather", "--chain", "-3"], ["bench", "decode", "--steps", "0"], ["bench", "decode", "--copy-mb", "0"],
    ["generate", "--checkpoint", "d", "--prompt-ids", "1,,2"],
    ["generate", "--checkpoint", "d", "--prompt-ids", "1", "--max-new-tokens", "1000000000000"],
    ["info", "a\nb"], ["generate", "--checkpoint", "d", "--prompt", "x", "--gather", "\udcff"],
    ["init-checkpoint", "--config", "tiny", "/tmp"], ["init-checkpoint", "--config", "nope", "/no/such/dir/x"],
    ["init-checkpoint", "--config", "tiny", "d", "--seed", "-1"], ["init-checkpoint", "d"],
    ["info", "--config", "nope"], ["bench", "kernels", "--config", "/no/such/config.json"],
])
def test_known_misuse_is_one_line(argv):
    kind, out, err = _outcome(argv)
    assert kind == "exit 2" and err.count("\n") == 1 and out == "", (kind, err)


def test_valid_command_lines_parse():
    for argv in (["info", "--json"], ["bench", "gather", "--sizes", "64,1k", "--chain", "10", "--repeats", "3"],
                 ["bench", "decode", "--config", "tiny", "--steps", "2", "--copy-mb", "1"],
                 ["demo", "--cpu-devices", "8"],
                 ["generate", "--checkpoint", "d", "--prompt-ids", "1, 2;3", "--max-new-tokens", "8", "--tp", "2"],
                 ["generate", "--checkpoint", "d", "--prompt", "[BOS]x", "--allow-special-tokens"],
                 ["init-checkpoint", "--config", "tiny-kimi-linear", "/tmp/jaxk3-fuzz-never-written", "--seed", "3", "--mxfp4"]):
        kind, out, err = _outcome(argv)
        assert kind == "parsed" and err == "", (argv, err)


@pytest.mark.parametrize("cmd", [[], ["info"], ["bench"], ["bench", "gather"], ["bench", "decode"], ["demo"],
                                 ["generate"], ["init-checkpoint"], ["bench", "generate"], ["bench", "kernels"]])
def test_help_of_every_command(cmd):
    kind, out, err = _outcome(cmd + ["--help"])
    assert kind == "exit 0" and err == "" and "usage:" in out
