"""The runner's persistent batch: rows kept across steps, only block-id changes applied, and
tables that always equal the scheduler's."""

import numpy as np
import torch

from hookllm import SamplingParams, testing
from hookllm.worker.batch import CachedRequestState
from hookllm.worker.input_batch import InputBatch


def state(request_id: str, **params) -> CachedRequestState:
    return CachedRequestState(request_id, [1, 2, 3], 3, SamplingParams(**params))


def rows_of(batch: InputBatch, states: list[CachedRequestState]) -> np.ndarray:
    return batch.rows([s.request_id for s in states], {s.request_id: s for s in states})


def ids(*columns: list[int]) -> np.ndarray:
    """A block update's ids: one list per KV cache group."""
    return np.array(columns, dtype=np.int32)


def device_rows(batch: InputBatch, rows: np.ndarray, width: int) -> list:
    return batch.device_block_tables(torch.from_numpy(rows), width).tolist()


def test_a_request_keeps_its_row_across_steps_and_a_finished_requests_row_is_reused():
    batch = InputBatch(num_groups=1, device=torch.device("cpu"), num_rows=4)
    a, b, c = state("a"), state("b"), state("c")
    rows = rows_of(batch, [a, b])
    assert rows_of(batch, [b, a]).tolist() == rows[::-1].tolist()
    batch.remove("a")
    assert rows_of(batch, [c, b]).tolist() == [rows[0], rows[1]]


def test_a_row_holds_its_requests_sampler_parameters():
    batch = InputBatch(num_groups=1, device=torch.device("cpu"))
    greedy, nucleus = state("greedy", temperature=0.0), state("nucleus", temperature=0.7, top_p=0.9, seed=3)
    rows = rows_of(batch, [nucleus, greedy])
    assert batch.sampler_table[:, rows].T.tolist() == [list(np.float32(nucleus.sampler_row)),
                                                       list(np.float32(greedy.sampler_row))]


def test_block_updates_extend_a_table_and_column_zero_replaces_it():
    batch = InputBatch(num_groups=2, device=torch.device("cpu"))
    rows = rows_of(batch, [state("a"), state("b")])
    batch.apply_device_updates(torch.from_numpy(batch.update_block_tables(rows, [(0, 0, ids([5, 6], [7, 8])),
                                                                              (1, 0, ids([9], [10]))])))
    batch.apply_device_updates(torch.from_numpy(batch.update_block_tables(rows, [(0, 2, ids([11], [12]))])))
    assert batch.num_blocks[rows].tolist() == [3, 1]
    assert device_rows(batch, rows, 3) == [[[5, 6, 11], [9, 0, 0]], [[7, 8, 12], [10, 0, 0]]]
    batch.apply_device_updates(torch.from_numpy(batch.update_block_tables(rows, [(0, 0, ids([1], [2]))])))
    assert batch.num_blocks[rows].tolist() == [1, 1] and device_rows(batch, rows, 1) == [[[1], [9]], [[2], [10]]]


def test_rows_and_columns_grow_keeping_every_entry():
    batch = InputBatch(num_groups=1, device=torch.device("cpu"), num_rows=1, num_columns=4)
    first = rows_of(batch, [state("a")])
    batch.apply_device_updates(torch.from_numpy(batch.update_block_tables(first, [(0, 0, ids([3, 4]))])))
    rows = rows_of(batch, [state("a"), state("b")])  # no free row: the rows double
    wide = list(range(100, 170))
    batch.apply_device_updates(torch.from_numpy(batch.update_block_tables(rows, [(1, 0, ids(wide))])))
    assert device_rows(batch, rows, 70) == [[[3, 4] + [0] * 68, wide]]
    assert (batch.block_table[:, rows, :70] == batch.device_block_table[:, rows, :70].numpy()).all()


def test_the_runners_tables_equal_the_schedulers_through_preemption_and_forks(make_llm):
    llm = make_llm(max_num_batched_tokens=32, num_kv_blocks=12, enable_prefix_caching=True)
    scheduler, runner = llm.engine.engine_core.scheduler, llm.engine.engine_core.executor.runner
    batches = testing.record_batches(llm.engine)
    build_inputs, checked = runner.build_inputs, []

    def checking(batch, scheduler_output):
        inputs = build_inputs(batch, scheduler_output)
        for request_id, row in zip(scheduler_output.request_ids, batch.rows):
            tables = scheduler.block_manager.block_ids(scheduler.requests[request_id])
            assert runner.input_batch.device_block_table[:, row, :len(tables[0])].tolist() == tables
            checked.append(request_id)
        return inputs

    runner.build_inputs = checking
    prompts = testing.random_prompts(12, 320, 10, 60, seed=3)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=1))
    assert checked and any(b.preempted_request_ids for b in batches)
    testing.assert_all_blocks_free(llm)


def test_a_decode_step_sends_only_the_blocks_requests_took(make_llm):
    llm = make_llm()
    batches = testing.record_batches(llm.engine)
    llm.generate([{"prompt_token_ids": p} for p in testing.random_prompts(8, 320, 5, 30, seed=2)],
                 testing.greedy(40))
    decode_steps = [b for b in batches if b.request_ids and set(b.num_scheduled_tokens) == {1}]
    assert decode_steps
    for step in decode_steps:
        for index, first, block_ids in step.block_updates:
            # The token this step writes opens a new block: that block alone is sent.
            assert block_ids.shape[1] == 1 and first == step.num_computed_tokens[index] // 16
    assert sum(len(step.block_updates) for step in decode_steps) < sum(len(step.request_ids) for step in decode_steps)
