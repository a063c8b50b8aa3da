"""Tokenizers, stop tokens and chat templates for HF folders and GGUF files.

GGUF byte-level BPE vocabularies (the `gpt2` tokenizer model with a known pre-tokenizer) are
rebuilt directly as a `tokenizers.Tokenizer`; other GGUF tokenizers go through transformers'
own GGUF conversion. Everything is local: nothing is fetched from a model hub. Only those
(and HF folders) import `AutoTokenizer`, and with it `transformers.models`: a byte-level BPE
GGUF file's tokenizer is built without it.

Stop tokens are the EOS, end-of-turn and end-of-message ids; a GGUF file whose metadata names
no end-of-turn id still stops on the tokens llama.cpp recognises as such by their text
(`_END_OF_TURN_TEXTS`: Gemma's `<end_of_turn>`, which is not its EOS).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from impasto.loader.gguf_file import GGUFFile
from impasto.loader.gguf_loader import gguf_metadata, open_gguf

# Split patterns of byte-level BPE families (applied before the byte-to-unicode mapping).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# GGUF `tokenizer.ggml.pre` -> (split pattern or None for GPT-2's, split digits, NFC, ignore_merges)
_PRE_TYPES: dict[str, tuple[str | None, bool, bool, bool]] = {
    "gpt-2": (None, False, False, False),
    "gpt2": (None, False, False, False),
    "smollm": (None, True, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True, False),
}
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types that become added tokens
_ID_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}

# Token texts that end a turn when the metadata names no `eot_token_id` (Gemma's end of turn is
# not its EOS); llama.cpp recognises them by their text too.
_END_OF_TURN_TEXTS = frozenset({"<end_of_turn>"})


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _token(reader: GGUFFile, tokens: list[str], key: str) -> str | None:
    idx = gguf_metadata(reader, f"tokenizer.ggml.{_ID_KEYS[key]}_token_id")
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _byte_level_bpe(reader: GGUFFile, tokens: list[str], pre_type: str) -> Tokenizer:
    split, digits, nfc, ignore_merges = _PRE_TYPES[pre_type]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # duplicate strings keep their first id
    # byte-level tokens never contain a space, so each merge is exactly two tokens
    merges = [tuple(m.split(" ", 1)) for m in gguf_metadata(reader, "tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    prefix = bool(gguf_metadata(reader, "tokenizer.ggml.add_space_prefix", False))
    if split is None:
        steps: list[pre.PreTokenizer] = [pre.ByteLevel(add_prefix_space=prefix, use_regex=True)]
    else:
        steps = [
            pre.Split(Regex(split), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=prefix, use_regex=False),
        ]
    if digits:
        steps.insert(0, pre.Digits(individual_digits=True))
    tk.pre_tokenizer = steps[0] if len(steps) == 1 else pre.Sequence(steps)
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    types = gguf_metadata(reader, "tokenizer.ggml.token_type") or []
    tk.add_tokens(
        [
            AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos, eos = _token(reader, tokens, "bos"), _token(reader, tokens, "eos")
    add_bos = bool(gguf_metadata(reader, "tokenizer.ggml.add_bos_token", False)) and bos
    add_eos = bool(gguf_metadata(reader, "tokenizer.ggml.add_eos_token", False)) and eos
    if add_bos or add_eos:
        head, tail = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        specials = {t for t, on in ((bos, add_bos), (eos, add_eos)) if on}
        tk.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}",
            pair=f"{head}$A{tail} {head}$B:1{tail}",
            special_tokens=[(t, vocab[t]) for t in specials],
        )
    return tk


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    reader = open_gguf(path)
    hf_json = gguf_metadata(reader, "tokenizer.huggingface.json")
    kind = gguf_metadata(reader, "tokenizer.ggml.model")
    pre_type = gguf_metadata(reader, "tokenizer.ggml.pre", "default")
    tokens: list[str] = gguf_metadata(reader, "tokenizer.ggml.tokens", [])
    if hf_json is not None:
        backend = Tokenizer.from_str(hf_json)
    elif kind == "gpt2" and pre_type in _PRE_TYPES:
        backend = _byte_level_bpe(reader, tokens, pre_type)
    else:  # other vocabularies (SentencePiece, unknown splits): transformers' converter
        from transformers import AutoTokenizer  # imports transformers.models: only when needed

        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    special = {
        f"{key}_token": tok
        for key in ("bos", "eos", "unk", "pad")
        if (tok := _token(reader, tokens, key)) is not None
    }
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tok.chat_template = gguf_metadata(reader, "tokenizer.chat_template")
    return tok


def load_tokenizer(model_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF model folder or GGUF file, chat template included."""
    path = Path(model_path).expanduser()
    if is_gguf_file(path):
        return _gguf_tokenizer(path)
    if path.is_dir():
        from transformers import AutoTokenizer  # imports transformers.models: only when needed

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    raise FileNotFoundError(f"no tokenizer at {str(path)!r}: expected a GGUF file or model folder")


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def get_eos_token_id(tok: PreTrainedTokenizerBase | None, config: Any = None) -> int | None:
    """The tokenizer's EOS id, else the (first) config EOS id, else None."""
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        return int(tok.eos_token_id)
    ids = _as_ids(getattr(config, "eos_token_id", None))
    return ids[0] if ids else None


def get_stop_token_ids(model_path: str | os.PathLike[str]) -> list[int]:
    """All ids that end a turn (EOS plus end-of-turn / end-of-message ids), in order, unique."""
    path = Path(model_path).expanduser()
    ids: list[int] = []
    if is_gguf_file(path):
        reader = open_gguf(path)
        for key in ("eos", "eot", "eom"):
            ids += _as_ids(gguf_metadata(reader, f"tokenizer.ggml.{key}_token_id"))
        if gguf_metadata(reader, "tokenizer.ggml.eot_token_id") is None:
            tokens = gguf_metadata(reader, "tokenizer.ggml.tokens", [])
            ids += [i for i, t in enumerate(tokens) if t in _END_OF_TURN_TEXTS]
    elif path.is_dir():
        for name in ("generation_config.json", "config.json"):
            file = path / name
            if file.is_file():
                ids += _as_ids(json.loads(file.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def apply_chat_template(
    tok: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """Render a conversation to the prompt string (not tokenized), with the model's chat
    template or `chat_template` (a Jinja template) instead."""
    if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
        raise ValueError(
            "this model has no chat template; use a completion prompt instead of chat messages"
        )
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    text = tok.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert isinstance(text, str)
    return text
