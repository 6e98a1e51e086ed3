"""docs/plugins.md's hook reference is generated from the hookspecs and must stay in step."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_hooks", DOCS / "gen_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plugins_md_hook_reference_is_up_to_date():
    text = (DOCS / "plugins.md").read_text()
    assert load_generator().render(text) == text, "docs/plugins.md is out of date: run python docs/gen_hooks.py"


def test_generated_hook_reference_covers_every_hookspec():
    from hookllm.plugins import hookspecs

    text = (DOCS / "plugins.md").read_text()
    hooks = [name for name, f in vars(hookspecs).items() if hasattr(f, hookspecs.PROJECT_NAME + "_spec")]
    assert len(hooks) >= 7
    assert all(f"#### `{name}(" in text for name in hooks)


def test_every_hookspec_carries_its_placement_and_an_example():
    from hookllm.plugins import hookspecs

    specs = {name: f for name, f in vars(hookspecs).items() if hasattr(f, hookspecs.PROJECT_NAME + "_spec")}
    assert set(hookspecs.placements()) == set(specs)
    assert [name for name, f in specs.items() if f"def {name}(" not in f.__doc__] == []


def test_the_deprecated_hook_names_table_lists_each_old_hook_and_its_replacement():
    from hookllm.plugins.deprecated_hooks import DEPRECATED_HOOKS

    text = (DOCS / "plugins.md").read_text().partition("### Deprecated hook names")[2]
    assert all(f"| `{old.name}(" in text and f"`{old.replacement}(" in text for old in DEPRECATED_HOOKS.values())


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_model_help_says_it_takes_a_folder_or_a_hub_id(command):
    result = subprocess.run([sys.executable, "-m", "hookllm.entrypoints.cli", command, "--help"],
                            capture_output=True, text=True, timeout=120, check=True)
    text = " ".join(result.stdout.split())  # argparse wraps the help at the terminal's width
    assert "--model MODEL a local folder (config.json + safetensors) or a Hugging Face hub id" in text
