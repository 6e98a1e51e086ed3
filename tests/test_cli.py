"""The hookllm command line."""

import json
import socket

import pytest

from hookllm import testing
from hookllm.entrypoints.cli import main


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "generate" in out and "plugins" in out


def help_entries(text: str) -> list[str]:
    """A ``--help`` text as one entry per flag (or heading): wrapped lines joined."""
    entries: list[str] = []
    for line in text.splitlines():
        if line.startswith("   ") and entries:  # help text continues at a deeper indent
            entries[-1] += " " + line.strip()
        else:
            entries.append(line.strip())
    return entries


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_shows_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    repeated = [entry for entry in help_entries(capsys.readouterr().out) if entry.count("default:") > 1]
    assert repeated == []


def test_help_ends_a_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--max-tokens MAX_TOKENS most tokens to generate per prompt (default: 128)" in help_entries(
        capsys.readouterr().out)


def test_generate_prints_the_greedy_continuation(tiny_llama_dir, capsys):
    prompt = "Paris is the capital of"
    expected = testing.LLM(str(tiny_llama_dir), device="cpu").generate(prompt, testing.greedy(8))[0].outputs[0].text
    assert main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "8", "--no-chat", "--device", "cpu", prompt]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_reports_a_bad_request_as_an_error(tiny_llama_dir, capsys):
    code = main(["generate", "--model", str(tiny_llama_dir), "--temperature", "-1", "--no-chat", "hi"])
    assert code == 2 and "temperature must be >= 0" in capsys.readouterr().err


def test_plugins_lists_the_bundled_adapters(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "Qwen3ForCausalLM" in out and "llava" in out


def test_plugins_fits_a_100_column_terminal(capsys):
    assert main(["plugins"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100


def test_plugins_wrapped_lists_keep_every_hook_and_architecture(capsys):
    assert main(["plugins", "--json"]) == 0
    names = [name for row in json.loads(capsys.readouterr().out) for name in row["hooks"] + row["architectures"]]
    assert main(["plugins"]) == 0
    words = capsys.readouterr().out.replace(",", " ").split()
    assert names and all(name in words for name in names)


# What the bundled plugins register, their register_components called here directly on the
# plugins' entry points.
LISTING_KEYS = ("tool_parsers", "reasoning_parsers", "quantization_methods", "structured_output_backends")


def registered_by_entry_points() -> dict[str, dict[str, list[str]]]:
    """Plugin -> {"tool_parsers": [names], ...} for every installed plugin that registers something."""
    from importlib import metadata

    from hookllm.plugins.components import Components

    registered: dict[str, dict[str, list[str]]] = {}
    for entry_point in metadata.entry_points(group="hookllm.plugins"):
        plugin = entry_point.load()
        components = Components()
        if hasattr(plugin, "register_components"):
            plugin.register_components(components)
        for kind, named in components.by_kind.items():
            if named:
                registered.setdefault(entry_point.name, {})[kind.name.lower() + "s"] = sorted(named)
    return registered


def test_plugins_json_lists_what_each_plugin_registers(capsys):
    expected = registered_by_entry_points()
    assert "hermes" in expected["tool_parsers"]["tool_parsers"]
    assert "qwen3" in expected["reasoning_parsers"]["reasoning_parsers"]
    assert "fp8" in expected["fp8"]["quantization_methods"]
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    listed = {row["name"]: {key: row[key] for key in LISTING_KEYS
                            if row[key]} for row in rows}
    assert {name: kinds for name, kinds in listed.items() if kinds} == expected


def test_plugins_lists_what_each_plugin_registers_under_it(capsys):
    assert main(["plugins"]) == 0
    blocks = capsys.readouterr().out.split("\nserved by")[0]
    lines = {}
    for line in blocks.splitlines():
        if not line.startswith(" "):
            plugin = line.split(" (")[0]
        else:
            label, _, value = line.strip().partition(": ")
            lines[plugin, label] = value.strip()
    for plugin, registered in registered_by_entry_points().items():
        for key, names in registered.items():
            assert lines[plugin, key.replace("_", " ")] == ", ".join(names)


def test_default_model_answers_paris(capsys):
    assert main(["generate", "--max-tokens", "32", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_with_several_prompts_heads_each_answer_with_its_prompt(tiny_llama_dir, capsys):
    llm = testing.LLM(str(tiny_llama_dir), device="cpu")
    prompts = ["Paris is", "The quick brown"]
    answers = [o.outputs[0].text for o in llm.generate(prompts, testing.greedy(4))]
    argv = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "4", "--no-chat", "--device", "cpu", *prompts]
    assert main(argv) == 0
    expected = "".join(f"--- {p}\n{a}\n" for p, a in zip(prompts, answers))
    assert capsys.readouterr().out == expected


def test_an_unknown_serve_flag_is_reported_with_serves_usage_and_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--max-num-sqes=4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: hookllm serve ")
    assert err.splitlines()[-1] == ("hookllm serve: error: unrecognized arguments: --max-num-sqes=4 "
                                    "(did you mean --max-num-seqs?)")


def test_serve_refuses_a_busy_port_before_loading_the_model(tiny_llama_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_llama_dir), "--port", str(port), "--device", "cpu", "--log-level", "info"]) == 2
    # One line naming the address, and nothing logged: the engine never started.
    assert capsys.readouterr().err == f"hookllm: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


@pytest.mark.parametrize("key", ["", "two words"])
def test_serve_refuses_an_api_key_that_would_not_work_before_anything_else(key, tmp_path, capsys):
    # The model does not exist: only the key is checked before it.
    assert main(["serve", str(tmp_path / "no-model"), "--api-key", key]) == 2
    assert "--api-key must be printable ASCII without spaces" in capsys.readouterr().err
