"""The GPU benchmarks' CPU-side parts: workloads, physical limits and the charts of the committed results."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module."""
    saved = list(sys.path)  # the script puts benchmarks/ first on the path to import its neighbours
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


@pytest.fixture(scope="module")
def throughput():
    return load_benchmark("throughput")


def test_workload_a_is_unchanged(throughput):
    prompts, max_tokens = throughput.workload_a()
    assert len(prompts) == 256
    assert (sum(map(len, prompts)), sum(max_tokens)) == (142827, 133966)


def test_short_workload_is_seeded_and_in_range(throughput):
    prompts, max_tokens = throughput.random_workload("short")
    assert (prompts, max_tokens) == throughput.random_workload("short")
    assert len(prompts) == len(max_tokens) == 2048
    assert all(32 <= len(p) <= 320 for p in prompts) and all(32 <= n <= 320 for n in max_tokens)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_decode_steps_admit_waiting_requests_as_places_free_up(throughput):
    assert throughput.decode_steps([3, 3, 3], max_batch=3) == 3
    assert throughput.decode_steps([3, 3, 3], max_batch=2) == 6
    assert throughput.decode_steps([5, 1, 1], max_batch=2) == 5


def test_decode_batches_count_the_running_requests_of_each_step(throughput):
    # Two places: requests of 3 and 1 steps start together; the third (1 step) takes the second place at step 1.
    assert throughput.decode_batches([3, 1, 1], max_batch=2) == [2, 2, 1]


def test_an_moe_step_reads_only_the_experts_its_batch_touches(throughput):
    # 4 experts, 2 per token: one token touches 2 of 4; a batch of b, 4 * (1 - (1/2)^b) on average.
    config = dict(hidden_size=8, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                  intermediate_size=16)
    expert_bytes = 2 * 3 * 8 * 16  # gate, up and down of one expert in bf16
    dense = 1000
    total = dense + 4 * expert_bytes
    assert throughput.step_weight_bytes(config, total, 1) == pytest.approx(dense + 2 * expert_bytes)
    assert throughput.step_weight_bytes(config, total, 2) == pytest.approx(dense + 3 * expert_bytes)
    assert throughput.step_weight_bytes({"hidden_size": 8}, total, 1) == total  # dense: every weight


def test_sliding_layers_read_at_most_their_window_of_each_context(throughput):
    config = dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=4, num_attention_heads=1, hidden_size=4,
                  sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    per_token = 2 * 1 * 4 * 2  # K and V, one head of 4, bf16
    # A 2-token prompt decoding 3 tokens reads contexts 2, 3, 4: the full layer all 9, the windowed 2 + 3 + 3.
    assert throughput.kv_bytes_read(config, [[0, 0]], [3]) == per_token * (9 + 8)


def test_physical_limit_reproduces_the_recorded_decode_limits(throughput):
    prompts, max_tokens = throughput.workload_a()
    checked = 0
    for path in BENCHMARKS.glob("results/throughput-*.json"):
        run = json.loads(path.read_text())
        if "physical_limit_inputs" not in run or run.get("workload_name", "a") != "a":
            continue
        if throughput.sliding_layers(throughput.SHAPES[run["model"]]):
            continue  # recorded before the limit capped sliding layers' K/V reads at their window
        limit = throughput.physical_limit(throughput.SHAPES[run["model"]], prompts, max_tokens,
                                          run["physical_limit_inputs"]["weight_bytes"], max_batch=256)
        assert limit["output_tok_s"] == pytest.approx(run["physical_limit_output_tok_s"], rel=1e-9)
        assert limit["output_tok_s_with_prefill"] < limit["output_tok_s"]
        checked += 1
    assert checked >= 3


def test_plots_draw_the_committed_results(tmp_path):
    subprocess.run([sys.executable, str(BENCHMARKS / "plots.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("throughput.png", "step-breakdown.png", "progress.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_sends_an_evenly_spread_fraction_as_chat_requests_with_required_tools(tiny_llama_dir):
    from transformers import AutoTokenizer

    serve = load_benchmark("serve")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))  # no chat template: the script's own
    # Longer than the template and tools (about 800 of this 320-token vocabulary's tokens).
    prompts = [[(37 * i + 11 * j) % len(tokenizer) for j in range(1000 + 50 * i)] for i in range(8)]
    max_tokens = [16 + i for i in range(8)]
    requests = serve.build_requests(prompts, max_tokens, 0.25, tokenizer)
    assert [path for path, _ in requests] == 2 * [serve.COMPLETIONS, serve.COMPLETIONS, serve.COMPLETIONS, serve.CHAT]
    assert requests[:3] == serve.build_requests(prompts[:3], max_tokens[:3])  # the plain ones, as without tools
    for (path, body), prompt, n in zip(requests, prompts, max_tokens):
        assert (body["max_tokens"], body["ignore_eos"], body["stream"]) == (n, True, True)
        if path == serve.COMPLETIONS:
            assert body["prompt"] == prompt
            continue
        assert body["tool_choice"] == "required" and body["chat_template"] == serve.TOOLS_TEMPLATE
        assert [tool["function"]["name"] for tool in body["tools"]] == ["get_weather", "search_flights"]
        # Rendered as the server renders it (template, tools, message), about the prompt's length.
        rendered = serve.chat_prompt_ids(tokenizer, body["messages"][0]["content"], body["chat_template"])
        assert 0.9 * len(prompt) <= len(rendered) <= len(prompt)


def test_sampling_options_reach_every_request_and_name_the_result(throughput):
    from argparse import Namespace

    args = Namespace(top_p=0.9, top_k=50, min_p=None, repetition_penalty=None, presence_penalty=0.5,
                     frequency_penalty=None)
    assert throughput.sampling(args) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "presence_penalty": 0.5}
    # transformers' generate has no presence penalty: the peers run without it.
    assert throughput.peer_sampling(args) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    assert throughput.sampling_suffix(args) == "-top_p0.9-top_k50-presence_penalty0.5"
    assert throughput.sampling_suffix(Namespace()) == ""
