"""The bundled ``structured`` plugin: JSON schema, regex, choice and grammar constraints.

Every constrained output is checked independently of llguidance: ``json.loads`` + ``jsonschema``,
``re.fullmatch``, membership in the choices. Free requests batched with constrained ones must
get exactly the tokens they get alone.
"""

from __future__ import annotations

import json
import os
import re
import threading

import jsonschema
import pytest
import torch

from hookllm import LLM, SamplingParams, hookimpl
from hookllm.worker.batch import Batch, CachedRequestState
from hookllm.bundled.structured import COMPILED_KEY
from hookllm.sampling_params import StructuredOutputsParams
from hookllm.tokenizer import load_tokenizer

backend = pytest.importorskip("hookllm.bundled.structured.backend")

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


def mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    """Constrained (JSON, regex, choice) and free requests, seeded: the same tokens in any batch."""
    specs = [StructuredOutputsParams(json=TINY), None, StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{3}"), None,
             StructuredOutputsParams(choice=["yes", "no", "maybe so"]), None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=spec,
                             logprobs=2 if i % 3 else None) for i, spec in enumerate(specs)]
    return ["Hello", "The quick brown fox", "Code:", "1 2 3", "Q", "Once upon"], params


def test_deferred_steps_give_the_tokens_of_steps_sampled_at_launch(make_llm):
    deferred = make_llm(plugins=["structured"], async_scheduling=True)
    inline = make_llm(plugins=["structured"], async_scheduling=False)  # never a step in flight: never deferred
    prompts, params = mixed_batch()
    got = deferred.generate(prompts, params, use_tqdm=False)
    want = inline.generate(prompts, params, use_tqdm=False)
    assert deferred.engine.engine_core.executor.runner.job_thread is not None  # the deferred path ran
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # Logprobs to float noise: the two schedules batch the last steps differently.
    assert chosen_logprobs(got) == pytest.approx(chosen_logprobs(want), abs=1e-5)


def chosen_logprobs(outputs) -> list[float]:
    return [entry[token].logprob for out in outputs if out.outputs[0].logprobs
            for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]


def test_masks_are_filled_off_the_runner_thread_while_a_step_is_in_flight(make_llm, monkeypatch):
    llm = make_llm(plugins=["structured"], async_scheduling=True)
    threads = []
    run = backend.MaskJob.run

    def recording(job):
        threads.append(threading.get_ident())
        run(job)

    monkeypatch.setattr(backend.MaskJob, "run", recording)
    llm.generate(*mixed_batch(), use_tqdm=False)
    runner_thread = threading.get_ident()  # LLM.generate steps the engine in the caller's thread
    assert threads[0] == runner_thread  # the first step has no step in flight: filled inline
    assert set(threads[1:]) and runner_thread not in threads[1:]


def test_an_unconstrained_batch_is_never_deferred(make_llm):
    llm = make_llm(plugins=["structured"], async_scheduling=True)
    deferred = []
    execute = llm.engine.engine_core.executor.execute

    def recording(scheduler_output, previous=None):
        step = execute(scheduler_output, previous)
        deferred.append(step is not None and step.is_deferred)
        return step

    llm.engine.engine_core.executor.execute = recording
    llm.generate(["Hello", "The quick brown fox"], SamplingParams(temperature=1.0, seed=0, max_tokens=8),
                 use_tqdm=False)
    assert len(deferred) > 8 and not any(deferred)
    assert llm.engine.engine_core.executor.runner.job_thread is None


class Sabotage:
    """A sampler that ignores the mask: a request's first token becomes ``extra_args["sabotage"]``."""

    @hookimpl(wrapper=True)
    def sample(self, logits, batch):
        tokens = yield
        for row, (request, output) in enumerate(zip(batch.sampling_requests, batch.exact_output_token_ids())):
            if "sabotage" in request.sampling_params.extra_args and not output:
                tokens[row] = request.sampling_params.extra_args["sabotage"]
        return tokens


def test_a_matcher_failure_in_a_deferred_step_ends_only_its_request(make_llm, tiny_llama_dir):
    llm = make_llm(plugins=["structured"], async_scheduling=True)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("The quick brown fox", free, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.hooks.pm.register(Sabotage(), name="sabotage")
    letter = load_tokenizer(str(tiny_llama_dir)).encode("x", add_special_tokens=False)[0]
    number = StructuredOutputsParams(regex="[0-9]+")
    digits = SamplingParams(temperature=1.0, seed=0, max_tokens=12, structured_outputs=number)
    sabotaged = SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=number,
                               extra_args={"sabotage": letter})
    broken, fine, other = llm.generate(["Hi", "Hi", "The quick brown fox"], [sabotaged, digits, free], use_tqdm=False)
    assert broken.outputs[0].token_ids[0] == letter and len(broken.outputs[0].token_ids) == 2  # then EOS only
    assert broken.outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]+", fine.outputs[0].text), fine.outputs[0].text
    assert other.outputs[0].token_ids == alone


