"""The hookllm command line."""

import json

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
