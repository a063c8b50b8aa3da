"""DiffusionGemma forward equivalence with transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from impasto.loader.hf import iter_safetensors, load_hf_model

from .checkpoints import build_checkpoint, build_model
from .harness import OneRequest

VARIANTS = {
    # sliding + full layers, MoE + shared dense MLP; the window covers prompt and canvas
    "moe": dict(sliding_window=64),
    # a different head/kv layout and layer pattern, top-1 routing
    "moe_top1": dict(
        sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        top_k_experts=1,
        num_global_key_value_heads=2,
    ),
}


# Dense layers (no experts): transformers' DiffusionGemma always has them, and documents its
# layers as Gemma-4 text decoder layers with the changes that concern the KV cache; its dense
# reference is therefore transformers' own Gemma-4 layer forward without the MoE block, run on
# DiffusionGemma's layers (attention and all), against impasto loading the same checkpoint
# without the expert tensors.
DENSE = "dense"
MOE_ONLY = ("router.", "experts.", "post_feedforward_layernorm_1.", "post_feedforward_layernorm_2.",
            "pre_feedforward_layernorm_2.")  # fmt: skip


def _dense_reference(hf) -> None:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

    layers = [*hf.model.encoder.language_model.layers, *hf.model.decoder.layers]
    for layer in layers:
        layer.enable_moe_block = False
        layer.hidden_size_per_layer_input = 0
        layer.gradient_checkpointing = False  # read by the Gemma-4 forward
        layer.forward = types.MethodType(Gemma4TextDecoderLayer.forward, layer)


def _dense_checkpoint(hf, moe_path, path) -> None:
    """The MoE checkpoint's tensors without the expert ones; config without experts."""
    from safetensors.torch import save_file

    config = copy.deepcopy(hf.config)
    config.text_config.num_experts = config.text_config.top_k_experts = None
    config.save_pretrained(path)
    state = dict(iter_safetensors(moe_path))
    save_file({n: t for n, t in state.items() if not any(m in n for m in MOE_ONLY)},
              str(path / "model.safetensors"))  # fmt: skip


@pytest.fixture(scope="module", params=sorted([*VARIANTS, DENSE]))
def pair(request, tmp_path_factory):
    variant = VARIANTS.get(request.param, VARIANTS["moe"])
    path = build_checkpoint(tmp_path_factory.mktemp(request.param), **variant)
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
    if request.param == DENSE:
        _dense_reference(hf)
        _dense_checkpoint(hf, path, path := tmp_path_factory.mktemp("dense-checkpoint"))
    ours, _ = load_hf_model(path)
    assert all(layer.moe == (request.param != DENSE) for layer in ours.layers)
    return hf.eval(), ours


def _hf_encode(hf, ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    with torch.no_grad():
        out = hf.model.encoder(input_ids=torch.tensor([ids]), cache=cache)
    return out.last_hidden_state[0], cache


def test_encoder_hidden_and_kv_match(pair):
    hf, ours = pair
    prompt = [
        int(t) for t in torch.randint(3, 160, (21,), generator=torch.Generator().manual_seed(1))
    ]
    want, cache = _hf_encode(hf, prompt)
    req = OneRequest(ours)
    # chunked like a prompt under a budget: the chunks see each other through the paged cache
    got = torch.cat([req.encode(prompt[:9]), req.encode(prompt[9:])])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(
        ours.compute_logits(got),
        hf.lm_head(want).float().div(30).tanh().mul(30),
        atol=5e-4,
        rtol=5e-4,
    )
    for i, layer in enumerate(cache.layers):
        k, v = req.cached_kv(i)
        torch.testing.assert_close(k, layer.keys[0].transpose(0, 1), atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(v, layer.values[0].transpose(0, 1), atol=2e-4, rtol=2e-4)


def test_decoder_logits_match_with_self_conditioning(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(2)
    prompt = [int(t) for t in torch.randint(3, 160, (13,), generator=g)]
    canvas = [int(t) for t in torch.randint(0, 160, (16,), generator=g)]
    _, cache = _hf_encode(hf, prompt)
    req = OneRequest(ours)
    req.encode(prompt)
    with torch.no_grad():
        want0 = hf(cache=cache, decoder_input_ids=torch.tensor([canvas])).logits[0]
    got0 = req.denoise(canvas)
    torch.testing.assert_close(got0, want0, atol=5e-4, rtol=5e-4)
    # second step: self-conditioning from the previous (temperature-processed) logits
    sc = want0 / 0.7
    with torch.no_grad():
        want1 = hf(
            cache=cache, decoder_input_ids=torch.tensor([canvas]), self_conditioning_logits=sc[None]
        ).logits[0]
    got1 = req.denoise(canvas, ours.soft_embeddings(torch.softmax(sc, -1)))
    torch.testing.assert_close(got1, want1, atol=5e-4, rtol=5e-4)
    # the decoder never wrote the cache
    assert req.num_computed == len(prompt)


def test_commit_then_next_canvas(pair):
    """Encoder commit of a canvas, then decoding the next canvas after it."""
    hf, ours = pair
    g = torch.Generator().manual_seed(3)
    prompt = [int(t) for t in torch.randint(3, 160, (7,), generator=g)]
    first = [int(t) for t in torch.randint(0, 160, (16,), generator=g)]
    nxt = [int(t) for t in torch.randint(0, 160, (16,), generator=g)]
    _, cache = _hf_encode(hf, prompt)
    with torch.no_grad():
        hf.model.encoder(
            input_ids=torch.tensor([first]), cache=cache, position_ids=torch.arange(7, 23)[None]
        )
        want = hf(cache=cache, decoder_input_ids=torch.tensor([nxt])).logits[0]
    req = OneRequest(ours)
    req.encode(prompt)
    req.encode(first)
    torch.testing.assert_close(req.denoise(nxt), want, atol=5e-4, rtol=5e-4)


def test_sliding_window_encoder_long_prompt(tmp_path):
    """A prompt longer than the sliding window (8): causal windowed attention in the encoder."""
    path = build_checkpoint(tmp_path / "w8", seed=4, sliding_window=8)
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_hf_model(path)
    prompt = list(range(3, 40))
    want, _ = _hf_encode(hf, prompt)
    req = OneRequest(ours)
    got = torch.cat([req.encode(prompt[:20]), req.encode(prompt[20:])])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_image_weights_are_ignored_and_text_loads_strictly(tmp_path):
    model = build_model(seed=5)
    names = {n for n, _ in model.named_parameters()}
    assert any("vision_tower" in n for n in names)
    path = tmp_path / "ck"
    model.save_pretrained(path)
    ours, _ = load_hf_model(path)
    assert ours.canvas_length == 16
