"""``/metrics``' latency histograms measure from a request's arrival at the server: a request that
waits in the queue behind another reports that wait in its time to first token and its
end-to-end latency, bounded by what its client measured.

The server runs one request at a time (``--max-num-seqs 1``). Request A streams until the client
closes it; request B, sent meanwhile, waits in the queue until A is aborted. The client knows B
was waiting by ``t_seen`` (the engine reports it), and A's abort follows ``t_close``: B's first
token cannot come less than ``t_close - t_seen`` after B arrived, and comes before B's client
sees any of it.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import Server, tiny_chat_model

MAX_POSITIONS = 8192  # room for a request A that could not end on its own before the test closes it
A_CHUNKS_AFTER_SEEN = 10  # chunks of A the client reads between seeing B wait and closing A
B_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("metrics-llama"), MAX_POSITIONS)


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "1024",
                     "--max-num-seqs", "1", "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name, labels left out but ``finished_reason``'s."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            samples[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return samples


def wait_until_queued(server: Server, timeout_s: float = 60.0) -> None:
    """Return once the engine reports a waiting request."""
    deadline = time.monotonic() + timeout_s
    for _ in range(10_000):
        if scrape(server)["hookllm:num_requests_waiting"] >= 1:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError("request B never showed as waiting")


def request_b(client: openai.OpenAI, endpoint: str, stream: bool) -> tuple[float, float]:
    """Send request B and take it whole: (seconds to its first chunk, or to the whole answer
    unstreamed; seconds in all)."""
    extra = {"ignore_eos": True}
    sent = time.perf_counter()
    if endpoint == "completions":
        answer = client.completions.create(model="tiny", prompt="Hello there", max_tokens=B_TOKENS, temperature=0,
                                           stream=stream, extra_body=extra)
    elif endpoint == "chat":
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=B_TOKENS, temperature=0, stream=stream, extra_body=extra)
    else:
        answer = client.responses.create(model="tiny", input="Hello", max_output_tokens=B_TOKENS, temperature=0,
                                         stream=stream, extra_body=extra)
    if not stream:
        total = time.perf_counter() - sent
        return total, total
    first = None
    for _ in answer:  # any chunk or event: the server sends none before B's first token
        if first is None:
            first = time.perf_counter() - sent
    return first, time.perf_counter() - sent


@pytest.mark.parametrize("endpoint, stream", [("completions", True), ("chat", False), ("responses", True)])
def test_a_queued_requests_latencies_count_its_wait_in_the_queue(server, client, endpoint, stream):
    a = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=MAX_POSITIONS - 64,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    a_chunks = iter(a)
    next(a_chunks)  # A has its first token, and its time to first token is recorded
    before = scrape(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        b = pool.submit(request_b, client, endpoint, stream)
        wait_until_queued(server)
        seen = time.perf_counter()
        for _ in range(A_CHUNKS_AFTER_SEEN):
            next(a_chunks)
        closed = time.perf_counter()
        a.close()
        client_first, client_total = b.result(timeout=120)
    after = scrape(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # A was aborted, not finished: B could start only after the client closed A.
    assert delta("hookllm:request_success_total[abort]") == 1
    assert delta("hookllm:request_success_total[length]") == 1  # B
    assert delta("hookllm:time_to_first_token_seconds_count") == 1
    assert delta("hookllm:e2e_request_latency_seconds_count") == 1
    ttft, e2e = delta("hookllm:time_to_first_token_seconds_sum"), delta("hookllm:e2e_request_latency_seconds_sum")
    waited = closed - seen
    assert waited <= ttft <= client_first
    assert ttft <= e2e <= client_total


def test_time_per_output_token_observations_add_up_to_the_time_from_first_to_last_token(server, client):
    before = scrape(server)
    started = time.perf_counter()
    response = client.completions.create(model="tiny", prompt="1 2 3", max_tokens=B_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    client_total = time.perf_counter() - started
    after = scrape(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    ttft, e2e = delta("hookllm:time_to_first_token_seconds_sum"), delta("hookllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft <= e2e <= client_total
    assert delta("hookllm:time_per_output_token_seconds_sum") == pytest.approx(e2e - ttft, abs=1e-6)
    # One observation per token after the first output's (which may hold more than one).
    assert 0 < delta("hookllm:time_per_output_token_seconds_count") <= response.usage.completion_tokens - 1


VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total[length]",
              "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
              "vllm:e2e_request_latency_seconds_count"]


def test_vllms_metric_names_report_the_same_values_as_hookllms(server, client):
    before = scrape(server)
    client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape(server)
    # By hand: a prompt of 5 token ids, 4 tokens generated, one request ended by its length.
    for prefix in ("hookllm:", "vllm:"):
        assert after[prefix + "prompt_tokens_total"] - before.get(prefix + "prompt_tokens_total", 0) == 5
        assert after[prefix + "generation_tokens_total"] - before.get(prefix + "generation_tokens_total", 0) == 4
        assert (after[prefix + "request_success_total[length]"]
                - before.get(prefix + "request_success_total[length]", 0)) == 1
    assert set(VLLM_NAMES) <= set(after)
    # Every vllm: sample (each histogram's buckets, sum and count too) equals its hookllm: twin;
    # only the creation timestamps differ, by the moments each was made.
    twins = [name for name in after if name.startswith("vllm:") and "_created" not in name]
    assert {name: after[name] for name in twins} == {name: after["hookllm:" + name[len("vllm:"):]] for name in twins}
