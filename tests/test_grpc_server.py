"""``hookllm serve --grpc-port``: vLLM's gRPC engine service beside the HTTP server, on one engine.

A client built from the repository's proto (``hookllm.grpc_client``) against a running server on
127.0.0.1: tokens equal ``LLM.generate``'s, cancelled and expired calls abort their requests, each
refused field and limit is a status naming it, and the server keeps serving. One server with both
front ends serves most of the module; a gRPC-only one the limits and
the graceful stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import signal
import subprocess
import sys
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from hookllm import LLM, SamplingParams
from hookllm.grpc import generate as grpc_generate
from hookllm.grpc import vllm_engine_pb2 as pb2
from hookllm.grpc_client import AsyncGrpcClient, GrpcClient, generate_request
from hookllm.sampling_params import StructuredOutputsParams
from server_fixtures import HOST, Server, free_port, with_chat_template

MAX_MODEL_LEN = 96
NUM_KV_BLOCKS = 64
PROMPTS = [[5, 17, 42, 9], [3, 3, 8, 100, 7, 12]]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS),
               "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
               max_model_len=MAX_MODEL_LEN, plugins=["structured"])


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    grpc_port = free_port()
    server = Server([str(tiny_llama_dir), *ENGINE_ARGS, "--grpc-port", str(grpc_port)])
    server.grpc_target = f"{HOST}:{grpc_port}"
    yield server
    assert server.stop() == 0


@pytest.fixture
def client(server):
    with GrpcClient(server.grpc_target, timeout=DEADLINE_S) as client:
        yield client


def expected_tokens(offline: LLM, prompts: list, **sampling) -> list[list[int]]:
    outputs = offline.generate([{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts],
                               SamplingParams(**sampling), use_tqdm=False)
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def wait_until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# What each grpcio-tools release writes of its own version (the rest must match exactly).
GENERATOR_VERSION = re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)|"
                               r"# Protobuf Python Version: \S+|GRPC_GENERATED_VERSION = '[^']*'")


def test_the_committed_modules_are_what_the_proto_generates(tmp_path):
    for path in grpc_generate.generate(tmp_path):
        generated, committed = (GENERATOR_VERSION.sub("", p.read_text()) for p in (path, grpc_generate.HERE / path.name))
        assert generated == committed, f"{path.name} is stale: run python -m hookllm.grpc.generate"


def test_greedy_tokens_equal_llm_generate_without_streaming(client, offline):
    assert [client.generate(p, **GREEDY)[0].output_ids for p in PROMPTS] == expected_tokens(offline, PROMPTS, **GREEDY)


def test_streamed_chunks_add_up_to_the_complete_message_and_to_llm_generate(client, offline):
    responses = list(client.stream(PROMPTS[1], **GREEDY))
    chunks, [complete] = [r.chunk for r in responses[:-1]], [r.complete for r in responses[-1:]]
    assert all(r.HasField("chunk") for r in responses[:-1]) and responses[-1].HasField("complete")
    assert [t for chunk in chunks for t in chunk.token_ids] == list(complete.output_ids)
    assert list(complete.output_ids) == expected_tokens(offline, PROMPTS[1:], **GREEDY)[0]
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 6, 8)


def test_a_text_prompt_is_tokenized_by_the_server(client, offline):
    assert client.generate("The capital of France", **GREEDY)[0].output_ids == \
        expected_tokens(offline, ["The capital of France"], **GREEDY)[0]


def test_n_3_seeded_gives_each_choice_as_llm_generate(client, offline):
    sampling = dict(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    assert [c.output_ids for c in client.generate(PROMPTS[0], **sampling)] == \
        expected_tokens(offline, PROMPTS[:1], **sampling)


def test_a_regex_constraint_goes_through_the_structured_plugin(client, offline):
    done = client.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=3, regex="[0-9]{3}")[0]
    expected = offline.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")),
        use_tqdm=False)[0].outputs[0]
    assert list(done.output_ids) == list(expected.token_ids) and done.finish_reason == "stop"


def test_the_async_client_streams_as_the_blocking_one(server, client):
    async def streamed() -> list[int]:
        async with AsyncGrpcClient(server.grpc_target, timeout=DEADLINE_S) as aclient:
            return [t async for r in aclient.stream(PROMPTS[0], **GREEDY) for t in r.chunk.token_ids]

    assert asyncio.run(streamed()) == list(client.generate(PROMPTS[0], **GREEDY)[0].output_ids)


def test_health_reflection_model_and_server_info(server, client):
    channel = grpc.insecure_channel(server.grpc_target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "vllm.grpc.engine.VllmEngine"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_S).status == \
            health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=DEADLINE_S)
    names = {s.name for s in next(listing).list_services_response.service}
    assert {"vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    channel.close()
    assert client.health_check().healthy
    info = client.model_info()
    assert (info.is_generation, info.max_context_length, info.vocab_size, info.supports_vision) == \
        (True, MAX_MODEL_LEN, 320, False)
    assert client.server_info().server_type == "vllm-grpc"


def running_requests(client: GrpcClient) -> int:
    return client.server_info().active_requests


def test_a_client_that_cancels_mid_stream_aborts_its_request(client):
    call = client.stream(PROMPTS[0], max_tokens=80, temperature=0.0, ignore_eos=True)
    next(call)
    assert running_requests(client) == 1
    call.cancel()
    wait_until(lambda: running_requests(client) == 0, "the cancelled request to leave the engine")


def test_an_expired_deadline_aborts_the_request(server, client):
    request = dict(max_tokens=80, temperature=0.0, ignore_eos=True, min_tokens=80)
    start = time.monotonic()
    list(client.stream(PROMPTS[0], **request))
    # The deadline falls a third of the way into the same request, however fast this machine runs it.
    with GrpcClient(server.grpc_target, timeout=(time.monotonic() - start) / 3) as hasty:
        code, _ = status_of(lambda: list(hasty.stream(PROMPTS[0], **request)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: running_requests(client) == 0, "the expired request to leave the engine")


def test_the_abort_rpc_ends_the_stream_with_finish_reason_abort(client):
    call = client.stream(PROMPTS[0], request_id="abort-me", max_tokens=80, temperature=0.0, ignore_eos=True)
    assert next(call).HasField("chunk")
    client.abort(["abort-me"])
    assert [r.complete.finish_reason for r in call if r.HasField("complete")] == ["abort"]


REFUSED = {
    "logprobs": (dict(logprobs=2), "sampling_params.logprobs"),
    "prompt_logprobs": (dict(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    "structural_tag": (dict(structural_tag="{}"), "sampling_params.structural_tag"),
    "json_object_false": (dict(json_object=False), "sampling_params.json_object"),
    "spaces_between_special_tokens": (dict(spaces_between_special_tokens=True), "spaces_between_special_tokens"),
    "top_p_out_of_range": (dict(top_p=1.5), "top_p must be in"),
    "max_tokens_zero": (dict(max_tokens=0), "max_tokens must be >= 1"),
    "truncate_zero": (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_sampling_field_is_invalid_argument_naming_it(client, case):
    sampling, named = REFUSED[case]
    code, details = status_of(lambda: client.generate(PROMPTS[0], **sampling))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and named in details


def test_an_empty_prompt_is_invalid_argument(client):
    assert status_of(lambda: client.generate([], max_tokens=4)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest.tokenized: the prompt is empty")


def test_a_request_without_input_is_invalid_argument(client):
    code, details = status_of(lambda: list(client.stub.Generate(pb2.GenerateRequest(request_id="x"))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest.input" in details


def test_a_token_id_past_the_vocabulary_is_invalid_argument(client):
    code, details = status_of(lambda: client.generate([5, 320], max_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "input_ids[1] = 320" in details


def test_a_prompt_past_the_context_is_resource_exhausted(client):
    code, details = status_of(lambda: client.generate([5] * MAX_MODEL_LEN, max_tokens=4))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{MAX_MODEL_LEN} tokens" in details


def test_prompt_and_max_tokens_past_the_context_are_resource_exhausted(client):
    code, details = status_of(lambda: client.generate([5] * 90, max_tokens=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokens 10" in details


def test_a_malformed_message_is_invalid_argument(server):
    channel = grpc.insecure_channel(server.grpc_target)
    raw = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
    code, details = status_of(lambda: list(raw(b"\x0a\xff\xff", timeout=DEADLINE_S)))
    channel.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed GenerateRequest" in details


def test_a_field_number_the_proto_lacks_is_invalid_argument(server):
    unknown_field_99 = b"\x98\x06\x01"  # field 99, varint 1, inside sampling_params (field 4)
    data = generate_request(PROMPTS[0], max_tokens=4).SerializeToString() + b"\x22" + bytes(
        [len(unknown_field_99)]) + unknown_field_99
    channel = grpc.insecure_channel(server.grpc_target)
    code, details = status_of(lambda: list(channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")(
        data, timeout=DEADLINE_S)))
    channel.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest.sampling_params sets field number 99" in details


def test_a_method_hookllm_lacks_is_unimplemented(server, client):
    channel = grpc.insecure_channel(server.grpc_target)
    code, _ = status_of(lambda: channel.unary_unary("/vllm.grpc.engine.VllmEngine/Tokenize")(b"", timeout=DEADLINE_S))
    channel.close()
    assert code == grpc.StatusCode.UNIMPLEMENTED
    code, details = status_of(lambda: client.stub.Embed(pb2.EmbedRequest(), timeout=DEADLINE_S))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "not an embedding model" in details


def test_http_and_grpc_interleaved_give_what_each_gives_alone(server, client, offline):
    http = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)

    def over_http(prompt: list[int]) -> str:
        return http.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text

    def over_grpc(prompt: list[int]) -> list[int]:
        return list(client.generate(prompt, **GREEDY)[0].output_ids)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, p) for p in PROMPTS for call in (over_http, over_grpc)]
        answers = [f.result(DEADLINE_S) for f in futures]
    alone = offline.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    assert answers == [x for o in alone for x in (o.outputs[0].text, list(o.outputs[0].token_ids))]


def test_grpc_calls_are_counted_in_the_http_metrics(server, client):
    client.generate(PROMPTS[0], max_tokens=2)
    status_of(lambda: client.generate([], max_tokens=2))
    assert server.metric("hookllm:grpc_requests_total", 'method="Generate"') >= 1
    assert server.metric("hookllm:grpc_requests_total", 'code="INVALID_ARGUMENT"') >= 1
    assert server.metric("vllm:generation_tokens_total") >= 2


@pytest.fixture(scope="module")
def grpc_only(tiny_llama_dir):
    """``--no-http``: at most 2 calls in flight and 1 KiB messages."""
    port = free_port()
    command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve", str(tiny_llama_dir), *ENGINE_ARGS,
               "--host", HOST, "--grpc-port", str(port), "--no-http", "--grpc-max-concurrent-rpcs", "2",
               "--grpc-max-message-bytes", "1024", "--shutdown-timeout", "20", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = GrpcClient(f"{HOST}:{port}", timeout=DEADLINE_S)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                client.health_check()
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the gRPC-only server did not start"
                time.sleep(0.25)
        yield process, client
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
        process.wait(30)


def test_a_constraint_the_structured_plugin_refuses_is_invalid_argument(grpc_only):
    _, client = grpc_only  # hookllm serve enables the structured plugin where it is installed
    code, details = status_of(lambda: client.generate(PROMPTS[0], max_tokens=4, json_schema="{not json"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "json" in details.lower()
    assert client.generate(PROMPTS[0], max_tokens=2)[0].completion_tokens == 2  # still serving


def test_a_message_past_the_size_limit_is_resource_exhausted(grpc_only):
    _, client = grpc_only
    code, _ = status_of(lambda: client.generate([100_000 % 320] * 700, max_tokens=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate(PROMPTS[0], max_tokens=2)[0].completion_tokens == 2  # still serving


def test_calls_past_the_concurrency_limit_are_resource_exhausted(grpc_only):
    _, client = grpc_only
    # Two long calls fill the limit. On a busy machine the server may finish one (its responses
    # wait, unread, in the client's transport) before the third call arrives, which then runs:
    # that try proves nothing and is made again. With no limit, every try would run.
    for _ in range(5):
        calls = [client.stream(PROMPTS[0], max_tokens=MAX_MODEL_LEN - len(PROMPTS[0]), temperature=0.0,
                               ignore_eos=True) for _ in range(2)]
        for call in calls:
            next(call)
        try:
            client.generate(PROMPTS[0], max_tokens=2)
            code = None
        except grpc.RpcError as error:
            code = error.code()
        for call in calls:
            call.cancel()
        wait_until(lambda: no_requests_left(client), "the cancelled requests to leave")
        if code is not None:
            break
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def no_requests_left(client: GrpcClient) -> bool:
    """Whether the engine runs no request; False while the server still counts the cancelled calls
    against its limit (it refuses this one then)."""
    try:
        return client.server_info().active_requests == 0
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False


def test_chat_over_grpc_renders_and_decodes_with_the_tokenizer(grpc_only, tiny_llama_dir, offline, tmp_path):
    _, client = grpc_only
    templated = with_chat_template(tiny_llama_dir, tmp_path / "templated")
    result = subprocess.run([sys.executable, "-m", "hookllm.entrypoints.cli", "chat", "--grpc", client.target,
                             "--tokenizer", str(templated), "--max-tokens", "6", "Hello"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(templated)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    [tokens] = expected_tokens(offline, [prompt], max_tokens=6, temperature=0.0)
    assert result.stdout == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"


def test_sigterm_lets_the_call_in_flight_finish_then_the_server_exits_0(grpc_only):
    process, client = grpc_only
    call = client.stream(PROMPTS[0], max_tokens=60, temperature=0.0, ignore_eos=True)
    next(call)
    process.send_signal(signal.SIGTERM)
    assert [r.complete.completion_tokens for r in call if r.HasField("complete")] == [60]
    assert process.wait(60) == 0
