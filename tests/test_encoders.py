"""Encoder models (BERT, XLM-RoBERTa, ModernBERT) on the pooling runner, through the transformers
backend with bidirectional paged attention: embeddings against sentence-transformers, classifier
probabilities against transformers, and a BERT cross-encoder's pair scores (token types and all)
against sentence-transformers' ``CrossEncoder``, on the same tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModel, AutoModelForSequenceClassification, AutoTokenizer, BertConfig,
                          ModernBertConfig, XLMRobertaConfig)

from hookllm import LLM, PoolingParams, testing
from pooling_fixtures import sentence_transformer

# Mixed lengths; the long one spans several of ModernBERT's local windows (8 tokens here).
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "x", "what is the capital of france"]
SIZES = dict(vocab_size=testing.WORDPIECE_VOCAB_SIZE, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             intermediate_size=64, pad_token_id=0, initializer_range=0.05)
CONFIGS = {
    "bert": lambda **kw: BertConfig(**SIZES, max_position_embeddings=64, type_vocab_size=2, **kw),
    # Positions numbered after the padding index (pad_token_id + 1 on): 66 positions serve 65 tokens.
    "xlm-roberta": lambda **kw: XLMRobertaConfig(**SIZES, max_position_embeddings=66, **kw),
    # Global attention every second layer, else a local window of 4 tokens on each side.
    "modernbert": lambda **kw: ModernBertConfig(**SIZES, max_position_embeddings=128, local_attention=8,
                                                global_attn_every_n_layers=2, bos_token_id=2, eos_token_id=3,
                                                cls_token_id=2, sep_token_id=3, **kw),
}
POOLINGS = {"bert": ("mean", True), "xlm-roberta": ("cls", True), "modernbert": ("mean", False)}


def encoder_dir(tmp_path_factory, name: str, model_cls=AutoModel, **config):
    path = tmp_path_factory.mktemp(name)
    testing.build_tiny_checkpoint(CONFIGS[name](**config), path, model_cls=model_cls)
    testing.build_tiny_wordpiece_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def embedding_model(request, tmp_path_factory):
    name = request.param
    mode, normalize = POOLINGS[name]
    folder = tmp_path_factory.mktemp(f"st-{name}")
    return sentence_transformer(encoder_dir(tmp_path_factory, name), folder, mode, normalize), folder


def test_encoder_embeddings_equal_sentence_transformers(embedding_model):
    reference, folder = embedding_model
    llm = LLM(str(folder), dtype="float32", device="cpu")  # an encoder: the pooling runner
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference.encode(TEXTS, convert_to_tensor=True), atol=1e-5, rtol=1e-5)


def test_an_encoder_computes_each_prompt_whole_in_one_step(embedding_model):
    # A 40-token step budget: prompts wait for a step with room instead of being cut into chunks.
    reference, folder = embedding_model
    llm = LLM(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=40)
    batches = testing.record_batches(llm.engine)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS * 3)])
    torch.testing.assert_close(got, reference.encode(TEXTS * 3, convert_to_tensor=True), atol=1e-5, rtol=1e-5)
    assert len(batches) > 1
    assert all(len(batch.pooling_rows) == len(batch.request_ids) for batch in batches), "a prompt was chunked"
    testing.assert_all_blocks_free(llm)


def test_a_bare_bert_embeds_with_its_normalized_cls_token(tmp_path_factory):
    path = encoder_dir(tmp_path_factory, "bert")
    reference = testing.load_reference(path, AutoModel)
    ids = AutoTokenizer.from_pretrained(str(path))(TEXTS[3])["input_ids"]
    with torch.no_grad():
        want = torch.nn.functional.normalize(reference(torch.tensor([ids])).last_hidden_state[0, 0], dim=-1)
    llm = LLM(str(path), dtype="float32", device="cpu")
    torch.testing.assert_close(torch.tensor(llm.embed(TEXTS[3])[0].outputs.embedding), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, config", [("bert", {}), ("xlm-roberta", {}),
                                          ("modernbert", {"classifier_pooling": "mean"})],
                         ids=["bert", "xlm-roberta", "modernbert-mean"])
def test_encoder_classifiers_give_transformers_probabilities(tmp_path_factory, name, config):
    path = encoder_dir(tmp_path_factory, name, AutoModelForSequenceClassification, num_labels=3, **config)
    reference = testing.load_reference(path, AutoModelForSequenceClassification)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), dtype="float32", device="cpu")
    outputs = llm.classify(TEXTS)
    for text, output in zip(TEXTS, outputs):
        with torch.no_grad():
            want = reference(torch.tensor([tokenizer(text)["input_ids"]])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def bert_cross_encoder(tmp_path_factory):
    return encoder_dir(tmp_path_factory, "bert", AutoModelForSequenceClassification, num_labels=1)


def test_a_bert_cross_encoder_scores_pairs_as_sentence_transformers(bert_cross_encoder):
    from sentence_transformers import CrossEncoder

    documents = ["hello world", "the lazy dog", "x y z", "paris is the capital of france"]
    want = torch.tensor(CrossEncoder(str(bert_cross_encoder), device="cpu").predict(
        [("what is the capital of france", document) for document in documents]))
    llm = LLM(str(bert_cross_encoder), dtype="float32", device="cpu")
    got = torch.tensor([o.outputs.score for o in llm.score("what is the capital of france", documents)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_pairs_token_types_change_its_score(bert_cross_encoder):
    tokenizer = AutoTokenizer.from_pretrained(str(bert_cross_encoder))
    encoded = tokenizer("what is the capital of france", "paris")
    pair = {"prompt_token_ids": encoded["input_ids"], "token_type_ids": encoded["token_type_ids"]}
    llm = LLM(str(bert_cross_encoder), dtype="float32", device="cpu")
    with_types, without = llm.encode([pair, encoded["input_ids"]], PoolingParams(task="score"), use_tqdm=False)
    assert with_types.outputs.data[0] != pytest.approx(float(without.outputs.data[0]), abs=1e-6)


@pytest.mark.parametrize("token_types, message", [([0, 1, 0], "0s then 1s"), ([0, 2, 2], "0s then 1s"),
                                                  ([0, 1], "one per token")])
def test_token_type_ids_that_are_not_a_pairs_segments_are_refused(bert_cross_encoder, token_types, message):
    llm = LLM(str(bert_cross_encoder), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=message):
        llm.encode({"prompt_token_ids": [2, 5, 3], "token_type_ids": token_types}, PoolingParams(task="score"))


def test_an_input_over_the_step_budget_is_refused_naming_it(tmp_path_factory):
    llm = LLM(str(encoder_dir(tmp_path_factory, "bert")), dtype="float32", device="cpu", max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"12 tokens\) is over max_num_batched_tokens \(8\).*one step"):
        llm.embed({"prompt_token_ids": list(range(5, 17))})


def test_an_encoder_refuses_the_generate_runner(tmp_path_factory):
    with pytest.raises(ValueError, match="BertModel is an encoder: it runs with the pooling runner"):
        LLM(str(encoder_dir(tmp_path_factory, "bert")), device="cpu", runner="generate")


def test_an_xlm_roberta_serves_its_positions_after_the_padding_index(tmp_path_factory):
    # 66 position embeddings, numbered from pad_token_id + 1 = 1: 65 tokens at most.
    llm = LLM(str(encoder_dir(tmp_path_factory, "xlm-roberta")), device="cpu")
    assert llm.engine.model_config.max_model_len == 65


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """A ColBERT checkpoint as the colbert-ai library saves one (``HF_ColBERT``: the BERT's tensors
    under ``bert.``, a ``linear`` projection of each token to 16 dimensions), and the reference:
    each text's token embeddings, normalized, from transformers' BertModel and that projection."""
    import json

    from safetensors.torch import load_file, save_file

    path = encoder_dir(tmp_path_factory, "bert")
    reference = testing.load_reference(path, AutoModel)
    tensors = {f"bert.{name}": tensor for name, tensor in load_file(str(path / "model.safetensors")).items()}
    projection = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    save_file({**tensors, "linear.weight": projection}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    tokenizer = AutoTokenizer.from_pretrained(str(path))

    def token_embeddings(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = reference(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden @ projection.T, dim=-1)

    return path, token_embeddings


def test_a_colbert_model_gives_projected_normalized_token_embeddings(colbert):
    path, token_embeddings = colbert
    llm = LLM(str(path), dtype="float32", device="cpu")
    for text, output in zip(TEXTS, llm.encode(TEXTS)):
        torch.testing.assert_close(output.outputs.data, token_embeddings(text), atol=1e-5, rtol=1e-5)


def test_a_colbert_model_scores_pairs_by_maxsim(colbert):
    path, token_embeddings = colbert
    query, documents = "what is the capital of france", ["paris is the capital of france", "the lazy dog", "x"]
    want = [float((token_embeddings(query) @ token_embeddings(doc).T).max(dim=1).values.sum()) for doc in documents]
    llm = LLM(str(path), dtype="float32", device="cpu")
    got = [output.outputs.score for output in llm.score(query, documents)]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_colbert_model_refuses_single_vector_embeddings(colbert):
    llm = LLM(str(colbert[0]), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="late-interaction model: it gives token embeddings"):
        llm.embed("hello world")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_compile_traces_each_encoder_whole_around_the_attention_operator(tmp_path_factory, name):
    """As for decoders (test_transformers_backend): dynamo traces a whole encoder forward without
    a graph break (its eager backend: no C compiler here) and computes what the eager one does."""
    from torch._dynamo.utils import counters

    path = encoder_dir(tmp_path_factory, name)
    eager = LLM(str(path), dtype="float32", device="cpu")
    compiled = LLM(str(path), dtype="float32", device="cpu")
    compiled.engine.engine_core.executor.model.use_torch_compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    got = torch.tensor([o.outputs.embedding for o in compiled.embed(TEXTS)])
    torch.testing.assert_close(got, torch.tensor([o.outputs.embedding for o in eager.embed(TEXTS)]),
                               atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


def test_a_pipelines_dense_modules_project_the_pooled_embedding(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st-dense")
    reference = sentence_transformer(encoder_dir(tmp_path_factory, "bert"), folder, "mean", True, dense=[24, 16])
    llm = LLM(str(folder), dtype="float32", device="cpu")
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference.encode(TEXTS, convert_to_tensor=True), atol=1e-5, rtol=1e-5)
    llm.engine.model_config.pooler.matryoshka = True  # the size a request may cut to is the last Dense's
    with pytest.raises(ValueError, match="dimensions=20 is over the model's embedding size 16"):
        llm.embed("x", PoolingParams(dimensions=20))
