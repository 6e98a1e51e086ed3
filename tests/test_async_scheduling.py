"""Async scheduling: step n+1 is scheduled and launched before step n's tokens are read back.

The token each decoding request needs next is taken from the previous step's output on the
device, so outputs lag one step; tokens, stop conditions and cache use stay the same.
"""

import threading

import pytest

from hookllm import SamplingParams, hookimpl, testing

PROMPT = "Paris is the capital of"


def test_each_step_reports_the_tokens_of_the_step_before(make_llm):
    engine = make_llm(async_scheduling=True).engine
    engine.add_request("0", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched, its token not read yet
    lengths = []
    while engine.has_unfinished_requests():
        lengths += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert lengths == [1, 2, 3]


def test_async_outputs_equal_sync_outputs(make_llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (1, 5, 9)]
    prompts = [PROMPT, "The", "A long time ago in a galaxy"]
    sync = make_llm(async_scheduling=False).generate(prompts, params)
    async_ = make_llm(async_scheduling=True).generate(prompts, params)
    for a, b in zip(sync, async_):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_no_token_is_computed_past_max_tokens(make_llm):
    llm = make_llm(async_scheduling=True)
    batches = testing.record_batches(llm.engine)
    prompt_ids = llm.tokenizer(PROMPT)["input_ids"]
    llm.generate({"prompt_token_ids": prompt_ids}, testing.greedy(6))
    # The last output token is sampled, never fed back: prompt + 5 tokens run through the model.
    assert sum(b.total_num_tokens for b in batches) == len(prompt_ids) + 5
    testing.assert_all_blocks_free(llm)


def test_a_request_stopped_while_a_step_is_in_flight_drops_that_steps_token(make_llm):
    llm = make_llm(async_scheduling=True)
    free_run = llm.generate(PROMPT, testing.greedy(12))[0].outputs[0].token_ids
    stop_id = free_run[3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == free_run[: free_run.index(stop_id) + 1]
    assert not llm.engine.engine_core.scheduler.requests
    testing.assert_all_blocks_free(llm)


class OverlapProbe:
    """A plugin whose logits job does nothing but, off the runner's thread, wait until the engine
    has scheduled the step after the job's own: it can only return if the job overlaps that work."""

    def __init__(self, engine):
        self.scheduled = 0
        self.changed = threading.Condition()
        self.runner_thread = threading.get_ident()
        self.overlapped: list[bool] = []  # per job run off the runner's thread
        schedule = engine.engine_core.scheduler.schedule

        def counting():
            batch = schedule()
            with self.changed:
                self.scheduled += 1
                self.changed.notify_all()
            return batch

        engine.engine_core.scheduler.schedule = counting

    @hookimpl
    def start_logits_job(self, batch):
        return ProbeJob(self, self.scheduled)


class ProbeJob:
    def __init__(self, probe: OverlapProbe, scheduled: int):
        self.probe, self.scheduled = probe, scheduled

    def run(self):
        probe = self.probe
        if threading.get_ident() != probe.runner_thread and all(probe.overlapped):  # one timeout is enough
            with probe.changed:
                probe.overlapped.append(probe.changed.wait_for(lambda: probe.scheduled > self.scheduled, timeout=10))

    def apply(self, logits):
        pass


def test_a_logits_job_runs_while_the_engine_schedules_the_next_step(make_llm):
    llm = make_llm(async_scheduling=True)
    probe = OverlapProbe(llm.engine)
    llm.engine.hooks.pm.register(probe, name="probe")
    llm.generate([PROMPT, "The"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(probe.overlapped) >= 4 and all(probe.overlapped)


class ReadyProbe:
    """Records, per deferred job, on which thread ``tokens_ready`` ran and what happened before it."""

    def __init__(self):
        self.runner_thread = threading.get_ident()
        self.events: list[tuple[str, int]] = []  # (event, job number)
        self.lock = threading.Lock()

    @hookimpl
    def start_logits_job(self, batch):
        if batch.previous is not None:
            return ReadyJob(self, len(self.events))

    def record(self, event: str, job: int) -> None:
        with self.lock:
            self.events.append((event, job))


class ReadyJob:
    def __init__(self, probe: ReadyProbe, number: int):
        self.probe, self.number = probe, number

    def tokens_ready(self):
        self.probe.record("ready" if threading.get_ident() == self.probe.runner_thread else "ready elsewhere",
                          self.number)

    def run(self):
        self.probe.record("run", self.number)

    def apply(self, logits):
        self.probe.record("apply", self.number)


def test_a_logits_jobs_tokens_ready_runs_once_on_the_runners_thread_before_its_step_samples(make_llm):
    llm = make_llm(async_scheduling=True)
    probe = ReadyProbe()
    llm.engine.hooks.pm.register(probe, name="ready-probe")
    llm.generate([PROMPT, "The"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    jobs = {number for _, number in probe.events}
    assert len(jobs) >= 4
    for job in jobs:
        events = [event for event, number in probe.events if number == job]
        assert sorted(events) == ["apply", "ready", "run"]  # tokens_ready once, on the runner's thread
        assert events[-1] == "apply"


class FailingJob:
    """A plugin whose logits job raises in deferred steps (a step in flight) of requests asking
    it, in ``run`` or in ``tokens_ready`` (``where``)."""

    def __init__(self, where: str):
        self.where = where

    @hookimpl
    def start_logits_job(self, batch):
        if batch.previous is not None and any(r.sampling_params.extra_args.get("explode")
                                              for r in batch.sampling_requests):
            return self

    def tokens_ready(self):
        if self.where == "tokens_ready":
            raise RuntimeError("job exploded")

    def run(self):
        if self.where == "run":
            raise RuntimeError("job exploded")

    def apply(self, logits):
        pass


@pytest.mark.parametrize("where", ["run", "tokens_ready"])
def test_a_failing_deferred_step_fails_its_call_and_the_llm_serves_again(make_llm, where):
    llm = make_llm(async_scheduling=True)
    expected = llm.generate(PROMPT, testing.greedy(6))[0].outputs[0].token_ids
    llm.engine.hooks.pm.register(FailingJob(where), name="failing")
    explode = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"explode": True})
    with pytest.raises(RuntimeError, match="job exploded"):
        # The first request finishes just before the failure: the runner must still hear of it.
        llm.generate([PROMPT, "The"], [testing.greedy(1), explode])
    assert llm.generate(PROMPT, testing.greedy(6))[0].outputs[0].token_ids == expected
    testing.assert_all_blocks_free(llm)
    assert not llm.engine.engine_core.executor.runner.requests
