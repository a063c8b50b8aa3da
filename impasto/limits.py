"""Input caps: every bound a request is checked against, in one place.

Each cap bounds the work or memory one request can cost (in the API process, the engine's step
loop or the sampler), so no single request, however hostile, can stall the server. A request
over a cap is refused at admission with an `InvalidParameterError` naming the parameter (a 400
with that `param` over HTTP, a `ValueError` offline); nothing is truncated silently.

Where vLLM has a bound it is vLLM's (seed, logprobs, max_tokens vs. the context, logit_bias
values); the others are generous for real use and small enough that the per-step cost they
allow stays in the noise. Model-dependent bounds (token ids < vocabulary size, prompt and
`max_tokens` within `max_model_len`, `logprobs` <= `--max-logprobs`) are checked by the engine's
`InputProcessor` against the model's config, not here.

Pure Python, importable from every layer.
"""

from __future__ import annotations

# Integers cross the API / engine process boundary as 64-bit values (msgspec): every integer
# parameter must fit in a signed 64-bit integer (`seed` may also be an unsigned 64-bit value).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1

# Choices per prompt (`n`; `best_of` must equal it).
MAX_N = 128
# Prompts in one /v1/completions request, and choices in it (prompts x n).
MAX_PROMPTS_PER_REQUEST = 1024
MAX_CHOICES_PER_REQUEST = 1024

# `stop`: strings checked against the text after every step, and their length (streaming holds
# back up to the longest one's length of text).
MAX_STOP_STRINGS = 64
# Characters in one `stop` string or one `bad_words` entry.
MAX_TEXT_PARAM_CHARS = 1024
# `bad_words`: each is tokenized at admission and matched against the output every step.
MAX_BAD_WORDS = 128

# Token-id parameters (ids are also checked against the vocabulary by the InputProcessor).
MAX_STOP_TOKEN_IDS = 1024
MAX_ALLOWED_TOKEN_IDS = 16384
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI allows 300
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0  # OpenAI's and vLLM's range

# Chat: roles a message may have (OpenAI's set).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Keys of `chat_template_kwargs` refused over HTTP: the arguments the server sets itself or
# that change what rendering returns, and `chat_template` (a request-supplied template is code
# run in the API process; its loops are not bounded).
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tools",
        "tokenize",
        "add_generation_prompt",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)
# Characters echoed back from a request in an error message.
MAX_ECHO_CHARS = 200
