"""vLLM's `allowed_token_ids` and `bad_words`: validated at admission (400s naming them), applied
by the sampler on every row (plain decode and each verified draft position), refused by
diffusion models, honoured offline, over HTTP and with speculative decoding."""

from __future__ import annotations

import re

import pytest
import torch

from impasto import LLM, SamplingParams
from impasto.config.model import ModelConfig
from impasto.engine.processor import InputProcessor
from impasto.errors import InvalidParameterError
from impasto.loader.packaged_models import ensure_default_model
from impasto.worker.sampler import Sampler, SamplingMetadata
from tests.engine.test_detokenizer import byte_level

V = 32


def _meta(params: list[SamplingParams], outputs: list[list[int]]) -> SamplingMetadata:
    prompts = [[1, 2, 3]] * len(params)
    positions = [3 + len(o) for o in outputs]
    return SamplingMetadata.from_params(params, outputs, prompts, positions, "cpu", None)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[True]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=["ok", 3]), "bad_words"),
    ],
)
def test_bad_values_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_json_values_are_type_checked():
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams.from_fields({"allowed_token_ids": "1,2"})
    assert e.value.param == "allowed_token_ids"
    p = SamplingParams.from_fields({"allowed_token_ids": [4, 5], "bad_words": ["x"]})
    assert p.allowed_token_ids == [4, 5] and p.bad_words == ["x"]


def _processor(**model) -> InputProcessor:
    cfg = ModelConfig("m", "float32", max_model_len=64, vocab_size=V, **model)
    return InputProcessor(cfg, byte_level() if not model.get("is_diffusion") else None)


def test_admission_checks_against_the_model():
    with pytest.raises(InvalidParameterError) as e:
        _processor().process("r", [1, 2], SamplingParams(allowed_token_ids=[1, V]))
    assert e.value.param == "allowed_token_ids"
    for kwargs in (dict(allowed_token_ids=[1]), dict(bad_words=["a"])):
        with pytest.raises(InvalidParameterError, match="diffusion") as e:
            _processor(is_diffusion=True).process("r", [1, 2], SamplingParams(**kwargs))
        assert e.value.param == next(iter(kwargs))
    no_tokenizer = InputProcessor(ModelConfig("m", "float32", 64, V), None)
    with pytest.raises(InvalidParameterError) as e:
        no_tokenizer.process("r", [1, 2], SamplingParams(bad_words=["a"]))
    assert e.value.param == "bad_words"


def test_bad_words_become_token_sequences_with_and_without_a_leading_space():
    tok = byte_level()
    p = SamplingParams(bad_words=["hello world"])
    p.update_from_tokenizer(tok, None, set())
    spellings = {tuple(ids) for ids in p.bad_words_token_ids or []}
    assert tuple(tok.encode("hello world", add_special_tokens=False)) in spellings
    assert tuple(tok.encode(" hello world", add_special_tokens=False)) in spellings


def test_allowed_token_ids_mask_every_other_token():
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    allowed = [3, 17, 30]
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    rand = SamplingParams(temperature=1.5, seed=7, allowed_token_ids=allowed)
    plain = SamplingParams(temperature=0.0)
    out = Sampler()(logits, _meta([greedy] * 32 + [rand] * 31 + [plain], [[]] * 64))
    ids = out.sampled_token_ids.tolist()
    assert set(ids[:63]) <= set(allowed)
    best = logits[:32, allowed].argmax(dim=-1)
    assert ids[:32] == [allowed[i] for i in best.tolist()]
    assert ids[63] == int(logits[63].argmax())  # other rows untouched


def test_bad_words_ban_the_last_token_only_after_the_rest_of_the_word():
    logits = torch.zeros(3, V)
    logits[:, 9] = 10.0  # 9 wins unless banned
    p = SamplingParams(temperature=0.0)
    p.bad_words_token_ids = [[5, 9], [11]]  # as update_from_tokenizer fills it in
    out = Sampler()(logits, _meta([p] * 3, [[1, 5], [5, 1], []]))
    got = out.sampled_token_ids.tolist()
    assert got[0] != 9 and got[1] == 9 and got[2] == 9  # only after ...5 is 9 banned
    logits[:, 11] = 20.0  # a one-token bad word is banned everywhere
    out = Sampler()(logits, _meta([p] * 3, [[1, 5], [5, 1], []]))
    assert 11 not in out.sampled_token_ids.tolist()


@pytest.mark.slow
def test_engine_offline_and_with_speculation():
    """On the real default model: allowed ids hold for every generated token, a bad word never
    appears, and n-gram speculation (verified rows) gives the same tokens as plain decoding."""
    outs = {}
    path = str(ensure_default_model())
    for spec in (
        None,
        {"method": "ngram", "num_speculative_tokens": 3, "acceptance_backoff": False},
    ):
        llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=spec)
        tok = llm.get_tokenizer()
        allowed = tok(" the cat sat on mat.", add_special_tokens=False).input_ids
        base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        free = llm.generate(["Once upon a time"], base, use_tqdm=False)[0].outputs[0]
        word = free.text.split()[1]
        params = [
            SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed
            ),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word]),
        ]
        restricted, banned = llm.generate(["Once upon a time"] * 2, params, use_tqdm=False)
        assert set(restricted.outputs[0].token_ids) <= set(allowed)
        # a banned word never appears as a word (its tokens may still spell part of another,
        # e.g. "the" in "together")
        assert not re.search(rf"\b{re.escape(word)}\b", banned.outputs[0].text)
        outs[spec is None] = (restricted.outputs[0].token_ids, banned.outputs[0].token_ids)
    assert outs[True] == outs[False]
