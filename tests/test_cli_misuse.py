"""Issue 15, the command line: every misuse is exit 2 with one line on stderr (never a traceback), found
before any weight is read where it can be.  In-process and without compiling a model: `load_model`
is replaced where a test only needs to know whether loading was reached."""
import json
import os
import sys
import types

import numpy as np
import pytest

import jaxk3.engine
from jaxk3 import cli
from jaxk3.cli import generate as cli_generate
from jaxk3.collectives import GatherUnavailableError
from jaxk3.config import KimiK3Config

sys.path.insert(0, os.path.dirname(__file__))
from test_cli import write_tokenizer  # noqa: E402


def one_error_line(err: str, *needles: str, after_progress: bool = False) -> str:
    """The one line of a misuse on stderr (after_progress: the last line, after the progress lines of loading)."""
    lines = err.splitlines()
    assert "Traceback" not in err and err.endswith("\n"), err
    if after_progress:
        assert sum("error:" in x for x in lines) == 1, err
        lines = lines[-1:]
    assert len(lines) == 1, f"want one line on stderr, got {err!r}"
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """cli.main in-process: (exit status, stdout, stderr); a SystemExit from argparse counts as its code."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if a command gets as far as reading weights."""
    def load_model(*a, **k):
        raise AssertionError("load_model was called: the misuse should have been caught before loading")

    monkeypatch.setattr(jaxk3.engine, "load_model", load_model)


class FakeModel:
    """Stands in for a loaded model: records the prompts; `fail` is raised by generate."""

    def __init__(self, fail=None):
        self.tp, self.dp, self.fail, self.rows = 2, 1, fail, None

    def generate(self, prompt_ids, max_new_tokens, return_logits=False, progress=None, *, temperature=0.0, top_k=0,
                 top_p=1.0, seed=0, stop_ids=None, on_tokens=None, prefill_chunk=None, decode_chunk=32,
                 step_by_step=False):
        rows = self.rows = prompt_ids
        if self.fail is not None:
            raise self.fail
        return types.SimpleNamespace(tokens=np.zeros((len(rows), max_new_tokens), np.int32), logits=None,
                                     step_times_s=[], prompt_time_s=0.1, decode_time_s=0.5,
                                     lengths=np.full(len(rows), max_new_tokens, np.int32))


def test_fake_model_keeps_the_real_signature():
    """The stand-in must accept what the CLI passes to Model.generate, or these tests break on each change."""
    import inspect
    from jaxk3.engine import Model
    def shape(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert shape(FakeModel.generate) == shape(Model.generate)


@pytest.fixture
def fake_load(monkeypatch):
    model = FakeModel()
    monkeypatch.setattr(jaxk3.engine, "load_model", lambda *a, **k: model)
    return model


def config_dir(tmp_path, **overrides):
    """A checkpoint directory with only config.json (tiny K3): enough for every check before loading."""
    (tmp_path / "config.json").write_text(json.dumps(KimiK3Config.tiny_k3(**overrides).to_hf_dict()))
    return str(tmp_path)


GEN = ["generate", "--no-progress", "--tp", "2"]


# ---------------------------------------------------------------- --max-new-tokens
def test_max_new_tokens_past_int32_is_a_parse_error(tmp_path, capsys, no_load):
    """Was: OverflowError traceback."""
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", "1,2",
                                "--max-new-tokens", "1000000000000"], capsys)
    assert rc == 2
    one_error_line(err, "--max-new-tokens", "1..2147483647", "1000000000000")


