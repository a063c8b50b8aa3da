"""Drive vLLM's v1 scheduler with no model, for `scheduler_overhead.py` (optional peer).

Only imported when vLLM is installed in the running Python; never a dependency of impasto.
Follows the shape of vLLM's own scheduler test utilities (one full-attention KV group of
tiny blocks, no model weights).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path


def make_vllm_step(num_reqs: int, prompt_len: int) -> Callable[[], None]:  # pragma: no cover
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "num_hidden_layers": 1,
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
            }
        )
    )
    vc = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=256,
            max_num_batched_tokens=32768,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(
            model=str(model_dir), max_model_len=2048, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
    )
    vc.cache_config.num_gpu_blocks = 10000
    kv_config = KVCacheConfig(
        num_blocks=10000,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    sched = Scheduler(
        vc, kv_config, structured_output_manager=StructuredOutputManager(vc), block_size=16
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(
            Request(str(i), [i] * prompt_len, params, None, None, block_hasher=hasher)
        )

    def step() -> None:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7]] * len(ids),
            ),
        )

    return step
