"""Pipeline parallelism: the decoder's layers cut into stages, one gloo process per stage (and per
tensor-parallel rank), each loading only its layers; hidden states pass from stage to stage and
the last stage samples. Every configuration answers as one process does."""

from __future__ import annotations

import json
import os
import signal
import time

import jsonschema
import pytest
import torch
from transformers import Gemma2Config, OPTConfig, Qwen3MoeConfig

from hookllm import LLM, EngineConfig, SamplingParams, testing
from hookllm.distributed import check_pipeline_parallel, stage_layer_counts, stage_layer_range
from hookllm.worker.multiproc_executor import WorkerError
from test_tensor_parallel import assert_same_outputs, cpu_llm, run
from test_transformers_tensor_parallel import assert_same_prompt_logprobs

# A shared 24-token prefix (prefix caching), then different tails; long enough to be chunked.
PREFIX = testing.random_prompts(1, 320, min_len=24, max_len=24, seed=3)[0]
PROMPTS = [PREFIX + tail for tail in testing.random_prompts(5, 320, min_len=4, max_len=20, seed=4)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
TRANSFORMERS_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                          eos_token_id=1, pad_token_id=0)
# A few KV blocks and a small token budget: prefills are chunked and requests preempted.
TIGHT = dict(num_kv_blocks=8, max_num_batched_tokens=16)


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    """The spawned ranks share the machine's cores (more threads make gloo's steps crawl)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    moe = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return {"llama": testing.build_tiny_checkpoint(testing.tiny_llama_config(num_hidden_layers=4), root / "llama"),
            "llama-tied": testing.build_tiny_checkpoint(
                testing.tiny_llama_config(num_hidden_layers=3, tie_word_embeddings=True), root / "llama-tied"),
            "qwen3-moe": testing.build_tiny_checkpoint(moe, root / "qwen3-moe"),
            # The transformers backend: Gemma 2 scales its embeddings, ties its head, soft-caps its
            # logits and alternates windowed layers; OPT adds learned positions to its embeddings.
            "gemma2": testing.build_tiny_checkpoint(Gemma2Config(
                **TRANSFORMERS_SHAPE, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * 2), root / "gemma2"),
            "opt": testing.build_tiny_checkpoint(OPTConfig(
                **TRANSFORMERS_SHAPE, ffn_dim=96, word_embed_proj_dim=64, tie_word_embeddings=False), root / "opt")}


def test_layers_split_evenly_the_first_stages_taking_the_remainder():
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    assert [stage_layer_range(10, rank, 4) for rank in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_the_layer_partition_variable_sets_each_stages_count(monkeypatch):
    monkeypatch.setenv("HOOKLLM_PP_LAYER_PARTITION", "1,3")
    assert [stage_layer_range(4, rank, 2) for rank in range(2)] == [(0, 1), (1, 4)]
    monkeypatch.setenv("HOOKLLM_PP_LAYER_PARTITION", "2,3")
    with pytest.raises(ValueError, match="must give 2 positive layer counts summing to 4"):
        stage_layer_counts(4, 2)


def test_more_stages_than_layers_is_refused_before_loading(checkpoints):
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is larger than the model's 4 layers"):
        cpu_llm(checkpoints["llama"], pipeline_parallel_size=5)


def test_a_model_class_without_the_flag_is_refused(checkpoints):
    class NoStages(torch.nn.Module):
        pass

    config = testing.tiny_llama_config(num_hidden_layers=4)
    with pytest.raises(ValueError, match="NoStages does not support pipeline parallelism"):
        check_pipeline_parallel(NoStages, config, pp_size=2, world_size=2)


def test_the_in_process_backend_with_several_stages_is_refused():
    with pytest.raises(ValueError, match="runs one rank; .* pipeline_parallel_size 2"):
        EngineConfig(model="unused", pipeline_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", ["llama", "qwen3-moe"])
def test_two_stages_answer_as_one_under_chunked_prefill_preemption_and_prefix_caching(
        checkpoints, case, async_scheduling):
    options = dict(TIGHT, async_scheduling=async_scheduling)
    one = run(cpu_llm(checkpoints[case], **options), PROMPTS, GREEDY)
    llm = cpu_llm(checkpoints[case], pipeline_parallel_size=2, **options)
    batches = testing.record_batches(llm.engine)
    two = run(llm, PROMPTS, GREEDY)
    assert_same_outputs(one, two)
    assert_same_prompt_logprobs(one, two)
    assert any(b.preempted_request_ids for b in batches), "the tight cache was meant to force preemption"
    assert any(b.num_computed_tokens[0] > 0 and b.num_scheduled_tokens[0] > 1 for b in batches), "no chunked prefill"


# Per stage: (layers built, holds the embedding, holds the LM head); a tied head keeps the embedding.
TRANSFORMERS_STAGES = {"gemma2": [(2, True, False), (2, True, True)], "opt": [(2, True, False), (2, False, True)]}


@pytest.mark.parametrize("case", TRANSFORMERS_STAGES)
def test_transformers_backend_stages_answer_as_one_under_chunked_prefill_preemption_and_prefix_caching(
        checkpoints, case):
    options = dict(TIGHT, async_scheduling=True, model_impl="transformers")
    one = run(cpu_llm(checkpoints[case], **options), PROMPTS, GREEDY)
    llm = cpu_llm(checkpoints[case], pipeline_parallel_size=2, **options)
    assert llm.apply_model(transformers_stage_parts) == TRANSFORMERS_STAGES[case]
    batches = testing.record_batches(llm.engine)
    two = run(llm, PROMPTS, GREEDY)
    assert_same_outputs(one, two)
    assert_same_prompt_logprobs(one, two)
    assert any(b.preempted_request_ids for b in batches), "the tight cache was meant to force preemption"


def test_each_stage_has_a_batch_of_other_requests_in_flight(checkpoints):
    """vLLM's batch queue: while one batch is in the last stage, the next, of other requests, is
    in the first; a request is scheduled again once its token is back."""
    llm = cpu_llm(checkpoints["llama"], num_kv_blocks=64, pipeline_parallel_size=2, async_scheduling=False)
    batches = testing.record_batches(llm.engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    expected = run(cpu_llm(checkpoints["llama"], num_kv_blocks=64), PROMPTS[:4], params)
    assert_same_outputs(expected, run(llm, PROMPTS[:4], params))
    decodes = [set(b.request_ids) for b in batches if b.request_ids and max(b.num_scheduled_tokens) == 1]
    assert len(decodes) > 4
    assert all(not (a & b) for a, b in zip(decodes, decodes[1:])), "consecutive batches share a request"


def test_an_uneven_partition_with_tied_embeddings_sampling_n_and_swapping_answers_as_one(checkpoints, monkeypatch):
    """The last stage keeps the embedding its head shares; n > 1 with a seed samples alike; a
    swapped request comes back to every stage's cache."""
    monkeypatch.setenv("HOOKLLM_PP_LAYER_PARTITION", "2,1")
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, n=2, ignore_eos=True, logprobs=1)
    options = dict(TIGHT, preemption_mode="swap", async_scheduling=True)
    one = run(cpu_llm(checkpoints["llama-tied"], **options), PROMPTS, params)
    two = run(cpu_llm(checkpoints["llama-tied"], pipeline_parallel_size=2, **options), PROMPTS, params)
    for a, b in zip(one, two):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_beam_search_across_two_stages_finds_one_processs_beams(checkpoints):
    from hookllm import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    one = cpu_llm(checkpoints["llama"], num_kv_blocks=64).beam_search(prompts, params)
    llm = cpu_llm(checkpoints["llama"], num_kv_blocks=64, pipeline_parallel_size=2)
    try:
        two = llm.beam_search(prompts, params)
    finally:
        llm.shutdown()
    assert [[s.tokens for s in o.sequences] for o in one] == [[s.tokens for s in o.sequences] for o in two]


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_two_ranks_in_each_of_two_stages_answer_as_one(checkpoints, model_impl):
    one = run(cpu_llm(checkpoints["llama"], num_kv_blocks=64, model_impl=model_impl), PROMPTS, GREEDY)
    llm = cpu_llm(checkpoints["llama"], num_kv_blocks=64, tensor_parallel_size=2, pipeline_parallel_size=2,
                  model_impl=model_impl)
    assert len(llm.engine.engine_core.executor.processes) == 4
    assert llm.apply_model(stage_layer_count) == [2, 2, 2, 2]
    two = run(llm, PROMPTS, GREEDY)
    assert_same_outputs(one, two)
    assert_same_prompt_logprobs(one, two)


