"""The pooling runner: embeddings and per-token hidden states of a causal LM, against
sentence-transformers on the same tiny random checkpoint (its pipeline read from the folder),
across mixed lengths, chunked prefill and a prompt recomputed after a preemption."""

import json
import shutil
import threading

import pytest
import torch

from hookllm import LLM, PoolingParams, SamplingParams, testing
from hookllm.pooling_params import PoolerConfig
from hookllm.worker.batch import Batch, CachedRequestState
from hookllm.worker.pooler import Pooler
from pooling_fixtures import sentence_transformer

# No text ends in a space: sentence-transformers before 6 strips its inputs (hookllm, as vLLM, does not).
TEXTS = ["hello world", " ".join("abcdefghijklmnopqrstuvwxyz" * 3), "x", "the quick brown fox"]


@pytest.fixture(scope="module", params=[("lasttoken", True), ("mean", False), ("cls", True)],
                ids=["last-normalized", "mean", "cls-normalized"])
def embedding_model(request, tiny_llama_dir, tmp_path_factory):
    mode, normalize = request.param
    folder = tmp_path_factory.mktemp(f"st-{mode}")
    return sentence_transformer(tiny_llama_dir, folder, mode, normalize), folder


def test_embeddings_equal_sentence_transformers(embedding_model):
    reference, folder = embedding_model
    llm = LLM(str(folder), dtype="float32", device="cpu")  # the pooling runner: the folder has modules.json
    outputs = llm.embed(TEXTS)
    want = reference.encode(TEXTS, convert_to_tensor=True)
    got = torch.tensor([o.outputs.embedding for o in outputs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_changes_no_embedding(embedding_model):
    reference, folder = embedding_model
    want = reference.encode(TEXTS * 3, convert_to_tensor=True)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=12)
    batches = testing.record_batches(llm.engine)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS * 3)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any(len(b.pooling_rows) < len(b.request_ids) for b in batches), "no prompt was chunked"
    testing.assert_all_blocks_free(llm)


def test_a_prompt_recomputed_after_a_preemption_pools_from_its_start():
    pooler = Pooler(PoolerConfig("mean", normalize=False))
    request = CachedRequestState("r", list(range(6)), 6, SamplingParams(), pooling_params=PoolingParams())
    hidden = torch.randn(6, 4)

    def chunk(start: int, end: int, completes: bool) -> dict:
        request.num_computed_tokens = start
        batch = Batch([request], [end - start], [], [], torch.Generator())
        return pooler.pool(hidden[start:end], batch, [0, end - start], [0] if completes else [])

    chunk(0, 4, completes=False)
    # Preempted: its blocks were freed and it starts over from token 0, then completes in two chunks.
    chunk(0, 3, completes=False)
    [pooled] = chunk(3, 6, completes=True).values()
    torch.testing.assert_close(pooled, hidden.mean(dim=0))
    assert not pooler.partial


def test_encode_gives_every_prompt_tokens_last_hidden_state(tiny_llama_dir, tiny_llama_reference):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", max_num_batched_tokens=16)
    prompt = list(range(3, 40))
    [output] = llm.encode([prompt])
    with torch.no_grad():
        want = tiny_llama_reference.model(torch.tensor([prompt])).last_hidden_state[0]
    assert output.outputs.data.shape == (len(prompt), want.shape[-1])
    torch.testing.assert_close(output.outputs.data, want, atol=1e-5, rtol=1e-5)


