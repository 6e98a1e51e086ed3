"""vLLM's offline API names and signatures, each checked against an independent result."""

from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest

import hookllm
from hookllm import (LLM, CompletionOutput, EngineArgs, LLMEngine, Logprob, RequestOutput, RequestOutputKind,
                     SamplingParams, TextPrompt, TokensPrompt, testing)
from hookllm.distributed import cleanup_dist_env_and_memory
from hookllm.utils import FlexibleArgumentParser

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_top_level_names():
    for name in ("LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "EngineArgs", "TextPrompt",
                 "TokensPrompt", "RequestOutput", "CompletionOutput", "Logprob"):
        assert name in hookllm.__all__ and hasattr(hookllm, name)
    assert {k.name for k in RequestOutputKind} == {"CUMULATIVE", "DELTA", "FINAL_ONLY"}


def test_output_kind_accepts_the_enum_and_its_strings():
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"


def test_text_and_tokens_prompts_give_the_same_tokens(llm, tiny_llama_reference):
    text = llm.get_tokenizer().decode(PROMPT)
    ids = llm.get_tokenizer()(text)["input_ids"]
    by_text = llm.generate(TextPrompt(prompt=text), testing.greedy(4), use_tqdm=False)[0]
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), testing.greedy(4), use_tqdm=False)[0]
    assert isinstance(by_text, RequestOutput) and isinstance(by_text.outputs[0], CompletionOutput)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == testing.reference_greedy(tiny_llama_reference, ids, 4)


def test_request_output_metrics_are_in_order(llm):
    out = llm.generate([PROMPT], testing.greedy(3), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert out.num_cached_tokens == 0


def test_engine_from_engine_args_steps_to_llm_generate_output(tiny_llama_dir, llm):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    assert engine.get_tokenizer() is not None and engine.get_model_config().architecture == "LlamaForCausalLM"
    engine.add_request("a", PROMPT, testing.greedy(5))
    assert engine.get_num_unfinished_requests() == 1
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert engine.get_num_unfinished_requests() == 0
    assert finished[0].outputs[0].token_ids == llm.generate([PROMPT], testing.greedy(5), use_tqdm=False)[0].outputs[0].token_ids


def test_flexible_argument_parser_takes_underscores_and_dashes():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    a = parser.parse_args(["--max_num_seqs", "3", "--enforce_eager"])
    b = parser.parse_args(["--max-num-seqs=3", "--enforce-eager"])
    assert a.max_num_seqs == b.max_num_seqs == 3 and a.enforce_eager is b.enforce_eager is True


def test_sampling_params_clone_is_independent():
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[4] = 2.0
    assert params.stop == ["x"] and params.logit_bias == {3: 1.0}


def test_detokenize_false_returns_tokens_without_text(llm):
    plain = llm.generate([PROMPT], testing.greedy(4), use_tqdm=False)[0].outputs[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False, logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids and out.text == ""
    assert all(isinstance(v, Logprob) and v.decoded_token is None for entry in out.logprobs for v in entry.values())


def test_logprobs_entries_carry_each_tokens_text_decoded_alone(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert len(out.logprobs) == 4
    assert all(v.decoded_token == tokenizer.decode([t]) for entry in out.logprobs for t, v in entry.items())


def test_truncate_prompt_tokens_keeps_the_prompt_end(llm):
    long = [7, 8, 9] + PROMPT
    out = llm.generate([long], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT
    assert out.outputs[0].token_ids == llm.generate([PROMPT], testing.greedy(3), use_tqdm=False)[0].outputs[0].token_ids


def test_chat_takes_template_and_generation_prompt_flags(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    params = testing.greedy(3)
    for add, cont, text in [(True, False, "<user>hi<assistant>yo<assistant>"), (False, True, "<user>hi<assistant>yo")]:
        got = llm.chat(messages, params, use_tqdm=False, chat_template=template, add_generation_prompt=add,
                       continue_final_message=cont, tools=[{"type": "function", "function": {"name": "f"}}])[0]
        expected = llm.generate(text, params, use_tqdm=False)[0]
        assert got.prompt_token_ids == expected.prompt_token_ids and got.outputs[0].token_ids == expected.outputs[0].token_ids


def write_generation_config(folder, **values) -> None:
    (folder / "generation_config.json").write_text(json.dumps(values))


def test_generation_config_defaults(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    write_generation_config(model, temperature=0.3, top_p=0.8, top_k=7, repetition_penalty=1.2, max_new_tokens=5)
    defaults = LLM(str(model), dtype="float32", device="cpu").get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (
        0.3, 0.8, 7, 1.2, 5)
    assert LLM(str(model), dtype="float32", device="cpu", generation_config="vllm").get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, temperature=0.0, max_new_tokens=2)
    llm = LLM(str(model), dtype="float32", device="cpu", generation_config=str(other))
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 or out.finish_reason == "stop"


def lay_out_hub_cache(cache, source, repo_id: str) -> None:
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    shutil.copytree(source, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")


def test_hub_id_resolves_from_the_local_cache(tiny_llama_dir, tmp_path, monkeypatch, llm):
    lay_out_hub_cache(tmp_path, tiny_llama_dir, "tiny-org/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = LLM("tiny-org/tiny-llama", dtype="float32", device="cpu")
    assert hub.engine.config.model == str(tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "abc123")
    assert (hub.generate([PROMPT], testing.greedy(4), use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([PROMPT], testing.greedy(4), use_tqdm=False)[0].outputs[0].token_ids)


def test_uncached_hub_id_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'nobody/nothing' is neither a local folder nor in the hub cache") as info:
        LLM("nobody/nothing", device="cpu")
    assert "\n" not in str(info.value)


def test_shutdown_and_cleanup_free_the_kv_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8)
    llm.generate([PROMPT], testing.greedy(2), use_tqdm=False)
    caches = [weakref.ref(layer.k_cache) for layer in llm.engine.engine_core.executor.attention_layers]
    llm.shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()
    assert all(ref() is None for ref in caches)


# The command line.

from hookllm.entrypoints import cli  # noqa: E402


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"hookllm {hookllm.__version__}"


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "hookllm", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"hookllm {hookllm.__version__}"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "(default: 128)" in capsys.readouterr().out


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI would load a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(hookllm, "LLM", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--image", "/no/such.png", "hi"], "no such image file: /no/such.png"),
    (["--temperature", "nan", "hi"], "temperature must be a finite number"),
])
def test_arguments_are_checked_before_the_model_loads(no_model_load, capsys, argv, message):
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_gpu_is_a_one_line_error(no_model_load, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["generate", "--device", "cuda", "hi"]) == 2
    assert capsys.readouterr().err == "hookllm: error: --device cuda: no CUDA GPU is available (use --device cpu)\n"


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hookllm, "LLM", interrupted)
    assert cli.main(["generate", "--device", "cpu", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_generate_streams_a_stdin_prompt_as_tokens_arrive(tiny_llama_dir, llm, monkeypatch):
    import io
    import sys

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    prompt = "Paris is the capital of"
    expected = llm.generate(prompt, testing.greedy(8), use_tqdm=False)[0].outputs[0].text
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    monkeypatch.setattr(sys, "stdout", Recorder())
    argv = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "8", "--no-chat", "--device", "cpu", "-"]
    assert cli.main(argv) == 0
    assert "".join(writes) == expected + "\n"
    assert len([w for w in writes if w.strip()]) > 2  # several pieces, not one answer at the end
