"""``python -m hookllm.adapters.llava.make_tiny OUT_DIR``: the folder it writes is a LLaVA that
hookllm loads on the CPU and that answers a chat with an image as transformers does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llava_fixtures import load_reference, random_image, reference_greedy, reference_inputs
from PIL import Image
from transformers import PreTrainedTokenizerFast

from hookllm import LLM, testing
from hookllm.adapters.llava.make_tiny import main

# The chat template's rendering of one user turn, written out by hand.
CHAT_PROMPT = "<s>USER: <image>\nWhat is this? ASSISTANT:"
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llava"  # the command creates the folder
    assert main([str(path)]) == 0
    return path


def test_the_command_writes_a_checkpoint_that_answers_with_an_image(tiny):
    image = random_image(40, 30, seed=1)
    llm = LLM(str(tiny), plugins=["llava"], device="cpu")
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is this?"}]}]
    output = llm.chat(messages, testing.greedy(6))[0]
    inputs = reference_inputs(tiny, CHAT_PROMPT, [image], add_special_tokens=False)  # <s> is in the text
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == reference_greedy(load_reference(tiny), inputs, 6)


def readme_llava_lines() -> list[str]:
    """The README's LLaVA lines, comments dropped: make_tiny, then the generate command it enables."""
    lines = [line.split("#", 1)[0].strip() for line in README.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("python -m hookllm.adapters.llava.make_tiny "))
    return lines[start:start + 2]


def test_the_readme_llava_lines_run_as_written_and_answer_as_transformers(tmp_path):
    folder = tmp_path / "llava"
    # The README's commands as a user types them, with this environment's python and hookllm, run
    # outside the checkout (whose top-level folders, kernels/ among them, would shadow packages).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    stdouts = []
    for line in readme_llava_lines():
        result = subprocess.run(line.replace("DIR", str(folder)), shell=True, env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        stdouts.append(result.stdout)
    assert stdouts[0].split("\n")[0] == str(folder)  # make_tiny names the folder first

    # generate's defaults: greedy, at most 128 tokens, stopping at EOS (id 2).
    prompt = "<s>USER: <image>\nWhat is in this picture? ASSISTANT:"
    inputs = reference_inputs(folder, prompt, [Image.open(folder / "cat.png")], add_special_tokens=False)
    tokens = reference_greedy(load_reference(folder), inputs, 128)
    tokens = tokens[:tokens.index(2)] if 2 in tokens else tokens
    expected = PreTrainedTokenizerFast.from_pretrained(folder).decode(tokens, skip_special_tokens=True)
    assert stdouts[1].strip() == expected.strip()
