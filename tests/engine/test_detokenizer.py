"""IncrementalDetokenizer on tokenizers trained here, offline: byte-level BPE, a
SentencePiece-style Metaspace BPE with byte fallback, and WordPiece."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from impasto.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, stop here please. The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, déjà vu; ça va?",
    "世界你好，这是一个测试。日本語のテキストです。",
    "emoji 🎉🚀 time, more emoji 😀👍🏽 here",
] * 10
TEXT = "Hello wörld, 世界 says 🎉 hi; stop here please — naïve 😀 end."


@cache
def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@cache
def metaspace() -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<unk>", "<s>", "</s>"]
    trained.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    )
    # Byte-fallback tokens are ordinary vocabulary entries (as in Llama), not special tokens.
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@cache
def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")


def byte_token(tok: PreTrainedTokenizerFast, b: int) -> int:
    """Id of the single-byte token for byte b (GPT-2 byte-to-char map: printable Latin-1 bytes
    map to themselves, the others to U+0100 onwards in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [x for x in range(256) if x not in printable]
    char = chr(b) if b in printable else chr(256 + others.index(b))
    return tok.convert_tokens_to_ids(char)


def feed(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1, finish: bool = True
) -> tuple[str | None, list[str]]:
    """Feed ids `chunk` at a time; return the stop string and the streamed deltas."""
    deltas: list[str] = []
    stop = None
    for s in range(0, len(ids), chunk):
        last = s + chunk >= len(ids)
        stop = detok.update(ids[s : s + chunk], finished=finish and last)
        deltas.append(detok.get_delta_text())
        assert "\ufffd" not in detok.output_text  # callers feed valid UTF-8 only
        if stop is not None:
            break
    return stop, deltas


@pytest.mark.parametrize("make", [byte_level, metaspace, wordpiece])
@pytest.mark.parametrize("chunk", [1, 3])
def test_valid_text_roundtrip_without_replacement_chars(make: Any, chunk: int) -> None:
    tok = make()
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[])
    stop, deltas = feed(detok, ids, chunk)
    assert stop is None
    assert detok.output_text == tok.decode(ids) == "".join(deltas)
    assert len(detok._window) <= 8  # O(1) state: a small window, not the whole sequence


def test_multibyte_chars_split_across_byte_tokens() -> None:
    tok = byte_level()
    # Single-byte tokens: every multi-byte character is cut between tokens.
    raw = "é世🎉".encode()
    byte_ids = [byte_token(tok, b) for b in raw]
    assert tok.decode(byte_ids) == "é世🎉"
    detok = IncrementalDetokenizer(tok, [])
    texts = []
    for t in byte_ids:
        detok.update([t])
        texts.append(detok.output_text)
    assert texts == ["", "é", "é", "é", "é世", "é世", "é世", "é世", "é世🎉"]


def test_byte_fallback_character_is_held_until_complete() -> None:
    tok = metaspace()
    ids = tok.encode("a ☃ b", add_special_tokens=False)  # ☃ is not in the corpus: 3 byte tokens
    assert sum(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids) == 3
    detok = IncrementalDetokenizer(tok, [])
    for t in ids:
        detok.update([t])
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == "a ☃ b"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_match_decode(data: st.DataObject) -> None:
    make = data.draw(st.sampled_from([byte_level, metaspace, wordpiece]))
    tok = make()
    # Byte-fallback decoding turns a whole run of byte tokens into U+FFFD once one byte is
    # invalid, which no incremental decoder can anticipate: random ids exclude byte tokens there
    # (valid byte runs are covered by test_random_text_roundtrip). Byte-level BPE: any ids.
    vocab = [i for t, i in tok.get_vocab().items() if not (len(t) == 6 and t.startswith("<0x"))]
    ids = data.draw(st.lists(st.sampled_from(sorted(vocab)), max_size=40))
    chunk = data.draw(st.integers(1, 4))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    seen = ""
    for s in range(0, len(ids), chunk):
        detok.update(ids[s : s + chunk])
        # Committed text only grows and is always a prefix of the full decode so far.
        assert detok.output_text.startswith(seen)
        seen = detok.output_text
        if make is byte_level:
            assert tok.decode(ids[: s + chunk], skip_special_tokens=skip).startswith(seen)
    detok.update([], finished=True)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\ufffd"),
        max_size=30,
    ),
    chunk=st.integers(1, 3),
    which=st.sampled_from([byte_level, metaspace, wordpiece]),
)
def test_random_text_roundtrip(text: str, chunk: int, which: Any) -> None:
    tok = which()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    stop, deltas = feed(detok, ids, chunk, finish=False)
    assert stop is None and "\ufffd" not in detok.output_text
    assert detok.output_text == tok.decode(ids, skip_special_tokens=True) == "".join(deltas)


