"""Tokenizers from GGUF metadata and HF folders; stop ids; chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from impasto.loader.tokenizer import (
    apply_chat_template,
    get_eos_token_id,
    get_stop_token_ids,
    load_tokenizer,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
MERGES = ["1 2", "12 3", "4 5", "Ġ w", "Ġw o", "h e", "he l", "hel l", "hell o"]
EXTRA = ["12", "123", "45", "Ġw", "Ġwo", "he", "hel", "hell", "hello", "abc"]


def write_tokenizer_gguf(path: Path, pre: str, **kv: object) -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIALS + alphabet + EXTRA
    types = [3, 3, 3, 4] + [1] * (len(alphabet) + len(EXTRA))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def pieces(path: Path, text: str) -> list[str]:
    tok = load_tokenizer(path)
    return tok.convert_ids_to_tokens(tok.encode(text))


@pytest.mark.parametrize(
    "pre,digits,abc",
    [
        ("gpt-2", ["123", "45"], ["a", "b", "c"]),
        ("smollm", ["1", "2", "3", "4", "5"], ["a", "b", "c"]),
        ("llama-bpe", ["123", "45"], ["abc"]),  # llama3 splits digits in 3s, ignores merges
        ("qwen2", ["1", "2", "3", "4", "5"], ["a", "b", "c"]),
    ],
)
def test_pre_tokenizer_families(
    tmp_path: Path, pre: str, digits: list[str], abc: list[str]
) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", pre)
    assert pieces(tmp_path / "t.gguf", "12345") == digits
    assert pieces(tmp_path / "t.gguf", "abc") == abc
    assert pieces(tmp_path / "t.gguf", "hello world") == ["hello", "Ġwo", "r", "l", "d"]


def test_special_tokens_and_roundtrip(tmp_path: Path) -> None:
    tokens = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2")
    tok = load_tokenizer(tmp_path / "t.gguf")
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == tuple(SPECIALS[1:3] + SPECIALS[:1])
    assert len(tok) == len(tokens)
    text = "<|im_start|>user\nhello <think>wörld 日本 🎉<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and 3 in ids  # specials are atomic
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello <think>wörld 日本 🎉"
    for s in ["", " ", "  two  spaces\n\n", "tab\tand\r\nCRLF", "ünïcödé", "a'll I'VE"]:
        assert tok.decode(tok.encode(s)) == s


def test_add_bos_token(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", "llama-bpe", add_bos_token=True)
    tok = load_tokenizer(tmp_path / "t.gguf")
    assert tok.encode("hello")[:2] == [1, tok.convert_tokens_to_ids("hello")]
    assert tok.encode("hello", add_special_tokens=False) == [tok.convert_tokens_to_ids("hello")]


def test_chat_template(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", chat_template=CHATML)
    tok = load_tokenizer(tmp_path / "t.gguf")
    text = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = apply_chat_template(tok, [{"role": "user", "content": "hi"}], False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_missing_chat_template(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2")
    tok = load_tokenizer(tmp_path / "t.gguf")
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


def test_stop_and_eos_ids(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", eot_token_id=3)
    assert get_stop_token_ids(tmp_path / "t.gguf") == [2, 3]
    tok = load_tokenizer(tmp_path / "t.gguf")
    assert get_eos_token_id(tok, None) == 2

    class Config:
        eos_token_id = [7, 8]

    assert get_eos_token_id(None, Config()) == 7
    assert get_eos_token_id(None, None) is None
    assert get_stop_token_ids(tmp_path / "missing") == []


def test_end_of_turn_found_by_its_text(tmp_path: Path) -> None:
    """Gemma files name only their EOS; `<end_of_turn>` still ends a turn (as in llama.cpp),
    unless the metadata names an end-of-turn id itself."""

    def write(path: Path, **kv: object) -> Path:
        w = gguf.GGUFWriter(str(path), "gemma3")
        w.add_tokenizer_model("llama")
        w.add_token_list(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "a"])
        w.add_eos_token_id(1)
        for key, value in kv.items():
            getattr(w, f"add_{key}")(value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    assert get_stop_token_ids(write(tmp_path / "a.gguf")) == [1, 4]
    assert get_stop_token_ids(write(tmp_path / "b.gguf", eot_token_id=5)) == [1, 5]


def test_hf_folder(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", chat_template=CHATML)
    gguf_tok = load_tokenizer(tmp_path / "t.gguf")
    folder = tmp_path / "hf"
    gguf_tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_tokenizer(folder)
    for s in ["hello world 12345", "<|im_start|>x<|im_end|>"]:
        assert tok.encode(s) == gguf_tok.encode(s)
    assert apply_chat_template(tok, [{"role": "user", "content": "hi"}]).endswith("assistant\n")
    assert get_stop_token_ids(folder) == [2, 3]
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nothing")


@pytest.mark.slow
def test_default_model_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    from impasto.loader.packaged_models import ensure_default_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = ensure_default_model()
    ours = load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    samples = [
        "Hello, world!",
        "12345 apples and 3.14159 pies",
        "  leading spaces\n\n\ttabs\r\nand CRLF",
        "don't I'll WE'RE",
        "héllo wörld 日本語 🎉 emoji",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x ** 2  # square",
    ]
    for s in samples:
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ours.decode(ids) == ref.decode(ids) == s
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert get_stop_token_ids(path) == [2]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = apply_chat_template(ours, messages)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
