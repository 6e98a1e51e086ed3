"""The bundled ``structured`` plugin: JSON schema, regex, choice and grammar constraints.

Every constrained output is checked independently of llguidance: ``json.loads`` + ``jsonschema``,
``re.fullmatch``, membership in the choices. Free requests batched with constrained ones must
get exactly the tokens they get alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from hookllm import LLM, SamplingParams
from hookllm.batch import Batch, RequestState
from hookllm.plugins.structured import COMPILED_KEY
from hookllm.sampling_params import StructuredOutputsParams
from hookllm.tokenizer import load_tokenizer

backend = pytest.importorskip("hookllm.plugins.structured.backend")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# The tiny random model spells anything: a schema that completes in a few tokens, without the
# free whitespace between JSON tokens (llguidance's x-guidance option) it would wander in.
TINY = {
    "type": "object",
    "x-guidance": {"whitespace_flexible": False},
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "tag": {"type": "string", "maxLength": 3}},
    "required": ["color", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smollm2():
    """The default SmolLM2-135M-Instruct with the plugin, async scheduling on (the harder path)."""
    return LLM(plugins=["structured"], dtype="float32", device="cpu", async_scheduling=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny(request, tiny_llama_dir):
    return LLM(str(tiny_llama_dir), plugins=["structured"], dtype="float32", device="cpu",
               async_scheduling=request.param)


def sampled(n: int, max_tokens: int, spec: StructuredOutputsParams | None, **kwargs) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec, **kwargs)
            for seed in range(n)]


def test_json_schema_outputs_validate_over_16_seeds_on_smollm2(smollm2):
    outputs = smollm2.generate(["Describe a person as JSON:"] * 16,
                               sampled(16, 80, StructuredOutputsParams(json=PERSON)), use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar completed, then EOS
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_json_schema_outputs_validate_over_16_seeds_on_the_tiny_model(tiny):
    outputs = tiny.generate(["Hello"] * 16, sampled(16, 48, StructuredOutputsParams(json=json.dumps(TINY))),
                            use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), TINY)


def test_choice_returns_one_of_the_choices(tiny):
    choices = ["yes", "no", "maybe so"]
    outputs = tiny.generate(["Q"] * 8, sampled(8, 16, StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert all(out.outputs[0].text in choices for out in outputs)


def test_regex_output_fully_matches(tiny):
    pattern = r"[a-f]{2,5}-\d{3}"
    outputs = tiny.generate(["Code:"] * 8, sampled(8, 24, None, extra_args={"structured_outputs": {"regex": pattern}}),
                            use_tqdm=False)
    for out in outputs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_lark_grammar_and_json_object(tiny):
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'
    out = tiny.generate(["G"], sampled(1, 32, StructuredOutputsParams(grammar=grammar)), use_tqdm=False)[0]
    assert re.fullmatch(r"\(\d(,\d)*\)", out.outputs[0].text), out.outputs[0].text
    # Any JSON object: whatever the model writes, it parses as a dict once it stops.
    outs = tiny.generate(["J"] * 4, sampled(4, 64, StructuredOutputsParams(json_object=True)), use_tqdm=False)
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in outs if o.outputs[0].finish_reason == "stop")


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(tiny):
    prompts = ["The quick brown fox", "1 2 3 4", "Hello there"]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(prompts, free, use_tqdm=False)]
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=TINY))
    mixed = tiny.generate(prompts + prompts, [free] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert any(o.outputs[0].token_ids != a for o, a in zip(mixed[3:], alone))  # the mask did change those


@pytest.mark.parametrize("spec, problem", [
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_an_invalid_constraint_is_a_value_error_at_add_time(tiny, spec, problem):
    engine = tiny.engine
    with pytest.raises(ValueError, match=re.escape(problem)) as info:
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    assert "request bad" in str(info.value)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_request("bad")


def test_exactly_one_constraint_must_be_set():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_a_bad_extra_args_constraint_names_the_request(tiny):
    with pytest.raises(ValueError, match="request bad-extra: structured_outputs must set exactly one"):
        tiny.engine.add_request("bad-extra", "Hi", SamplingParams(extra_args={"structured_outputs": {}}))
    assert not tiny.engine.has_request("bad-extra")


def test_matchers_are_dropped_when_requests_finish(tiny):
    tiny.generate(["Hello"] * 3, sampled(3, 16, StructuredOutputsParams(json=TINY)), use_tqdm=False)
    assert not backend._MATCHERS


def test_a_matcher_error_masks_its_row_to_eos_only_and_leaves_the_others(tiny_llama_dir, tiny):
    # A sampler that ignored the mask: the request's output holds a token the grammar refuses.
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    compiled = backend.compile_request("r", StructuredOutputsParams(regex="[0-9]+"), tokenizer,
                                       tiny.engine.model_config)
    params = SamplingParams(extra_args={COMPILED_KEY: compiled})
    prompt = tokenizer.encode("Hi")
    bad = tokenizer.encode("x", add_special_tokens=False)
    good = tokenizer.encode("1", add_special_tokens=False)
    states = [RequestState(rid, prompt + out, len(prompt), params) for rid, out in (("broken", bad), ("fine", good))]
    vocab = len(tokenizer)
    logits = torch.zeros(2, vocab)
    with torch.inference_mode():  # as the runner calls it
        backend.mask_logits(logits, Batch(states, [1, 1], states, torch.Generator()), [0, 1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(compiled.eos_token_ids)
    digits = {i for i in range(vocab) if re.fullmatch(r"[0-9]+", tokenizer.decode([i]))}
    assert digits <= set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert backend._MATCHERS["broken"].error == """token "x" doesn't satisfy the grammar; byte 'x' fails parse"""
    for state in states:
        backend.drop(state)
