"""A conformance kit for adapter authors: tiny checkpoints and checks against transformers.

Typical use in an adapter's tests::

    from transformers import GPT2Config
    from hookllm import testing

    def test_matches_transformers(tmp_path):
        path = testing.build_tiny_checkpoint(GPT2Config(n_embd=64, n_layer=2, n_head=4), tmp_path)
        testing.assert_adapter_matches_transformers(path, plugins=["gpt2"])

Random tiny models are built with ``initializer_range=0.2`` (unless the config sets it), since
transformers' default init gives near-flat logits whose greedy output proves nothing.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import torch

from hookllm.distributed import is_last_stage
from hookllm.entrypoints.llm import LLM
from hookllm.sched.request import Request
from hookllm.sampling_params import SamplingParams
from hookllm.sched.output import NewRequestData, SchedulerOutput

LOGITS_ATOL = 1e-4


def tiny_llama_config(**overrides: Any) -> Any:
    """A tiny Llama config with GQA (4 query heads, 2 KV heads); keyword arguments override fields."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_tiny_checkpoint(config: Any, path: str | Path, seed: int = 0, model_cls: Any = None) -> Path:
    """Instantiate ``config`` with random weights and ``save_pretrained`` it.

    ``model_cls`` is a transformers Auto class (``from_config``), by default
    ``AutoModelForCausalLM``; a multimodal model passes e.g. ``AutoModelForImageTextToText``.
    """
    from transformers import AutoModelForCausalLM

    if getattr(config, "initializer_range", None) in (None, 0.02):
        config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = (model_cls or AutoModelForCausalLM).from_config(config).eval()
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path: str | Path, model_cls: Any = None) -> Any:
    """The transformers model of a checkpoint, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return (model_cls or AutoModelForCausalLM).from_pretrained(str(path), dtype=torch.float32).eval()


def random_prompts(num: int, vocab_size: int, min_len: int = 3, max_len: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def prompt_logits(llm: LLM, prompt_token_ids: list[int]) -> torch.Tensor:
    """hookllm's logits at every prompt position (one prefill through the model runner), on the CPU."""
    request = Request("prompt-logits", list(prompt_token_ids), SamplingParams())
    try:
        return forward_chunk(llm.engine, request, request.num_tokens, logits=True)
    finally:
        release_chunked(llm.engine, request)


def forward_chunk(engine: Any, request: Request, count: int, logits: bool = False) -> torch.Tensor:
    """Run ``request``'s next ``count`` tokens alone through the model runner, under any executor:
    their hidden states (or logits), the last rank's, on the CPU.

    Allocates the KV blocks they need and advances ``num_computed_tokens``; the caller ends
    with :func:`release_chunked`.
    """
    block_manager = engine.engine_core.scheduler.block_manager
    if not block_manager.allocate_slots(request, count):
        raise RuntimeError("not enough free KV blocks for the chunk")
    new = ([NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params, request.mm_items)]
           if request.num_computed_tokens == 0 else [])
    step = SchedulerOutput(new, [request.request_id], [count], [request.num_computed_tokens], [[]], [],
                           block_manager.take_block_updates([request]))
    # The last rank's: the last pipeline stage holds the head (every rank of it has all logits).
    output = engine.engine_core.executor.collective_rpc(_forward_on_worker, (step, logits))[-1]
    request.num_computed_tokens += count
    return output


def _forward_on_worker(worker: Any, step: SchedulerOutput, logits: bool) -> torch.Tensor:
    runner = worker.runner
    runner.update_states(step)
    hidden_states, _ = runner.forward(runner.make_batch(step, None), step)
    with torch.inference_mode():
        output = worker.model.compute_logits(hidden_states) if logits and is_last_stage() else hidden_states
    return output.float().cpu()


def release_chunked(engine: Any, request: Request) -> None:
    """Free what :func:`forward_chunk` runs left: the request's blocks and its runner state."""
    engine.engine_core.scheduler.block_manager.free(request)
    engine.engine_core.executor.execute(SchedulerOutput.empty([request.request_id]))


