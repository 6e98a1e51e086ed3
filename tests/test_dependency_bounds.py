"""pyproject.toml's dependency floors: each dependency names one, requirements/minimums.txt (what
``make test-minimums`` installs) is generated from them, and the structured plugin refuses an
llguidance below its floor when it loads instead of failing at the first constrained request."""

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

from hookllm.plugins.manager import PluginManager, discover_plugins

ROOT = Path(__file__).resolve().parent.parent


def load_minimums():
    spec = importlib.util.spec_from_file_location("minimums", ROOT / "requirements" / "minimums.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


minimums = load_minimums()


def test_every_dependency_and_extra_names_a_floor():
    unbounded = []
    for requirement in minimums.requirements():
        try:
            minimums.floor(requirement)
        except ValueError:
            unbounded.append(str(requirement))
    assert unbounded == []


def test_minimums_txt_is_what_the_script_generates_from_pyproject():
    assert (ROOT / "requirements" / "minimums.txt").read_text() == minimums.minimums()


def test_a_package_listed_twice_with_two_floors_is_refused(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["numpy>=1.26"]\n'
                         '[project.optional-dependencies]\ndev = ["numpy>=2.0"]\n')
    with pytest.raises(ValueError, match="numpy: two floors in pyproject.toml, 1.26 and 2.0"):
        minimums.minimums(pyproject)


def test_the_structured_plugins_llguidance_floor_is_pyprojects():
    from hookllm.bundled.structured import LLGUIDANCE_MIN_VERSION

    floors = {minimums.floor(r) for r in minimums.requirements() if r.name == "llguidance"}
    assert floors == {LLGUIDANCE_MIN_VERSION}


def test_an_llguidance_below_the_floor_fails_the_structured_plugins_load_naming_the_floor(monkeypatch):
    real_version = importlib.metadata.version
    # 1.6.1's LLTokenizer takes one EOS token, not the list the plugin passes.
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.6.1" if name == "llguidance" else real_version(name))
    monkeypatch.delitem(sys.modules, "hookllm.bundled.structured")  # loaded afresh, then restored
    monkeypatch.setenv("HOOKLLM_PLUGINS", "structured")
    installed = PluginManager(discover_plugins())
    with pytest.raises(ValueError, match=r"plugin 'structured' failed to load: ImportError: the structured plugin "
                                         r"needs llguidance>=1\.7\.0, but 1\.6\.1 is installed"):
        installed.check_selected(["structured"])
