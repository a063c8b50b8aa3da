"""Generation defaults (vLLM's `generation_config` / `override_generation_config`): a model's
recommended sampling parameters fill what a request leaves unset, from an HF folder's
generation_config.json, a GGUF file's `general.sampling.*` metadata or a packaged model's card;
"vllm" turns them off; overrides win; bad values are refused naming the argument."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest

from impasto import LLM, SamplingParams
from impasto.errors import InvalidParameterError
from impasto.loader.generation_defaults import model_generation_defaults

ARGS = dict(dtype="float32", skip_tokenizer_init=True, num_threads=1, max_model_len=64)
HF_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
             "max_new_tokens": 7, "bos_token_id": 1}  # fmt: skip


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("genconf") / "model"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(json.dumps(HF_CONFIG))
    return path


def test_defaults_come_from_generation_config_json(model_with_defaults):
    llm = LLM(str(model_with_defaults), **ARGS)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 7)
    # generate() without params uses them: the same tokens as the same params given explicitly
    # (each on a fresh engine: the same generator state).
    prompt = {"prompt_token_ids": [3, 9, 27, 81]}
    (implicit,) = llm.generate(prompt, use_tqdm=False)
    explicit = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=7)
    (given,) = LLM(str(model_with_defaults), **ARGS).generate(prompt, explicit, use_tqdm=False)
    assert implicit.outputs[0].token_ids == given.outputs[0].token_ids
    assert len(implicit.outputs[0].token_ids) == 7


def test_vllm_mode_and_overrides(model_with_defaults, tiny_llama):
    plain = LLM(str(model_with_defaults), **ARGS, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    over = LLM(
        str(model_with_defaults),
        **ARGS,
        override_generation_config={"temperature": 0.0, "repetition_penalty": 1.2},
    )
    p = over.get_default_sampling_params()
    assert (p.temperature, p.repetition_penalty, p.max_tokens) == (0.0, 1.2, 7)
    # A folder named explicitly: its generation_config.json, whatever the model's own.
    other = LLM(str(tiny_llama), **ARGS, generation_config=str(model_with_defaults))
    assert other.get_default_sampling_params().top_k == 20


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(generation_config="/nonexistent/folder"), "generation_config"),
        (dict(override_generation_config={"temperature": -1.0}), "override_generation_config"),
        (dict(override_generation_config={"beams": 4}), "override_generation_config"),
    ],
)
def test_bad_generation_configs_are_refused(tiny_llama, kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(tiny_llama), **ARGS, **kwargs)
    assert e.value.param == param


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_uint32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.penalty_repeat", 1.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = model_generation_defaults(path, "auto")
    assert got == {
        "temperature": pytest.approx(0.25),
        "top_k": 40,
        "repetition_penalty": pytest.approx(1.1),
    }
    assert model_generation_defaults(path, "vllm") == {}
