"""`jaxk3 generate`: a fresh process on a tiny K3 checkpoint in the real format (text prompt through a
tiny tiktoken tokenizer written here), and the argument / checkpoint errors (in-process, no compile)."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxk3 import cli
from jaxk3.config import KimiK3Config

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import write_k3  # noqa: E402
from small_models import tiny_k3_4l  # noqa: E402
from conftest import CHILD_XLA_FLAGS  # noqa: E402

MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world"]
SPECIAL = {990: "[BOS]", 991: "[EOS]"}


def write_tokenizer(path):
    """A tiny Kimi-style tokenizer: tiktoken.model (base64 token, rank per line) + tokenizer_config.json."""
    ranks = [bytes([b]) for b in range(256)] + MERGES
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        for r, tok in enumerate(ranks):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    conf = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIAL.items()},
            "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3cli")
    write_k3(str(d), tiny_k3_4l(), seed=11)  # the tiny K3's first four layers: the CLI is the subject, not depth
    write_tokenizer(str(d))
    return str(d)


def test_tokenizer_encodes_with_merges_and_specials(ckpt):
    pytest.importorskip("tiktoken", reason="text prompts need tiktoken")
    from jaxk3.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(ckpt)
    assert tok.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")]
    # "[BOS]" typed in text is text; the special token only when asked for
    assert tok.encode("[BOS]hi") == [ord(c) for c in "[BOS]hi"]
    assert tok.encode("[BOS]hi", allow_special=True) == [990, ord("h"), ord("i")]
    assert tok.decode(tok.encode("hello world!")) == "hello world!"
    assert tok.decode([256 + 3, 999]) == "hello<999>"  # ids past the tokenizer print as <id>


@pytest.mark.slow
def test_generate_fresh_process_text_prompt(ckpt):
    """`python -m jaxk3.cli generate` in a new process: loads the sharded MXFP4 K3 checkpoint at TP 2 on CPU
    devices, encodes the text prompt, shows progress, prints ids + text + tokens/s; ids equal
    load_model().generate.  (8 devices as in this process: the process's device count is part of the
    compilation cache's key, so the in-process run below gets the programs the subprocess compiled.)"""
    pytest.importorskip("tiktoken", reason="text prompts need tiktoken")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the tests' XLA level (conftest.py); the child sets its devices
    r = subprocess.run([sys.executable, "-m", "jaxk3.cli", "generate", "--checkpoint", ckpt, "--prompt",
                        "hello world", "--max-new-tokens", "4", "--tp", "2", "--dtype", "float32",
                        "--gather", "lax", "--cpu-devices", "8"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert out["prompt ids"] == "259,264"
    new = [int(t) for t in out["new ids"].split(",")]
    assert len(new) == 4 and "text" in out
    assert "loading weights" in r.stderr and "generating" in r.stderr and "tokens/s" in r.stderr

    import jaxk3
    m = jaxk3.load_model(ckpt, tp=2, dtype="float32", gather="lax")
    np.testing.assert_array_equal(m.generate([[259, 264]], 4).tokens[0], new)


def test_generate_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--checkpoint", "--prompt", "--prompt-ids", "--max-new-tokens", "--tp", "--dtype", "--gather",
                "--cpu-devices", "--allow-special-tokens", "examples:"):
        assert opt in text


def test_generate_text_prompt_without_tokenizer(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KimiK3Config.tiny_k3().to_hf_dict()))
    assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no tiktoken.model" in err and "--prompt-ids" in err


def test_generate_bad_checkpoint_is_a_named_error(tmp_path, capsys):
    assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1,2", "--no-progress"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "positive integer"),
    (["--prompt-ids", "1", "--gather", "nccl"], "invalid choice"),
    ([], "one of the arguments --prompt --prompt-ids is required"),
])
def test_generate_bad_arguments(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--checkpoint", str(tmp_path)] + argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


# ------------------------------------------------------------------------------ init-checkpoint
@pytest.mark.parametrize("preset, mxfp4, layout", [("tiny", False, "k3"), ("tiny", True, "k3"),
                                                   ("tiny-kimi-linear", False, "flat")])
def test_init_checkpoint_writes_what_the_loader_reads(tmp_path, capsys, preset, mxfp4, layout):
    """init-checkpoint's checkpoint in the hub layout: info reports it from its headers, load_model
    places it (the README's quick start runs generate on it: tests/test_quickstart.py)."""
    import jaxk3
    from jaxk3 import checkpoint as ck

    d = tmp_path / "ckpt"
    argv = ["init-checkpoint", "--config", preset, str(d), "--seed", "3"] + (["--mxfp4"] if mxfp4 else [])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"wrote {d}" in out and f"jaxk3 generate --checkpoint {d}" in out
    raw = json.loads((d / "config.json").read_text())
    assert ("text_config" in raw) == (layout == "k3")
    assert ("quantization_config" in raw) == mxfp4
    names = ck.scan_checkpoint(str(d))
    assert any(n.startswith("language_model.") for n in names) == (layout == "k3")
    assert any(n.endswith("weight_packed") for n in names) == mxfp4
    assert names[next(n for n in names if n.endswith("embed_tokens.weight"))].dtype == "BF16"
    assert cli.main(["info", "--checkpoint", str(d), "--tp", "2"]) == 0
    assert f"routed experts {'mxfp4' if mxfp4 else 'dense'}" in capsys.readouterr().out
    cfg = ck.load_config(str(d))
    want = KimiK3Config.tiny_k3() if preset == "tiny" else KimiK3Config.tiny_kimi_linear()
    assert cfg == want
    m = jaxk3.load_model(str(d), tp=2, dtype="float32")
    assert m.cfg.experts_format == ("mxfp4" if mxfp4 else "dense")


def test_init_checkpoint_force_replaces_and_seeds_differ(tmp_path, capsys):
    from jaxk3 import checkpoint as ck

    d = tmp_path / "ckpt"
    assert cli.main(["init-checkpoint", "--config", "tiny", str(d), "--dtype", "float32"]) == 0
    (d / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an older sharded write: removed
    (d / "notes.txt").write_text("kept")
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(KimiK3Config.tiny_kimi_linear().to_hf_dict()))
    assert cli.main(["init-checkpoint", "--config", str(tmp_path), str(d), "--force", "--seed", "1"]) == 0
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors", "notes.txt"]
    assert ck.load_config(str(d)) == KimiK3Config.tiny_kimi_linear()
