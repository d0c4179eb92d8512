"""Issue 15, the command line: every misuse is exit 2 with one line on stderr (never a traceback), found
before any weight is read where it can be.  In-process and without compiling a model: `load_model`
is replaced where a test only needs to know whether loading was reached."""
import json
import os
import re
import sys
import types

import numpy as np
import pytest

import jaxk3.engine
from jaxk3 import cli
from jaxk3.cli import generate as cli_generate
from jaxk3.collectives import GatherUnavailableError
from jaxk3.config import KimiK3Config
from jaxk3.kernels import kda_decode

sys.path.insert(0, os.path.dirname(__file__))
from test_cli import write_tokenizer  # noqa: E402
from small_models import tiny_k3_4l  # noqa: E402
from conftest import CHILD_XLA_FLAGS  # noqa: E402


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
    per_rank = cfg.cache_bytes_per_rank(1, length, 2, 4, ring=kda_decode.RING)
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


# ================================================================ issue 20: a new user's probe
def checkpoint_dir(tmp_path, cfg=None, **overrides) -> str:
    """A real tiny checkpoint (config.json + model.safetensors, float32), written by init-checkpoint's code."""
    from jaxk3 import checkpoint as ck
    from jaxk3.model import random_hf_weights

    cfg = cfg or KimiK3Config.tiny_k3(**overrides)
    ck.save_checkpoint(tmp_path, cfg, random_hf_weights(cfg, 0), k3_layout=True)
    return str(tmp_path)


