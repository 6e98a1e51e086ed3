"""docs/plugins.md's hook reference is generated from the hookspecs and must stay in step."""

import importlib.util
from pathlib import Path

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
    assert all(f"### `{name}(" in text for name in hooks)