def record_batches(engine: Any) -> list[SchedulerOutput]:
    """Every batch ``engine``'s scheduler emits from now on, appended as it is emitted."""
    batches: list[SchedulerOutput] = []
    schedule = engine.engine_core.scheduler.schedule

    def recording() -> SchedulerOutput:
        batch = schedule()
        batches.append(batch)
        return batch

    engine.engine_core.scheduler.schedule = recording
    return batches


def reference_greedy(model: Any, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_token_ids])
        # An explicit mask: otherwise transformers masks prompt tokens equal to the pad id.
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_token_ids):].tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def assert_prefill_logits_match(llm: LLM, reference: Any, prompt_token_ids: list[int], atol: float = LOGITS_ATOL) -> None:
    ours = prompt_logits(llm, prompt_token_ids)
    with torch.inference_mode():
        theirs = reference(torch.tensor([prompt_token_ids])).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    assert diff < atol, f"prefill logits differ from transformers by {diff:.3g} (atol {atol})"


def assert_greedy_matches(llm: LLM, reference: Any, prompts: Sequence[list[int]], max_tokens: int = 16) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens))
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(reference, prompt, max_tokens)
        assert len(set(expected)) > 1, "the reference output is constant: raise initializer_range"
        assert output.outputs[0].token_ids == expected, f"prompt {prompt[:8]}...: greedy tokens differ"


def assert_batch_invariant(llm: LLM, prompts: Sequence[list[int]], max_tokens: int = 12) -> None:
    """Greedy tokens of all prompts run together equal each prompt run alone; no block leaks."""
    params = greedy(max_tokens)
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert together == alone, "batched greedy output differs from running each prompt alone"
    assert_all_blocks_free(llm)


def assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.engine.engine_core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks, (
        f"{manager.num_blocks - manager.num_free_blocks} KV blocks still held after all requests finished"
    )


def assert_adapter_matches_transformers(
    path: str | Path, plugins: Sequence[str] = (), num_prompts: int = 4, max_tokens: int = 12, **llm_kwargs: Any
) -> LLM:
    """The whole kit on one checkpoint: prefill logits, greedy tokens, then batch invariance
    under chunked prefill and preemption (small token budget, few KV blocks)."""
    reference = load_reference(path)
    vocab = reference.config.vocab_size
    prompts = random_prompts(num_prompts, vocab, seed=1)
    llm = LLM(str(path), plugins=list(plugins), dtype="float32", device="cpu", **llm_kwargs)
    assert_prefill_logits_match(llm, reference, prompts[0])
    assert_greedy_matches(llm, reference, prompts, max_tokens)
    tight = LLM(str(path), plugins=list(plugins), dtype="float32", device="cpu",
                max_num_batched_tokens=16, num_kv_blocks=8, **llm_kwargs)
    assert_batch_invariant(tight, random_prompts(12, vocab, max_len=30, seed=2), max_tokens)
    return llm


TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill chunks and decode tokens in one step.",
]


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 320, special_tokens: Sequence[str] = ()) -> Any:
    """Train a byte-level BPE tokenizer offline and ``save_pretrained`` it into ``path``.

    Its ids stay below ``vocab_size``; ``<s>`` (id 0) is BOS and ``</s>`` (id 1) EOS, and
    ``special_tokens`` (e.g. a multimodal placeholder) are added after them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", *special_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def build_tiny_wordpiece_tokenizer(path: str | Path) -> Any:
    """A BERT-style tokenizer (WordPiece, ``[CLS] a [SEP] b [SEP]`` with token types for pairs)
    over a small English vocabulary, ``save_pretrained`` into ``path``: ``[PAD]`` is id 0,
    ``[CLS]`` 2, ``[SEP]`` 3; ids stay below :data:`WORDPIECE_VOCAB_SIZE`."""
    from transformers import BertTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(WORDPIECE_VOCAB) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    tokenizer.save_pretrained(str(path))
    return tokenizer


WORDPIECE_VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                   + "the quick brown fox jumps over lazy dog hello world what is capital of france paris".split()
                   + list("abcdefghijklmnopqrstuvwxyz") + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"])
WORDPIECE_VOCAB_SIZE = len(WORDPIECE_VOCAB)
