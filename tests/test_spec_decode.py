"""Speculative decoding changes speed, never output: with any proposer (n-gram lookup, one that
knows the answer, one that is always wrong, one that raises) a request's tokens are those the
engine gives without speculation, greedy or seeded, through chunked prefill, preemption, prefix
caching and both scheduling modes; drafts are counted and accepted where they are right."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from hookllm import EngineConfig, SamplingParams, hookimpl, testing
from hookllm.engine.llm_engine import LLMEngine
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins

# Mixed lengths; two repeat themselves (for the n-gram lookup), two fill a KV block (for the prefix cache).
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 60)), [100, 7], [200, 201, 202] * 6]
MAX_TOKENS = 20


class Oracle:
    """Proposes what each prompt's expected output says comes next (``answers``: prompt ->
    output token ids), shifted by ``offset`` (1: every guess wrong); raises when ``fail``."""

    answers: dict[tuple[int, ...], list[int]] = {}
    offset = 0
    fail = False
    calls = 0

    def __init__(self, config, context):
        self.k = config.num_speculative_tokens

    def propose(self, batch):
        Oracle.calls += 1
        if Oracle.fail:
            raise RuntimeError("the oracle is out")
        guesses = []
        for i, request in enumerate(batch.requests):
            history = batch.history(i)
            answer = Oracle.answers.get(tuple(request.prompt_token_ids), [])
            done = len(history) - request.num_prompt_tokens
            guesses.append([(t + Oracle.offset) % 320 for t in answer[done:done + self.k]])
        return guesses


@hookimpl
def register_spec_proposers(proposers):
    proposers.add("oracle", Oracle)


@pytest.fixture
def oracle():
    Oracle.answers, Oracle.offset, Oracle.fail, Oracle.calls = {}, 0, False, 0
    return Oracle


def make_engine(model_dir, speculative_config: dict | None, **options) -> LLMEngine:
    plugins = discover_plugins()
    module = types.ModuleType("oracle_proposer")
    module.register_spec_proposers = register_spec_proposers
    plugins["oracle_proposer"] = PluginInfo("oracle_proposer", module)
    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, **options}
    config = EngineConfig(str(model_dir), speculative_config=speculative_config, **options)
    return LLMEngine(config, PluginManager(plugins))


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             max_steps: int = 500) -> tuple[list[list[int]], int]:
    """Each prompt's output token ids, and the steps it took."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    finished = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            testing.assert_all_blocks_free(types.SimpleNamespace(engine=engine))
            return [finished[str(i)] for i in range(len(prompts))], step
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    raise AssertionError(f"requests left after {max_steps} steps")


def spec_counts(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.get_stats()
    return stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def oracle_config(k: int = 4, **extra) -> dict:
    return {"method": "oracle", "num_speculative_tokens": k, **extra}


def greedy_run(model_dir, speculative_config: dict | None, **options) -> tuple[list[list[int]], tuple[int, int]]:
    """``PROMPTS``' greedy outputs from an engine made for the run (shut down after), and its
    (drafted, accepted) counts."""
    engine = make_engine(model_dir, speculative_config, **options)
    try:
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
        return outputs, spec_counts(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def expected_greedy(tiny_llama_dir):
    return greedy_run(tiny_llama_dir, None)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_greedy_tokens_equal_tokens_without_speculation(tiny_llama_dir, expected_greedy, async_scheduling):
    engine = make_engine(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3}, async_scheduling=async_scheduling)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    drafted, _ = spec_counts(engine)
    assert drafted > 0  # the repeating prompts gave the lookup something to propose


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_right_guesses_are_accepted_and_save_steps(tiny_llama_dir, expected_greedy, oracle, async_scheduling):
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(4), async_scheduling=async_scheduling)
    outputs, steps = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0
    # One prefill step, then 5 tokens a step: 19 more tokens in 4 steps (20 one at a time).
    assert steps <= 1 + -(-(MAX_TOKENS - 1) // 5) + 1
    stats = engine.get_stats()
    assert stats.spec_accepted_per_position[0] == stats.spec_num_drafts


def test_each_request_counts_its_guesses_in_its_metrics(tiny_llama_dir, expected_greedy, oracle):
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    oracle.offset = 0
    engine = make_engine(tiny_llama_dir, oracle_config(3))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, testing.greedy(MAX_TOKENS))
    metrics = []
    while engine.has_unfinished_requests():
        metrics += [output.metrics for output in engine.step() if output.finished]
    drafted, accepted = spec_counts(engine)
    assert sum(m.spec_num_draft_tokens for m in metrics) == drafted > 0
    assert sum(m.spec_num_accepted_tokens for m in metrics) == accepted > 0
    assert all(m.spec_num_accepted_tokens <= m.spec_num_draft_tokens for m in metrics)


