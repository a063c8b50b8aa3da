"""DiffusionGemma through the whole engine: prefill -> (denoise x k -> commit)*."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from impasto.sampling_params import SamplingParams

from .conftest import CANVAS, make_llm


def _prompts(lens: list[int], seed: int = 0, vocab: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def _gen(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_matches_hf_generate_with_one_step_per_canvas(tiny_dg, monkeypatch):
    """With one denoising step a canvas commits the argmax of the decoder over the initial
    canvas: HF generate, fed our initial canvases, must produce the same tokens."""
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
    )

    from impasto.worker.diffusion.sampler import random_canvas

    prompt = _prompts([9], seed=3)[0]
    n_canvas = 3
    queue = []
    for k in range(n_canvas):  # the initial canvas, then one (discarded) renoise per canvas
        queue += [random_canvas(160, CANVAS, 0, len(prompt) + CANVAS * k, -1), None]

    def initialize_canvas(self, batch_size, device):
        canvas = queue.pop(0)
        return (torch.zeros(CANVAS, dtype=torch.long) if canvas is None else canvas)[None]

    monkeypatch.setattr(EntropyBoundSampler, "initialize_canvas", initialize_canvas)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny_dg, dtype=torch.float32).eval()
    want = (
        hf.generate(torch.tensor([prompt]), max_new_tokens=CANVAS * n_canvas, max_denoising_steps=1)
        .sequences[0, len(prompt) :]
        .tolist()
    )
    llm = make_llm(tiny_dg, diffusion_config={"max_denoising_steps": 1})
    got = _gen(llm, [prompt], SamplingParams(max_tokens=CANVAS * n_canvas, ignore_eos=True))[0]
    eos = hf.config.text_config.eos_token_id
    n = want.index(eos) + 1 if eos in want else len(want)  # HF pads after an EOS
    assert got[:n] == want[:n] and n >= CANVAS


def test_seed_scenario_preemption_prefix_cache_one_token_resume(tiny_dg):
    """Concurrent requests, 16-token blocks, a pool small enough to preempt, prompts with
    len % 16 == 1: the preemption counter moves, resumes need exactly 1 token (the seed
    shape), nothing crashes, and every output equals the request run alone."""
    prompts = _prompts([129, 129, 33, 65, 17, 97, 145])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = make_llm(tiny_dg, num_gpu_blocks_override=24, max_model_len=256)
    engine = llm.llm_engine
    resumed: list[int] = []
    execute = engine.runner.execute_model

    def spy(so):
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                resumed.append(so.num_scheduled_tokens[rid])
        return execute(so)

    engine.runner.execute_model = spy
    outs = _gen(llm, prompts, params)
    metrics = {m.name: m.value for m in engine.get_metrics()}
    assert metrics["impasto:num_preemptions"] > 0 and 1 in resumed
    assert metrics["impasto:request_success"] == len(prompts)
    assert all(len(o) == 48 for o in outs)
    for prompt, out in zip(prompts, outs, strict=True):
        assert _gen(make_llm(tiny_dg), [prompt], params)[0] == out


def test_mixed_lengths_batch_and_prefix_cache_hits_are_invariant(tiny_dg):
    prompts = _prompts([5, 40, 16, 17, 70])
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=11)
    llm = make_llm(tiny_dg, max_num_batched_tokens=64)  # chunked prefills next to canvases
    first = _gen(llm, prompts, params)
    again = _gen(llm, prompts[::-1], params)[::-1]  # every prompt now hits the prefix cache
    assert first == again
    assert [len(o) for o in first] == [20] * 5
    # the request seed matters: another seed gives another output
    assert (
        _gen(llm, prompts[:1], SamplingParams(max_tokens=20, ignore_eos=True, seed=12)) != first[:1]
    )


def test_vocab_work_chunked_or_eager_gives_the_same_outputs(tiny_dg, monkeypatch):
    """The canvases of a step share one LM head, sampler pass and self-conditioning product
    per workspace chunk: outputs are the same with one canvas per chunk, and with the eager
    sampler and soft-capping instead of the CPU kernels."""
    from impasto.worker.diffusion import runner as runner_mod

    prompts = _prompts([5, 40, 16, 17, 70, 33], seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True, seed=5)
    want = _gen(make_llm(tiny_dg), prompts, params)

    llm = make_llm(tiny_dg)
    vocab = llm.llm_engine.runner.vocab
    monkeypatch.setattr(runner_mod, "WORKSPACE_BYTES", CANVAS * vocab * 4)
    steps = []
    denoise = llm.llm_engine.runner._denoise

    def spy(states, *args):
        steps.append(len(states))
        return denoise(states, *args)

    monkeypatch.setattr(llm.llm_engine.runner, "_denoise", spy)
    assert _gen(llm, prompts, params) == want
    assert max(steps) > 1  # several canvases per step, so several chunks per step
    monkeypatch.undo()

    eager = make_llm(tiny_dg)
    runner = eager.llm_engine.runner
    if runner.canvas_sampler.ops is None:
        pytest.skip("CPU kernels unavailable: the default run was eager already")
    runner.canvas_sampler.ops = None
    runner.model.use_kernels(None)
    assert _gen(eager, prompts, params) == want


def test_streaming_emits_whole_canvases_and_metrics(tiny_dg):
    llm = make_llm(tiny_dg)
    engine = llm.llm_engine
    engine.add_request(
        "a", {"prompt_token_ids": _prompts([10])[0]}, SamplingParams(max_tokens=40, ignore_eos=True)
    )
    deltas = []  # the engine's outputs are deltas: one whole canvas each
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(len(out.outputs[0].token_ids))
    assert deltas == [16, 16, 8]
    m = {x.name: x.value for x in engine.get_metrics()}
    assert m["impasto:diffusion_canvases_committed"] == 3
    assert m["impasto:diffusion_committed_tokens"] == 48
    assert m["impasto:diffusion_canvas_positions"] == 16 * m["impasto:diffusion_denoising_steps"]
    assert 3 <= m["impasto:diffusion_denoising_steps"] <= 18  # cap 6 steps per canvas
    assert m["impasto:generation_tokens"] == 40


def test_max_tokens_smaller_than_a_canvas(tiny_dg):
    llm = make_llm(tiny_dg)
    prompt = _prompts([12])[0]
    full = _gen(llm, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert list(out.outputs[0].token_ids) == full[:5]
    assert out.outputs[0].finish_reason == "length"


def test_eos_inside_a_canvas(tiny_dg):
    llm = make_llm(tiny_dg)
    prompt = _prompts([20])[0]
    full = _gen(llm, [prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    eos = full[21]  # in the second canvas
    first = full.index(eos)
    processor = llm.llm_engine.processor  # the model's EOS as admission sees it
    processor.model = dataclasses.replace(processor.model, eos_token_id=eos)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=32), use_tqdm=False
    )[0]
    assert list(out.outputs[0].token_ids) == full[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_max_model_len_inside_a_canvas(tiny_dg):
    """The last canvas is clipped at max_model_len: padded in the sampler, committed partly."""
    prompt = _prompts([17])[0]
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    llm = make_llm(tiny_dg, max_model_len=40)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 - 17 and out.outputs[0].finish_reason == "length"
    roomy = _gen(make_llm(tiny_dg), [prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert list(out.outputs[0].token_ids[:16]) == roomy  # the unclipped first canvas


@pytest.mark.parametrize(
    "params",
    [
        dict(n=2),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(logit_bias={5: 1.0}),
        dict(logprobs=1),
        dict(prompt_logprobs=1),
        dict(temperature=0.0),
        dict(top_p=0.9),
        dict(top_k=5),
        dict(min_p=0.1),
    ],
)
def test_unsupported_sampling_params_rejected_at_admission(tiny_dg_llm, params):
    name = next(iter(params))
    with pytest.raises(ValueError, match=name) as err:
        tiny_dg_llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(**params), use_tqdm=False
        )
    assert getattr(err.value, "param", None) == name
    assert not tiny_dg_llm.llm_engine.has_unfinished_requests()


def test_image_inputs_rejected(tiny_dg_llm):
    with pytest.raises(ValueError, match="image"):
        tiny_dg_llm.generate(
            [{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": object()}}], use_tqdm=False
        )


@pytest.fixture(scope="module")
def tiny_dg_llm(tiny_dg):
    return make_llm(tiny_dg)