@pytest.mark.parametrize("n", [1000000000, 100000])
def test_max_new_tokens_past_max_position_embeddings(tmp_path, capsys, no_load, n):
    """Was: out of memory after loading (1e9), still running after 120 s (1e5)."""
    ckpt = config_dir(tmp_path, max_position_embeddings=65536)
    rc, _, err = run_cli(GEN + ["--checkpoint", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", str(n)], capsys)
    assert rc == 2
    one_error_line(err, f"--max-new-tokens {n}", f"prompt 3 + {n} new", "max_position_embeddings = 65536",
                   "at most 65533 new tokens")


def test_prompt_filling_max_position_embeddings(tmp_path, capsys, no_load):
    ckpt = config_dir(tmp_path, max_position_embeddings=4)
    rc, _, err = run_cli(GEN + ["--checkpoint", ckpt, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "1"], capsys)
    assert rc == 2
    one_error_line(err, "prompt of 5 tokens fills", "max_position_embeddings = 4")


def test_cache_larger_than_memory(tmp_path, capsys, no_load, monkeypatch):
    """No max_position_embeddings in the config: the cache size is still checked, with the figures."""
    monkeypatch.setattr(cli_generate, "device_memory", lambda device: (1 << 30, "host memory"))
    ckpt = config_dir(tmp_path)
    assert KimiK3Config.from_pretrained(ckpt).max_position_embeddings is None
    rc, _, err = run_cli(GEN + ["--checkpoint", ckpt, "--prompt-ids", "1,2", "--max-new-tokens", "1000000000",
                                "--dtype", "float32"], capsys)
    assert rc == 2
    cfg = KimiK3Config.tiny_k3()
    length = cli_generate.cache_len(2, 1000000000)  # 2 + 1e9 positions rounded up to the model's cache bucket
    assert 1000000002 <= length < 1000000002 + 4096
    per_rank = cfg.cache_bytes_per_rank(1, length, 2, 4)
    line = one_error_line(err, "smaller --max-new-tokens than 1000000000", "decode cache needs", "per rank",
                          f"batch 1 x {length} positions, float32", "x 2 CPU ranks", "1.0 GiB of host memory")
    assert f"{per_rank / (1 << 30):.1f} GiB per rank" in line


def test_device_memory_is_known_on_cpu():
    import jax

    limit, where = cli_generate.device_memory(jax.devices()[0])
    assert limit is not None and limit > 1 << 26 and where


def test_checks_pass_a_valid_run_through_to_loading(tmp_path, capsys, fake_load):
    """The new checks do not reject a run that fits: it reaches load_model and prints its tokens."""
    ckpt = config_dir(tmp_path, max_position_embeddings=4096)
    rc, out, err = run_cli(GEN + ["--checkpoint", ckpt, "--prompt-ids", "1,2,3;4", "--max-new-tokens", "4093"], capsys)
    assert rc == 0, err
    assert fake_load.rows == [[1, 2, 3], [4]]
    assert out.count("new ids: ") == 2


def test_prompt_ids_outside_the_vocabulary_before_loading(tmp_path, capsys, no_load):
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", "1,2;5000"], capsys)
    assert rc == 2
    one_error_line(err, "prompt 2: token id 5000 is outside the vocabulary [0, 1000)")


def test_tp_checks_before_loading(tmp_path, capsys, no_load):
    ckpt = config_dir(tmp_path)
    rc, _, err = run_cli(["generate", "--checkpoint", ckpt, "--prompt-ids", "1", "--tp", "9"], capsys)
    assert rc == 2
    one_error_line(err, "--tp 9: only 8 devices present")
    rc, _, err = run_cli(["generate", "--checkpoint", ckpt, "--prompt-ids", "1", "--tp", "3"], capsys)
    assert rc == 2
    one_error_line(err, "--tp 3", "not divisible by the TP size 3")


# ---------------------------------------------------------------- --gather ffi
def test_gather_ffi_with_more_prompts_than_rows(tmp_path, capsys, no_load):
    """Was: GatherUnavailableError traceback (65 prompts > JAXK3_GATHER_MAX_ROWS=64)."""
    prompts = ";".join(str(i) for i in range(1, 66))
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", prompts, "--gather", "ffi"],
                         capsys)
    assert rc == 2
    one_error_line(err, "--gather ffi", "65 prompts per rank", "65 rows > JAXK3_GATHER_MAX_ROWS=64",
                   "--gather auto or lax")


def test_gather_ffi_more_rows_fine_with_auto(tmp_path, capsys, fake_load):
    prompts = ";".join(str(i) for i in range(1, 66))
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", prompts, "--gather", "auto"],
                         capsys)
    assert rc == 0, err
    assert len(fake_load.rows) == 65


@pytest.mark.parametrize("exc", [GatherUnavailableError("impl='ffi' but the FFI gather does not apply: 70 rows"),
                                 ValueError("prompt_ids: row 0 has token ids\noutside [0, 1000)"),
                                 FloatingPointError("generate: the logits of row(s) [0] are not finite (NaN/Inf)")])
def test_errors_of_generation_are_one_line(tmp_path, capsys, monkeypatch, exc):
    """What the checks cannot foresee (the model's own gathers, the model's own checks): exit 2, one line."""
    monkeypatch.setattr(jaxk3.engine, "load_model", lambda *a, **k: FakeModel(fail=exc))
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", "1,2"], capsys)
    assert rc == 2
    one_error_line(err, "jaxk3 generate: error:", str(exc).replace("\n", "\\n"), after_progress=True)


