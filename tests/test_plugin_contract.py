"""The adapter contract (``ModelProtocol``) against every bundled model class, and the plugin
framework's independence from the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hookllm.adapters.llama import ARCHITECTURES
from hookllm.adapters.llava import ARCHITECTURE as LLAVA
from hookllm.plugins.contract import ModelProtocol, capability, contract_violations
from hookllm.plugins.manager import PluginManager

FRAMEWORK = Path(__file__).resolve().parents[1] / "plugins"
ENGINE_PACKAGES = ("hookllm.engine", "hookllm.worker", "hookllm.sched")


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, LLAVA])
def test_every_bundled_model_class_satisfies_the_model_protocol(architecture):
    model_cls = PluginManager().registry.resolve(architecture)
    assert contract_violations(model_cls) == []
    assert issubclass(model_cls, torch.nn.Module) and issubclass(model_cls, ModelProtocol)


def test_a_forward_without_inputs_embeds_is_a_violation_naming_it():
    class NoEmbeds(torch.nn.Module):
        def forward(self, input_ids, positions):
            return input_ids

        embed_tokens = compute_logits = load_weights = forward

    assert contract_violations(NoEmbeds)[0] == (
        "NoEmbeds.forward(input_ids, positions) should take (input_ids, positions, inputs_embeds=...)")


def test_a_model_class_setting_no_capability_flag_has_the_protocols_defaults():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, positions, inputs_embeds=None):
            return input_ids

        embed_tokens = compute_logits = load_weights = forward

    flags = ("supports_tensor_parallel", "supports_expert_parallel", "supports_quantization", "supports_torch_compile")
    assert issubclass(Plain, ModelProtocol)
    assert [capability(Plain, flag) for flag in flags] == [False] * 4
    llama = PluginManager().registry.resolve("LlamaForCausalLM")
    assert [capability(llama, flag) for flag in flags] == [True, False, True, False]


def runtime_imports(path: Path) -> list[str]:
    """The modules ``path`` imports, except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) == "TYPE_CHECKING" for node in ast.walk(block)}
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(FRAMEWORK.glob("*.py")), ids=lambda p: p.name)
def test_the_plugin_framework_imports_no_engine_package(path):
    assert [name for name in runtime_imports(path) if name.startswith(ENGINE_PACKAGES)] == []