def test_a_causal_lm_embeds_with_its_last_token_normalized(tiny_llama_dir, tiny_llama_reference):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    prompt = [5, 6, 7, 8, 9]
    [output] = llm.embed([prompt])
    with torch.no_grad():
        last = tiny_llama_reference.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), torch.nn.functional.normalize(last, dim=0),
                               atol=1e-5, rtol=1e-5)
    unnormalized = llm.embed([prompt], PoolingParams(normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(unnormalized), last, atol=1e-5, rtol=1e-5)


def test_dimensions_cut_a_matryoshka_models_embedding_before_normalizing(tiny_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(["hi"], PoolingParams(dimensions=8))
    shutil.copytree(tiny_llama_dir, tmp_path / "matryoshka")
    config = json.loads((tmp_path / "matryoshka" / "config.json").read_text())
    (tmp_path / "matryoshka" / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = LLM(str(tmp_path / "matryoshka"), dtype="float32", device="cpu", runner="pooling")
    with pytest.raises(ValueError, match="over the model's embedding size"):
        llm.embed(["hi"], PoolingParams(dimensions=10_000))
    full = torch.tensor(llm.embed(["hi"], PoolingParams(normalize=False))[0].outputs.embedding)
    [output] = llm.embed(["hi"], PoolingParams(dimensions=8))
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), torch.nn.functional.normalize(full[:8], dim=0))


def test_a_generation_request_to_a_pooling_model_names_the_runner(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    with pytest.raises(ValueError, match="pooling runner"):
        llm.generate(["hi"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        llm.embed([])
    assert llm.embed(["still serving"])[0].outputs.hidden_size > 0


def test_a_pooling_request_to_a_generation_model_names_the_runner(make_llm):
    with pytest.raises(ValueError, match="generate runner"):
        make_llm().embed(["hi"])


def test_a_pooling_engine_and_a_generating_one_serve_side_by_side(tiny_llama_dir, tiny_llama_reference):
    generating = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    pooling = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    prompt = [5, 6, 7, 8, 9]
    tokens = generating.generate({"prompt_token_ids": prompt}, testing.greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    [embedding] = pooling.embed([prompt], PoolingParams(normalize=False), use_tqdm=False)
    with torch.no_grad():
        want = tiny_llama_reference.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 5:]
        last = tiny_llama_reference.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    assert tokens == want.tolist()
    torch.testing.assert_close(torch.tensor(embedding.outputs.embedding), last, atol=1e-5, rtol=1e-5)


def test_an_input_the_cache_can_never_hold_is_refused_naming_its_size(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", num_kv_blocks=2)
    with pytest.raises(ValueError, match=r"the input \(40 tokens\) needs 3 KV blocks"):
        llm.embed([list(range(3, 43))])
    assert llm.embed([[5, 6, 7]])[0].outputs.hidden_size == 64


def test_a_calls_texts_are_tokenized_together_as_the_engine_tokenizes_each(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    calls = []
    tokenizer = llm.get_tokenizer()
    processor = llm.engine.input_processor
    real_token_ids_of = processor._token_ids_of
    prompts = TEXTS + [{"prompt": "x y"}, [5, 6]]
    processor._token_ids_of = lambda texts: calls.append(texts) or real_token_ids_of(texts)
    outputs = llm.embed(prompts, use_tqdm=False)
    assert calls == [TEXTS + ["x y"]]  # one call; the token ids need none
    assert [o.prompt_token_ids for o in outputs] == [tokenizer(t)["input_ids"] for t in TEXTS + ["x y"]] + [[5, 6]]


def test_a_tokenizer_with_truncation_set_tokenizes_through_transformers(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    processor, tokenizer = llm.engine.input_processor, llm.get_tokenizer()
    assert processor.tokenizes_in_rust
    tokenizer.backend_tokenizer.enable_truncation(3)  # state transformers' wrapper overrides
    assert not processor.tokenizes_in_rust
    assert processor._token_ids_of(TEXTS) == tokenizer(TEXTS)["input_ids"]


def test_a_large_calls_prompts_are_tokenized_and_queued_a_batch_at_a_time(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", max_num_seqs=2)
    processor = llm.engine.input_processor
    batches = []
    real_token_ids_of = processor._token_ids_of
    processor._token_ids_of = lambda texts: batches.append((texts, threading.current_thread().name)) \
        or real_token_ids_of(texts)
    outputs = llm.embed(TEXTS + ["x y"], use_tqdm=False)
    # max_num_seqs each: the first before any step, the next on a thread while the engine steps;
    # a batch of one text is tokenized as its request is made.
    assert [texts for texts, _ in batches] == [TEXTS[:2], TEXTS[2:], ["x y"]]
    assert [thread.startswith("hookllm-tokenize") for _, thread in batches] == [False, True, False]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("hookllm-tokenize")]
    alone = [llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS + ["x y"]]
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outputs]), torch.tensor(alone))


def test_a_pooling_engine_hashes_no_block_for_a_prefix_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", block_size=16)
    llm.embed([" ".join(["hello"] * 40)] * 2, use_tqdm=False)  # full blocks, a prefix shared
    block_manager = llm.engine.engine_core.scheduler.block_manager
    assert not block_manager.enable_prefix_caching and not block_manager.cached
