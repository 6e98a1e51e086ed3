"""PEFT adapters of the tiny Llama and their transformers + PEFT references, for the LoRA tests.

PEFT initialises B to zero (a fresh adapter changes nothing): the adapters here get random B,
so each one's output differs from the base model's and from the others'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hookllm.lora.request import LoRARequest

# Three adapters of different ranks, targets and scalings: attention only; every projection with
# rsLoRA; a few projections, the token embedding and the LM head, with per-module rank and alpha
# patterns (down's rank 8, gate's alpha 32).
ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all": dict(r=16, lora_alpha=8, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "some": dict(r=4, lora_alpha=4, target_modules=["v_proj", "gate_proj", "down_proj", "embed_tokens", "lm_head"],
                 rank_pattern={"down_proj": 8}, alpha_pattern={"gate_proj": 32}),
}


def load_base(base_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def build_adapter(base_dir: Path, path: Path, seed: int, **lora_config: Any) -> Path:
    """A PEFT LoRA adapter of the model at ``base_dir``, saved at ``path``, with random A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_base(base_dir), LoraConfig(lora_dropout=0.0, **lora_config))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(str(path), save_embedding_layers=False)  # the vocabulary is the base model's
    return path


def build_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """Every adapter of ADAPTER_SPECS for the model at ``base_dir``, each in its folder under ``root``."""
    return {name: build_adapter(base_dir, root / name, seed, **spec)
            for seed, (name, spec) in enumerate(ADAPTER_SPECS.items())}


def peft_reference(base_dir: Path, adapter_dir: Path | None) -> Any:
    """transformers' model of ``base_dir`` with PEFT's adapter applied (None: the base model)."""
    from peft import PeftModel

    model = load_base(base_dir)
    return model if adapter_dir is None else PeftModel.from_pretrained(model, str(adapter_dir)).eval()


@torch.no_grad()
def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the plainest reference."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@torch.no_grad()
def prompt_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """Each prompt token's logprob after the ones before it (positions 1..n-1)."""
    logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def lora_requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())}
