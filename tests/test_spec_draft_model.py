"""The ``draft_model`` proposer: a small model of the target's tokenizer guesses, its K/V kept in
the target's blocks. With the target itself as the draft every greedy guess is right (its cache
holds exactly what the target's does); with a perturbed copy some are wrong; either way a
request's tokens are those without speculation, through chunked prefill, preemption, prefix
caching, tensor parallelism and both scheduling modes."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from hookllm import EngineConfig, SamplingParams, hookimpl, testing
from hookllm.engine.llm_engine import LLMEngine
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins
from hookllm.spec.draft_model import DraftModelProposer
from test_spec_decode import (MAX_TOKENS, PROMPTS, SWAPPING, expected_greedy, expected_n_completions,  # noqa: F401
                              generate, greedy_run, make_engine, n_completions, spec_counts)


@pytest.fixture(scope="module")
def perturbed_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with noise on every weight: it agrees with the target on some tokens only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.25 * parameter.std())
    path = tmp_path_factory.mktemp("perturbed-draft")
    model.save_pretrained(path)
    return path


def draft_config(model_dir, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_target_as_its_own_draft_has_every_guess_accepted(tiny_llama_dir, expected_greedy, async_scheduling):
    engine = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir), async_scheduling=async_scheduling)
    outputs, steps = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0
    assert steps <= 1 + -(-(MAX_TOKENS - 1) // 5) + 1  # the prompts' step, then five tokens a step


def test_the_method_defaults_to_draft_model_when_a_model_is_given(tiny_llama_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, {"model": str(tiny_llama_dir), "num_speculative_tokens": 2})
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert spec_counts(engine)[1] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_draft_that_disagrees_at_times_keeps_tokens_exact(tiny_llama_dir, perturbed_draft_dir, expected_greedy,
                                                             async_scheduling):
    engine = make_engine(tiny_llama_dir, draft_config(perturbed_draft_dir), async_scheduling=async_scheduling)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    drafted, accepted = spec_counts(engine)
    assert 0 < accepted < drafted


def test_chunked_prefill_and_preemption_keep_the_drafts_cache_whole(tiny_llama_dir, expected_greedy):
    """Chunks and recomputed requests run the draft over the same tokens as the target: with the
    target as the draft, every guess is still right."""
    engine = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir, 6), num_kv_blocks=4, max_num_batched_tokens=9)
    batches = testing.record_batches(engine)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert any(batch.preempted_request_ids for batch in batches), "nothing was preempted"
    assert any(len(batch.sampling_rows) < len(batch.request_ids) for batch in batches), "no prompt was chunked"
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0


def test_swap_preemption_carries_the_drafts_cache(tiny_llama_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir, 3), num_kv_blocks=5, preemption_mode="swap",
                         max_num_batched_tokens=24)
    batches = testing.record_batches(engine)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert any(batch.swap_out for batch in batches), "nothing was swapped out"
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0


def test_seeded_n_completions_through_swap_preemption_keep_their_tokens(tiny_llama_dir, expected_n_completions):
    """n = 2 seeded completions per prompt in a cache too small for all, swapped out and back
    with the draft's K/V: the tokens without speculation, some of the draft's greedy guesses
    kept (at temperature 1 the target often draws another token)."""
    engine = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir, 3), **SWAPPING)
    batches = testing.record_batches(engine)
    assert n_completions(engine) == expected_n_completions
    assert any(batch.swap_out for batch in batches), "nothing was swapped out"
    drafted, accepted = spec_counts(engine)
    assert accepted > 0 and drafted > 0


def test_prefix_cache_hits_hold_the_drafts_cache_too(tiny_llama_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir))
    for _ in range(2):
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
        assert outputs == expected_greedy
    assert engine.get_stats().prefix_cache_hits > 0
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0


def test_seeded_sampling_gives_the_same_tokens_with_a_draft_model(tiny_llama_dir, perturbed_draft_dir):
    params = [SamplingParams(temperature=t, top_p=p, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
              for t, p, seed in [(1.0, 1.0, 1), (0.7, 0.9, 2), (0.3, 1.0, 3), (1.0, 0.8, 4)]]
    engine = make_engine(tiny_llama_dir, None)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    engine = make_engine(tiny_llama_dir, draft_config(perturbed_draft_dir, 3))
    outputs, _ = generate(engine, PROMPTS, params)
    assert outputs == expected
    assert spec_counts(engine)[1] > 0


def test_the_drafts_layers_take_their_share_of_each_cache_block(tiny_llama_dir):
    """Each block holds the draft's K/V beside the target's: a fixed cache budget holds half as
    many blocks when the draft is the target's size."""
    budget = 2 ** 20
    plain = make_engine(tiny_llama_dir, None, num_kv_blocks=None, cpu_kv_cache_bytes=budget)
    drafting = make_engine(tiny_llama_dir, draft_config(tiny_llama_dir), num_kv_blocks=None, cpu_kv_cache_bytes=budget)
    assert drafting.engine_core.executor.num_kv_blocks == plain.engine_core.executor.num_kv_blocks // 2


