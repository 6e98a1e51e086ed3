"""What ``hookllm generate`` and ``hookllm serve`` log: the start-up summary at info level, the
``hookllm`` logger tree at ``--log-level`` / ``HOOKLLM_LOGGING_LEVEL`` (plugins' loggers under it
included, in the server's engine process too), and each request's end only with
``--enable-log-requests`` at debug level."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import openai
import pytest

from hookllm.entrypoints.cli import main
from server_fixtures import Server

DOCS = Path(__file__).resolve().parents[1] / "docs"
CPU_KV_CACHE_BYTES = 1 << 20
MAX_TOKENS = 4


@pytest.fixture(autouse=True)
def hookllm_logging_restored():
    """The CLI run in this process sets the ``hookllm`` logger up: leave it as it was for other tests."""
    logger = logging.getLogger("hookllm")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def summary(text: str) -> dict[str, str]:
    """The start-up summary's ``name: value`` lines, from the line saying the engine is ready."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("engine ready"))
    rows = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        name, _, value = line.strip().partition(":")
        rows[name] = value.strip()
    return rows


def generate(model: Path, *flags: str) -> int:
    return main(["generate", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--no-chat",
                 "--max-tokens", "2", "--cpu-kv-cache-bytes", str(CPU_KV_CACHE_BYTES), *flags, "Hello"])


def test_generate_at_info_logs_the_startup_summary_with_the_engines_settings(tiny_llama_dir, capsys):
    assert generate(tiny_llama_dir, "--log-level", "info", "--max-num-seqs", "3") == 0
    rows = summary(capsys.readouterr().err)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # A block holds K and V of 16 tokens in every layer, in float32 (4 bytes).
    block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 16 * 4
    blocks = CPU_KV_CACHE_BYTES // block_bytes
    assert rows["model"] == str(tiny_llama_dir)
    assert rows["architecture"] == config["architectures"][0] == "LlamaForCausalLM"
    assert rows["plugin"] == "llama"  # the bundled adapter of the Llama family
    assert "llama" in rows["active_plugins"].split(", ")
    assert (rows["dtype"], rows["device"], rows["kv_cache_dtype"]) == ("float32", "cpu", "float32")
    assert (int(rows["kv_cache_blocks"]), int(rows["kv_cache_tokens"]), int(rows["block_size"])) == (
        blocks, blocks * 16, 16)
    assert int(rows["max_model_len"]) == config["max_position_embeddings"]
    assert (int(rows["max_num_seqs"]), int(rows["max_num_batched_tokens"])) == (3, 8192)
    assert int(rows["tensor_parallel_size"]) == 1
    assert rows["quantization"] == "none"
    assert rows["cuda_graphs"] == "not used"  # CPU
    assert re.fullmatch(r"\d+\.\d\d s \(load_model .*\)", rows["load_time"])


def test_the_startup_summary_names_the_quantization_method_and_its_numeric_path(tiny_llama_dir, capsys):
    assert generate(tiny_llama_dir, "--log-level", "info", "--quantization", "fp8") == 0
    line = summary(capsys.readouterr().err)["quantization"]
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    # Per decoder layer: the fused q/k/v projection, o_proj, the fused gate/up projection, down_proj.
    assert line.startswith("fp8: FP8 e4m3 weights quantized at load, scaled per channel")
    assert re.search(rf"; {4 * layers} linear layers on the (w8a8|weight-only) path$", line)


