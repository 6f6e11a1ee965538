"""resolve_model_path: a model folder as is, a folder that is not one and a name that is neither a
folder nor a hub id refused by name; and all of it without torch, so that a command refuses a bad
folder before the loaders' imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from saccade.models.model_path import resolve_model_path


def test_a_model_folder_is_taken_as_it_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(tmp_path) == tmp_path


def test_a_folder_without_a_config_and_a_name_that_is_no_hub_id_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="has no config.json: it is not a Hugging Face model folder"):
        resolve_model_path(tmp_path)
    for name in ("./missing", "no-slash", "a/b/c"):
        with pytest.raises(ValueError, match="neither an existing folder nor a hub id like 'Org/Model-Name'"):
            resolve_model_path(name)


def test_the_module_imports_neither_torch_nor_transformers():
    code = ("import sys; import saccade.models.model_path; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
