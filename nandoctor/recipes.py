"""Load and validate recipes, and resolve `--model` (a recipe name, a local checkpoint directory, or a
hub id already in the local Hugging Face cache). Nothing here downloads anything."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import yaml

from .config import Recipe, recipe_from_dict, with_paths_resolved
from .errors import NandoctorError, did_you_mean
from .typed import load_yaml

RECIPE_DIRS = (
    Path(__file__).resolve().parent.parent / "recipes",  # a source checkout or an editable install
    Path(sys.prefix) / "share" / "nandoctor" / "recipes",  # a regular install (setup.cfg data_files)
)
DEFAULT_MODEL = "tiny-llama"


def recipe_names() -> list[str]:
    names = set()
    for d in RECIPE_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_recipe(path: str | Path) -> Recipe:
    """Read one recipe file; any problem is a NandoctorError naming the file. Its `executor:` section
    is not part of the recipe (see executor_section)."""
    path = Path(path)
    data = _read_yaml(path)
    data.pop("executor", None)
    return with_paths_resolved(recipe_from_dict(data, path.stem), path.parent)  # relative to the recipe file


def executor_section(path: str | Path) -> tuple[str | None, list[str]]:
    """A recipe file's `executor:` section ({kind: slurm, partition: h100, ...}) as (kind, ["KEY=VALUE", ...]),
    the defaults that --executor and --executor-opt override; (None, []) without one."""
    section = _read_yaml(Path(path)).get("executor") or {}
    if not isinstance(section, dict):
        raise NandoctorError(f"recipe {str(path)!r}: executor must be a mapping, e.g. {{kind: slurm, partition: h100}}")
    return section.get("kind"), [f"{k}={v}" for k, v in section.items() if k != "kind"]


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise NandoctorError(f"cannot read recipe {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise NandoctorError(
            f"recipe {str(path)!r} is not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
            "a recipe is a YAML file, e.g. recipes/tiny-llama.yaml"
        ) from None
    try:
        data = load_yaml(text)  # YAML 1.2 core: `off` is a string, 1e-8 a number
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise NandoctorError(f"recipe {str(path)!r} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return data if data is not None else {}


def recipe_by_name(name: str) -> Recipe | None:
    for d in RECIPE_DIRS:
        path = d / f"{name}.yaml"
        if path.is_file():
            return load_recipe(path)
    return None


def cached_snapshot(hub_id: str) -> Path | None:
    """The local snapshot directory of a hub id if it is already cached with weights, else None."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # not cached, malformed id, or hub library absent: all mean "not local"
        return None
    return path if any(path.glob("*.safetensors")) else None


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(model: str | None, recipe_path: str | None = None) -> Recipe:
    """Turn --model / --recipe into a Recipe. A checkpoint directory or cached hub id keeps the
    training settings of the default recipe and points the model at the local files."""
    if recipe_path:
        recipe = load_recipe(recipe_path)
        return _with_model(recipe, model) if model else recipe
    return _with_model(recipe_by_name(DEFAULT_MODEL) or Recipe(), model or DEFAULT_MODEL)


def _with_model(base: Recipe, model: str) -> Recipe:
    named = recipe_by_name(model)
    if named is not None:
        return named
    path = Path(model).expanduser()
    if is_checkpoint_dir(path):
        return _local(base, path.resolve(), hub_id=None)
    if path.exists():
        raise NandoctorError(
            f"--model {model!r}: the directory has no config.json; "
            "a checkpoint directory needs config.json and *.safetensors"
        )
    if "/" in model and not model.startswith((".", "/")):
        snapshot = cached_snapshot(model)
        if snapshot is not None:
            return _local(base, snapshot, hub_id=model)
        raise NandoctorError(
            f"--model {model!r}: not in the local Hugging Face cache (nothing is downloaded); "
            f"use a recipe ({', '.join(recipe_names())}) or a local checkpoint directory"
        )
    names = recipe_names()
    raise NandoctorError(
        f"unknown model {model!r};{did_you_mean(model, names, n=3)} valid: a recipe name ({', '.join(names)}), "
        "a local checkpoint directory with config.json, or a hub id already in the local cache"
    )


def _local(base: Recipe, path: Path, hub_id: str | None) -> Recipe:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise NandoctorError(f"cannot read {path / 'config.json'}: {e}") from None
    if "model_type" not in config:
        raise NandoctorError(f"{path / 'config.json'} has no model_type; it is not a transformers checkpoint config")
    model = dataclasses.replace(base.model, path=str(path), hub_id=hub_id, arch={}, scale="auto")
    return dataclasses.replace(base, name=hub_id or path.name, model=model, description=f"local checkpoint {path}")
