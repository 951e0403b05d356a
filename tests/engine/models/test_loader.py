"""The real SmolLM2 GGUF: resolve, dequantize into a fresh safetensors cache, reload from it, and
match transformers' greedy `generate` on the same dequantized weights."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem_engine.models import loader
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.models.packed_linear import packing_supported
from tests.engine.utils import hf_greedy, paged_greedy, read_only


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Correctness, not speed, is tested here: one intra-op thread avoids OpenMP's barrier stalls when
    the two cores are shared with other work, which made these tests several times slower. (Function
    scope: the cold cache build in the module fixture keeps its threads.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def first_load(cache_dir: Path) -> Iterator[tuple[loader.LoadedModel, int]]:
    """A cold start as `tandem serve` does it: an API-server process reads config and tokenizer while
    this process (the engine) loads the model, both on the same empty cache. Yields the model and how
    many times the cache was built across both (the build lock makes it one)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_CACHE_DIR", str(cache_dir))
    api_server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import logging; logging.basicConfig(level=logging.INFO); "
            "from tandem_engine.models import loader as L; "
            "print(L.load_config_and_tokenizer(L.resolve_model(L.SMOLLM2_ALIAS))[0].model_type)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(["workers", *sys.path])},
    )
    records = _Records()
    log = logging.getLogger("tandem_engine.models.loader")
    log.addHandler(records)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        loaded = loader.load_model(loader.resolve_model(loader.SMOLLM2_ALIAS), torch.float32)
        out, err = api_server.communicate(timeout=300)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
        api_server.kill()
    assert api_server.returncode == 0 and out.strip() == "llama", err
    built = "built the model cache"
    builds = err.count(built) + sum(built in m for m in records.messages)
    yield loaded, builds
    mp.undo()


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "from-env"))
    src = loader.resolve_model("smollm2-135m-instruct")
    assert src.kind == "gguf" and src.path.suffix == ".gguf" and src.path.is_file()
    assert src.served_name == "smollm2-135m-instruct"
    assert src.cache_dir == tmp_path / "from-env"
    # An explicit directory (--cache-dir) wins over the environment.
    src = loader.resolve_model("smollm2-135m-instruct", tmp_path / "flag")
    assert loader.gguf_cache_dir(src).parent == tmp_path / "flag"
    with pytest.raises(FileNotFoundError):
        loader.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        loader.resolve_model(str(tmp_path))