def test_wrong_guesses_change_nothing(tiny_llama_dir, expected_greedy, oracle):
    oracle.answers, oracle.offset = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}, 1
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    drafted, accepted = spec_counts(engine)
    assert drafted > 0 and accepted == 0


def test_a_failing_proposer_fails_only_speculation(tiny_llama_dir, expected_greedy, oracle, caplog):
    oracle.fail = True
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    with caplog.at_level(logging.ERROR):
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert oracle.calls > 1
    failures = [r for r in caplog.records if "proposer 'oracle' failed" in r.getMessage()]
    assert len(failures) == 1  # logged once, not every step


def test_chunked_prefill_and_preemption_keep_tokens_exact(tiny_llama_dir, expected_greedy, oracle):
    """A small token budget chunks the prompts and cuts drafts short; too few blocks preempt
    requests (their drafts dropped, their tokens recomputed)."""
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(6), num_kv_blocks=4, max_num_batched_tokens=9)
    batches = testing.record_batches(engine)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert spec_counts(engine)[1] > 0
    assert any(batch.preempted_request_ids for batch in batches), "nothing was preempted"
    assert any(len(drafts) < 6 for batch in batches for drafts in batch.spec_token_ids.values())


def test_prefix_cache_hits_keep_tokens_exact(tiny_llama_dir, expected_greedy, oracle):
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    for _ in range(2):
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
        assert outputs == expected_greedy
    assert engine.get_stats().prefix_cache_hits > 0


