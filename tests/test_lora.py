"""LoRA adapters served over one base model: each request's tokens and prompt logprobs equal
transformers + PEFT on the same adapter folder, in batches mixing the base model and three
adapters of different ranks and targets, under every scheduling feature."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hookllm import LLM, SamplingParams, testing
from hookllm.sampling_params import StructuredOutputsParams
from hookllm.engine.beam_search import BeamSearchParams
from hookllm.lora.request import LoRARequest
from lora_fixtures import build_adapter, build_adapters, greedy, lora_requests, peft_reference, prompt_logprobs

pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPTS = testing.random_prompts(8, 320, min_len=5, max_len=30, seed=3)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return build_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def requests(adapters):
    return lora_requests(adapters)


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters):
    """Per adapter name (None: the base model), the PEFT model's greedy tokens and prompt
    logprobs of every prompt."""
    result = {}
    for name in [None, *adapters]:
        model = peft_reference(tiny_llama_dir, None if name is None else adapters[name])
        result[name] = [(greedy(model, p, MAX_TOKENS), prompt_logprobs(model, p)) for p in PROMPTS]
    return result


def mixed_batch(requests):
    """Every prompt once per adapter and once on the base model, interleaved."""
    names = [None, *requests]
    return [(names[(i + j) % len(names)], i) for j in range(len(names)) for i in range(len(PROMPTS))]


def run(llm, requests, batch, prompt_logprobs_too=True):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=0 if prompt_logprobs_too else None)
    return llm.generate([PROMPTS[i] for _, i in batch], params, use_tqdm=False,
                        lora_request=[None if name is None else requests[name] for name, _ in batch])


def check_and_shut_down(llm, requests, references):
    """The mixed batch checked on an engine of several processes, which is shut down after."""
    try:
        batch = mixed_batch(requests)
        check(run(llm, requests, batch), batch, references)
    finally:
        llm.engine.shutdown()


def check(outputs, batch, references, prompt_logprobs_too=True):
    for output, (name, i) in zip(outputs, batch):
        tokens, logprobs = references[name][i]
        assert output.outputs[0].token_ids == tokens, (name, i)
        if prompt_logprobs_too:
            got = torch.tensor([entry[PROMPTS[i][p + 1]].logprob for p, entry in enumerate(output.prompt_logprobs[1:])])
            torch.testing.assert_close(got, logprobs, atol=2e-4, rtol=0)


def test_the_adapters_change_the_output(references):
    # Otherwise the comparisons below would prove nothing.
    outputs = [tuple(tokens) for name in references for tokens, _ in references[name]]
    assert len(set(outputs)) > 3 * len(PROMPTS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_mixed_batch_equals_peft_per_request(make_llm, requests, references, async_scheduling):
    llm = make_llm(enable_lora=True, max_loras=3, async_scheduling=async_scheduling)
    batch = mixed_batch(requests)
    check(run(llm, requests, batch), batch, references)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_verifies_each_row_with_its_requests_adapter(make_llm, tiny_llama_dir, requests,
                                                                        references, async_scheduling):
    """The base model drafts for every request (draft_model, no adapters); each request's k + 1
    verified rows run its own adapter, so its tokens are PEFT's, guesses kept or not."""
    llm = make_llm(enable_lora=True, max_loras=3, async_scheduling=async_scheduling,
                   speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    batch = mixed_batch(requests)
    check(run(llm, requests, batch), batch, references)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_each_output_names_the_adapter_its_request_ran_with(make_llm, requests):
    llm = make_llm(enable_lora=True, max_loras=3)
    batch = mixed_batch(requests)[:4]
    for output, (name, _) in zip(run(llm, requests, batch, prompt_logprobs_too=False), batch):
        assert output.lora_request == (None if name is None else requests[name])


def test_chunked_prefill_and_preemption_keep_each_adapter(make_llm, requests, references):
    # 16-token steps chunk every prompt; 12 blocks of 16 hold few requests at once, so some are
    # preempted and recomputed (with their adapter) while others run.
    llm = make_llm(enable_lora=True, max_loras=2, max_num_batched_tokens=16, num_kv_blocks=12, max_num_seqs=8)
    batch = mixed_batch(requests)
    check(run(llm, requests, batch), batch, references)


def test_swap_preemption_keeps_each_adapter(make_llm, requests, references):
    llm = make_llm(enable_lora=True, max_loras=3, num_kv_blocks=10, preemption_mode="swap")
    batch = mixed_batch(requests)
    check(run(llm, requests, batch, prompt_logprobs_too=False), batch, references, prompt_logprobs_too=False)


def test_more_adapters_in_flight_than_slots_all_finish_with_their_own(make_llm, requests, references):
    llm = make_llm(enable_lora=True, max_loras=1, max_cpu_loras=1)
    batch = mixed_batch(requests)
    check(run(llm, requests, batch, prompt_logprobs_too=False), batch, references, prompt_logprobs_too=False)


def test_the_prefix_cache_never_shares_blocks_between_adapters(make_llm, requests, references):
    llm = make_llm(enable_lora=True, max_loras=3)
    long_prompt = PROMPTS[0] * 3  # two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([long_prompt], params, use_tqdm=False, lora_request=requests["attn"])[0]
    again = llm.generate([long_prompt], params, use_tqdm=False, lora_request=requests["attn"])[0]
    other = llm.generate([long_prompt], params, use_tqdm=False, lora_request=requests["all"])[0]
    base = llm.generate([long_prompt], params, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_parallel_sampling_runs_every_completion_with_the_adapter(make_llm, requests, references):
    llm = make_llm(enable_lora=True)
    output = llm.generate([PROMPTS[2]], SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False, lora_request=requests["all"])[0]
    assert [c.token_ids for c in output.outputs] == [references["all"][2][0]] * 2


def test_beam_search_forks_every_beam_with_the_adapter(make_llm, requests, references):
    llm = make_llm(enable_lora=True)
    best = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True),
                           lora_request=requests["some"])[0].sequences[0]
    assert best.tokens[-MAX_TOKENS:] == references["some"][1][0]