def test_copies_of_one_gguf_share_one_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is keyed on a GGUF's contents: every clone's .venv holds its own copy of the embedded model,
    and a key on the path left half a gigabyte behind per clone (CI's machine filled its disk). A file that
    changes gets its own entry; a path hashed once is not read again while its size and mtime hold."""
    cache = tmp_path / "cache"
    a, b, c = (tmp_path / n / "m.gguf" for n in "abc")
    for f, data in ((a, b"same weights"), (b, b"same weights"), (c, b"other weights")):
        f.parent.mkdir()
        f.write_bytes(data)
    entry = [loader.gguf_cache_dir(loader.ModelSource("gguf", f, "m", cache)) for f in (a, b, c)]
    assert entry[0] == entry[1] != entry[2] and entry[0].parent == cache
    assert len(json.loads((cache / loader.DIGESTS).read_text())) == 3

    reads: list[Path] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *args, **kw: (reads.append(Path(f)), real_open(f, *args, **kw))[1])
    assert loader.gguf_cache_dir(loader.ModelSource("gguf", a, "m", cache)) == entry[0]
    assert a not in reads
    a.write_bytes(b"new weights!")  # same size, a later mtime
    os.utime(a, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert loader.gguf_cache_dir(loader.ModelSource("gguf", a, "m", cache)) not in entry
    # A deleted clone's path leaves the memo when it is next written.
    b.unlink()
    c.write_bytes(b"other weights, edited")
    loader.gguf_cache_dir(loader.ModelSource("gguf", c, "m", cache))
    assert not any(k.startswith(str(b)) for k in json.loads((cache / loader.DIGESTS).read_text()))


def test_pick_dtype() -> None:
    assert loader.pick_dtype("float32") is torch.float32
    assert loader.pick_dtype("bfloat16") is torch.bfloat16
    with open("/proc/cpuinfo") as f:
        amx = "amx_bf16" in f.read()
    expected = torch.bfloat16 if torch.cuda.is_available() or amx else torch.float32
    assert loader.pick_dtype("auto") is expected
    with pytest.raises(ValueError):
        loader.pick_dtype("int8")


@pytest.mark.parametrize(("flags", "amx"), [
    ("fpu avx2 fma avx512f avx512_bf16 avx512_vnni", False),  # Zen 4 / Cooper Lake: float32 by default
    ("fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", True),  # Sapphire Rapids
    ("fpu avx2 fma", False),
])
def test_auto_is_bfloat16_only_with_amx(flags: str, amx: bool, tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n")
    assert loader.cpu_has_amx_bf16(str(cpuinfo)) is amx
    assert not loader.cpu_has_amx_bf16(str(tmp_path / "missing"))


def test_gguf_is_cached_and_reloaded_fast(
    first_load: tuple[loader.LoadedModel, int], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded, meta_builds = first_load
    assert meta_builds == 1, "model cache built more than once by concurrent starters"
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.hf_config.num_hidden_layers == 30 and loaded.model.tie_word_embeddings
    assert loaded.eos_token_ids == [2]
    (weights,) = cache_dir.glob("*/model/model.safetensors")
    assert not [p for p in cache_dir.glob("*/.*") if p.is_dir()], "temporary cache directories left behind"
    mtime = weights.stat().st_mtime_ns

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache_dir))
    src = loader.resolve_model(loader.SMOLLM2_ALIAS)
    t0 = time.perf_counter()
    config, tokenizer, gen = loader.load_config_and_tokenizer(src)
    meta_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = loader.load_model(src, torch.float32)
    load_s = time.perf_counter() - t0
    assert weights.stat().st_mtime_ns == mtime, "second load rebuilt the cache"
    assert config.vocab_size == 49152 and tokenizer.eos_token_id == 2 and gen.get("eos_token_id") == 2
    assert meta_s < 5 and load_s < 10, (meta_s, load_s)
    for a, b in zip(loaded.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)

    # The cache is itself a safetensors model directory, servable as a path.
    as_dir = loader.resolve_model(str(weights.parent))
    assert as_dir.kind == "safetensors"
    assert loader.load_config_and_tokenizer(as_dir)[0].hidden_size == 576


def test_a_warm_start_reads_the_config_transformers_resolved_without_its_config_classes(
    first_load: tuple[loader.LoadedModel, int], cache_dir: Path
) -> None:
    """The GGUF cache keeps the config with every default LlamaConfig fills in; a warm start reads it back
    (attribute for attribute what AutoConfig gives) without importing transformers at all: LlamaConfig's
    import alone took ~1.4 s of each of the API server's and the EngineCore's start on 2 CPUs."""
    from transformers import AutoConfig

    code = (
        "import json, sys; from pathlib import Path; from tandem_engine.models import loader\n"
        f"config, gen = loader.load_config(loader.resolve_model(loader.SMOLLM2_ALIAS, Path({str(cache_dir)!r})))\n"
        "print(json.dumps({'transformers': sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'),\n"
        "                  'config': vars(config), 'gen': gen}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    warm = json.loads(out.stdout.splitlines()[-1])
    assert warm["transformers"] == []
    (weights_dir,) = {p.parent for p in cache_dir.glob("*/model/model.safetensors")}
    reference = AutoConfig.from_pretrained(weights_dir)
    assert json.loads(json.dumps(vars(loader.ResolvedConfig(**warm["config"])))) == json.loads(
        reference.to_json_string(use_diff=False)) | {"_name_or_path": str(weights_dir)}
    config, gen = loader.load_config(loader.resolve_model(loader.SMOLLM2_ALIAS, cache_dir))
    assert config.id2label == reference.id2label and config.tie_word_embeddings is True
    assert gen == warm["gen"] == loader._generation_config(weights_dir, reference)


def test_greedy_matches_transformers_generate(
    first_load: tuple[loader.LoadedModel, int], cache_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, _ = first_load
    (weights_dir,) = {p.parent for p in cache_dir.glob("*/model/model.safetensors")}
    # transformers on the very weights its own GGUF dequantization produced.
    hf = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(weights_dir)
    prompt = tok("The capital of France is")["input_ids"]
    ref, ref_logits = hf_greedy(hf, prompt, 16)
    got, got_logits = paged_greedy(loaded.model, [prompt], 16, chunk=3, block_size=16, num_blocks=8)
    assert got[0] == ref, (tok.decode(got[0]), tok.decode(ref))
    for a, b in zip(got_logits[0], ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)


@pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")),
                    reason="this torch build cannot pack weights for oneDNN")
def test_onednn_pack_off_keeps_plain_weights_only(
    first_load: tuple[loader.LoadedModel, int], cache_dir: Path
) -> None:
    loaded, _ = first_load
    assert loaded.model.packed_lm_head is not None
    plain = loader.load_model(loader.resolve_model(loader.SMOLLM2_ALIAS, cache_dir), torch.float32,
                              onednn_pack=False)
    assert plain.model.packed_lm_head is None


def test_complete_cache_is_only_read(first_load: tuple[loader.LoadedModel, int], cache_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete cache (with the kernel, as the worker image bakes it, on a read-only volume) is only
    read by a start: nothing in it is created or modified."""
    from tandem_engine.kernels import prefill_attention
    from tandem_engine.kernels.paged_attention import load_kernel
    from tandem_engine.prepare import prepare

    prepare(loader.SMOLLM2_ALIAS, cache_dir)

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(cache_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in cache_dir.rglob("*")}

    before = snapshot()
    read_only(monkeypatch, cache_dir)
    src = loader.resolve_model(loader.SMOLLM2_ALIAS, cache_dir)
    assert loader.load_config_and_tokenizer(src)[0].num_hidden_layers == 30
    loader.load_model(src, torch.float32, onednn_pack=False)
    assert load_kernel.__wrapped__(cache_dir) is not None
    assert prefill_attention.load_kernel.__wrapped__(cache_dir) is not None
    assert snapshot() == before
