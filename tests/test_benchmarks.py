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


def test_physical_limit_reproduces_the_recorded_decode_limits(throughput, monkeypatch):
    from argparse import Namespace

    checked, h200 = 0, (throughput.HBM_BYTES_PER_S, throughput.BF16_FLOP_PER_S)  # the tests run without a GPU
    for path in BENCHMARKS.glob("results/throughput-*.json"):
        run = json.loads(path.read_text())
        if "physical_limit_inputs" not in run or run.get("workload_name", "a") != "a":
            continue
        if throughput.sliding_layers(throughput.SHAPES[run["model"]]):
            continue  # recorded before the limit capped sliding layers' K/V reads at their window
        # The run's workload: its request count, each prompt's n completions counted as sequences.
        n = run.get("sampling", {}).get("n", 1)
        requests = run["results"]["hookllm"]["num_requests"] // n
        prompts, max_tokens = throughput.completions_of(*throughput.workload_a(requests), Namespace(n=n))
        inputs = run["physical_limit_inputs"]
        # The rates of the run's card (the first runs, all on an H200, did not record them).
        monkeypatch.setattr(throughput, "HBM_BYTES_PER_S", inputs.get("hbm_bytes_per_s", h200[0]))
        monkeypatch.setattr(throughput, "BF16_FLOP_PER_S", inputs.get("bf16_flop_per_s", h200[1]))
        limit = throughput.physical_limit(throughput.SHAPES[run["model"]], prompts, max_tokens,
                                          inputs.get("checkpoint_weight_bytes", inputs["weight_bytes"]), max_batch=256,
                                          quantization=run.get("quantization"),
                                          kv_cache_dtype=run.get("kv_cache_dtype", "auto"))
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


def test_the_latency_workload_is_greedy_unless_sampling_options_are_given(throughput):
    from argparse import Namespace

    assert throughput.latency_sampling(Namespace()) == {"temperature": 0.0}
    assert throughput.latency_sampling(Namespace(top_p=0.9)) == {"temperature": 0.6, "top_p": 0.9}


def test_n_completions_count_as_that_many_sequences(throughput):
    from argparse import Namespace

    prompts, max_tokens = [[1, 2], [3]], [5, 7]
    assert throughput.completions_of(prompts, max_tokens, Namespace(n=3)) == (
        [[1, 2]] * 3 + [[3]] * 3, [5, 5, 5, 7, 7, 7])
    assert throughput.completions_of(prompts, max_tokens, Namespace()) == (prompts, max_tokens)


def test_fp8_limit_counts_linear_weights_and_kv_at_one_byte(throughput):
    config = throughput.SHAPES["llama-3.1-8b"]
    h, layers, inter, vocab = 4096, 32, 14336, 128256
    linear = layers * (h * (4096 + 2 * 1024) + 4096 * h + 3 * h * inter)  # q, k, v, o, gate, up, down
    rest = 2 * vocab * h + (2 * layers + 1) * h  # embeddings and lm_head (untied), norms
    bf16 = 2 * (linear + rest)
    assert bf16 == throughput.config_weight_bytes(config)  # every parameter of the model in bf16
    prompts, max_tokens = [[0] * 100], [10]
    plain = throughput.physical_limit(config, prompts, max_tokens, bf16)
    fp8 = throughput.physical_limit(config, prompts, max_tokens, bf16, quantization="fp8", kv_cache_dtype="fp8")
    assert fp8["weight_bytes"] == linear * 1 + rest * 2 and plain["weight_bytes"] == bf16
    assert fp8["kv_bytes_per_token"] * 2 == plain["kv_bytes_per_token"] == layers * 2 * 8 * 128 * 2
    assert fp8["bytes_read"] == 10 * (linear + 2 * rest) + throughput.kv_bytes_read(config, prompts, max_tokens, 1)
    # Prefill: the linear layers' FLOPs at the FP8 rate, attention and lm_head at the bf16 rate.
    linear_flops = 2.0 * linear * 100
    assert fp8["prefill_s"] == pytest.approx((plain["prefill_flops"] - linear_flops) / throughput.BF16_FLOP_PER_S
                                             + linear_flops / throughput.FP8_FLOP_PER_S)
    assert fp8["output_tok_s"] > plain["output_tok_s"]


def test_fp8_runs_name_their_result_files_and_pass_only_the_options_set(throughput):
    from argparse import Namespace

    assert throughput.precision(Namespace(quantization=None, kv_cache_dtype="auto")) == {}
    assert throughput.precision_suffix(Namespace(quantization=None, kv_cache_dtype="auto")) == ""
    both = Namespace(quantization="fp8", kv_cache_dtype="fp8")
    assert throughput.precision(both) == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert throughput.precision_suffix(both) == "-fp8-kvfp8"
    assert throughput.precision_suffix(Namespace(quantization=None, kv_cache_dtype="fp8")) == "-kvfp8"


def test_pooling_compares_embeddings_with_sentence_transformers_on_the_same_texts(tmp_path):
    pooling = load_benchmark("pooling")
    pooling.main(["--tiny", "--num-inputs", "40", "--repeat", "1", "--st-batch-sizes", "16", "--root", str(tmp_path),
                  "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "pooling-tiny-bert.json").read_text())
    assert result["min_cosine_to_sentence_transformers"] > 0.9999
    assert result["hookllm_embeddings_per_s"] > 0 and result["flops_floor_embeddings_per_s"] is None
    assert 40 * 16 <= result["tokens"] <= 40 * 512


def test_pooling_profile_times_the_engine_parts_of_one_call(tmp_path):
    pooling = load_benchmark("pooling")
    pooling.main(["--tiny", "--num-inputs", "40", "--repeat", "1", "--st-batch-sizes", "16", "--profile",
                  "--root", str(tmp_path), "--out", str(tmp_path / "out")])
    profiled = json.loads((tmp_path / "out" / "pooling-tiny-bert.json").read_text())["profile"]
    parts = profiled["host_s_by_part"]
    assert set(parts) == set(pooling.HOST_PARTS) and all(seconds > 0 for seconds in parts.values())
    # Every part runs inside the call (the tokenizer's thread aside: 40 texts are one batch, tokenized in line).
    assert sum(parts.values()) < profiled["wall_s"]
    assert profiled["gpu_busy_s"] == 0 and profiled["top_kernels_s"] == {}  # on the CPU: no CUDA kernels


def test_each_gpu_gets_its_own_rates_unless_the_environment_names_them(monkeypatch):
    common = load_benchmark("common")
    assert common.gpu_rates("NVIDIA H200") == (4.3e12, 790e12)
    assert common.gpu_rates("NVIDIA H100 80GB HBM3") == (3.0e12, 790e12)
    assert common.gpu_rates("NVIDIA H100 PCIe") == (1.8e12, 605e12)
    assert common.gpu_rates("NVIDIA L4") == (4.3e12, 790e12)  # unknown: the H200's
    monkeypatch.setenv("HOOKLLM_BENCH_HBM_BYTES_PER_S", "3e11")
    monkeypatch.setenv("HOOKLLM_BENCH_BF16_FLOP_PER_S", "1.2e14")
    assert common.gpu_rates("NVIDIA L4") == (3e11, 1.2e14)