def test_structured_output_constrains_an_adapter_request(tiny_llama_dir, requests):
    llm = LLM(str(tiny_llama_dir), plugins=["structured"], dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "maybe so"]))
    outputs = llm.generate(["Q"] * 3, params, use_tqdm=False, lora_request=list(requests.values()))
    assert all(output.outputs[0].text in ("yes", "no", "maybe so") for output in outputs)


def test_tensor_parallel_ranks_shard_the_adapters(make_llm, requests, references):
    llm = make_llm(enable_lora=True, max_loras=3, tensor_parallel_size=2, num_kv_blocks=64)
    check_and_shut_down(llm, requests, references)


def test_pipeline_stages_apply_each_their_layers_adapters(make_llm, requests, references):
    # The first stage holds the embedding and the first layers, the last the other layers and the
    # head: each wraps and loads what it holds of every adapter.
    llm = make_llm(enable_lora=True, max_loras=3, pipeline_parallel_size=2, num_kv_blocks=64)
    check_and_shut_down(llm, requests, references)


def test_data_parallel_engines_each_serve_the_adapters(tiny_llama_dir, requests, references):
    from hookllm import EngineConfig
    from hookllm.engine.async_llm import AsyncLLM

    engine = AsyncLLM(config=EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                          data_parallel_size=2, enable_lora=True, max_loras=3))
    batch = mixed_batch(requests)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(name, i) -> list[int]:
        lora = None if name is None else requests[name]
        outputs = [o async for o in engine.generate({"prompt_token_ids": PROMPTS[i]}, params, lora_request=lora)]
        return [t for output in outputs for t in output.outputs[0].token_ids]

    async def all_of_them() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*[one(name, i) for name, i in batch]), 120)

    try:
        got = asyncio.run(all_of_them())
    finally:
        engine.shutdown()
    assert got == [references[name][i][0] for name, i in batch]


def test_an_moe_model_takes_attention_adapters_and_refuses_expert_ones(tmp_path):
    from transformers import Qwen3MoeConfig

    base = testing.build_tiny_checkpoint(Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512), tmp_path / "moe")
    attention = build_adapter(base, tmp_path / "attn", 0, r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    router = build_adapter(base, tmp_path / "router", 1, r=8, lora_alpha=8, target_modules=["gate"])
    llm = LLM(str(base), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    output = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(attention)))
    assert output[0].outputs[0].token_ids == greedy(peft_reference(base, attention), PROMPTS[0], MAX_TOKENS)
    message = refused(llm, LoRARequest("router", 2, str(router)))
    assert "'router'" in message and "experts are not supported" in message


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_transformers_backend_equals_peft_per_request(make_llm, requests, references, tensor_parallel_size):
    # One process: q/k/v and gate/up fused by hookllm, each one wrapped projection of several
    # slices; two: the projections split as transformers' plan says, each wrapped alone.
    llm = make_llm(enable_lora=True, max_loras=3, model_impl="transformers", tensor_parallel_size=tensor_parallel_size,
                   num_kv_blocks=64)
    check_and_shut_down(llm, requests, references)


