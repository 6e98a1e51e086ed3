"""Scheduler and block manager rules, checked on hand-built requests (no model needed)."""

from hookllm import SamplingParams
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.request import Request, RequestStatus
from hookllm.sched.scheduler import Scheduler


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=100))


def _advance(scheduler, batch):
    """The step ran: each sampling request got token 0."""
    scheduler.update_from_output(batch, [0] * len(batch.sampling_rows))


def test_allocation_rounds_up_to_whole_blocks():
    manager = BlockManager(num_blocks=10, block_size=16)
    r = _request("a", 17)
    assert manager.allocate_slots(r, 17) and manager.block_ids(r) == [[0, 1]]  # one KV cache group: one table
    manager.free(r)
    assert manager.num_free_blocks == 10 and manager.block_ids(r) == []


def updates_as_lists(updates) -> list[tuple[int, int, list[list[int]]]]:
    return [(index, first, ids.tolist()) for index, first, ids in updates]


def test_block_updates_send_a_whole_table_once_then_only_the_blocks_taken_since():
    manager = BlockManager(num_blocks=40, block_size=16)
    a, b = _request("a", 20), _request("b", 100)
    manager.allocate_slots(a, 20)
    manager.allocate_slots(b, 100)
    assert updates_as_lists(manager.take_block_updates([b, a])) == [(0, 0, manager.block_ids(b)),
                                                                    (1, 0, manager.block_ids(a))]
    assert manager.take_block_updates([b, a]) == []  # nothing changed
    a.num_computed_tokens = 20
    manager.allocate_slots(a, 20)  # grows a's row in place: one more block
    assert updates_as_lists(manager.take_block_updates([b, a])) == [(1, 2, [manager.block_ids(a)[0][2:]])]


def test_block_updates_start_over_for_a_reused_row():
    manager = BlockManager(num_blocks=40, block_size=16)
    a = _request("a", 40)
    manager.allocate_slots(a, 40)
    manager.take_block_updates([a])
    row = a.block_table_row
    manager.free(a)
    c = _request("c", 5)
    manager.allocate_slots(c, 5)
    assert c.block_table_row == row
    assert updates_as_lists(manager.take_block_updates([c])) == [(0, 0, manager.block_ids(c))]


def test_block_updates_resend_a_table_from_a_block_copied_on_write():
    manager = BlockManager(num_blocks=40, block_size=16)
    parent, child = _request("parent", 20), _request("child", 20)
    manager.allocate_slots(parent, 20)
    parent.num_computed_tokens = child.num_computed_tokens = 20
    manager.fork(parent, child)
    manager.take_block_updates([parent, child])
    # The child writes into the shared second block: it gets a copy of it, which the runner must read.
    assert manager.allocate_slots(child, 1) and manager.take_copies()
    assert updates_as_lists(manager.take_block_updates([parent, child])) == [(1, 1, [manager.block_ids(child)[0][1:]])]


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    manager = BlockManager(num_blocks=2, block_size=16)
    r = _request("a", 40)
    assert not manager.allocate_slots(r, 40)
    assert manager.block_ids(r) == [] and manager.num_free_blocks == 2


def test_token_budget_chunks_a_long_prefill():
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=50)
    r = _request("a", 120)
    scheduler.add(r)
    chunks = []
    while r.num_computed_tokens < 120:
        batch = scheduler.schedule()
        chunks.append(batch.num_scheduled_tokens[0])
        assert batch.sampling_request_ids == (["a"] if r.num_computed_tokens == 120 else [])
        _advance(scheduler, batch)
    assert chunks == [50, 50, 20]


def test_decodes_and_a_new_prefill_share_one_batch():
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64)
    a = _request("a", 10)
    scheduler.add(a)
    _advance(scheduler, scheduler.schedule())
    b = _request("b", 30)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.request_ids == ["a", "b"] and batch.num_scheduled_tokens == [1, 30]


def test_running_out_of_blocks_preempts_the_newest_request():
    scheduler = Scheduler(BlockManager(4, 16), max_num_seqs=8, max_num_batched_tokens=256)
    old, new = _request("old", 32), _request("new", 31)
    scheduler.add(old)
    scheduler.add(new)
    _advance(scheduler, scheduler.schedule())  # 2 + 2 blocks: the cache is full
    batch = scheduler.schedule()  # old needs a third block for its decode
    assert batch.preempted_request_ids == ["new"] and batch.request_ids == ["old"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert scheduler.block_manager.block_ids(new) == []
    assert scheduler.waiting[0] is new  # requeued first, to be recomputed


def test_finishing_frees_blocks_immediately():
    manager = BlockManager(8, 16)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=256)
    r = _request("a", 40)
    scheduler.add(r)
    scheduler.schedule()
    assert manager.num_free_blocks == 5
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == 8 and not scheduler.has_unfinished()


def test_max_num_seqs_leaves_the_rest_waiting():
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(4):
        scheduler.add(_request(str(i), 5))
    batch = scheduler.schedule()
    assert batch.request_ids == ["0", "1"] and len(scheduler.waiting) == 2


def _lora_request(rid: str, adapter: int | None) -> Request:
    from hookllm.lora.request import LoRARequest

    request = _request(rid, 8)
    request.lora_request = None if adapter is None else LoRARequest(f"adapter-{adapter}", adapter, "/adapters")
    return request


def test_a_request_whose_adapter_has_no_slot_waits_while_later_ones_run():
    scheduler = Scheduler(BlockManager(num_blocks=40, block_size=16), max_num_seqs=8, max_num_batched_tokens=64,
                          max_loras=1)
    for request in (_lora_request("x", 1), _lora_request("y", 2), _lora_request("base", None),
                    _lora_request("x2", 1)):
        scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.request_ids == ["x", "base", "x2"]  # adapter 2 has no slot while adapter 1 runs
    assert [r.request_id for r in scheduler.waiting] == ["y"]
    assert (scheduler.stats().running_lora_adapters, scheduler.stats().waiting_lora_adapters) == (
        ["adapter-1"], ["adapter-2"])
    _advance(scheduler, batch)
    for request_id in ("x", "x2"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().request_ids == ["base", "y"]  # the slot is free: adapter 2 runs


def test_a_speculating_step_keeps_slots_ahead_for_a_draft_models_guesses():
    """With a draft model (``num_lookahead_tokens``), a request's blocks hold k tokens past the
    step's, within its length limit; the prefix cache registers only computed blocks."""
    from hookllm.spec.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=4)
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, speculative_config=spec,
                          num_lookahead_tokens=4)
    a = _request("a", 8)
    near_limit = Request("b", list(range(7)), SamplingParams(max_tokens=2), max_num_tokens=9)
    scheduler.add(a)
    scheduler.add(near_limit)
    scheduler.schedule()
    assert [len(ids) for ids in manager.block_ids(a)] == [3]  # 8 + 4 slots
    assert [len(ids) for ids in manager.block_ids(near_limit)] == [3]  # 7 + 2: its limit
    assert a.num_registered_blocks == 2
