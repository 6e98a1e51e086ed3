"""The start-up warm-up (hookllm.worker.warmup): its steps stay within the engine's limits and meet
every case that shapes a kernel launch, and running them leaves the engine as it was.

On CUDA the worker runs it at start-up; here it is called directly on CPU engines."""

import logging

import pytest

from hookllm import LLM, SamplingParams
from hookllm.engine.arg_utils import EngineArgs
from hookllm.worker.cuda_graph import batch_size_buckets
from hookllm.utils import FlexibleArgumentParser
from hookllm.worker.warmup import PROMPT_LOGPROBS, SAMPLER_PATHS, pooling_warmup_steps, warm_up, warmup_steps

# Small limits keep the warm-up short on the CPU.
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64)
# The 1B shape's: 8192-token budget, 4096 positions, 256 requests.
DEFAULT_SIZES = batch_size_buckets(256)
DEFAULT_STEPS = warmup_steps(8192, 4096, 16, DEFAULT_SIZES)


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("budget, max_model_len, block_size",
                         [(8192, 4096, 16), (48, 64, 16), (24, 20, 32), (8, 4, 16), (8, 2, 16)])
def test_warmup_steps_stay_within_the_token_budget_and_the_model_length(budget, max_model_len, block_size):
    for step in warmup_steps(budget, max_model_len, block_size, batch_size_buckets(256)):
        assert sum(row.query for row in step.rows) <= budget
        for row in step.rows:
            assert row.query >= 1 and row.context >= 0
            # The engine's longest sequence: max_model_len tokens, the last one sampled, never computed.
            assert row.context + row.query + step.then_decode <= max_model_len - 1


def test_warmup_prefills_every_query_tile_fresh_and_after_cached_context():
    longest = [(max(row.query for row in step.rows), step) for step in DEFAULT_STEPS]
    fresh = {next_power_of_two(q) for q, step in longest if all(row.context == 0 for row in step.rows)}
    after_context = {next_power_of_two(q) for q, step in longest if all(row.context > 0 for row in step.rows)}
    tiles = {2 ** k for k in range(1, 13)}  # 2 .. 4096
    assert tiles <= fresh and tiles <= after_context


def test_warmup_runs_eager_steps_of_even_and_odd_token_counts():
    eager = [step for step in DEFAULT_STEPS if max(row.query for row in step.rows) > 1]
    assert {sum(row.query for row in step.rows) % 2 for step in eager} == {0, 1}


def test_warmup_decodes_at_every_batch_size_then_from_the_token_in_flight():
    assert {len(step.rows) for step in DEFAULT_STEPS if step.then_decode} == set(DEFAULT_SIZES)


def test_warmup_decodes_at_power_of_two_sequence_lengths_up_to_the_longest():
    seq_lens = {step.rows[0].context + 1 for step in DEFAULT_STEPS if len(step.rows) == 1 and step.rows[0].query == 1}
    assert {2 ** k for k in range(5, 12)} | {4095} <= seq_lens  # 32 .. 4095: each split of a long context


def test_warmup_runs_every_sampler_path():
    params = [row.params for step in DEFAULT_STEPS for row in step.rows]
    assert all(p in params for p in SAMPLER_PATHS + (PROMPT_LOGPROBS,))


def test_warmup_runs_each_filter_variant_alone_at_both_alignments_of_the_parameter_table():
    # The filter kernel compiles apart for ranks (top-k or top-p) with and without a nucleus and
    # for min-p alone, and for parameter rows 16-byte aligned (a multiple of 4 rows) or not.
    def variant(p):
        return (p.top_k > 0 or p.top_p < 1.0, p.top_p < 1.0)

    filtered = [p for p in SAMPLER_PATHS if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)]
    assert {variant(p) for p in filtered} == {(True, True), (True, False), (False, False)}
    for p in filtered:
        alone = {len(step.rows) % 4 == 0 for step in DEFAULT_STEPS if all(row.params is p for row in step.rows)}
        assert alone == {True, False}


def test_warmup_leaves_no_block_used_no_prefix_cached_and_no_request_in_the_runner(make_llm):
    llm = make_llm(**LIMITS)
    warm_up(llm.engine.engine_core.executor)
    stats = llm.engine.get_stats()
    assert stats.num_used_blocks == 0 and stats.prefix_cache_queries == 0
    assert not llm.engine.engine_core.scheduler.block_manager.cached
    runner = llm.engine.engine_core.executor.runner
    assert not runner.requests and not runner.prompt_logprob_ids and not runner.logits_adjuster.slots


def test_generation_after_the_warmup_equals_an_engine_without_it(make_llm):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=2),  # the engine's generator
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, presence_penalty=0.5, ignore_eos=True)]
    warmed, plain = make_llm(**LIMITS), make_llm(**LIMITS)
    warm_up(warmed.engine.engine_core.executor)

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run(warmed) == run(plain)


def test_warmup_logs_its_step_count_and_time(make_llm, caplog):
    llm = make_llm(**LIMITS)
    with caplog.at_level(logging.INFO, logger="hookllm.worker.warmup"):
        seconds = warm_up(llm.engine.engine_core.executor)
    assert f"steps in {seconds:.2f} s" in caplog.text


def test_a_cpu_engine_starts_without_the_warmup(make_llm):
    assert make_llm(**LIMITS).engine.engine_core.executor.warmup_seconds is None


def test_no_warmup_flag_turns_it_off():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-warmup"])).create_engine_config().warmup is False
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config().warmup is True


@pytest.mark.parametrize("chunks", [True, False], ids=["decoder", "encoder"])
def test_pooling_warmup_pools_whole_prompts_up_to_the_model_length_and_several_together(chunks):
    steps = pooling_warmup_steps(8192, 512, 16, chunks)
    assert all(sum(row.query for row in step.rows) <= 8192 for step in steps)
    fresh = {step.rows[0].query for step in steps if len(step.rows) == 1 and step.rows[0].context == 0}
    assert {2 ** k for k in range(1, 10)} <= fresh  # 2 .. 512: a pooling prompt may fill max_model_len
    assert any(row.context > 0 for step in steps for row in step.rows) == chunks  # an encoder never chunks
    assert max(len(step.rows) for step in steps) > 1


def test_the_pooling_warmup_runs_on_an_encoder_and_leaves_its_embeddings_unchanged(tmp_path):
    from transformers import AutoModel, BertConfig

    from hookllm import testing

    config = BertConfig(vocab_size=testing.WORDPIECE_VOCAB_SIZE, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    testing.build_tiny_checkpoint(config, tmp_path, model_cls=AutoModel)
    testing.build_tiny_wordpiece_tokenizer(tmp_path)
    warmed, plain = (LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=48) for _ in range(2))
    warm_up(warmed.engine.engine_core.executor)
    assert not warmed.engine.engine_core.executor.runner.requests
    texts = ["hello world", "the quick brown fox"]
    assert [o.outputs.embedding for o in warmed.embed(texts)] == [o.outputs.embedding for o in plain.embed(texts)]
