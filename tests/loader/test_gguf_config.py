"""GGUF configs built without transformers' model classes (impasto.loader.gguf_config).

They must equal what the architecture's transformers class builds from the same keyword
arguments, on every attribute of its `to_dict()` and every instance attribute (tiny files of
each architecture, hand-picked arguments, and the packaged real files when cached); and the
GGUF path, from `from impasto import LLM` to a generated token, must import none of
`transformers.models`, sympy, accelerate or `torch.distributed.tensor` (a fresh interpreter
checks `sys.modules`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_testutil import tiny_config, write_gguf
from tokenizers import pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from impasto.loader.gguf_config import ARCHITECTURES, build_config
from impasto.loader.gguf_loader import gguf_to_hf_config, gguf_to_hf_config_kwargs
from impasto.loader.packaged_models import PACKAGED_MODELS, default_cache_dir

CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma3": Gemma3TextConfig,
}
# This file's tiny configs: narrower than tiny_config's defaults.
SMALL: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, head_dim=32)
HEAVY = ("transformers.models", "sympy", "accelerate", "torch.distributed.tensor")
ROOT = Path(__file__).resolve().parents[2]


def assert_same_config(ours: PretrainedConfig, ref: PretrainedConfig) -> None:
    """Every attribute of the reference's `to_dict()` (model_type included) and of its
    instance, with equal values."""
    ref_dict, our_dict = ref.to_dict(), ours.to_dict()
    for key, value in ref_dict.items():
        assert key in our_dict, key
        assert our_dict[key] == value, key
        assert getattr(ours, key) == getattr(ref, key), key
    assert our_dict == ref_dict
    assert ours.__dict__ == ref.__dict__  # what PretrainedConfig's == compares
    assert type(ours).__name__ == f"{type(ref).__name__.removesuffix('Config')}GGUFConfig"


def llama3_divisors(head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor the converter writes for a llama3-scaled rope."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = tiny_config(
        LlamaConfig,
        **(SMALL | dict(head_dim=head_dim)),
        rope_parameters=rope,
        max_position_embeddings=131072,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return (plain / scaled.double()).float().numpy()


YARN = {
    "rope_scaling_type": gguf.RopeScalingType.YARN,
    "rope_scaling_factor": 4.0,
    "rope_scaling_orig_ctx_len": 32,
}
LINEAR = {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 2.0}
BIAS = {"blk.0.attn_q.bias": np.zeros(128, np.float32)}
UNTIED = {"output.weight": np.zeros((64, 128), np.float32)}
# id: (arch, config overrides, extra metadata, extra tensors)
FILES: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "llama": ("llama", {}, {}, {}),
    "llama-untied-bias": ("llama", {}, {}, {**UNTIED, **BIAS}),
    "llama-yarn": ("llama", {}, YARN, {}),
    "llama-linear": ("llama", {}, LINEAR, {}),
    "llama3-rope-freqs": (
        "llama",
        {"head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        {},
        {"rope_freqs.weight": llama3_divisors(64)},
    ),
    "qwen2": ("qwen2", {}, {}, {}),
    "qwen2-yarn-untied": ("qwen2", {}, YARN, UNTIED),
    "qwen3": ("qwen3", {}, {}, {}),
    "qwen3-bias": ("qwen3", {}, {}, BIAS),
    "gemma3": ("gemma3", {}, LINEAR, {}),
    "gemma3-softcap-untied": ("gemma3", {"final_logit_softcapping": 30.0}, {}, UNTIED),
    "gemma3-no-window": ("gemma3", {"sliding_window": 0}, {}, {}),
    "gemma3-27b-shape": (
        "gemma3",
        dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128),
        {},
        {},
    ),
}


def write_case(path: Path, case: str) -> Path:
    arch, overrides, kv, tensors = FILES[case]
    config = tiny_config(CLASSES[arch], **SMALL)
    for key, value in overrides.items():  # after the class's own checks (sliding_window 0)
        setattr(config, key, value)
    write_gguf(path, arch, config, {}, extra_kv=kv, extra_tensors=tensors)
    return path


def test_field_defaults_are_the_classes() -> None:
    """The tables of gguf_config are the installed classes' own fields and defaults."""
    base = {f.name for f in dataclasses.fields(PretrainedConfig)}
    assert set(ARCHITECTURES) == set(CLASSES)
    for arch, (_, defaults, name) in ARCHITECTURES.items():
        cls = CLASSES[arch]
        assert cls.__name__ == name
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}
        assert fields == defaults, arch
        for f in dataclasses.fields(cls):  # no base field with a default of its own
            if f.name in base:
                assert f.default == PretrainedConfig.__dataclass_fields__[f.name].default


