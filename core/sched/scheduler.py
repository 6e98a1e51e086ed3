"""Continuous batching: each step, decide how many tokens of which requests to compute.

vLLM v1 style: no separate prefill and decode phases. Running requests go first (a decode is
one token; an unfinished prefill continues its next chunk), then waiting requests are admitted
in arrival order, all under one token budget. When blocks run out, the newest running request
is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed,
or, with ``preemption_mode="swap"``, their contents move to host memory and it resumes later
exactly where it was (before any new request is admitted).

The scheduler owns every change to a request's state: ``schedule`` advances what a step
computes (with async scheduling the step's sampled token is a placeholder until read back),
``update_from_output`` applies the sampled tokens and the stop rules that need no text, and
``finish_request`` ends a request. Requests come in as plain ``EngineCoreRequest``s
(``add_requests``, ``fork``), from which it makes its own :class:`Request`s; others read those
and never write them. A step's batch leaves as a plain :class:`SchedulerOutput`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hookllm.sched.block_manager import BlockManager, HostBlockAllocator
from hookllm.sched.request import Request, RequestStatus
from hookllm.sched.output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from hookllm.engine.core_request import EngineCoreRequest
    from hookllm.spec.config import SpeculativeConfig


class SpecCounts:
    """Drafts verified and accepted since the engine started, for the stats."""

    def __init__(self, num_positions: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_positions

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_blocks: int
    num_blocks: int
    # Prefix caching, in tokens since the engine started: looked up at admission, and found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_swapped_reqs: int = 0
    # LoRA adapters (names) of the running and of the waiting requests (vLLM's lora_requests_info).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # Speculative decoding since the engine started (vLLM's spec_decode counters): steps in which a
    # request verified drafts, the drafts verified, those accepted, and those accepted by position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV cache's blocks held by requests, 0 to 1."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(), preemption_mode: str = "recompute",
                 num_host_blocks: int = 0, pipeline_depth: int = 1, chunked_prefill: bool = True,
                 max_loras: int = 0, speculative_config: SpeculativeConfig | None = None,
                 num_lookahead_tokens: int = 0):
        self.block_manager = block_manager
        # Speculative decoding: a running request's drafts (from the step that sampled its last
        # token) are scheduled after that token; ``update_from_spec_output`` keeps what verified.
        self.speculative_config = speculative_config
        # Slots kept past a speculating step's tokens, where a draft model writes its guesses' K/V.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_counts = SpecCounts(speculative_config.num_speculative_tokens if speculative_config else 0)
        # LoRA: most adapters the running requests may use at once (the worker's slots; 0: no LoRA).
        self.max_loras = max_loras
        # Off for encoders: bidirectional attention needs a prompt's every key in its one step.
        self.chunked_prefill = chunked_prefill
        # Pipeline stages keep ``pipeline_depth`` batches in flight, each of other requests
        # (vLLM's batch queue): a request is scheduled again only once the token its last step
        # sampled is back, and a batch takes its share of the requests, so the next stage's
        # batch has requests of its own.
        self.pipeline_depth = pipeline_depth
        self.await_sampled_tokens = pipeline_depth > 1
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Swapped out (preemption_mode="swap"), first to resume first; their K/V wait in the
        # worker's host cache, in the host blocks the allocator gave them.
        self.preemption_mode = preemption_mode
        self.swapped: deque[Request] = deque()
        self.host_allocator = HostBlockAllocator(num_host_blocks)
        # Finished since the last batch: the runner drops their state when the next batch arrives.
        self.finished_request_ids: list[str] = []
        # Finished requests that keep their blocks for forks (beam search) until released.
        self.retained: dict[str, Request] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_requests(self, request_id: str, core_requests: list[EngineCoreRequest]) -> None:
        """Queue the engine requests of the user's request ``request_id``: itself, or its ``n``
        children, which share the prompt's cached blocks. ``ValueError`` if together they could
        never fit in the cache."""
        requests = [Request.from_core_request(core_request) for core_request in core_requests]
        if not self.chunked_prefill and requests[0].num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"request {request_id}: the input ({requests[0].num_tokens} tokens) is over "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}), and an encoder computes "
                             "a prompt in one step")
        manager = self.block_manager
        needed = manager.blocks_to_fit(requests, self.max_num_batched_tokens)
        if needed > manager.num_blocks:
            first = requests[0]
            if first.pooling_params is not None:
                what = f"the input ({first.max_num_tokens} tokens)"
            elif len(requests) == 1:
                what = f"prompt plus max_tokens ({first.max_num_tokens} tokens)"
            else:
                what = f"n={len(requests)} completions of up to {first.max_num_tokens} tokens"
            raise ValueError(f"request {request_id}: {what} needs {needed} KV blocks, but the cache has only "
                             f"{manager.num_blocks} blocks of {manager.block_size}")
        for request in requests:
            self.add(request)

    def retain_blocks(self, request_id: str) -> None:
        """Keep the request's KV blocks once it finishes, for ``fork``, until ``release``."""
        self.requests[request_id].retain_blocks = True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold KV blocks."""
        if self.has_unfinished() or self.retained:
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def take_finished_request_ids(self) -> list[str]:
        """The requests finished since the last batch, forgotten here: the caller tells the runner."""
        finished, self.finished_request_ids = self.finished_request_ids, []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> SchedulerStats:
        manager = self.block_manager
        stats = SchedulerStats(len(self.running), len(self.waiting),
                               manager.num_blocks - manager.num_free_blocks, manager.num_blocks,
                               self.prefix_cache_queries, self.prefix_cache_hits, len(self.swapped))
        if self.max_loras:
            stats.running_lora_adapters = _adapter_names(self.running)
            stats.waiting_lora_adapters = _adapter_names([*self.waiting, *self.swapped])
        if self.speculative_config is not None:
            counts = self.spec_counts
            stats.spec_num_drafts, stats.spec_num_draft_tokens = counts.num_drafts, counts.num_draft_tokens
            stats.spec_num_accepted_tokens = counts.num_accepted_tokens
            stats.spec_accepted_per_position = list(counts.accepted_per_position)
        return stats

    def speculates(self) -> bool:
        """Whether the next step speculates: proposes drafts after it samples, and verifies the
        drafts of the requests that have them (off while more requests run than
        ``disable_by_batch_size``)."""
        return self.speculative_config is not None and self.speculative_config.speculates(len(self.running))

    def fork(self, parent_id: str, core_request: EngineCoreRequest) -> None:
        """Queue ``core_request``, which continues the retained request ``parent_id``'s computed
        tokens, sharing its KV blocks (a block either later writes into is copied first)."""
        parent = self.retained[parent_id]
        child = Request.from_core_request(core_request)
        child.retain_blocks = parent.retain_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        self.block_manager.fork(parent, child)
        self.add(child)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished request kept for forks; unknown ids pass."""
        request = self.retained.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        # (device, host) and (host, device) block pairs the worker copies before the step runs.
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        limit = self._batch_size_limit()
        speculates = self.speculates()
        spec_token_ids: dict[str, list[int]] = {}

        # A running request has tokens to compute unless a step in flight samples its token (under
        # pipeline stages) or its last one (at its length limit), or it pools and its prompt is
        # computed (it ends when that step's output is read). Checked inline, the methods looked
        # up once: every running request passes here every step.
        running, allocate, awaits = self.running, self.block_manager.allocate_slots, self.await_sampled_tokens
        i = 0
        while i < len(running) and budget > 0 and len(scheduled) < limit:
            request = running[i]
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            if (request.num_computed_tokens >= num_tokens if request.pooling_params is not None
                    else num_tokens >= request.max_num_tokens or (awaits and request.num_output_placeholders)):
                i += 1
                continue
            num_new = min(num_tokens - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts:
                # Its drafts follow its last token, as many as the budget and its length limit
                # leave room for (a step emits up to one token more than it keeps drafts).
                request.spec_token_ids = []
                room = min(budget - num_new, request.max_num_tokens - num_tokens - 1) if speculates else 0
                drafts = drafts[:max(room, 0)]
                num_new += len(drafts)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new) if speculates else 0
            while not allocate(request, num_new, (), lookahead):
                victim = running.pop()  # the newest running request
                self._preempt(victim, swap_out)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                counts.append(num_new)
                if drafts:
                    spec_token_ids[request.request_id] = drafts
                budget -= num_new
                i += 1

        # The adapters of the running requests: a request whose adapter is not among them needs a slot.
        active_loras = ({r.lora_request.lora_int_id for r in running if r.lora_request is not None}
                        if self.max_loras else set())

        # Admitting or resuming work right after a preemption would only thrash the cache. It also
        # means a swapped request resumes at least one step after it was swapped out, so (async
        # scheduling) the token its last step sampled has been read back by then.
        while (not preempted and self.swapped and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) < limit):
            request = self.swapped[0]
            if self._awaits_token(request) or not self._has_lora_slot(request, active_loras):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new) if speculates else 0
            if not self.block_manager.allocate_slots(request, num_new, (), lookahead):
                break
            # In each group, its first blocks take back their K/V from the host; the rest are new.
            for host_ids, device_ids in zip(request.host_block_ids, self.block_manager.live_block_ids(request)):
                swap_in += zip(host_ids, device_ids)
            self.host_allocator.free(request.host_block_ids)
            request.host_block_ids = []
            self._start_running(self.swapped, num_new, scheduled, counts)
            budget -= num_new

        skipped: list[Request] = []  # waiting for a LoRA slot: later requests may go first
        while (not preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs and len(scheduled) < limit):
            request = self.waiting[0]
            if self._awaits_token(request):
                break  # preempted while a step in flight samples its token: it resumes once that is back
            if not self._has_lora_slot(request, active_loras):
                skipped.append(self.waiting.popleft())
                continue
            # A request holding no blocks starts from its longest cached prefix (a fork holds its parent's),
            # unless it asks for prompt logprobs: those read the hidden states of the tokens it computes (as
            # pooling requests do: a pooling engine has no prefix cache).
            looks_up = (self.block_manager.enable_prefix_caching and not self.block_manager.holds_blocks(request)
                        and request.sampling_params.prompt_logprobs is None)
            hits = self.block_manager.find_cached_prefix(request) if looks_up else []
            num_cached = len(hits) * self.block_manager.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            if not self.chunked_prefill and num_new < request.num_tokens - request.num_computed_tokens:
                break  # the whole prompt waits for a step with room for it
            end = request.num_computed_tokens + num_cached + num_new
            lookahead = self._lookahead(request, end) if speculates else 0
            if not self.block_manager.allocate_slots(request, num_new, hits, lookahead):
                break
            if looks_up:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
            request.num_computed_tokens += num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            self._start_running(self.waiting, num_new, scheduled, counts)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return self._commit_step(scheduled, counts, preempted, swap_out, swap_in, spec_token_ids, speculates)

    def _lookahead(self, request: Request, end: int) -> int:
        """Slots a speculating step keeps past a request's first ``end`` tokens: the draft
        model's guesses, which never pass the request's length limit."""
        return max(0, min(self.num_lookahead_tokens, request.max_num_tokens - end))

    def _batch_size_limit(self) -> int:
        """Most requests one batch takes: all it may, or under pipeline stages its share of the
        unfinished ones."""
        if self.pipeline_depth == 1:
            return self.max_num_seqs
        unfinished = len(self.running) + len(self.waiting) + len(self.swapped)
        return max(1, -(-unfinished // self.pipeline_depth))

    def _has_lora_slot(self, request: Request, active_loras: set[int]) -> bool:
        """Whether the request's adapter (if any) runs already or can take a slot; if so it is
        counted in ``active_loras``."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id in active_loras:
            return True
        if len(active_loras) >= self.max_loras:
            return False
        active_loras.add(lora.lora_int_id)
        return True

    def _awaits_token(self, request: Request) -> bool:
        return self.await_sampled_tokens and request.num_output_placeholders > 0

    def _start_running(self, queue: deque[Request], num_new: int, scheduled: list[Request],
                       counts: list[int]) -> None:
        """Move the head of ``queue`` (waiting or swapped) to running, scheduled for ``num_new`` tokens."""
        request = queue.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(request)
        counts.append(num_new)

    def _commit_step(self, scheduled: list[Request], counts: list[int], preempted: list[Request],
                     swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                     spec_token_ids: dict[str, list[int]], speculates: bool) -> SchedulerOutput:
        """Commit the step and return it as data: computed tokens advance now (drafts included,
        until verification says how many stay), each request whose chunk reaches its last token
        gets a placeholder for the token it samples, and the finished request ids and block
        copies are taken."""
        new_requests, new_token_ids, sampling_rows, pooling_rows = [], [], [], []
        computed = [r.num_computed_tokens for r in scheduled]
        for row, (request, count) in enumerate(zip(scheduled, counts)):
            if request.num_synced_tokens == 0:
                new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params, request.mm_items, request.pooling_params,
                                                   request.lora_request))
                request.num_synced_tokens = request.num_prompt_tokens
            known = request.all_token_ids
            new_token_ids.append(known[request.num_synced_tokens:])
            request.num_synced_tokens = len(known)
            request.num_computed_tokens += count
            num_drafts = len(spec_token_ids.get(request.request_id, ())) if spec_token_ids else 0
            if request.num_computed_tokens - num_drafts == len(known) + request.num_output_placeholders:  # num_tokens
                if request.pooling_params is not None:
                    pooling_rows.append(row)  # computed whole: scheduled no more
                else:
                    sampling_rows.append(row)
                    request.num_output_placeholders += 1
        finished = self.take_finished_request_ids()
        return SchedulerOutput(
            new_requests=new_requests,
            request_ids=[r.request_id for r in scheduled],
            num_scheduled_tokens=counts,
            num_computed_tokens=computed,
            new_token_ids=new_token_ids,
            sampling_rows=sampling_rows,
            block_updates=self.block_manager.take_block_updates(scheduled),
            block_copies=self.block_manager.take_copies(),
            finished_request_ids=finished,
            preempted_request_ids=[r.request_id for r in preempted],
            swap_out=swap_out,
            swap_in=swap_in,
            pooling_rows=pooling_rows,
            spec_token_ids=spec_token_ids,
            speculates=speculates,
        )

    def _preempt(self, request: Request, swap_out: list[tuple[int, int]]) -> None:
        """Swap the request out (adding its block pairs to ``swap_out``) when the mode asks and it
        can be, else free its blocks for it to be recomputed from the start."""
        request.spec_token_ids = []  # guesses for a step it no longer runs next
        # Swapped, it keeps only the blocks it reads when it resumes (its computed count stays).
        self.block_manager.free_out_of_window(request)
        live_block_ids = self.block_manager.live_block_ids(request)
        host_block_ids = self._host_blocks_for(request, live_block_ids)
        if host_block_ids is not None:
            for device_ids, host_ids in zip(live_block_ids, host_block_ids):
                swap_out += zip(device_ids, host_ids)
            request.host_block_ids = host_block_ids
            self.block_manager.free(request)  # its computed tokens stay computed
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _host_blocks_for(self, request: Request, live_block_ids: list[list[int]]) -> list[list[int]] | None:
        """Host blocks for a request about to be swapped out (per group, one for each of its
        ``live_block_ids``), or None: it is recomputed instead.

        Only a request holding every block alone is swapped: a shared block (prefix cache, fork)
        must stay on the device for its other holders. A request keeping its blocks for forks
        (beam search) is recomputed too, as a fork needs its blocks on the device.
        """
        blocks = self.block_manager.blocks
        if (self.preemption_mode != "swap" or request.retain_blocks
                or any(blocks[block_id].ref_count > 1 for block_ids in live_block_ids for block_id in block_ids)):
            return None
        return self.host_allocator.allocate([len(block_ids) for block_ids in live_block_ids])

    def update_from_output(self, batch: SchedulerOutput, token_ids: list[int]) -> list[tuple[Request, int]]:
        """Apply a step's sampled tokens (one per ``batch.sampling_rows``, in order): append each,
        then stop on a stop token or EOS (after ``min_tokens``) or at the length limit.

        Returns ``(request, row)`` for each request that took its token; a request finished
        while the step ran (stopped, aborted) drops it.
        """
        updated = []
        for row, request_id in enumerate(batch.sampling_request_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished while this step ran
            request.num_output_placeholders -= 1
            self._append_token(request, token_ids[row])
            updated.append((request, row))
        return updated

    def update_from_spec_output(self, batch: SchedulerOutput, token_ids: list[list[int]],
                                draft_token_ids: list[list[int]]) -> list[tuple[Request, int, int]]:
        """Apply a speculating step's emitted tokens (a list per ``batch.sampling_rows``: the
        drafts the target kept, then the token it drew), in order, each under the stop rules
        as ``update_from_output`` applies them; the rejected drafts' positions count as not
        computed again, and an unfinished request keeps ``draft_token_ids`` for its next step.

        Returns ``(request, row, taken)``: how many of the row's tokens the request took (the
        rest came after a stop).
        """
        updated = []
        verified = batch.spec_token_ids
        for row, request_id in enumerate(batch.sampling_request_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished while this step ran
            request.num_output_placeholders -= 1
            emitted = token_ids[row]
            drafts = verified.get(request_id)
            if drafts:
                accepted = len(emitted) - 1
                request.num_computed_tokens -= len(drafts) - accepted
                self.spec_counts.record(len(drafts), accepted)
            taken = 0
            for token_id in emitted:
                taken += 1
                if self._append_token(request, token_id):
                    break
            else:
                request.spec_token_ids = draft_token_ids[row]
            updated.append((request, row, taken))
        return updated

    def _append_token(self, request: Request, token_id: int) -> bool:
        """Append a sampled token and apply the stop rules; True when it ended the request."""
        request.append_output_token(token_id)
        params = request.sampling_params
        stop_token = token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
        if stop_token and len(request.output_token_ids) >= params.min_tokens:
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            return True
        if len(request.all_token_ids) >= request.max_num_tokens:  # max_tokens or max_model_len
            self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
            return True
        return False

    def finish_pooled(self, batch: SchedulerOutput) -> list[Request]:
        """End the pooling requests whose prompt ``batch`` completed (their output is the step's
        pooled hidden states); returns those still unfinished until now."""
        finished = []
        for row in batch.pooling_rows:
            request = self.requests.get(batch.request_ids[row])
            if request is not None:
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
        return finished

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request (stopped, length or aborted) and free its blocks at once; unknown ids pass."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.host_allocator.free(request.host_block_ids)
            request.host_block_ids = []
        else:
            self.waiting.remove(request)
        request.status = status
        if request.retain_blocks and status is not RequestStatus.FINISHED_ABORTED:
            self.retained[request_id] = request
        else:
            self.block_manager.free(request)
        if request.num_synced_tokens:
            self.finished_request_ids.append(request_id)


def _adapter_names(requests: list[Request]) -> list[str]:
    """The distinct LoRA adapter names of ``requests``, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