def edit_config(path, **changes):
    cpath = os.path.join(path, "config.json")
    with open(cpath) as f:
        raw = json.load(f)
    (raw.get("text_config") or raw).update(changes)
    with open(cpath, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("cmd", [GEN + ["--prompt-ids", "1,2"], ["info"]])
def test_config_json_that_is_an_array(tmp_path, capsys, no_load, cmd):
    """Was: AttributeError: 'list' object has no attribute 'get' (generate, info --checkpoint)."""
    (tmp_path / "config.json").write_text("[1, 2]")
    rc, out, err = run_cli(cmd + ["--checkpoint", str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    one_error_line(err, f"{tmp_path}/config.json: must be a JSON object, got an array")


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_token", 0, "num_experts_per_token: must be >= 1, got 0"),
    ("hidden_size", 256.5, "hidden_size: must be an integer, got 256.5 (not rounded)"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings: must be true or false, got "false"'),
    ("num_expert_group", 3, "num_expert_group: 3 groups do not divide num_experts 16"),
])
@pytest.mark.parametrize("cmd", ["generate", "info"])
def test_config_validation_names_file_and_field(tmp_path, capsys, no_load, field, value, message, cmd):
    """Was: num_experts_per_token 0 loaded and changed the tokens; hidden_size 256.5 ran as 256."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": KimiK3Config.tiny_k3().to_hf_dict()}))
    edit_config(str(tmp_path), **{field: value})
    argv = (GEN + ["--prompt-ids", "1,2"] if cmd == "generate" else ["info"]) + ["--checkpoint", str(tmp_path)]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2
    one_error_line(err, f"{tmp_path}/config.json: {message}")


@pytest.mark.parametrize("ids", [False, True])
def test_corrupt_tokenizer_config(tok_dir, capsys, no_load, ids):
    """Was: JSONDecodeError traceback (--prompt); with --prompt-ids the broken file was silently ignored."""
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        f.write('{"added_tokens_decoder": {')
    src = ["--prompt-ids", "1,2"] if ids else ["--prompt", "hi"]
    rc, _, err = run_cli(GEN + ["--checkpoint", tok_dir] + src, capsys)
    assert rc == 2
    one_error_line(err, f"tokenizer: {tok_dir}/tokenizer_config.json is not valid JSON")


def test_tokenizer_config_with_wrong_shapes(tok_dir, capsys, no_load):
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": [1, 2]}, f)
    rc, _, err = run_cli(GEN + ["--checkpoint", tok_dir, "--prompt", "hi"], capsys)
    assert rc == 2
    one_error_line(err, "tokenizer_config.json: added_tokens_decoder must be an object")


@pytest.mark.parametrize("cmd", [GEN + ["--prompt-ids", "1,2"], ["info"]])
def test_directory_named_model_safetensors(tmp_path, capsys, monkeypatch, cmd):
    """Was: IsADirectoryError traceback.  The real loader runs; it must fail before any tensor is read."""
    from jaxk3 import checkpoint as ck

    monkeypatch.setattr(ck, "safe_open", lambda *a, **k: pytest.fail("a tensor was read"))
    (tmp_path / "config.json").write_text(json.dumps(KimiK3Config.tiny_k3().to_hf_dict()))
    (tmp_path / "model.safetensors").mkdir()
    rc, _, err = run_cli(cmd + ["--checkpoint", str(tmp_path)], capsys)
    assert rc == 2
    one_error_line(err, f"{tmp_path}/model.safetensors: is a directory, not a safetensors file",
                   after_progress=cmd[0] == "generate")


@pytest.mark.parametrize("argv", [["bench", "kernels"], ["bench", "generate"], ["bench", "decode"], ["info"]])
def test_config_that_does_not_exist(capsys, argv):
    """Was: FileNotFoundError traceback (bench kernels --config nope)."""
    rc, out, err = run_cli(argv + ["--config", "nope"], capsys)
    assert rc == 2 and out == ""
    one_error_line(err, f"jaxk3 {' '.join(argv)}: error: --config 'nope': not k3, kimi-linear-48b, tiny, "
                        "a config.json file or a directory holding one")


def test_bench_kernels_config_with_bad_contents(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(KimiK3Config.tiny_k3().to_hf_dict(), hidden_size=256.5)))
    rc, _, err = run_cli(["bench", "kernels", "--config", str(tmp_path)], capsys)
    assert rc == 2
    one_error_line(err, f"{tmp_path}/config.json: hidden_size: must be an integer, got 256.5")


def test_demo_picks_the_largest_tp_that_divides():
    """Was: ValueError: kda num_heads = 8 is not divisible by the TP size 3 (demo --cpu-devices 3)."""
    from jaxk3.tools.demo import pick_tp

    tiny = KimiK3Config.tiny_k3()
    assert pick_tp(tiny, 8) == (8, None)
    assert pick_tp(tiny, 3) == (2, "kda num_heads = 8 is not divisible by the TP size 3")
    assert pick_tp(tiny, 7) == (4, "kda num_heads = 8 is not divisible by the TP size 7")
    assert pick_tp(tiny, 1) == (1, None)


def test_demo_on_three_devices_says_which_tp(capsys, monkeypatch):
    """The demo's own run on 3 devices (the model run and the gather bench stubbed: no compile here)."""
    import jax

    from jaxk3.tools import bench_gather, demo

    three = jax.devices()[:3]
    seen = {}

    def run_demo(tp, **kw):
        seen["tp"] = tp
        return dict(tokens_equal=True, new_tokens=16, fast_median_ms=1.0, lax_median_ms=1.0, speedup=1.0)

    rows = [dict(bytes_per_rank=s, impl=i, us_per_gather=1.0) for s in (64, 1024, 4096) for i in ("lax", "ffi")]
    monkeypatch.setattr(jax, "devices", lambda *a: three)
    monkeypatch.setattr(demo, "run_demo", run_demo)
    monkeypatch.setattr(bench_gather, "bench_gather", lambda **kw: {"rows": rows})
    monkeypatch.setattr(bench_gather, "gather_table", lambda res: "table")
    rc, out, err = run_cli(["demo"], capsys)
    assert rc == 0 and seen["tp"] == 2, err
    assert "model: TP 2 on 2 of the 3 devices (the largest TP that divides the tiny model: kda num_heads = 8 " \
           "is not divisible by the TP size 3)" in out


ENV_CASES = [("JAXK3_GATHER", "foo", "environment: JAXK3_GATHER='foo': expected one of ('auto', 'ffi', 'lax')"),
             ("JAXK3_GATHER_MAX_ROWS", "abc", "environment: JAXK3_GATHER_MAX_ROWS='abc' is not an integer"),
             ("JAXK3_GATHER_MAX_BYTES", "-5", "environment: JAXK3_GATHER_MAX_BYTES=-5 must be >= 0"),
             ("JAXK3_GATHER_TIMEOUT_S", "0", "environment: JAXK3_GATHER_TIMEOUT_S=0.0 must be a finite number")]


@pytest.mark.parametrize("var, value, message", ENV_CASES)
@pytest.mark.parametrize("argv", [["info"], ["info", "--config", "tiny"], ["demo"], ["bench", "gather"],
                                  ["bench", "decode", "--config", "tiny"], ["bench", "kernels", "--config", "tiny"],
                                  ["bench", "generate", "--config", "tiny"],
                                  ["generate", "--checkpoint", "/no/such/dir", "--prompt-ids", "1"],
                                  ["init-checkpoint", "--config", "tiny", "/tmp/jaxk3-never-written"]])
def test_bad_environment_is_one_line_for_every_command(capsys, monkeypatch, no_load, var, value, message, argv):
    """Was: the collectives' named ValueError, but as a traceback from wherever the variable was first read."""
    monkeypatch.setenv(var, value)
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    one_error_line(err, f"{' '.join(['jaxk3'] + argv[:2 if argv[0] == 'bench' else 1])}: error: {message}")
    assert not os.path.exists("/tmp/jaxk3-never-written")


def test_bench_generate_defaults_refused_on_a_small_machine(capsys, monkeypatch):
    """Was: the Kimi-Linear-48B preset ran on a CPU-only machine with no word that it needs ~92 GiB."""
    from jaxk3.tools import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: (24 << 30, "host memory"))
    rc, out, err = run_cli(["bench", "generate"], capsys)
    assert rc == 2 and out == ""
    one_error_line(err, "jaxk3 bench generate: error: --config kimi-linear-48b at TP 1 (27 layers, 256 routed "
                        "experts, bfloat16) needs 92.1 GiB per rank (weights 91.5 GiB + decode cache",
                   "batch 8 x 4608 positions", "more than the 24.0 GiB of host memory", "run it on one, or try --config tiny")


def test_bench_generate_counts_every_cpu_rank(capsys, monkeypatch):
    from jaxk3.tools import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: (24 << 30, "host memory"))
    rc, _, err = run_cli(["bench", "generate", "--tp", "4"], capsys)
    assert rc == 2
    one_error_line(err, "--config kimi-linear-48b at TP 4", "x 4 CPU ranks", "24.0 GiB of host memory")