@pytest.mark.parametrize(
    "arch,kwargs",
    [
        ("llama", {}),
        ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=None)),
        ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0})),
        ("llama", dict(rope_parameters={"rope_theta": 5e5}, eos_token_id=[2, 7])),
        ("qwen2", dict(head_dim=64, bos_token_id=None, pad_token_id=3)),
        ("qwen2", dict(use_sliding_window=True, max_window_layers=2, num_hidden_layers=4)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
        ("qwen3", dict(attention_bias=True, tie_word_embeddings=True, architectures=["X"])),
        ("gemma3", {}),
        ("gemma3", dict(num_hidden_layers=5, sliding_window_pattern=2)),
        ("gemma3", dict(use_bidirectional_attention=True)),
        (
            "gemma3",
            dict(
                num_hidden_layers=4,
                sliding_window=None,
                layer_types=["full_attention"] * 4,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0}},
            ),
        ),
    ],
)
def test_build_config_equals_the_class(arch: str, kwargs: dict[str, Any]) -> None:
    before = copy.deepcopy(kwargs)
    ours = build_config(arch, **kwargs)
    assert kwargs == before  # nested rope dicts are not filled in place
    assert_same_config(ours, CLASSES[arch](**copy.deepcopy(kwargs)))


def test_build_config_refuses_what_it_does_not_mirror() -> None:
    with pytest.raises(ValueError, match="architecture 'gemma'"):
        build_config("gemma")
    with pytest.raises(ValueError, match="rope_theta"):
        build_config("llama", rope_theta=5e5)


@pytest.mark.parametrize("case", list(FILES))
def test_tiny_gguf_config_equals_the_class(tmp_path: Path, case: str) -> None:
    path = write_case(tmp_path / "m.gguf", case)
    arch, kwargs = gguf_to_hf_config_kwargs(path)
    assert arch == FILES[case][0]
    assert_same_config(gguf_to_hf_config(path), CLASSES[arch](**kwargs))


@pytest.mark.parametrize("name", list(PACKAGED_MODELS))
def test_real_gguf_config_equals_the_class(name: str) -> None:
    path = default_cache_dir() / PACKAGED_MODELS[name].filename
    if not path.is_file():
        pytest.skip(f"{path} is not cached")
    arch, kwargs = gguf_to_hf_config_kwargs(path)
    assert_same_config(gguf_to_hf_config(path), CLASSES[arch](**kwargs))


# Run in a fresh interpreter: the import, a config of every architecture, and a tiny engine
# end to end (its byte-level BPE tokenizer, model, KV cache, one greedy generation).
_CHILD = """
import json, sys
from impasto import LLM, SamplingParams
from impasto.loader.gguf_loader import gguf_to_hf_config

def loaded():
    return [h for h in {heavy!r} if any(m == h or m.startswith(h + ".") for m in sys.modules)]

after_import = loaded()
for path in {configs!r}:
    gguf_to_hf_config(path)
llm = LLM({engine!r}, max_model_len=64, kv_cache_memory_bytes=1 << 20)
params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
out = llm.generate(["ab"], params, use_tqdm=False)
n = len(out[0].outputs[0].token_ids)
print(json.dumps(dict(import_=after_import, heavy=loaded(), n=n)))
"""


def run_child(script: str) -> dict[str, Any]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)  # this checkout's impasto, not an installed one
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gguf_path_imports_no_model_classes(tmp_path: Path) -> None:
    configs = [str(write_case(tmp_path / f"{c}.gguf", c)) for c in ("llama", "qwen2", "qwen3")]
    configs.append(str(write_case(tmp_path / "gemma3.gguf", "gemma3")))
    config = tiny_config(LlamaConfig, **SMALL, vocab_size=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = dict(
        tokenizer_model="gpt2",
        tokenizer_pre="gpt-2",
        token_list=tokens,
        token_types=[1] * len(tokens),
        token_merges=[],
    )
    engine = tmp_path / "engine.gguf"
    write_gguf(engine, "llama", config, state, extra_kv=tokenizer)
    got = run_child(_CHILD.format(heavy=HEAVY, configs=configs, engine=str(engine)))
    assert got["import_"] == [] and got["heavy"] == []
    assert got["n"] == 2
