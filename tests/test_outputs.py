"""What LLMEngine.step reports per request: cumulative, delta or final-only outputs."""

from hookllm import SamplingParams, testing

PROMPT = "Paris is the capital of"


def _run(llm, output_kind):
    engine = llm.engine
    engine.add_request("0", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind=output_kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_cumulative_outputs_grow_by_one_token_a_step(make_llm):
    final = make_llm().generate(PROMPT, testing.greedy(12))[0].outputs[0]
    outputs = _run(make_llm(), "cumulative")
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 13))
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == final.token_ids
    assert outputs[-1].outputs[0].text == final.text


def test_delta_outputs_concatenate_to_the_final_output(make_llm):
    final = make_llm().generate(PROMPT, testing.greedy(12))[0].outputs[0]
    outputs = _run(make_llm(), "delta")
    assert [t for o in outputs for t in o.outputs[0].token_ids] == final.token_ids
    assert "".join(o.outputs[0].text for o in outputs) == final.text
    assert [o.finished for o in outputs] == [False] * 11 + [True]


def test_final_only_reports_once(make_llm):
    outputs = _run(make_llm(), "final_only")
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 12