def test_seeded_sampling_gives_the_same_tokens_with_speculation(tiny_llama_dir, oracle):
    """A seeded request's noise hangs on (seed, position) alone, and verification samples each
    position as a step without drafts does: the very same tokens, top-k/top-p/min-p included."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, max_tokens=MAX_TOKENS,
                             ignore_eos=True)
              for t, k, p, m, seed in [(1.0, 0, 1.0, 0.0, 1), (0.7, 20, 0.9, 0.0, 2), (1.3, 0, 0.8, 0.05, 3),
                                       (1.0, 5, 1.0, 0.0, 4)]]
    engine = make_engine(tiny_llama_dir, None)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected)}
    engine = make_engine(tiny_llama_dir, oracle_config(3))
    outputs, _ = generate(engine, PROMPTS, params)
    assert outputs == expected
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0


N_COMPLETIONS = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
SWAPPING = dict(num_kv_blocks=5, preemption_mode="swap", max_num_batched_tokens=24)


def n_completions(engine: LLMEngine) -> list[list[list[int]]]:
    """Each prompt's two completions under ``N_COMPLETIONS``."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, N_COMPLETIONS)
    finished: dict[str, dict[int, list[int]]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished.setdefault(output.request_id, {}).update(
                {c.index: c.token_ids for c in output.outputs if c.finish_reason is not None})
    return [[finished[str(i)][index] for index in range(2)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected_n_completions(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, None, **SWAPPING)
    try:
        return n_completions(engine)
    finally:
        engine.shutdown()


def test_n_completions_and_swap_preemption_keep_seeded_tokens(tiny_llama_dir, expected_n_completions, oracle):
    """n = 2 seeded completions (each its own request) in a cache too small for all: swapped out
    and back, their tokens are those without speculation."""
    oracle.answers = {tuple(p): out[0] for p, out in zip(PROMPTS, expected_n_completions)}
    engine = make_engine(tiny_llama_dir, oracle_config(3), **SWAPPING)
    batches = testing.record_batches(engine)
    assert n_completions(engine) == expected_n_completions
    assert spec_counts(engine)[1] > 0
    assert any(batch.swap_out for batch in batches), "nothing was swapped out"


def test_tensor_parallel_ranks_verify_alike(tiny_llama_dir, expected_greedy):
    """Two gloo ranks, each proposing and verifying: the tokens of one process."""
    outputs, (drafted, _) = greedy_run(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1}, tensor_parallel_size=2)
    assert outputs == expected_greedy
    assert drafted > 0


def test_stop_tokens_and_max_tokens_inside_an_accepted_run(tiny_llama_dir, expected_greedy, oracle):
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    stop_at = expected_greedy[0][6]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    outputs, _ = generate(engine, PROMPTS[:2], params)
    assert outputs[0] == expected_greedy[0][:expected_greedy[0].index(stop_at) + 1]
    assert outputs[1] == expected_greedy[1][:7]


def final_outputs(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
    """Each prompt's finished CompletionOutput (``params``: one for all, or one per prompt)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i] if isinstance(params, list) else params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    return [finished[str(i)] for i in range(len(prompts))]


def test_a_stop_token_inside_an_accepted_run_keeps_the_text_before_it(tiny_llama_dir, expected_greedy, oracle):
    """The tokens a step keeps before its stop token get their text, as one a step would."""
    prompts = [{"prompt_token_ids": PROMPTS[0]}]
    # The first step samples token 0, the next keeps tokens 1 .. 3 and the stop token is its fourth.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[expected_greedy[0][4]])
    engine = make_engine(tiny_llama_dir, None)
    expected = final_outputs(engine, prompts, params)
    engine.shutdown()
    oracle.answers = {tuple(PROMPTS[0]): expected_greedy[0]}
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    outputs = final_outputs(engine, prompts, params)
    assert (outputs[0].text, outputs[0].finish_reason) == (expected[0].text, "stop")
    assert outputs[0].text


def test_a_stop_string_inside_an_accepted_run_cuts_the_text_there(tiny_llama_dir, oracle):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    engine = make_engine(tiny_llama_dir, None)
    plain = final_outputs(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stop = plain[0].text[len(plain[0].text) // 2:][:2]  # two characters from the middle of the first text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    expected = final_outputs(engine, prompts, params)
    engine.shutdown()
    assert expected[0].finish_reason == "stop"
    oracle.answers = {tuple(p["prompt_token_ids"]): out.token_ids for p, out in zip(prompts, plain)}
    engine = make_engine(tiny_llama_dir, oracle_config(6))
    outputs = final_outputs(engine, prompts, params)
    assert [(o.text, o.finish_reason, o.stop_reason) for o in outputs] == \
        [(o.text, o.finish_reason, o.stop_reason) for o in expected]
    assert spec_counts(engine)[1] > 0


@pytest.mark.parametrize("offset", [0, 1], ids=["right-guesses", "wrong-guesses"])
def test_structured_output_masks_each_drafted_row_after_the_drafts_before_it(tiny_llama_dir, oracle, offset):
    """A constrained request takes guesses: its row j is masked as the grammar stands after the
    output and the first j guesses. Right guesses are all kept (a row masked as the first would
    refuse them), wrong ones are refused, and the text is the one without speculation."""
    from hookllm.sampling_params import StructuredOutputsParams

    specs = [StructuredOutputsParams(choice=["alpha beta gamma", "delta epsilon"]),
             StructuredOutputsParams(regex="[a-f]{6}-[0-9]{6}"),
             StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"], "additionalProperties": False})]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec) for spec in specs]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    engine = make_engine(tiny_llama_dir, None, plugins=["structured"])
    expected = final_outputs(engine, prompts, params)
    engine.shutdown()
    oracle.answers = {tuple(p["prompt_token_ids"]): out.token_ids for p, out in zip(prompts, expected)}
    oracle.offset = offset
    engine = make_engine(tiny_llama_dir, oracle_config(4), plugins=["structured"])
    outputs = final_outputs(engine, prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert outputs[0].text in ("alpha beta gamma", "delta epsilon")
    drafted, accepted = spec_counts(engine)
    assert drafted > 0 and accepted == (drafted if offset == 0 else 0)


def test_logprobs_are_those_of_the_emitted_tokens(tiny_llama_dir, expected_greedy, oracle):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    engine = make_engine(tiny_llama_dir, None)
    expected = final_outputs(engine, prompts, params)
    engine.shutdown()
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    got = final_outputs(engine, prompts, params)
    for want_output, have_output in zip(expected, got):
        assert len(have_output.logprobs) == len(want_output.logprobs) == 10
        for want, have in zip(want_output.logprobs, have_output.logprobs):
            assert list(want) == list(have)
            np.testing.assert_allclose([want[t].logprob for t in want], [have[t].logprob for t in want], atol=1e-5)
    assert spec_counts(engine)[1] > 0


def test_penalties_bias_and_bad_words_count_the_drafts_before_each_row(tiny_llama_dir, expected_greedy, oracle):
    """A drafted row's penalties count its request's output and the drafts before it, as the
    step that would have sampled that position alone; logit bias, allowed tokens and a banned
    bigram apply to every row. With the right answers as guesses every guess holds."""
    banned = expected_greedy[3][3:5]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.8,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={7: 3.0},
                             allowed_token_ids=list(range(0, 320, 3))),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words_token_ids=[banned])]
    engine = make_engine(tiny_llama_dir, None)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    assert expected[0] != expected_greedy[0] and expected[3] != expected_greedy[3]  # each feature bites
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected)}
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    outputs, _ = generate(engine, PROMPTS, params)
    assert outputs == expected
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0


def test_each_drafted_rows_penalized_logits_equal_transformers_at_its_position(tiny_llama_dir, tiny_llama_reference,
                                                                                oracle, monkeypatch):
    """Row j of a request checking drafts gets the logits transformers' repetition penalty (and
    the frequency and presence penalties by hand) give after the prompt, the output and the
    request's first j drafts."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from hookllm.worker import sampler

    prompt, penalties = PROMPTS[3], dict(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalties)
    engine = make_engine(tiny_llama_dir, None)
    (expected,), _ = generate(engine, [prompt], params)
    engine.shutdown()
    oracle.answers = {tuple(prompt): expected}
    captured = []
    real = sampler.sample
    monkeypatch.setattr(sampler, "sample", lambda logits, *args: captured.append(logits.clone()) or real(logits, *args))
    engine = make_engine(tiny_llama_dir, oracle_config(3))
    assert generate(engine, [prompt], params)[0] == [expected]
    assert max(len(logits) for logits in captured) == 4
    emitted = 0
    for logits in captured:
        for j, row in enumerate(logits):
            output = expected[:emitted + j]
            with torch.inference_mode():
                raw = tiny_llama_reference(torch.tensor([prompt + output])).logits[0, -1].float()
            want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), raw[None])[0]
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=want.shape[0]).float()
            want -= 0.5 * counts + 0.3 * (counts > 0)
            torch.testing.assert_close(row, want, atol=1e-4, rtol=0)
        emitted += len(logits)


