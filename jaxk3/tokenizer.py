"""The Kimi tokenizer of a checkpoint directory, through `tiktoken` (optional dependency).

Kimi checkpoints ship `tiktoken.model` (the BPE ranks: one `base64(token bytes) rank` per line) and
`tokenizer_config.json` (`added_tokens_decoder`: id -> {"content": "[BOS]", ...}, the special
tokens).  The pre-tokenisation regex is the one of Kimi's `tokenization_kimi.py` (Han runs kept
together, cased-letter words with English contractions, up to 3 digits, punctuation, whitespace).
Text is encoded as is: no BOS is added (Kimi's tokenizer adds none by default), and text that
spells a special token ("[BOS]") is plain text unless the caller asks for specials
(`encode(text, allow_special=True)`, the CLI's `--allow-special-tokens`).
"""
from __future__ import annotations

import json
import os

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or unreadable (the message names the file)."""


class TokenizerUnavailableError(TokenizerError):
    """The `tiktoken` package is not installed: text cannot be encoded, token ids still work."""


class KimiTokenizer:
    """encode(text) -> ids; decode(ids) -> text (ids the tokenizer does not know print as <id>).

    `special`: the special tokens' text -> id (from tokenizer_config.json)."""

    def __init__(self, encoding, special: dict[str, int]):
        self.encoding, self.special = encoding, special

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "KimiTokenizer":
        path = os.fspath(path)
        ranks_path = os.path.join(path, RANKS_FILE)
        if not os.path.exists(ranks_path):
            raise TokenizerError(f"tokenizer: {path} has no {RANKS_FILE}; pass token ids with --prompt-ids instead")
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise TokenizerUnavailableError("tokenizer: text prompts need the `tiktoken` package (pip install tiktoken); "
                                 "or pass token ids with --prompt-ids") from None
        try:
            ranks = load_tiktoken_bpe(ranks_path)
        except Exception as e:
            raise TokenizerError(f"tokenizer: cannot read {ranks_path} as tiktoken BPE ranks ({e})") from None
        special: dict[str, int] = {}
        cpath = os.path.join(path, CONFIG_FILE)
        if os.path.exists(cpath):
            special = _special_tokens(cpath, set(ranks.values()))
        enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(path)) or "kimi", pat_str=KIMI_PAT_STR,
                                mergeable_ranks=ranks, special_tokens=special)
        return cls(enc, special)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """The ids of `text`.  allow_special=False (the default): text is plain text, and "[BOS]"
        typed in it is the ids of those five characters; True: the text of a special token becomes
        its id.  Raises TokenizerError for text that is not valid Unicode (e.g. lone surrogates)."""
        try:
            if allow_special:
                return self.encoding.encode(text, allowed_special="all")
            return self.encoding.encode(text, allowed_special=set(), disallowed_special=())
        except UnicodeError as e:
            raise TokenizerError(f"tokenizer: the text is not valid Unicode ({e})") from None

    def decode(self, ids) -> str:
        out, run = [], []
        for i in map(int, ids):
            try:
                self.encoding.decode_single_token_bytes(i)
                run.append(i)
            except KeyError:
                if run:
                    out.append(self.encoding.decode(run, errors="replace"))
                    run = []
                out.append(f"<{i}>")
        if run:
            out.append(self.encoding.decode(run, errors="replace"))
        return "".join(out)


def _special_tokens(cpath: str, ranked: set[int]) -> dict[str, int]:
    """The special tokens of tokenizer_config.json (`added_tokens_decoder`: id -> {"content": ...}),
    text -> id, leaving out ids that are BPE ranks; TokenizerError naming the file for anything else."""
    try:
        with open(cpath, encoding="utf-8") as f:
            conf = json.load(f)
    except OSError as e:
        raise TokenizerError(f"tokenizer: cannot read {cpath} ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerError(f"tokenizer: {cpath} is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise TokenizerError(f"tokenizer: {cpath} must be a JSON object, got {type(conf).__name__}")
    added = conf.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise TokenizerError(f"tokenizer: {cpath}: added_tokens_decoder must be an object (id -> token), got "
                             f"{type(added).__name__}")
    special: dict[str, int] = {}
    for i, tok in added.items():
        content = tok.get("content") if isinstance(tok, dict) else tok
        if not str(i).isdigit() or not isinstance(content, (str, type(None))):
            raise TokenizerError(f"tokenizer: {cpath}: added_tokens_decoder entry {i!r}: need a token id and "
                                 f"{{\"content\": text}}, got {tok!r}"[:300])
        if content is not None and int(i) not in ranked:
            special[content] = int(i)
    return special


def has_tokenizer(path: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), RANKS_FILE))
