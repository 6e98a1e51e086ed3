"""Speculative decoding on CUDA: verification steps run through the CUDA graphs of steps with
several tokens per request, with async scheduling on; in float32 a request's tokens are those
the engine gives without speculation, greedy or seeded.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu/test_spec_decode_gpu.py``. Skipped without CUDA.
"""

import pytest
import torch

from hookllm import SamplingParams, testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_spec_decode import Oracle, generate, make_engine, oracle_config, spec_counts  # noqa: E402

PROMPTS = testing.random_prompts(16, 320, min_len=20, max_len=300, seed=3)
OPTIONS = dict(device="cuda", dtype="float32", num_kv_blocks=None, gpu_memory_utilization=0.3)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_guessed_tokens_equal_tokens_without_speculation_under_cuda_graphs(small_llama, sampling):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    engine = make_engine(small_llama, None, **OPTIONS)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    Oracle.answers, Oracle.offset, Oracle.fail = {tuple(p): out for p, out in zip(PROMPTS, expected)}, 0, False
    engine = make_engine(small_llama, oracle_config(4), **OPTIONS)
    assert engine.engine_core.executor.runner.cuda_graphs is not None
    outputs, _ = generate(engine, PROMPTS, params)
    drafted, accepted = spec_counts(engine)
    engine.shutdown()
    assert outputs == expected
    assert accepted == drafted > 0


def test_the_target_as_its_own_draft_model_under_cuda_graphs(small_llama):
    """``draft_model`` with the target itself as the draft: the target's steps, the draft's pass
    over each step and its guessing steps replay CUDA graphs (the draft's own); in float32
    nearly every guess holds (one-token and several-token steps may round apart at a near tie)
    and tokens are exact."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    engine = make_engine(small_llama, None, **OPTIONS)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    engine = make_engine(small_llama, {"model": str(small_llama), "num_speculative_tokens": 4}, **OPTIONS)
    proposer = engine.engine_core.executor.runner.spec.proposer
    assert proposer.step_graphs is not None and proposer.guess_graphs is not None
    outputs, _ = generate(engine, PROMPTS, params)
    drafted, accepted = spec_counts(engine)
    engine.shutdown()
    assert outputs == expected
    assert accepted >= 0.9 * drafted > 0


def test_eagle3_guesses_under_cuda_graphs_equal_its_eager_guesses(small_llama, tmp_path):
    """The target's streams are written inside its CUDA graphs: the head guesses as in an
    eager engine, and tokens are exact."""
    from test_spec_eagle3 import RecordingEagle3, build_eagle3_head, recording_engine

    head = build_eagle3_head(small_llama, tmp_path / "head", draft_vocab=200, aux_layers=[0, 2, 3])
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    engine = make_engine(small_llama, None, **OPTIONS)
    expected, _ = generate(engine, PROMPTS, params)
    engine.shutdown()
    records = {}
    for eager in (True, False):
        RecordingEagle3.records, RecordingEagle3.answers = [], {}
        engine = recording_engine(small_llama, head, 4, **OPTIONS, enforce_eager=eager)
        outputs, _ = generate(engine, PROMPTS, params)
        engine.shutdown()
        assert outputs == expected
        records[eager] = sorted(RecordingEagle3.records)
    assert records[True] == records[False]