def test_tensor_parallel_ranks_draft_alike(tiny_llama_dir, expected_greedy):
    """Two gloo ranks, the draft sharded as the target is: the tokens of one process."""
    outputs, (drafted, accepted) = greedy_run(tiny_llama_dir, draft_config(tiny_llama_dir, 3), tensor_parallel_size=2)
    assert outputs == expected_greedy
    assert accepted == drafted > 0


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    testing.build_tiny_checkpoint(testing.tiny_llama_config(vocab_size=256), tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target's 320"):
        make_engine(tiny_llama_dir, draft_config(tmp_path))


def test_a_draft_with_fewer_positions_than_the_engine_serves_is_refused(tiny_llama_dir, tmp_path):
    testing.build_tiny_checkpoint(testing.tiny_llama_config(max_position_embeddings=128), tmp_path)
    with pytest.raises(ValueError, match="speculative_config's model .*: max_model_len 512 exceeds the model's 128"):
        make_engine(tiny_llama_dir, draft_config(tmp_path))


def test_draft_model_without_a_model_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="method 'draft_model' needs a model"):
        make_engine(tiny_llama_dir, {"method": "draft_model", "num_speculative_tokens": 2})


def test_a_missing_draft_folder_is_refused_naming_it(tiny_llama_dir, tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(ValueError, match="no-such-draft"):
        make_engine(tiny_llama_dir, draft_config(missing))


def test_the_draft_config_serializes_as_vllm_writes_it(tiny_llama_dir):
    from hookllm.spec.config import SpeculativeConfig

    config = SpeculativeConfig.parse(json.dumps({"model": str(tiny_llama_dir), "num_speculative_tokens": 5}))
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", str(tiny_llama_dir), 5)


class FailingDraft(DraftModelProposer):
    """A draft model whose pass over the steps' tokens fails from its third step on."""

    def __init__(self, config, context, model, target):
        super().__init__(config, context, model, target)
        self.steps = 0

    def follow(self, step):
        self.steps += 1
        if self.steps > 2:
            raise RuntimeError("the draft fell over")
        super().follow(step)


def test_a_failing_draft_model_stops_only_speculation(tiny_llama_dir, expected_greedy, caplog):
    module = types.ModuleType("failing_draft")
    module.register_spec_proposers = hookimpl(lambda proposers: proposers.add("failing_draft", FailingDraft))
    plugins = {**discover_plugins(), "failing_draft": PluginInfo("failing_draft", module)}
    config = EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                          speculative_config=draft_config(tiny_llama_dir, method="failing_draft"))
    engine = LLMEngine(config, PluginManager(plugins))
    with caplog.at_level(logging.ERROR):
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    assert sum("the draft fell over" in r.exc_text for r in caplog.records if r.exc_text) == 1


def test_the_server_speculates_with_a_draft_model_and_reports_it(tiny_llama_dir):
    """``hookllm serve --speculative-config`` with a draft model, through the openai client: the
    texts of the engine without speculation, and vLLM's counters in /metrics."""
    import openai

    from hookllm import LLM
    from server_fixtures import Server

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    params = testing.greedy(MAX_TOKENS)
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                        use_tqdm=False)]
    llm.shutdown()
    server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                     "--speculative-config", json.dumps(draft_config(tiny_llama_dir, 3))])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, expected):
            completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert completion.choices[0].text == text
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    finally:
        server.stop()
