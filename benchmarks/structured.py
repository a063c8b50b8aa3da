"""Structured outputs: what a JSON-schema constraint costs, and llguidance against xgrammar.

    python benchmarks/structured.py                 # default model, batch 1 and 16
    python benchmarks/structured.py --batch-sizes 1 --max-tokens 64
    IMPASTO_BENCH_XGRAMMAR_PYTHON=/path/to/venv/bin/python python benchmarks/structured.py

1. Engine overhead: the same chat prompts (asking for records as JSON) run unconstrained and
   with a JSON schema, alternating runs in one process, greedy, 128 tokens at most. Decode
   tokens/s = generated tokens / wall time of the batch; the constrained run's outputs are
   checked against the schema (jsonschema) and counted.
2. Grammar engines on the model's tokenizer, the same schemas: compile time (a cold cache,
   median of 5) and the time to compute one token mask along a valid output (median over its
   tokens). llguidance runs here; xgrammar, never a dependency, runs in the Python named by
   IMPASTO_BENCH_XGRAMMAR_PYTHON (a virtualenv with `pip install xgrammar`), same schemas
   and tokens, when that is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "email", "tags"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty", "price"],
                },
            },
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
            },
        },
        "required": ["id", "status", "items", "address"],
    },
}
SAMPLE = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math"]},
    "order": {
        "id": 1042,
        "status": "paid",
        "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.5}],
        "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
    },
}
TOPICS = ["a customer", "a scientist", "a chef", "a pilot", "a student", "a painter"]


# -- grammar engines ------------------------------------------------------------------------------
def _llguidance_times(tokenizer, vocab_size: int) -> dict[str, tuple[float, float]]:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    out = {}
    for name, schema in SCHEMAS.items():
        compiles = []
        for _ in range(5):  # a new tokenizer view each time: no cache anywhere
            lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            t = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            matcher = llguidance.LLMatcher(lltok, grammar)
            compiles.append(time.perf_counter() - t)
        ids = tokenizer.encode(json.dumps(SAMPLE[name]), add_special_tokens=False)
        mask = allocate_token_bitmask(1, vocab_size)
        per_token = []
        for tok in ids:
            t = time.perf_counter()
            fill_next_token_bitmask(matcher, mask, 0)
            per_token.append(time.perf_counter() - t)
            assert matcher.consume_token(tok), matcher.get_error()
        out[name] = (statistics.median(compiles), statistics.median(per_token))
    return out


_XGRAMMAR_SCRIPT = r"""
import json, statistics, sys, time
import xgrammar as xgr
from transformers import AutoTokenizer
spec = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
out = {}
for name, schema in spec["schemas"].items():
    compiles = []
    for _ in range(5):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=spec["vocab_size"])
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        compiles.append(time.perf_counter() - t)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per_token = []
    for t_id in tok.encode(json.dumps(spec["samples"][name]), add_special_tokens=False):
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        per_token.append(time.perf_counter() - t)
        assert matcher.accept_token(t_id)
    out[name] = [statistics.median(compiles), statistics.median(per_token)]
print(json.dumps(out))
"""


def _xgrammar_times(tokenizer_dir: str, vocab_size: int) -> dict[str, tuple[float, float]] | None:
    python = os.environ.get("IMPASTO_BENCH_XGRAMMAR_PYTHON")
    if not python:
        return None
    spec = {"tokenizer": tokenizer_dir, "vocab_size": vocab_size, "schemas": SCHEMAS}
    spec["samples"] = SAMPLE
    run = subprocess.run(
        [python, "-c", _XGRAMMAR_SCRIPT], input=json.dumps(spec), capture_output=True, text=True
    )
    if run.returncode != 0:
        print(f"# xgrammar failed: {run.stderr.strip().splitlines()[-1:]}")
        return None
    return {k: tuple(v) for k, v in json.loads(run.stdout).items()}


def _prefix_checker(tokenizer, vocab_size: int, schema: dict):
    """Whether generated tokens (cut by max_tokens) are a prefix of a document valid under
    `schema`, checked by a fresh matcher."""
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)

    def check(ids: list[int]) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar)
        return matcher.try_consume_tokens(ids) == len(ids)

    return check


# -- engine overhead ----------------------------------------------------------------------------
def _run(llm, prompts, params) -> tuple[float, int, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return wall, tokens, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from impasto import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, max_model_len=1024, max_num_seqs=16)
    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.vocab_size
    print(f"# {llm.llm_engine.model_path}, {os.cpu_count()} cores")

    # Every request runs to max_tokens in both modes, so both keep the same batch shape: EOS is
    # ignored unconstrained, and the schema (a long array of records) cannot end sooner.
    schema = {"type": "array", "items": SCHEMAS["person"], "minItems": 1000}
    print("\n| batch | unconstrained tok/s | JSON schema tok/s | ratio | outputs in the grammar |")
    print("|---|---|---|---|---|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = [
            llm.get_tokenizer().apply_chat_template(
                [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for i in range(b)
        ]
        plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        constrained = SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        check = _prefix_checker(tokenizer, vocab, schema)
        _run(llm, prompts, constrained)  # warm: compile, caches
        rates: dict[str, list[float]] = {"plain": [], "json": []}
        valid = 0
        for _ in range(args.rounds):
            for key, params in (("plain", plain), ("json", constrained)):
                wall, tokens, outputs = _run(llm, prompts, params)
                rates[key].append(tokens / wall)
                if key == "json":
                    valid += sum(check(ids) for ids in outputs)
        p, j = statistics.median(rates["plain"]), statistics.median(rates["json"])
        print(f"| {b} | {p:.1f} | {j:.1f} | {j / p:.2f} | {valid}/{b * args.rounds} |")

    ll = _llguidance_times(tokenizer, vocab)
    tok_dir = getattr(tokenizer, "name_or_path", "") or ""
    saved = None
    if os.environ.get("IMPASTO_BENCH_XGRAMMAR_PYTHON"):
        import tempfile

        saved = tempfile.mkdtemp()
        tokenizer.save_pretrained(saved)
        tok_dir = saved
    xg = _xgrammar_times(tok_dir, vocab) if saved else None
    print(f"\nGrammar engines on this tokenizer ({vocab} tokens), medians:\n")
    print("| schema | llguidance compile ms | llguidance mask us/token |", end="")
    print(" xgrammar compile ms | xgrammar mask us/token |" if xg else "")
    print("|---|---|---|" + ("---|---|" if xg else ""))
    for name in SCHEMAS:
        c, m = ll[name]
        row = f"| {name} | {c * 1e3:.2f} | {m * 1e6:.1f} |"
        if xg:
            xc, xm = xg[name]
            row += f" {xc * 1e3:.2f} | {xm * 1e6:.1f} |"
        print(row)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