def test_garbage_bytes_keep_the_window_small() -> None:
    tok = byte_level()
    ids = [byte_token(tok, 0x80)] * 50 + [byte_token(tok, 0xE4)]
    detok = IncrementalDetokenizer(tok, [])
    for t in ids:
        detok.update([t])
        assert len(detok._window) <= 6
    # Invalid bytes are committed a few tokens late; the lead byte 0xE4 may still complete.
    assert detok.output_text in ["\ufffd" * n for n in range(46, 51)]
    detok.update([], finished=True)
    assert detok.output_text == tok.decode(ids)


def stream(
    tok: PreTrainedTokenizerFast, text: str, stop: list[str], include: bool = False, chunk: int = 1
) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    stop_str, deltas = feed(detok, ids, chunk)
    return detok, stop_str, deltas


@pytest.mark.parametrize("make", [byte_level, metaspace])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_spanning_tokens(make: Any, chunk: int) -> None:
    tok = make()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 20
    for stop_str in ["op he", "世界 s", "🎉", "ve 😀 e", "lease"]:
        detok, found, deltas = stream(tok, TEXT, [stop_str], chunk=chunk)
        cut = TEXT.index(stop_str)
        assert found == stop_str and detok.stop_reason == stop_str and detok.finished
        assert detok.output_text == TEXT[:cut] == "".join(deltas)
        detok, found, deltas = stream(tok, TEXT, [stop_str], include=True, chunk=chunk)
        assert detok.output_text == TEXT[: cut + len(stop_str)] == "".join(deltas)


def test_first_completed_stop_wins_and_later_tokens_are_ignored() -> None:
    tok = byte_level()
    detok, found, _ = stream(tok, TEXT, ["please", "says", "zzz"], chunk=100)
    assert found == "says" and detok.output_text == TEXT[: TEXT.index("says")]
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None
    assert detok.output_text == TEXT[: TEXT.index("says")]


def test_streaming_never_emits_a_partial_stop_string() -> None:
    tok = byte_level()
    ids = tok.encode("Hello wörld, stop", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["stop here", "wörld!"])
    streamed = ""
    for t in ids:
        detok.update([t])
        streamed += detok.get_delta_text()
        assert not streamed.endswith(("s", "st", "sto", "stop", "w", "wö", "wörld"))
    assert streamed == "Hello wörld, "  # "stop" may still become "stop here"
    detok.update([], finished=True)
    assert streamed + detok.get_delta_text() == "Hello wörld, stop"


def test_stop_terminated_drops_the_stop_token_text() -> None:
    tok = byte_level()
    eos = tok.convert_tokens_to_ids("<eos>")
    ids = tok.encode("Hello", add_special_tokens=False)
    for include, skip, expected in [
        (False, False, "Hello"),
        (True, False, "Hello<eos>"),
        (True, True, "Hello"),
    ]:
        detok = IncrementalDetokenizer(
            tok, [], skip_special_tokens=skip, include_stop_str_in_output=include
        )
        assert detok.update([*ids, eos], stop_terminated=True) is None
        assert detok.output_text == expected and detok.finished


def test_prompt_context_renders_the_first_output_token() -> None:
    tok = metaspace()
    prompt = tok.encode("Hello", add_special_tokens=False)
    out = tok.encode("Hello world", add_special_tokens=False)[len(prompt) :]
    assert tok.decode(out) == "world"  # alone, Metaspace strips the leading space
    detok = IncrementalDetokenizer(tok, prompt)
    detok.update(out)
    assert detok.output_text == " world"


@settings(max_examples=50, deadline=None)
@given(prompt=st.text(max_size=12), out=st.text(max_size=12), chunk=st.integers(1, 3))
def test_output_after_a_prompt_is_the_suffix_of_the_joint_decode(
    prompt: str, out: str, chunk: int
) -> None:
    tok = byte_level()
    p_ids = tok.encode(prompt, add_special_tokens=False)
    o_ids = tok.encode(out, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, p_ids)
    for s in range(0, len(o_ids), chunk):
        detok.update(o_ids[s : s + chunk], finished=s + chunk >= len(o_ids))
    joint = tok.decode(p_ids + o_ids)
    assert detok.output_text == joint[len(tok.decode(p_ids)) :]


def first_stop(text: str, stops: list[str], include: bool) -> str:
    """Reference: check after every character, as a character-level stream would."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end if include else end - len(s)]
    return text


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stop_strings_match_a_character_level_reference(data: st.DataObject) -> None:
    tok = data.draw(st.sampled_from([byte_level, metaspace]))()
    text = data.draw(st.text(st.sampled_from("ab cé世🎉"), max_size=25))
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    n_stops = data.draw(st.integers(1, 3))
    stops = [
        data.draw(st.text(st.sampled_from("ab cé世🎉"), min_size=1, max_size=4))
        for _ in range(n_stops)
    ]
    include = data.draw(st.booleans())
    chunk = data.draw(st.integers(1, 5))
    detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    found, deltas = feed(detok, ids, chunk)
    expected = first_stop(full, stops, include)
    assert detok.output_text == expected == "".join(deltas)
    assert (found is not None) == (expected != full or any(full.endswith(s) for s in stops))
