"""The step token budget (--max-num-batched-tokens): a default sized for the device, and what a running
stream sees while a long prompt arrives on a CPU engine with it."""

from __future__ import annotations

import dataclasses

from tandem_engine.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.model_runner import ModelRunner


def test_the_default_budget_depends_on_the_device_and_a_flag_wins() -> None:
    assert (CPU_STEP_TOKENS, GPU_STEP_TOKENS) == (512, 2048)
    d = EngineConfig()
    assert d.max_num_batched_tokens is None
    assert d.step_token_budget("cpu") == 512
    assert d.step_token_budget("cuda") == 2048
    # Every running request decodes in each step: the default never drops below max_num_seqs.
    many = dataclasses.replace(d, max_num_seqs=1024)
    assert many.step_token_budget("cpu") == 1024 and many.step_token_budget("cuda") == 2048
    for given in (64, 700, 4096):
        flag = dataclasses.replace(d, max_num_batched_tokens=given)
        assert flag.step_token_budget("cpu") == flag.step_token_budget("cuda") == given


def test_a_stream_keeps_its_pace_while_a_long_prompt_is_prefilled_in_cpu_sized_chunks() -> None:
    """On a CPU engine with the default budget, a 1300-token prompt takes three steps of at most 512
    tokens, and the stream already running gets a token in each of them, instead of one 1300-token
    step that every running stream would wait out."""
    core = EngineCore(EngineConfig(model="smollm2-135m-instruct", dtype="float32", num_kv_blocks=160,
                                   max_model_len=2048), runner=ModelRunner)
    try:
        assert core.device.type == "cpu"
        greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        core.add_request(Request("stream", list(range(100, 140)), greedy, [0]))
        core.step()  # the stream's prompt and its first token
        core.add_request(Request("long", [100 + i % 5000 for i in range(1300)],
                                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), [0]))
        steps = []
        while True:
            out = core.step()
            steps.append({o.request_id: len(o.new_token_ids) for o in out})
            if steps[-1].get("long"):
                break
        assert len(steps) == 3, steps  # 511 + 511 + 278 prompt tokens beside the stream's decode
        assert all(s.get("stream") == 1 for s in steps), steps
        assert [s.get("long", 0) for s in steps] == [0, 0, 1]
        assert core.scheduler.max_num_batched_tokens * len(steps) >= 1300 + len(steps)
    finally:
        core.shutdown()
