"""Build what an engine would otherwise build at its first start: the model cache of a GGUF model and the
CPU kernels (decode and prefill attention, fused norm and activation, the fused decode step and its float32
panel matmul, and `--quantization gguf`'s matmul), into a cache directory: for this CPU, or for every ISA level
`TANDEM_CPU_KERNEL_MARCH` lists (`x86-64-v4,x86-64-v3` in the image). The worker image runs it at build
time so that pods start warm from a read-only cache (docs/operations.md, "Start-up and the model cache"):

    python -m tandem_engine.prepare --model smollm2-135m-instruct --cache-dir /opt/tandem/cache
"""

from __future__ import annotations

import argparse
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

from tandem_engine.config import EngineConfig

logger = logging.getLogger(__name__)


def prepare(model: str, cache_dir: Path, kernel: bool = True) -> Path:
    """Build the model's cache (a GGUF's; nothing for a safetensors directory) and, with `kernel`, every CPU
    kernel an engine may build at start (decode and prefill attention, fused norm and activation, the fused
    decode step and the dense path's panel matmul; `--quantization gguf`'s matmul; on x86, a bfloat16 model's
    AMX matmul) under `cache_dir`. Returns the model's safetensors directory. Raises RuntimeError if a kernel
    cannot be built."""
    from tandem_engine.kernels.amx_matmul import build_amx_kernel
    from tandem_engine.kernels.build import compile_for_level, kernel_levels, kernel_march, recording
    from tandem_engine.kernels.decode_step import load_decode_kernel
    from tandem_engine.kernels.fused import load_fused_ops
    from tandem_engine.kernels.gguf_matmul import load_gguf_kernel
    from tandem_engine.kernels.paged_attention import load_kernel
    from tandem_engine.kernels.panel_matmul import load_panel_kernel
    from tandem_engine.kernels.prefill_attention import load_kernel as load_prefill_kernel
    from tandem_engine.models.loader import resolve_model, weights_dir

    t0 = time.perf_counter()
    d = weights_dir(resolve_model(model, cache_dir))
    if kernel:
        with recording() as built:
            load_gguf_kernel(cache_dir)  # RuntimeError naming the flag if it cannot be built
            if load_kernel(cache_dir) is None or load_prefill_kernel(cache_dir) is None \
                    or not load_fused_ops(cache_dir).native \
                    or load_decode_kernel(cache_dir) is None or load_panel_kernel(cache_dir) is None:
                raise RuntimeError("the CPU kernels could not be built (is a C compiler installed?)")
            if platform.machine() in ("x86_64", "AMD64"):  # for nodes with AMX; a compiler without it only warns
                build_amx_kernel(cache_dir)
        # The other ISA levels TANDEM_CPU_KERNEL_MARCH lists (an image's: x86-64-v4 for AVX-512 nodes), compiled
        # for the nodes that have them; this machine may not.
        for level in kernel_levels():
            if level != kernel_march():
                for name, source, flags in built:
                    try:
                        compile_for_level(name, source, flags, level, cache_dir)
                    except (OSError, subprocess.SubprocessError) as e:
                        raise RuntimeError(f"the {name} kernel could not be built for {level}: {e}") from e
                logger.info("[startup] CPU kernels compiled for %s too", level)
    logger.info("[startup] prepared %s in %s in %.1fs", model, d, time.perf_counter() - t0)
    return d


def main(argv: list[str] | None = None) -> int:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m tandem_engine.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=defaults.model, help="as `tandem serve --model`")
    p.add_argument("--cache-dir", default=defaults.cache_dir, help="as `tandem serve --cache-dir`")
    p.add_argument("--no-kernel", action="store_true", help="skip the CPU kernels")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        prepare(args.model, Path(args.cache_dir).expanduser(), kernel=not args.no_kernel)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
