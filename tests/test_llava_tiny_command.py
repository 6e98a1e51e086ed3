"""``python -m hookllm.adapters.llava.make_tiny OUT_DIR``: the folder it writes is a LLaVA that
hookllm loads on the CPU and that answers a chat with an image as transformers does."""

import pytest
from llava_fixtures import load_reference, random_image, reference_greedy, reference_inputs

from hookllm import LLM, testing
from hookllm.adapters.llava.make_tiny import main

# The chat template's rendering of one user turn, written out by hand.
CHAT_PROMPT = "<s>USER: <image>\nWhat is this? ASSISTANT:"


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