@pytest.mark.parametrize("exc", [GatherUnavailableError("no handler"), ValueError("gather: bad")])
def test_errors_of_loading_are_one_line(tmp_path, capsys, monkeypatch, exc):
    def load_model(*a, **k):
        raise exc

    monkeypatch.setattr(jaxk3.engine, "load_model", load_model)
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", "1,2"], capsys)
    assert rc == 2
    one_error_line(err, "jaxk3 generate: error:", str(exc), after_progress=True)


def test_gather_ffi_unavailable_at_trace_time_real_model(tmp_path, capsys, monkeypatch):
    """A real tiny checkpoint: the logits gather (2 KB per rank) exceeds JAXK3_GATHER_MAX_BYTES=16 while the
    pre-load probe (4 bytes) passes, so the model's own GatherUnavailableError is raised while the first
    step is traced (before any compile) and reported in one line."""
    from test_checkpoint import write_k3

    write_k3(str(tmp_path), seed=3)
    monkeypatch.setenv("JAXK3_GATHER_MAX_BYTES", "16")
    rc, _, err = run_cli(GEN + ["--checkpoint", str(tmp_path), "--prompt-ids", "1,2", "--gather", "ffi",
                                "--dtype", "float32"], capsys)
    assert rc == 2
    assert "loaded in" in err  # past the pre-load probe: the model's own gather raised
    one_error_line(err, "jaxk3 generate: error:", "FFI gather does not apply", "JAXK3_GATHER_MAX_BYTES=16",
                   after_progress=True)


# ---------------------------------------------------------------- bench gather / decode
@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "0"], "bad size '0'"),
    (["--sizes", "64,0k"], "bad size '0k'"),
    (["--sizes", "2048m"], "bad size '2048m'"),
    (["--repeats", "0"], "--repeats: need an integer in 1..10000, got '0'"),
    (["--chain", "0"], "--chain: need an integer in 1..10000, got '0'"),
    (["--chain", "-3"], "--chain: need an integer in 1..10000, got '-3'"),
    (["--chain", "1e3"], "--chain"),
    (["--devices", "0"], "--devices: need a positive integer"),
])
def test_bench_gather_bad_numbers(capsys, argv, needle):
    """Was: traceback (--sizes 0), StatisticsError (--repeats 0), ZeroDivisionError (--chain 0),
    exit 0 with negative µs (--chain -3)."""
    rc, out, err = run_cli(["bench", "gather"] + argv, capsys)
    assert rc == 2 and out == ""
    one_error_line(err, "jaxk3 bench gather: error:", needle)


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "--steps"), (["--repeats", "0"], "--repeats"), (["--copy-mb", "0"], "--copy-mb"),
    (["--copy-mb", "-1"], "--copy-mb"), (["--tp", "0"], "--tp"), (["--experts", "-2"], "--experts"),
    (["--batch", "0"], "--batch"), (["--context", "1,,2"], "--context"),
    (["--config", "/no/such/config.json"], "--config '/no/such/config.json'"),
    (["--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json: the directory /no/such/dir does not exist"),
    (["--heartbeat-timeout", "-5"], "--heartbeat-timeout: must be >= 1"),
    (["--process-id", "-1"], "--process-id: must be >= 0"),
])
def test_bench_decode_bad_arguments(capsys, argv, needle):
    rc, out, err = run_cli(["bench", "decode"] + argv, capsys)
    assert rc == 2 and out == ""
    one_error_line(err, "jaxk3 bench decode", needle)


def test_bench_gather_json_to_a_missing_directory(capsys):
    """Checked before minutes of benchmarking, not after."""
    rc, _, err = run_cli(["bench", "gather", "--json", "/no/such/dir/g.json"], capsys)
    assert rc == 2
    one_error_line(err, "/no/such/dir does not exist")


