"""Structured outputs on a tiny random Llama with a byte-level tokenizer (one token per byte):
every output matches its constraint; a constraint changes nothing about the other requests of
a batch, nor about its own output under batching, preemption, prefix caching or n-gram
speculation (greedy and seeded sampling); bad constraints are refused at admission."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from impasto import LLM, SamplingParams, StructuredOutputsParams
from impasto.engine.structured.grammar import GrammarCompiler
from impasto.engine.structured.manager import StructuredOutputManager
from impasto.errors import InvalidParameterError
from impasto.testing import save_byte_tokenizer
from tests.entrypoints.conftest import build_checkpoint

ARGS = dict(dtype="float32", block_size=4, max_num_seqs=8, num_threads=1, max_model_len=176)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["age"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
TIGHT = dict(disable_any_whitespace=True)  # a random model would otherwise pad with spaces
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, **TIGHT),
    "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA), **TIGHT),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}"),
    "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
    "gbnf": StructuredOutputsParams(grammar='root ::= "x" [0-9] ("+" [0-9]){0,3}'),
    "lark": StructuredOutputsParams(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
    "json_object": StructuredOutputsParams(json_object=True, **TIGHT),
}
PROMPTS = ["Tell me about it: ", "abc abc abc abc ", '{"id": 12, "name": "x']


def check(kind: str, text: str) -> None:
    if kind.startswith("json"):
        value = json.loads(text)
        if kind == "json_object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{2,5}-\d{1,3}", text), text
    elif kind == "choice":
        assert text in ("alpha", "beta", "gamma delta")
    elif kind == "gbnf":
        assert re.fullmatch(r"x[0-9](\+[0-9]){0,3}", text), text
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text), text


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = build_checkpoint(
        tmp_path_factory.mktemp("so_llama"), "llama", vocab_size=272, eos_token_id=256
    )
    save_byte_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _params(kind: str | None, seed: int | None = None, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 0.8,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=None if kind is None else CONSTRAINTS[kind],
    )


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _texts(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_outputs_match_their_constraints(model, seed):
    llm = LLM(str(model), **ARGS)
    kinds = list(CONSTRAINTS)
    outs = llm.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))],
        [_params(k, seed) for k in kinds],
        use_tqdm=False,
    )
    for kind, out in zip(kinds, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)


def test_a_constraint_changes_nothing_but_its_own_output(model):
    """Alone or batched with others (constrained or not), with a KV pool small enough to
    preempt, chunked prefill and prefix caching: the same tokens."""
    kinds: list[str | None] = [None, "json", "regex", None, "choice", "lark"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    params = [_params(k, seed=None if i % 2 else i) for i, k in enumerate(kinds)]
    alone = [
        _texts(LLM(str(model), **ARGS), [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)
    ]
    tight = dict(num_gpu_blocks_override=48, max_num_batched_tokens=16, enable_prefix_caching=True)
    llm = LLM(str(model), **{**ARGS, **tight})
    batched = _texts(llm, prompts, params)
    assert batched == alone
    assert _metric(llm, "impasto:num_preemptions") > 0


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_ngram_speculation_gives_the_same_constrained_output(model, seed):
    """Drafts are verified against the grammar position by position: the output equals the
    one without speculation, drafts the grammar refuses included (the prompt repeats text the
    constraint forbids, so n-gram drafts often leave the grammar)."""
    kinds = ["json", "regex", "gbnf", "choice"]
    prompts = ["abab abab abab ab", '{"id":1,"name":"a","id":1,"name":"a"', "x1+2+x1+2+x1", "al"]
    params = [_params(k, seed) for k in kinds]
    expected = _texts(LLM(str(model), **ARGS), prompts, params)
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(str(model), **ARGS, speculative_config=spec)
    assert _texts(llm, prompts, params) == expected
    assert _metric(llm, "impasto:spec_decode_num_draft_tokens") > 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
        dict(json="{not json"),
        dict(regex="(unclosed"),
        dict(grammar="root ::= ("),
        dict(choice=[]),
        dict(json={"type": "object"}, regex="a"),
        dict(regex="a+", disable_any_whitespace=True),
        dict(),
    ],
)
def test_bad_constraints_are_refused_at_admission(model, bad):
    llm = LLM(str(model), **ARGS)
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**bad)))
    assert e.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()


def test_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(model):
    """One row per verification position: row j is the mask after the first j drafts; the rows
    after a draft the grammar refuses allow everything; the matcher is rolled back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    compiler = GrammarCompiler(tok, 272, [256])
    params = StructuredOutputsParams(regex=r"ab(c|d)e")
    manager = StructuredOutputManager(compiler)
    manager._matchers["r"] = compiler.compile(params)
    a, b, c, e, z = (ord(x) for x in "abcez")
    masks = manager._fill([("r", [a, b, z, e])])
    assert masks.first_row == {"r": 0} and masks.bitmask.shape == (5, 9)

    reference = compiler.compile(params)
    expected = allocate_token_bitmask(5, 272)
    for j, token in enumerate([a, b]):
        fill_next_token_bitmask(reference, expected, j)
        assert reference.consume_token(token)
    fill_next_token_bitmask(reference, expected, 2)  # after "ab"; "z" is refused: rows 3, 4 open
    assert torch.equal(masks.bitmask, expected)
    assert (masks.bitmask[3:] == -1).all()
    # The matcher is where it was: "abce" is still the whole way through.
    matcher = manager._matchers["r"]
    assert matcher.try_consume_tokens([a, b, c, e]) == 4 and matcher.is_accepting()
    assert isinstance(matcher, llguidance.LLMatcher)
