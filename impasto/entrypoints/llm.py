"""The offline API, shaped like vLLM's: `LLM(model, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from impasto.config.engine_args import EngineArgs
from impasto.engine.dp_engine import DataParallelLLMEngine
from impasto.engine.engine import LLMEngine, PromptType
from impasto.engine.metrics import Metric
from impasto.loader.tokenizer import apply_chat_template
from impasto.outputs import RequestOutput
from impasto.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        self.llm_engine: LLMEngine | DataParallelLLMEngine
        if self.engine_args.data_parallel_size > 1:  # N engine processes behind a router
            self.llm_engine = DataParallelLLMEngine(self.engine_args)
        else:
            self.llm_engine = LLMEngine(self.engine_args)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (`generation_config`,
        `override_generation_config`); what `generate` / `chat` use when given none."""
        return SamplingParams.from_fields(self.llm_engine.config.model.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("the number of sampling_params must match the number of prompts.")
        engine = self.llm_engine
        # Admit everything before enqueueing anything (each prompt tokenized and checked once):
        # a bad prompt fails the call cleanly.
        requests = [
            engine.process_request(None, prompt, params, priority=priority[i] if priority else 0)
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        added: list[str] = []
        try:
            for request in requests:
                engine.add_engine_request(request)  # QueueFullError with a bounded queue
                added.append(request.request_id)
        except BaseException:
            engine.abort_request(added)  # all or nothing: the call leaves no request behind
            raise
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init is set).")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            text = apply_chat_template(
                tok,
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            # The template already carries the special tokens.
            prompts.append(
                {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids}
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        results: dict[str, RequestOutput] = {}  # accumulated from the engine's deltas
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while pending:
                for delta in engine.step():
                    rid = delta.request_id
                    if rid not in pending:
                        continue
                    out = results.get(rid)
                    if out is None:
                        results[rid] = out = RequestOutput.start(delta)
                    else:
                        out.add(delta)
                    if out.finished:
                        pending.discard(rid)
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output: {rate:.1f} tok/s")
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"requests lost by the engine: {sorted(pending)}")
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the engine processes (data parallelism) or tensor-parallel ranks now."""
        if isinstance(self.llm_engine, DataParallelLLMEngine):
            self.llm_engine.shutdown()
        else:
            self.llm_engine.close()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts
