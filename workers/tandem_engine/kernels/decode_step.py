"""The whole-step kernel (decode_step.c): every layer of a step, decode rows and prefill chunks, in one
OpenMP region. Here: its C structures field for field, and its build; worker/decode_step.py assembles a
model's step from them (docs/architecture.md, "One C call per step")."""

from __future__ import annotations

import ctypes
from pathlib import Path

from tandem_engine.kernels.build import base_flags, try_build

SOURCE = (Path(__file__).parent / "decode_step.c").read_text()
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # in decode_step.c's layer_t order

p_, i64 = ctypes.c_void_p, ctypes.c_int64


# The structures of decode_step.c, field for field.
class CPart(ctypes.Structure):
    _fields_ = [("data", p_), ("rows", i64), ("qtype", i64)]


class CProj(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(CPart)), ("n_parts", i64), ("cols", i64)]


class CLayer(ctypes.Structure):
    _fields_ = [*((name, CProj) for name in PROJECTIONS), ("post_attn_norm", p_), ("next_norm", p_)]


class CKernels(ctypes.Structure):
    _fields_ = [(name, p_) for name in ("quantize", "matmul_cols", "add_rms_norm_row", "silu_mul_row",
                                        "attention_heads", "prefill_attention_item", "matmul_rows")]


class CModel(ctypes.Structure):
    _fields_ = [("k", CKernels), ("layers", ctypes.POINTER(CLayer)),
                *((name, i64) for name in ("n_layers", "hidden", "inter", "nq", "nkv", "d")),
                ("first_norm", p_), ("rope_cos", p_), ("rope_sin", p_), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("col_align", i64), ("row_block_bytes", i64)]


class CStep(ctypes.Structure):
    _fields_ = [("m", i64), *((name, p_) for name in ("x", "h", "positions", "slots", "klens", "table")),
                ("table_stride", i64), ("bs", i64), ("kv_type", i64),
                *((name, p_) for name in ("kv", "qkv", "attn", "o", "gu", "act", "down", "xq", "scratch")),
                ("scratch_per_thread", i64), ("phase_ns", p_), ("prefill_items", i64),
                *((f"prefill_{name}", p_) for name in ("seq_ids", "q_starts", "q_lens", "seq_lens", "table")),
                ("prefill_table_stride", i64)]


# decode_step.c's phases, in step_t.phase_ns order.
PHASES = ("qkv_rope_kv_write", "attention", "attention_out", "o", "norm_residual", "gate_up", "activation", "down")



def build_flags() -> tuple[str, ...]:
    """decode_step.c's compile flags: no contraction, so that its RoPE and adds round as torch's ops do."""
    return (*base_flags(), "-ffp-contract=off")


def load_decode_kernel(cache_dir: Path) -> ctypes.CDLL | None:
    """The fused decode step's C kernel, built once under `cache_dir` (kernels/build.py); None, with a
    warning, when it cannot be."""
    return try_build("decode_step", SOURCE, build_flags(), cache_dir,
                     "decode steps run op by op")