def test_disable_by_batch_size_turns_speculation_off_for_large_batches(tiny_llama_dir, expected_greedy, oracle):
    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(4, disable_by_batch_size=3))
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert spec_counts(engine) == (0, 0)  # four requests ran together to the end
    outputs, _ = generate(engine, PROMPTS[:3], testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy[:3]
    assert spec_counts(engine)[1] > 0


# The chi-square distribution's 0.999 quantiles (from tables), by degrees of freedom.
CHI2_CRITICAL_0_001 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264,
                       32.909, 34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315, 46.797, 48.268,
                       49.728, 51.179, 52.620, 54.052, 55.476, 56.892, 58.301, 59.703, 61.098, 62.487, 63.870,
                       65.247, 66.619]
DRAWS = 3000


def filtered_probs(logits, temperature: float, top_k: int, top_p: float):
    """softmax at ``temperature`` over the top-k logits (0: all), then the smallest top-p nucleus of them."""
    values, ids = (logits / temperature).topk(top_k or logits.shape[-1])
    probs = values.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p
    probs = probs * keep
    return ids[keep].tolist(), (probs[keep] / probs.sum()).tolist()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 4, 1.0), (0.5, 0, 0.7)])
def test_unseeded_sampling_keeps_the_distribution_of_verified_tokens(tiny_llama_dir, tiny_llama_reference, oracle,
                                                                     temperature, top_k, top_p):
    """The first two tokens of thousands of unseeded requests, the second verified against the
    most likely pair's guess, pass a chi-square test (significance 0.001) against their exact
    joint distribution from transformers on the same weights."""
    import torch

    prompt = PROMPTS[0]
    with torch.inference_mode():
        first_ids, first_probs = filtered_probs(tiny_llama_reference(torch.tensor([prompt])).logits[0, -1],
                                                temperature, top_k, top_p)
        joint = {}
        for t1, p1 in zip(first_ids, first_probs):
            logits = tiny_llama_reference(torch.tensor([prompt + [t1]])).logits[0, -1]
            for t2, p2 in zip(*filtered_probs(logits, temperature, top_k, top_p)):
                joint[t1, t2] = p1 * p2
    best = max(joint, key=joint.get)
    oracle.answers = {tuple(prompt): list(best) + [0]}
    engine = make_engine(tiny_llama_dir, oracle_config(2), max_num_seqs=512, num_kv_blocks=1024)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, ignore_eos=True)
    outputs, _ = generate(engine, [prompt] * DRAWS, params)
    drafted, accepted = spec_counts(engine)
    assert drafted == DRAWS and 0 < accepted < DRAWS
    observed = {}
    for tokens in outputs:
        observed[tuple(tokens[:2])] = observed.get(tuple(tokens[:2]), 0) + 1
    assert set(observed) <= set(joint)
    # Cells expected under 5 draws are pooled into one.
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * DRAWS >= 5]
    pooled_expected = sum(joint[c] for c in cells if c not in big) * DRAWS
    pooled_observed = sum(observed.get(c, 0) for c in cells if c not in big)
    statistic = sum((observed.get(c, 0) - joint[c] * DRAWS) ** 2 / (joint[c] * DRAWS) for c in big)
    bins = len(big)
    if pooled_expected >= 5:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        bins += 1
    assert 3 <= bins <= len(CHI2_CRITICAL_0_001) + 1
    assert statistic < CHI2_CRITICAL_0_001[bins - 2], (statistic, bins)


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in 1 .. 16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be in 1 .. 16, got 17"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "1 <= prompt_lookup_min <= prompt_lookup_max, got 4 and 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": "2"}, "num_speculative_tokens must be int, got '2'"),
    ('{"method": "ngram",', "speculative_config is not valid JSON"),
])
def test_bad_speculative_configs_are_refused_naming_the_problem(tiny_llama_dir, config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(str(tiny_llama_dir), speculative_config=config)


def test_an_unknown_method_lists_the_installed_ones(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative decoding method named 'medusa'; "
                                         "the speculative decoding methods: draft_model, eagle3, ngram, oracle"):
        make_engine(tiny_llama_dir, {"method": "medusa", "num_speculative_tokens": 2})


def test_speculation_with_pipeline_parallelism_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative_config with pipeline_parallel_size > 1 is not offered"):
        EngineConfig(str(tiny_llama_dir), pipeline_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_metrics_report_the_counters_under_vllm_names(tiny_llama_dir, expected_greedy, oracle):
    from prometheus_client import CollectorRegistry, generate_latest

    from hookllm.server.metrics import EngineMetrics

    oracle.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = make_engine(tiny_llama_dir, oracle_config(4))
    generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    stats = engine.get_stats()
    served = types.SimpleNamespace(config=engine.config, engine_stats=lambda: [stats])
    registry = CollectorRegistry()
    registry.register(EngineMetrics(served, "tiny"))
    text = generate_latest(registry).decode()
    labels = '{engine="0",model_name="tiny"}'
    for name, value in [("num_drafts", stats.spec_num_drafts), ("num_draft_tokens", stats.spec_num_draft_tokens),
                        ("num_accepted_tokens", stats.spec_num_accepted_tokens)]:
        assert f"vllm:spec_decode_{name}_total{labels} {float(value)}" in text
        assert f"hookllm:spec_decode_{name}_total{labels} {float(value)}" in text
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",position="0"}} '
            f'{float(stats.spec_accepted_per_position[0])}') in text


def test_the_serve_flag_takes_the_config_as_json():
    import argparse

    from hookllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 3)
    assert (config.speculative_config.prompt_lookup_min, config.speculative_config.prompt_lookup_max) == (5, 5)
