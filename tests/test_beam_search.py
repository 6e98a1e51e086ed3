"""Beam search against transformers' generate(num_beams=k, early_stopping=True) on the same weights."""

import pytest
import torch

from hookllm import BeamSearchParams, testing


def reference_beams(model, prompt: list[int], k: int, max_tokens: int, eos: int | None, length_penalty: float):
    """transformers' k returned beams: (generated token ids, score), best first."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k, do_sample=False,
            early_stopping=True, length_penalty=length_penalty, max_new_tokens=max_tokens,
            eos_token_id=eos, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )
    if k == 1:  # transformers runs greedy search: one unpadded sequence, scored by its own log-probs
        tokens = out.sequences[0, len(prompt):]
        logprobs = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(out.scores, tokens)])
        return [(tokens.tolist(), logprobs.sum().item() / len(tokens) ** length_penalty)]
    lengths = (out.beam_indices + 1).bool().sum(dim=1).tolist()  # generated tokens of each returned beam
    return [(seq[len(prompt):len(prompt) + n].tolist(), score)
            for seq, n, score in zip(out.sequences, lengths, out.sequences_scores.tolist())]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("with_eos", [False, True])
def test_beam_search_matches_transformers(make_llm, tiny_llama_reference, k, with_eos):
    llm = make_llm(num_kv_blocks=64)
    copies = []
    copy_blocks = llm.engine.engine_core.executor.copy_blocks
    llm.engine.engine_core.executor.copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    ended_early = False
    for prompt in testing.random_prompts(2, 320, min_len=5, max_len=30, seed=k):
        eos = None
        if with_eos:
            # The random model rarely says EOS: make the token its greedy run emits third the EOS.
            eos = testing.reference_greedy(tiny_llama_reference, prompt, 3)[-1]
            llm.engine.engine_core.scheduler.eos_token_ids = {eos}
        params = BeamSearchParams(beam_width=k, max_tokens=10, ignore_eos=not with_eos, length_penalty=0.7)
        ours = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
        theirs = reference_beams(tiny_llama_reference, prompt, k, 10, eos, 0.7)
        assert [s.tokens[len(prompt):] for s in ours] == [tokens for tokens, _ in theirs]
        assert [s.score for s in ours] == pytest.approx([score for _, score in theirs], abs=1e-4)
        ended_early |= any(len(s.tokens) - len(prompt) < 10 for s in ours)
    assert ended_early == with_eos
    # Beams fork on shared blocks: each partial last block written by two beams is copied first.
    assert bool(copies) == (k > 1)
    testing.assert_all_blocks_free(llm)