def stage_layer_count(model) -> int:
    """For ``apply_model``: the decoder layers this rank built (the others are stand-ins), as
    counted by their paged attention layers."""
    from hookllm.layers.attention import Attention

    return sum(isinstance(module, Attention) for module in model.modules())


def transformers_stage_parts(model) -> tuple[int, bool, bool]:
    """For ``apply_model``: what this rank of a transformers-backend model built."""
    from hookllm.layers import StageMissing

    parts = (model.hf_model.get_input_embeddings(), model.hf_model.get_output_embeddings())
    return (len(model.attention), *(not isinstance(part, StageMissing) for part in parts))


def test_a_killed_stage_ends_the_engine_with_an_error_naming_its_rank(checkpoints):
    llm = cpu_llm(checkpoints["llama"], num_kv_blocks=64, pipeline_parallel_size=2)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(engine.engine_core.executor.processes[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0"):
        for _ in range(400):
            engine.step()
    assert time.monotonic() - start < 60
    assert not engine.engine_core.executor.processes  # every rank was stopped


def test_structured_output_is_enforced_by_the_last_stage_as_by_one_process(tiny_llama_dir):
    from hookllm.sampling_params import StructuredOutputsParams
    from test_structured_output import TINY, sampled

    params = sampled(4, 48, StructuredOutputsParams(json=json.dumps(TINY)))
    options = dict(plugins=["structured"], num_kv_blocks=64, async_scheduling=True)
    one = cpu_llm(tiny_llama_dir, **options).generate(["Hello"] * 4, params)
    llm = cpu_llm(tiny_llama_dir, pipeline_parallel_size=2, **options)
    try:
        two = llm.generate(["Hello"] * 4, params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for out in two:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), TINY)
