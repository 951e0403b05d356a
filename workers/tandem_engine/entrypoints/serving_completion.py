"""POST /v1/completions: prompt (text, token ids, or a batch of either) -> n engine requests per prompt ->
one JSON response or an SSE stream of `text_completion` chunks."""

from __future__ import annotations

from typing import Any

from tandem_engine.entrypoints.openai_protocol import (
    MAX_PROMPTS,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    OpenAIError,
    UsageInfo,
)
from tandem_engine.entrypoints.serving_base import ChoiceOutput, OpenAIServing, Prepared
from tandem_engine.entrypoints.serving_common import check_length, clamp_logprob
from tandem_engine.frontend.interface import TokenLogprob


def completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> CompletionLogProbs:
    """OpenAI's completions logprobs: parallel lists, `text_offset` counting characters of the output
    from `offset` on, `top_logprobs` holding the sampled token plus the alternatives."""
    result = CompletionLogProbs()
    for lp in logprobs:
        result.tokens.append(lp.token)
        result.token_logprobs.append(clamp_logprob(lp.logprob))
        result.text_offset.append(offset)
        offset += len(lp.token)
        top: dict[str, float] = {lp.token: clamp_logprob(lp.logprob)}
        for alt in lp.top:
            top.setdefault(alt.token, clamp_logprob(alt.logprob))
        result.top_logprobs.append(top)
    return result


def completion_choice(choice: ChoiceOutput) -> CompletionChoice:
    return CompletionChoice(
        index=choice.index,
        text=choice.text,
        logprobs=None if choice.logprobs is None else completion_logprobs(choice.logprobs, choice.text_offset),
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        token_ids=choice.token_ids,
        prompt_token_ids=choice.prompt_token_ids,
    )


class CompletionServing(OpenAIServing[CompletionRequest]):
    request_type = CompletionRequest
    id_prefix = "cmpl"

    def prepare(self, req: CompletionRequest) -> Prepared:
        if req.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.echo:
            raise OpenAIError("echo is not supported", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of is not supported (it must equal n when given)", param="best_of")
        prompts = self._tokenize_prompts(req)
        params = [
            req.to_sampling_params(check_length(self.engine, len(p), req.max_tokens, "prompt"), req.logprobs)
            for p in prompts
        ]
        return Prepared(prompts, params)

    def _tokenize_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if prompt is None:
            raise OpenAIError("prompt is required", param="prompt")
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            batch: list[Any] = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise OpenAIError("The prompt is empty", param="prompt")
        if len(batch) > MAX_PROMPTS:
            raise OpenAIError(f"At most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        out: list[list[int]] = []
        for p in batch:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("The prompt is empty", param="prompt")
                out.append(self.engine.tokenize(p, add_special_tokens=req.add_special_tokens))
            else:
                out.append(list(p))
        return out

    def response(
        self, request_id: str, choices: list[ChoiceOutput], usage: UsageInfo, kv: dict[str, Any] | None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=request_id,
            model=self.engine.model_name,
            choices=[completion_choice(c) for c in choices],
            usage=usage,
            kv_transfer_params=kv,
        )

    def chunk(
        self, request_id: str, created: int, choices: list[ChoiceOutput], usage: UsageInfo | None
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=request_id,
            created=created,
            model=self.engine.model_name,
            choices=[completion_choice(c) for c in choices],
            usage=usage,
        )