@pytest.mark.parametrize("option, noun", [("--gather", "gather"), ("--psum", "all-reduce")])
def test_ffi_collectives_and_a_long_prompt_before_loading(tmp_path, capsys, no_load, option, noun):
    """Was: a prompt over 64 tokens refused with --gather ffi / --psum ffi only after the weights were loaded."""
    prompt = ",".join(str(i) for i in range(1, 66))
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", prompt, option, "ffi"], capsys)
    assert rc == 2
    one_error_line(err, f"{option} ffi: the FFI {noun} cannot serve the prompt of 65 tokens (1 x 128 rows per "
                        f"prefill step): 128 rows > JAXK3_GATHER_MAX_ROWS=64", f"use {option} auto or lax")


def test_ffi_collectives_and_a_short_prompt_still_load(tmp_path, capsys, fake_load):
    prompt = ",".join(str(i) for i in range(1, 65))
    rc, _, err = run_cli(GEN + ["--checkpoint", config_dir(tmp_path), "--prompt-ids", prompt, "--gather", "ffi",
                                "--psum", "ffi"], capsys)
    assert rc == 0, err
    assert len(fake_load.rows[0]) == 64


@pytest.mark.slow
def test_eos_list_second_id_stops_generation_end_to_end(tmp_path, capsys):
    """Was: config.py kept eos_token_id[0] of a list.  A real tiny checkpoint: generate 6 tokens, then
    make the third one the second id of an eos list; `jaxk3 generate` stops there (the CLI passes no stop ids: Model.generate's default stops it)."""
    from jaxk3.checkpoint import load_config

    ckpt = checkpoint_dir(tmp_path, tiny_k3_4l())  # what the CLI does does not depend on depth: 4 layers compile sooner
    base = GEN + ["--checkpoint", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--tp", "1",
                  "--dtype", "float32"]
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    new = [int(t) for t in out.split("new ids: ")[1].split()[0].split(",")]
    assert len(new) == 6
    stop = new[2]
    first = next(i for i in range(1000) if i not in new)  # an eos id that never comes
    edit_config(ckpt, eos_token_id=[first, stop])
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    assert f"new ids: {','.join(map(str, new[:new.index(stop) + 1]))}\n" in out
    cfg = load_config(ckpt)
    assert cfg.eos_token_ids == (first, stop) and cfg.eos_token_id == first
    # the CLI passes no stop ids: the stop came from Model.generate's default (engine._check_stop_ids)
    assert jaxk3.engine._check_stop_ids(None, cfg) == (first, stop)


# ---------------------------------------------------------------- Ctrl-C and a closed pipe (subprocesses)
def _cli_process(argv, sigint: bool = False, **kw):
    """`python -m jaxk3.cli argv` in a fresh process.  sigint=True: with Python's Ctrl-C handler installed
    even where this suite was started with SIGINT ignored (a background job of a shell without job control:
    its children inherit the ignore, and Python then leaves SIGINT ignored; seen: the Ctrl-C test's CLI ran
    all 20000 tokens and exited 0)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the tests' XLA level (conftest.py); the child sets its devices
    head = ([sys.executable, "-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'jaxk3'; runpy.run_module('jaxk3.cli', run_name='__main__', alter_sys=True)"]
            if sigint else [sys.executable, "-m", "jaxk3.cli"])
    return subprocess.Popen(head + argv, env=env, **kw)


@pytest.mark.slow
def test_ctrl_c_prints_the_tokens_so_far_and_exits_130(tmp_path):
    """Was: a 23-57-line KeyboardInterrupt traceback, the tokens generated so far lost.  SIGINT once the
    decode progress shows new tokens: the tokens so far on stdout, one line on stderr, exit 130.
    (One compile of the tiny model in the subprocess: about a minute on the 2-core machine.)"""
    import signal
    import subprocess
    import threading
    import time

    ckpt = checkpoint_dir(tmp_path, tiny_k3_4l())  # what the CLI does does not depend on depth: 4 layers compile sooner
    # 20000 new tokens (~6 min at the 54 tok/s of a busy CI machine): the run cannot end before the SIGINT lands
    # (with 2000 it once did, in a busy two-worker run: exit 0 with every token)
    p = _cli_process(["generate", "--checkpoint", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "20000",
                      "--dtype", "float32", "--cpu-devices", "1"], sigint=True, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    err = bytearray()
    reader = threading.Thread(target=lambda: [err.extend(b) for b in iter(lambda: p.stderr.read1(1 << 16), b"")])
    reader.start()
    deadline = time.monotonic() + 400
    try:
        while not re.search(rb"generating:[^\r\n]*\| *[1-9][0-9]*/20000", bytes(err)):
            assert p.poll() is None and time.monotonic() < deadline, bytes(err).decode()
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out = p.stdout.read().decode()
        rc = p.wait(timeout=120)
    finally:
        p.kill()
        reader.join()
    text = bytes(err).decode()
    assert rc == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    last = text.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(r"jaxk3 generate: interrupted \(Ctrl-C\) after ([0-9]+) new tokens; the tokens so far are "
                        r"on stdout", last), last
    n = int(re.search(r"after ([0-9]+) new tokens", last).group(1))
    lines = out.splitlines()
    assert lines[0] == "prompt ids: 1,2,3" and lines[1].startswith("new ids: "), out
    new = lines[1][len("new ids: "):].split(",")
    assert 1 <= len(new) == n < 20000 and all(t.isdigit() for t in new)


@pytest.mark.slow
def test_closed_pipe_ends_quietly_with_141(tmp_path):
    """Was: a BrokenPipeError traceback (`jaxk3 generate ... | head`).  The reader closes its end before
    any output: one line on stderr, exit 141, no 'Exception ignored' at exit."""
    import subprocess

    ckpt = checkpoint_dir(tmp_path, tiny_k3_4l())  # what the CLI does does not depend on depth: 4 layers compile sooner
    # the checkpoint, prompt, token count, TP and device count of test_eos_list_second_id_stops_generation_end_to_end
    # (its first run, in-process above): the compilation cache serves the programs, the process still runs them
    for argv, cmd in ((["info"], "jaxk3 info"),
                      (["generate", "--checkpoint", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                        "--dtype", "float32", "--cpu-devices", "8", "--tp", "1", "--no-progress"], "jaxk3 generate")):
        r, w = os.pipe()
        p = _cli_process(argv, stdout=w, stderr=subprocess.PIPE)
        os.close(w)
        os.close(r)  # the reader is gone before the command writes anything
        _, err = p.communicate(timeout=400)
        text = err.decode()
        assert p.returncode == 141, text
        assert "Traceback" not in text and "Exception ignored" not in text, text
        assert text.rstrip("\n").splitlines()[-1] == \
            f"{cmd}: stdout was closed before the output was written (broken pipe)", text


# ---------------------------------------------------------------- init-checkpoint
@pytest.mark.parametrize("setup, argv, needle", [
    (lambda d: (d / "x").write_text("x"), [], "is not empty (--force writes into it"),
    (lambda d: None, ["--config", "nope"], "--config 'nope': not tiny, tiny-kimi-linear, a config.json file"),
    (lambda d: None, ["--config", "k3"], "--config 'k3': not tiny, tiny-kimi-linear"),
    (lambda d: None, ["--seed", "-1"], "--seed: need a seed in 0..2147483647"),
    (lambda d: None, ["--dtype", "int8"], "--dtype: invalid choice"),
])
def test_init_checkpoint_misuse(tmp_path, capsys, setup, argv, needle):
    setup(tmp_path)
    config = [] if "--config" in argv else ["--config", "tiny"]
    rc, out, err = run_cli(["init-checkpoint", str(tmp_path)] + config + argv, capsys)
    assert rc == 2 and out == ""
    one_error_line(err, "jaxk3 init-checkpoint: error:", needle)
    assert not (tmp_path / "config.json").exists()


def test_init_checkpoint_dir_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    rc, _, err = run_cli(["init-checkpoint", "--config", "tiny", str(tmp_path / "f")], capsys)
    assert rc == 2
    one_error_line(err, f"{tmp_path}/f: exists and is not a directory")


def test_init_checkpoint_bad_config_contents(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(dict(KimiK3Config.tiny_k3().to_hf_dict(), num_experts_per_token=0)))
    rc, _, err = run_cli(["init-checkpoint", "--config", str(cfg), str(tmp_path / "out")], capsys)
    assert rc == 2
    one_error_line(err, f"{cfg}: num_experts_per_token: must be >= 1, got 0")
    assert not (tmp_path / "out").exists()


def test_init_checkpoint_mxfp4_needs_experts_and_group_widths(tmp_path, capsys):
    dense_only = tmp_path / "dense.json"
    dense_only.write_text(json.dumps(KimiK3Config.tiny_k3(first_k_dense_replace=8).to_hf_dict()))
    rc, _, err = run_cli(["init-checkpoint", "--config", str(dense_only), str(tmp_path / "a"), "--mxfp4"], capsys)
    assert rc == 2
    one_error_line(err, "--mxfp4: --config", "has no MoE layer")
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(KimiK3Config.tiny_k3(moe_intermediate_size=48).to_hf_dict()))
    rc, _, err = run_cli(["init-checkpoint", "--config", str(odd), str(tmp_path / "b"), "--mxfp4"], capsys)
    assert rc == 2
    one_error_line(err, "experts_format: 'mxfp4': moe_intermediate_size = 48 is not a multiple of the MXFP4 group 32")


def test_bench_decode_target_needs_census(capsys):
    rc, _, err = run_cli(["bench", "decode", "--target", "h200", "--config", "tiny"], capsys)
    assert rc == 2
    assert "--target: only with --census" in one_error_line(err, "--target")


def test_bench_decode_target_without_the_cuda_plugin_says_how(capsys):
    """Without jax's CUDA plugin (this suite's venvs) `--census --target h200` fails with one line that names the
    missing plugin and `make aot`, before compiling anything."""
    from jaxk3.tools import aot

    try:
        aot.target_mesh("h200", 1)
        pytest.skip("this jax can compile for the H200 (its CUDA plugin is here): tests/test_aot.py covers it")
    except aot.TargetUnavailable:
        pass
    rc, _, err = run_cli(["bench", "decode", "--census", "--target", "h200", "--config", "tiny", "--tp", "1",
                          "--batch", "1", "--context", "1k"], capsys)
    assert rc == 2
    line = one_error_line(err, "target h200")
    assert "CUDA plugin" in line and "make aot" in line, line
