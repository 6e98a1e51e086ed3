"""Scripts shaped like vLLM's basic offline-inference examples (written for this project),
with only the import and the model path changed, run against the tiny checkpoint."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import textwrap

import pytest

from hookllm import LLM, testing

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]


@pytest.fixture(scope="module")
def greedy_texts(tiny_llama_dir) -> list[str]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    return [o.outputs[0].text for o in llm.generate(PROMPTS, testing.greedy(8), use_tqdm=False)]


def run_script(tmp_path, source: str, model, argv: list[str] = ()) -> dict:
    """Run ``source`` as __main__ with MODEL set; it writes its results to RESULT as JSON."""
    script = tmp_path / "example.py"
    script.write_text(textwrap.dedent(source))
    result = tmp_path / "result.json"
    old_argv = sys.argv
    os.environ["MODEL"], os.environ["RESULT"] = str(model), str(result)
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old_argv
        del os.environ["MODEL"], os.environ["RESULT"]
    return json.loads(result.read_text())


def test_basic_generate(tmp_path, tiny_llama_dir, greedy_texts):
    result = run_script(tmp_path, """
        import json, os
        from hookllm import LLM, SamplingParams

        prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
        sampling_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm = LLM(model=os.environ["MODEL"], dtype="float32", device="cpu")
        outputs = llm.generate(prompts, sampling_params)
        for output in outputs:
            print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
        json.dump([o.outputs[0].text for o in outputs], open(os.environ["RESULT"], "w"))
    """, tiny_llama_dir)
    assert result == greedy_texts


def test_chat(tmp_path, tiny_llama_dir):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    result = run_script(tmp_path, """
        import json, os
        from hookllm import LLM, SamplingParams

        llm = LLM(model=os.environ["MODEL"], dtype="float32", device="cpu")
        sampling_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        conversation = [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "Hello"},
        ]
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=os.environ["TEMPLATE"])
        json.dump(outputs[0].outputs[0].token_ids, open(os.environ["RESULT"], "w"))
    """.replace('os.environ["TEMPLATE"]', repr(template)), tiny_llama_dir)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    text = "<system>You are a helpful assistant<user>Hello<assistant>"
    assert result == llm.generate(text, testing.greedy(6), use_tqdm=False)[0].outputs[0].token_ids


def test_engine_args_and_llm_engine_step_loop(tmp_path, tiny_llama_dir, greedy_texts):
    result = run_script(tmp_path, """
        import json, os
        from hookllm import EngineArgs, LLMEngine, SamplingParams
        from hookllm.utils import FlexibleArgumentParser

        def process_requests(engine, prompts):
            request_id = 0
            finished = {}
            while prompts or engine.has_unfinished_requests():
                if prompts:
                    prompt, params = prompts.pop(0)
                    engine.add_request(str(request_id), prompt, params)
                    request_id += 1
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output.outputs[0].text
            return [finished[str(i)] for i in range(request_id)]

        parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
        parser = EngineArgs.add_cli_args(parser)
        args = parser.parse_args()
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [(p, params) for p in ["Hello, my name is", "The president of the United States is",
                                        "The capital of France is"]]
        json.dump(process_requests(engine, prompts), open(os.environ["RESULT"], "w"))
    """, tiny_llama_dir, ["--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--max_num_seqs", "2"])
    assert result == greedy_texts


def test_flexible_argument_parser_cli_script(tmp_path, tiny_llama_dir, greedy_texts):
    result = run_script(tmp_path, """
        import json, os
        from hookllm import LLM, EngineArgs
        from hookllm.utils import FlexibleArgumentParser

        def create_parser():
            parser = FlexibleArgumentParser()
            EngineArgs.add_cli_args(parser)
            group = parser.add_argument_group("Sampling parameters")
            group.add_argument("--max-tokens", type=int)
            group.add_argument("--temperature", type=float)
            return parser

        def main(args):
            max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
            llm = LLM(**args)
            sampling_params = llm.get_default_sampling_params()
            sampling_params.max_tokens, sampling_params.temperature = max_tokens, temperature
            sampling_params.ignore_eos = True
            outputs = llm.generate(["Hello, my name is", "The president of the United States is",
                                    "The capital of France is"], sampling_params)
            json.dump([o.outputs[0].text for o in outputs], open(os.environ["RESULT"], "w"))

        if __name__ == "__main__":
            main(vars(create_parser().parse_args()))
    """, tiny_llama_dir, ["--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
                          "--max_tokens", "8", "--temperature", "0"])
    assert result == greedy_texts


def test_generation_config_defaults_script(tmp_path, tiny_llama_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                              "repetition_penalty": 1.5}))
    result = run_script(tmp_path, """
        import json, os
        from hookllm import LLM

        llm = LLM(model=os.environ["MODEL"], generation_config="auto", dtype="float32", device="cpu")
        sampling_params = llm.get_default_sampling_params()
        sampling_params.ignore_eos = True
        outputs = llm.generate("Hello, my name is", sampling_params)
        json.dump(outputs[0].outputs[0].token_ids, open(os.environ["RESULT"], "w"))
    """, model)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    from hookllm import SamplingParams

    expected = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.5,
                                                                ignore_eos=True), use_tqdm=False)[0]
    assert result == expected.outputs[0].token_ids


def test_cleanup_between_engines(tmp_path, tiny_llama_dir, greedy_texts):
    result = run_script(tmp_path, """
        import gc, json, os
        from hookllm import LLM, SamplingParams
        from hookllm.distributed import cleanup_dist_env_and_memory

        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        texts = []
        for _ in range(2):
            llm = LLM(model=os.environ["MODEL"], dtype="float32", device="cpu")
            texts.append(llm.generate("Hello, my name is", params)[0].outputs[0].text)
            del llm
            cleanup_dist_env_and_memory()
        json.dump(texts, open(os.environ["RESULT"], "w"))
    """, tiny_llama_dir)
    assert result == [greedy_texts[0]] * 2
