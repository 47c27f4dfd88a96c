"""The user guides match the code: every public method, parameter and option of `Engine`,
`EngineConfig`, `SamplingParams`, `DiffusionEngine` and `DiffusionConfig` is in docs/python_api.md
(the EngineConfig table is exactly the fields' help text), the README links every guide, and the RL
handover guide's example runs."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from tide.config import DEMO_MODEL_PATH, EngineConfig
from tide.engine import Engine
from tide.io_struct import WeightUpdateOptions
from tide.sampling_params import SamplingParams

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
API = (DOCS / "python_api.md").read_text()
GUIDES = ("quickstart_gpu.md", "python_api.md", "http_api.md", "rl_handover.md", "troubleshooting.md")


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def _method_row(name: str) -> str:
    rows = [line for line in API.splitlines() if f"`{name}(" in line]
    assert rows, f"docs/python_api.md does not document {name}()"
    return " ".join(rows)


def _check_methods(cls: type) -> None:
    for name, sig in _public_methods(cls).items():
        row = _method_row(name)
        for param in sig.parameters.values():
            if param.name == "self" or param.kind is param.VAR_KEYWORD and name == "__init__":
                continue
            shown = "**" + param.name if param.kind is param.VAR_KEYWORD else param.name
            assert shown in row, f"{cls.__name__}.{name}: parameter {param.name} is not documented"


def test_engine_methods_and_parameters_are_documented():
    _check_methods(Engine)
    for field in WeightUpdateOptions.__struct_fields__:
        assert f"`{field}=" in API, field


def test_engine_config_table_is_the_fields_help():
    for field in dataclasses.fields(EngineConfig):
        default = "the demo model" if field.default == DEMO_MODEL_PATH else repr(field.default)
        row = f"| `{field.name}` | `{default}` | {field.metadata['help']} |"
        assert row in API, f"docs/python_api.md row for {field.name} differs from EngineConfig:\n{row}"


def test_sampling_params_are_documented():
    for field in dataclasses.fields(SamplingParams):
        if field.init:
            assert f"`{field.name}`" in API, field.name


def test_diffusion_engine_is_documented():
    pytest.importorskip("diffusers")
    from tide.diffusion import DiffusionEngine
    from tide.diffusion.config import DiffusionConfig

    for name, sig in _public_methods(DiffusionEngine).items():
        row = _method_row(name)
        if "(...)" in row:
            continue  # documented as "the same parameters as generate"
        for param in sig.parameters:
            if param != "self":
                assert param in row, f"DiffusionEngine.{name}: {param}"
    section = API[API.index("## `tide.DiffusionEngine"):]
    for field in dataclasses.fields(DiffusionConfig):
        assert f"`{field.name}`" in section, field.name


def test_readme_links_every_guide_and_the_demo_model():
    readme = README.read_text()
    for page in GUIDES:
        assert (DOCS / page).is_file(), page
        assert f"(docs/{page})" in readme, page
    assert "(tide/demo_model/README.md)" in readme
    assert "/openapi.json" in (DOCS / "http_api.md").read_text()


def test_rl_handover_example_runs():
    text = (DOCS / "rl_handover.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/rl_handover.md", "exec"), {"__name__": "rl_handover_example"})


def test_ray_engine_methods_and_parameters_are_documented():
    """docs/parallel.md lists every public method of `RayEngine` with its parameters (its Python
    block runs in tests/test_ray_replicas.py)."""
    from tide.cluster.ray import RayEngine

    text = (DOCS / "parallel.md").read_text()
    section = text[text.index("### On a Ray cluster"):]
    for name, sig in _public_methods(RayEngine).items():
        rows = " ".join(line for line in section.splitlines() if f"`{name}(" in line)
        assert rows, f"docs/parallel.md does not document RayEngine.{name}()"
        for param in sig.parameters.values():
            if param.name == "self":
                continue
            shown = "**" + param.name if param.kind is param.VAR_KEYWORD else param.name
            assert shown in rows, f"RayEngine.{name}: parameter {param.name} is not documented"
    for param in inspect.signature(RayEngine.__init__).parameters:
        if param != "self":
            assert param in section, f"RayEngine({param}) is not documented"
