"""Runs one scheduler step through the model: builds the flattened batch and attention metadata,
executes the forward pass over the paged KV cache, and samples at each request's last position.

The KV cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, so the
whole pool can be registered for KV transfer once; each layer gets (k, v) views of it. Its dtype is
`--kv-cache-dtype` (auto: the model's); the pool's size in blocks follows from its real bytes per block.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata
from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer.interface import KVConnectorWorker
from tandem_engine.models.loader import LoadedModel, pick_dtype
from tandem_engine.scheduler_output import SampledToken, SchedulerOutput
from tandem_engine.worker.sampler import Sampler
from tandem_engine.worker.weight_plan import plan_weights

logger = logging.getLogger(__name__)


def kv_layout(hf_config: object) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a Llama-family config."""
    heads = hf_config.num_attention_heads  # type: ignore[attr-defined]
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads  # type: ignore[attr-defined]
    return hf_config.num_hidden_layers, kv_heads, head_dim  # type: ignore[attr-defined]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores for `--kv-cache-dtype name` under a model computing in `model_dtype`."""
    return model_dtype if name == "auto" else pick_dtype(name)


def kv_cache_blocks(config: EngineConfig, layout: tuple[int, int, int], kv_dtype: torch.dtype) -> int:
    """The KV blocks an engine holds: --num-kv-blocks, else as many as --kv-cache-gib takes of a model whose
    kv_layout is `layout`."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    num_layers, num_kv_heads, head_dim = layout
    per_block = 2 * num_layers * config.block_size * num_kv_heads * head_dim * kv_dtype.itemsize
    return max(2, int(config.kv_cache_gib * (1 << 30)) // per_block)


def select_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    name = config.attention_backend
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from tandem_engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from tandem_engine.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(use_kernel=None if config.cpu_attention_kernel else False,
                                 cache_dir=config.cache_path)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.device = device or torch.device("cpu")
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = select_backend(config, self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(loaded.hf_config)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        ops = plan_weights(self.model, config, self.device, self.backend, self.kv_dtype)
        self.sampler = Sampler(ops.argmax)
        self.num_blocks = self._num_blocks()
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_pool = torch.zeros(
            self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            dtype=self.kv_dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(self.num_layers)]
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_connector: KVConnectorWorker | None = None

    def register_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Hand the whole pool to the KV connector once (it registers it with its transport)."""
        connector.register_kv_caches(self.kv_pool)
        self.kv_connector = connector

    @property
    def kv_dtype_name(self) -> str:
        """The cache dtype as `--kv-cache-dtype` spells it ("bfloat16")."""
        return str(self.kv_dtype).removeprefix("torch.")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer's K (or V) cache."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv_pool.element_size()

    def _num_blocks(self) -> int:
        return kv_cache_blocks(self.config, (self.num_layers, self.num_kv_heads, self.head_dim), self.kv_dtype)

    def warm_up(self) -> float:
        """One prefill and one decode-shaped step on scratch blocks, so the first request is not slow."""
        t0 = time.perf_counter()
        n = min(32, self.max_model_len - 1, (self.num_blocks - 1) * self.block_size - 1)
        blocks = list(range(1, -(-(n + 1) // self.block_size) + 1))
        ids = list(range(n))
        self._forward([ids], [0], [blocks], [True])
        self._forward([[1]], [n], [blocks], [True])
        return time.perf_counter() - t0

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        items = sched.scheduled
        tokens = [it.request.all_token_ids[it.start : it.start + it.num_tokens] for it in items]
        logits = self._forward(tokens, [it.start for it in items], [it.block_ids for it in items],
                               [it.sample for it in items])
        sampling = [it.request for it in items if it.sample]
        if not sampling:
            return {}
        # The sampler works on host tensors: [num_sampled, vocab] is small next to the forward pass.
        sampled = self.sampler(logits.cpu(), sampling)
        return {r.request_id: s for r, s in zip(sampling, sampled, strict=True)}

    @torch.inference_mode()
    def _forward(self, tokens: list[list[int]], starts: list[int], block_ids: list[list[int]],
                 sample: list[bool]) -> torch.Tensor:
        """Forward the flattened batch; returns logits `[num_sampled, vocab]` (float32)."""
        bs = self.block_size
        query_lens = [len(t) for t in tokens]
        seq_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
        num_seqs = len(tokens)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        input_ids = np.fromiter((t for seq in tokens for t in seq), dtype=np.int64, count=int(qsl[-1]))
        max_blocks = max(-(-s // bs) for s in seq_lens)
        table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, b in enumerate(block_ids):
            nb = min(len(b), max_blocks)
            table[i, :nb] = b[:nb]
        # positions of every token, and its slot = block_table[pos // bs] * bs + pos % bs
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1], query_lens) \
            + np.repeat(np.asarray(starts, dtype=np.int64), query_lens)
        slots = table[seq_index, positions // bs] * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(table.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev),
                            self.kv_caches, meta, self.backend)
        last = torch.from_numpy(qsl[1:][np.asarray(sample, dtype=bool)] - 1).to(dev)
        return self.model.compute_logits(hidden.index_select(0, last)).float()