def test_hookllm_logging_level_sets_the_level_without_the_flag(tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setenv("HOOKLLM_LOGGING_LEVEL", "warning")
    assert generate(tiny_llama_dir) == 0
    assert "engine ready" not in capsys.readouterr().err
    assert generate(tiny_llama_dir, "--log-level", "info") == 0  # the flag wins
    assert "engine ready" in capsys.readouterr().err


def test_an_unknown_hookllm_logging_level_is_an_error_naming_it(tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setenv("HOOKLLM_LOGGING_LEVEL", "loud")
    assert generate(tiny_llama_dir) == 2
    assert "HOOKLLM_LOGGING_LEVEL: 'loud' is not a log level" in capsys.readouterr().err


def docs_latency_plugin() -> str:
    """The request_completed example of docs/plugins.md, as written there."""
    text = (DOCS / "plugins.md").read_text()
    example = text[text.index("A plugin that logs each request's latency:"):]
    return example.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The docs' example as an installed plugin named ``latency`` (module plus dist-info)."""
    site = tmp_path_factory.mktemp("site")
    (site / "latency_plugin.py").write_text(docs_latency_plugin())
    dist_info = site / "latency_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: latency-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[hookllm.plugins]\nlatency = latency_plugin\n")
    return site


@pytest.fixture(scope="module")
def served(tiny_llama_dir, plugin_site):
    """``serve(*flags)``: what a server with ``flags`` and the latency plugin printed while it
    answered one completion, with that completion and the seconds its client waited (one server
    per set of flags, in this module)."""
    runs: dict[tuple[str, ...], tuple[str, openai.types.Completion, float]] = {}

    def serve(*flags: str) -> tuple[str, openai.types.Completion, float]:
        if flags not in runs:
            with pytest.MonkeyPatch.context() as env:  # the server's processes find the plugin on their path
                env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])))
                env.delenv("HOOKLLM_PLUGINS", raising=False)
                env.delenv("HOOKLLM_LOGGING_LEVEL", raising=False)
                server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                                 "64", "--served-model-name", "tiny", "--plugin", "latency", *flags])
            try:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                started = time.perf_counter()
                completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=MAX_TOKENS,
                                                       temperature=0, extra_body={"ignore_eos": True})
                seconds = time.perf_counter() - started
            finally:
                assert server.stop() == 0
            runs[flags] = (server.process.stdout.read(), completion, seconds)
        return runs[flags]

    return serve


PLUGIN_LINE = re.compile(rf"hookllm\.plugins\.latency: cmpl-\w+-0 length: {MAX_TOKENS} tokens in \d+\.\d+ s")
REQUEST_LINE = re.compile(r"request (cmpl-\w+-0) finished \(length\): (\d+) prompt tokens, (\d+) output tokens, "
                          r"(\d+\.\d+) s, first token after (\d+\.\d+) s")


def test_serve_shows_the_startup_summary_and_a_plugins_info_lines_at_info_not_at_warning(served):
    # Both are logged in the engine process (request_completed runs there).
    at_info, _, _ = served("--log-level", "info", "--enable-log-requests")
    assert summary(at_info)["plugin"] == "llama"
    assert PLUGIN_LINE.search(at_info)
    at_warning, _, _ = served("--log-level", "warning", "--enable-log-requests")
    assert "engine ready" not in at_warning and "hookllm.plugins.latency" not in at_warning


def test_serve_with_enable_log_requests_at_debug_logs_each_requests_end(served):
    output, completion, client_seconds = served("--log-level", "debug", "--enable-log-requests")
    (line,) = REQUEST_LINE.findall(output)
    _, prompt_tokens, output_tokens, latency, first_token = line
    assert (int(prompt_tokens), int(output_tokens)) == (completion.usage.prompt_tokens, MAX_TOKENS)
    assert 0 < float(first_token) <= float(latency) <= client_seconds + 0.0005  # the log rounds to ms


@pytest.mark.parametrize("flags", [("--log-level", "debug"), ("--log-level", "info", "--enable-log-requests")],
                         ids=["debug-without-enable-log-requests", "enable-log-requests-at-info"])
def test_requests_are_not_logged_without_both_enable_log_requests_and_debug(served, flags):
    output, _, _ = served(*flags)
    assert PLUGIN_LINE.search(output)  # the server logged what its level shows
    assert not REQUEST_LINE.search(output)
