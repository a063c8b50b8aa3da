"""The packaged Gemma-3-270m GGUF (Q4_K_M): config and tensors as transformers reads them,
greedy decoding token-exact against transformers' Gemma3ForCausalLM on those tensors, and the
SentencePiece tokenizer against an independent reading of the vocabulary in the metadata."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from impasto import LLM, SamplingParams
from impasto.loader.gguf_loader import (
    gguf_metadata,
    gguf_to_hf_config,
    iter_gguf_weights,
    open_gguf,
)
from impasto.loader.packaged_models import ensure_model, lookup
from impasto.loader.tokenizer import apply_chat_template, get_stop_token_ids, load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
TEXTS = [
    "The capital of France is",
    "  leading spaces\n\nnewlines\ttabs",
    "1234567 + 89 = ?",
    "def f(x):\n    return x**2\n",
    "naïve café, 日本語のテキスト, Ｆｕｌｌｗｉｄｔｈ",
    "emoji 🎨 🫠 a\u200bb",
    "\U0001f9ec\U0001fae0 \u0f00\u1f10 \U0001d518\U0001d52b\U0001d526",  # some byte fallback
    "<b>bold</b> &amp; <start_of_turn>user\nhi<end_of_turn>\n",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return ensure_model(lookup("gemma-3-270m"))


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """transformers' own reading of the file: its config and dequantized tensors."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with torch.device("meta"):  # a skeleton for its name map; meta costs no memory
            skeleton = AutoModelForCausalLM.from_config(config)
        ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {k: torch.as_tensor(v).float() for k, v in ref["tensors"].items()}
    return config, tensors


def test_config_and_tensors_match_transformers(gguf_path: Path, reference) -> None:
    ref_config, ref_tensors = reference
    ours = gguf_to_hf_config(gguf_path)
    assert ours.model_type == ref_config.model_type
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "hidden_activation",
    ):
        assert getattr(ours, key) == getattr(ref_config, key), key
    weights = dict(iter_gguf_weights(gguf_path))
    assert set(weights) == set(ref_tensors)
    for name, tensor in weights.items():  # norms: both undo the converter's +1 in float32
        assert torch.equal(tensor, ref_tensors[name]), name


def test_greedy_matches_transformers(gguf_path: Path, reference) -> None:
    ref_config, ref_tensors = reference
    ref = AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(ref_tensors, strict=False)
    assert not unexpected and set(missing) == {"lm_head.weight"}
    ref.tie_weights()
    # dequantized: the weights transformers computes with (packed runs are checked against
    # llama.cpp by benchmarks/gguf_agreement.py)
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=256, seed=0, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = out.prompt_token_ids
        assert ids[0] == 2  # <bos>
        with torch.no_grad():
            expect = ref.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == expect, prompt
    assert outs[0].outputs[0].text.startswith(" the capital")


def spm_reference(reader: Any) -> Callable[[str], list[int]]:
    """llama.cpp's SentencePiece (BPE-by-score) tokenization, from the metadata alone, with
    special tokens parsed (as for a rendered chat prompt): control and user-defined tokens are
    cut out of the raw text first (longest first); in the rest spaces
    become '▁' and adjacent symbols merge, highest-scoring vocabulary entry first (leftmost on
    ties); symbols outside the vocabulary fall back to their UTF-8 bytes."""
    tokens = gguf_metadata(reader, "tokenizer.ggml.tokens")
    scores = gguf_metadata(reader, "tokenizer.ggml.scores")
    types = gguf_metadata(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    special = [t for t, k in zip(tokens, types, strict=True) if k in (3, 4)]
    special.sort(key=len, reverse=True)

    def merge(text: str) -> list[int]:
        syms = list(text.replace(" ", "\u2581"))
        while True:
            pairs = [(i, syms[i] + syms[i + 1]) for i in range(len(syms) - 1)]
            found = [(scores[vocab[m]], -i) for i, m in pairs if m in vocab]
            if not found:
                break
            i = -max(found)[1]
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        ids: list[int] = []
        for s in syms:
            ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
        return ids

    def encode(text: str) -> list[int]:
        parts: list[str | int] = [text]
        for u in special:
            cut: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or u not in p:
                    cut.append(p)
                    continue
                for j, piece in enumerate(p.split(u)):
                    cut += ([vocab[u]] if j else []) + ([piece] if piece else [])
            parts = cut
        ids = [gguf_metadata(reader, "tokenizer.ggml.bos_token_id")]  # add_bos_token: true
        for p in parts:
            ids += [p] if isinstance(p, int) else merge(p)
        return ids

    return encode


def test_tokenizer_matches_the_metadata(gguf_path: Path) -> None:
    reader = open_gguf(gguf_path)
    assert gguf_metadata(reader, "tokenizer.ggml.model") == "llama"
    assert gguf_metadata(reader, "tokenizer.ggml.add_bos_token") is True
    tok = load_tokenizer(gguf_path)
    ref = spm_reference(reader)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text), text
        assert tok.decode(ids, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", ""), text
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>"
    assert get_stop_token_ids(gguf_path) == [1, 106]  # <eos>, and <end_of_turn> by its text
    # This conversion carries no chat template (the pretrained model: it completes text).
    assert gguf_metadata(reader, "tokenizer.chat_template") is None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])