def test_triton_kernels_interpreted_equal_peft(make_llm, requests, references):
    llm = make_llm(enable_lora=True, max_loras=3, attention_backend="triton")
    batch = [(None, 0), ("attn", 1), ("all", 2), ("some", 3), ("all", 0)]
    check(run(llm, requests, batch), batch, references)


# --- bad input: each a clear error naming the adapter; the engine keeps serving -----------------

@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)


def refused(llm, lora_request) -> str:
    with pytest.raises(ValueError) as error:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora_request)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    return str(error.value)


def copy_adapter(source, target, config_changes=None, tensors=None):
    target.mkdir()
    config = json.loads((source / "adapter_config.json").read_text()) | (config_changes or {})
    (target / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else load_file(str(source / "adapter_model.safetensors")),
              str(target / "adapter_model.safetensors"))
    return target


def test_a_rank_over_max_lora_rank_is_refused(llm, requests):
    message = refused(llm, requests["all"])  # rank 16 > 8
    assert "'all'" in message and "rank 16" in message and "max_lora_rank 8" in message


def test_a_target_module_the_model_lacks_is_refused(llm, adapters, tmp_path):
    tensors = load_file(str(adapters["attn"] / "adapter_model.safetensors"))
    tensors = {name.replace("layers.1.", "layers.7."): t for name, t in tensors.items()}
    path = copy_adapter(adapters["attn"], tmp_path / "deep", tensors=tensors)
    message = refused(llm, LoRARequest("deep", 11, str(path)))
    assert "'deep'" in message and "layer 7" in message and "2 layers" in message


def test_tensors_of_another_shape_are_refused(llm, adapters, tmp_path):
    tensors = load_file(str(adapters["attn"] / "adapter_model.safetensors"))
    name = next(n for n in tensors if "q_proj.lora_B" in n)
    tensors[name] = torch.zeros(32, tensors[name].shape[1])
    path = copy_adapter(adapters["attn"], tmp_path / "narrow", tensors=tensors)
    message = refused(llm, LoRARequest("narrow", 12, str(path)))
    assert "'narrow'" in message and "q_proj" in message and "[64, r]" in message


def test_an_adapter_that_saves_the_whole_embedding_is_refused(llm, adapters, tmp_path):
    # PEFT's save_embedding_layers (its default when the embedding is a target) stores the whole
    # table too, as for a resized vocabulary, which the base model's embedding cannot stand for.
    tensors = load_file(str(adapters["attn"] / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] = torch.zeros(320, 64)
    path = copy_adapter(adapters["attn"], tmp_path / "whole", tensors=tensors)
    message = refused(llm, LoRARequest("whole", 13, str(path)))
    assert "'whole'" in message and "save_embedding_layers=False" in message


def test_an_adapter_of_another_base_model_is_refused(llm, adapters, tmp_path):
    path = copy_adapter(adapters["attn"], tmp_path / "other", {"base_model_name_or_path": "org/another-model"})
    message = refused(llm, LoRARequest("other", 13, str(path)))
    assert "'other'" in message and "org/another-model" in message


def test_a_missing_folder_and_an_unsupported_feature_are_refused(llm, adapters, tmp_path):
    assert "not found" in refused(llm, LoRARequest("ghost", 14, str(tmp_path / "nowhere")))
    dora = copy_adapter(adapters["attn"], tmp_path / "dora", {"use_dora": True})
    assert "DoRA" in refused(llm, LoRARequest("dora", 15, str(dora)))


def test_one_id_for_two_adapters_is_refused(llm, adapters):
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False,
                 lora_request=LoRARequest("attn", 21, str(adapters["attn"])))
    message = refused(llm, LoRARequest("some", 21, str(adapters["some"])))
    assert "lora_int_id 21" in message and "'attn'" in message


def test_a_lora_request_without_enable_lora_is_refused(make_llm, requests):
    message = refused(make_llm(), requests["attn"])
    assert "enable_lora" in message and "'attn'" in message


def test_a_model_hookllm_cannot_adapt_is_refused_at_start(tmp_path):
    from transformers import GPT2Config

    # GPT-2's projections are transformers' Conv1D under other names: none a PEFT Llama target.
    base = testing.build_tiny_checkpoint(GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=2, n_positions=128),
                                         tmp_path / "gpt2")
    with pytest.raises(ValueError, match="enable_lora: .* has no projections hookllm can adapt"):
        LLM(str(base), dtype="float32", device="cpu", enable_lora=True)