@pytest.mark.parametrize("value", ["0", "-1", "x", "99999", ""])
def test_cpu_devices_bad_value(capsys, monkeypatch, value):
    """Read before jax starts: also one line and exit 2 (was exit 1 through sys.exit(text))."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    rc, _, err = run_cli(["info", "--cpu-devices", value], capsys)
    assert rc == 2
    one_error_line(err, "--cpu-devices", "1..1024")


def test_cpu_devices_prefix_is_applied(monkeypatch):
    """argparse takes `--cpu 4` as --cpu-devices 4, so the early reader must too (or it is silently ignored)."""
    assert cli.common.cpu_devices_from_argv(["info", "--cpu", "4"]) == 4
    assert cli.common.cpu_devices_from_argv(["info", "--cpu-devices=2", "--cpu-devices", "3"]) == 3
    assert cli.common.cpu_devices_from_argv(["generate", "--prompt=--cpu-devices=0"]) is None
    assert cli.common.cpu_devices_from_argv(["info", "--", "--cpu-devices", "0"]) is None


# ---------------------------------------------------------------- --prompt-ids
@pytest.mark.parametrize("ids, needle", [
    ("1,,2", "empty item in prompt 1 of '1,,2'"),
    ("1,2,", "empty item in prompt 1"),
    (",1", "empty item in prompt 1"),
    ("1;;2", "prompt 2 is empty"),
    ("1;2;", "prompt 3 is empty"),
    ("1,-1", "negative token id -1"),
    ("1 2", "got '1 2'"),
    ("1.5", "got '1.5'"),
    ("٣", "got '٣'"),
])
def test_prompt_ids_rejects_empty_items_and_negatives(tmp_path, capsys, ids, needle):
    """Was: `1,,2` ran as 1,2 silently."""
    rc, _, err = run_cli(["generate", "--checkpoint", str(tmp_path), f"--prompt-ids={ids}"], capsys)
    assert rc == 2
    one_error_line(err, "jaxk3 generate: error: argument --prompt-ids", needle)


def test_prompt_ids_spaces_around_ids_are_fine():
    assert cli_generate._ids(" 1, 2 ;3 ") == [[1, 2], [3]]


# ---------------------------------------------------------------- special tokens in --prompt
@pytest.fixture
def tok_dir(tmp_path):
    pytest.importorskip("tiktoken", reason="text prompts need tiktoken")
    config_dir(tmp_path)
    write_tokenizer(str(tmp_path))
    return str(tmp_path)


def test_special_token_text_in_prompt_is_plain_text(tok_dir, capsys, fake_load):
    """Was: `[BOS]` typed in --prompt became the special token id 990."""
    rc, out, err = run_cli(GEN + ["--checkpoint", tok_dir, "--prompt", "[BOS]hi", "--max-new-tokens", "2"], capsys)
    assert rc == 0, err
    assert fake_load.rows == [[ord(c) for c in "[BOS]hi"]]
    assert "prompt ids: " + ",".join(str(ord(c)) for c in "[BOS]hi") in out


def test_special_tokens_with_the_flag(tok_dir, capsys, fake_load):
    rc, _, err = run_cli(GEN + ["--checkpoint", tok_dir, "--prompt", "[BOS]hi", "--allow-special-tokens"], capsys)
    assert rc == 0, err
    assert fake_load.rows == [[990, ord("h"), ord("i")]]


def test_allow_special_tokens_needs_a_text_prompt(tmp_path, capsys):
    rc, _, err = run_cli(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1", "--allow-special-tokens"],
                         capsys)
    assert rc == 2
    one_error_line(err, "--allow-special-tokens applies to --prompt text")


# ---------------------------------------------------------------- one line, whatever the text
def test_error_lines_escape_newlines(capsys):
    rc, _, err = run_cli(["info", "a\nb", "\x1b[2J"], capsys)
    assert rc == 2
    one_error_line(err, "unrecognized arguments", "a\\nb", "\\x1b[2J")


def test_experts_and_kernels_flags(tmp_path, capsys):
    """--experts mxfp4 on a checkpoint with dense experts, and --kernels on where no kernel runs (the
    CPU): exit 2 with one line naming the problem; the memory report reads headers only."""
    from jaxk3.model import random_hf_weights
    from jaxk3 import checkpoint as ck

    cfg = KimiK3Config.tiny_k3()
    ck.save_checkpoint(tmp_path, cfg, random_hf_weights(cfg, 0), k3_layout=True)
    base = GEN + ["--checkpoint", str(tmp_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--tp", "1"]
    rc, out, err = run_cli(base + ["--experts", "mxfp4"], capsys)
    assert rc == 2 and "is a dense expert weight: experts='mxfp4' needs MXFP4" in err and len(err.strip().splitlines()) <= 3
    rc, out, err = run_cli(base + ["--kernels", "on"], capsys)
    assert rc == 2 and "does not apply: no" in err and "kernel for platform 'cpu'" in err
    rc, out, err = run_cli(["info", "--checkpoint", str(tmp_path), "--tp", "2"], capsys)
    assert rc == 0 and "dense" in out