def test_structured_outputs_without_the_plugin_is_a_value_error_naming_it(make_llm):
    engine = make_llm().engine
    for params in (SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
                   SamplingParams(extra_args={"structured_outputs": {"regex": "a+"}})):
        with pytest.raises(ValueError, match=r"request r: no active plugin \w+ structured_outputs.*; .*"
                                             r"--plugin structured / LLM\(plugins=\['structured'\]\)"):
            engine.add_request("r", "Hello", params)
        assert not engine.has_request("r")


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
    assert not backend.engine_state(tiny.engine.hooks.context).matchers


def test_a_matcher_error_masks_its_row_to_eos_only_and_leaves_the_others(tiny_llama_dir, tiny, caplog):
    # A sampler that ignored the mask: the request's output holds a token the grammar refuses.
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    compiled = backend.compile_request("r", StructuredOutputsParams(regex="[0-9]+"), tokenizer,
                                       tiny.engine.model_config)
    params = SamplingParams(extra_args={COMPILED_KEY: compiled})
    prompt = tokenizer.encode("Hi")
    bad = tokenizer.encode("x", add_special_tokens=False)
    good = tokenizer.encode("1", add_special_tokens=False)
    states = [CachedRequestState(rid, prompt + out, len(prompt), params) for rid, out in (("broken", bad), ("fine", good))]
    vocab = len(tokenizer)
    logits = torch.zeros(2, vocab)
    engine = backend.EngineState()
    job = backend.MaskJob(batch_of(states), [0, 1], engine)
    try:
        with torch.inference_mode():  # as the runner calls it
            job.run()
            job.apply(logits)
    finally:
        engine.close()
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(compiled.eos_token_ids)
    digits = {i for i in range(vocab) if re.fullmatch(r"[0-9]+", tokenizer.decode([i]))}
    assert digits <= set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert """request broken: structured output failed (token "x" doesn't satisfy the grammar; byte 'x' fails parse)""" \
        in caplog.text


def batch_of(states: list[CachedRequestState]) -> Batch:
    """A decode batch of ``states``, every row sampling, no token in flight."""
    return Batch(states, [1] * len(states), states, [len(s.all_token_ids) for s in states], torch.Generator())


def digits_request(tiny_llama_dir, tiny, request_id: str, output: str) -> CachedRequestState:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    compiled = backend.compile_request(request_id, StructuredOutputsParams(regex="[0-9]+"), tokenizer,
                                       tiny.engine.model_config)
    prompt = tokenizer.encode("Hi")
    return CachedRequestState(request_id, prompt + tokenizer.encode(output, add_special_tokens=False), len(prompt),
                              SamplingParams(extra_args={COMPILED_KEY: compiled}))


def test_matchers_live_in_a_process_of_their_own_which_shutdown_stops(make_llm):
    llm = make_llm(plugins=["structured"], async_scheduling=True)
    llm.generate(*mixed_batch(), use_tqdm=False)
    process = backend.engine_state(llm.engine.hooks.context).process._process
    assert process.pid != os.getpid() and process.poll() is None
    llm.shutdown()
    assert process.poll() == 0  # exited by itself once its connection closed


def masks_after_a_refused_token(tiny_llama_dir, tiny, between=lambda engine: None):
    """Send the step of a digits-only request whose output is "12" (its masks never applied), call
    ``between(engine)``, then run and apply the step after a refused "x". Returns the tokens the
    second mask allows, the request's EOS ids and the matcher process of the second step."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    engine = backend.EngineState()
    state = digits_request(tiny_llama_dir, tiny, "r", "12")
    logits = torch.zeros(1, len(tokenizer))
    try:
        with torch.inference_mode():
            backend.MaskJob(batch_of([state]), [0], engine).run()  # digits allowed next
            between(engine)
            state.all_token_ids += tokenizer.encode("x", add_special_tokens=False)  # refused by [0-9]+
            job = backend.MaskJob(batch_of([state]), [0], engine)
            job.run()
            job.apply(logits)
            process = engine.process
    finally:
        engine.close()
    eos = sorted(state.sampling_params.extra_args[COMPILED_KEY].eos_token_ids)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist(), eos, process


def test_a_killed_matcher_process_is_replaced_and_rebuilds_the_matchers(tiny_llama_dir, tiny, caplog):
    killed = []

    def kill(engine):
        killed.append(engine.process)
        engine.process._process.kill()
        engine.process._process.wait()

    allowed, eos, process = masks_after_a_refused_token(tiny_llama_dir, tiny, between=kill)
    assert process is not killed[0] and "matcher process exited" in caplog.text and "starting a new one" in caplog.text
    # The new matcher was fed the whole output, "12x": it failed on the "x", so EOS alone is allowed.
    assert "request r: structured output failed" in caplog.text
    assert allowed == eos


def test_a_step_whose_masks_were_never_applied_does_not_answer_for_the_next(tiny_llama_dir, tiny):
    # A job whose step failed (a later hook raised) is never applied: its reply must not be read
    # as the next step's (which would allow digits).
    allowed, eos, _ = masks_after_a_refused_token(tiny_llama_dir, tiny)
    assert allowed == eos
