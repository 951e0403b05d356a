"""Everything that crosses the KV-transfer boundary, as msgspec Structs.

Two wires meet here (docs/contracts.md, docs/architecture.md):

- `kv_transfer_params`, the JSON object of the OpenAI API's P/D extension. A client (the router) sends
  `RemoteDecodeParams` to a prefill engine; the prefill engine answers with `RemotePrefillParams`, which
  the client hands unchanged to a decode engine. Field names and their order are the HTTP contract, so
  these Structs are untagged. The router cannot import the engine and keeps its own copy in
  tandem_router/request.py; tests/engine/kv_transfer/test_kv_params_roundtrip.py proves the two agree.
- The side channel of a prefill engine (msgpack over ZMQ REQ/ROUTER, side_channel.py): a request is one
  of `SideChannelRequest`, the answer one of `SideChannelReply`, tagged by class name.

The engine's HTTP and ZMQ layers carry `kv_transfer_params` as an opaque dict; only the connector reads
it, through `wants_remote_decode` and `remote_prefill_params`.
"""

from __future__ import annotations

from typing import Any

import msgspec

# -- kv_transfer_params (HTTP JSON) ---------------------------------------------------------------


class RemoteDecodeParams(msgspec.Struct, kw_only=True):
    """Sent to a prefill engine: compute the prompt, then hold its blocks for a remote decode.
    Build it with no arguments; the nulls are part of the form clients send."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None


class RemotePrefillParams(msgspec.Struct, kw_only=True):
    """A prefill engine's answer, handed to a decode engine: where the prompt's blocks are held.
    `remote_engine_id` carries the prefill engine's boot nonce; `block_size` 0 means not stated."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    tp_size: int = 1
    block_size: int = 0
    lease_seconds: float = 0.0


class _Flags(msgspec.Struct):
    """The two flags every form carries: which leg of a P/D pair a request is."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False


def _flags(raw: dict[str, Any] | None) -> _Flags:
    if not raw:
        return _Flags()
    try:
        return msgspec.convert(raw, _Flags, strict=False)
    except msgspec.ValidationError:
        return _Flags()


def wants_remote_decode(raw: dict[str, Any] | None) -> bool:
    """A prefill engine's reading of a request's `kv_transfer_params`: hold its blocks afterwards."""
    return _flags(raw).do_remote_decode


def remote_prefill_params(raw: dict[str, Any] | None) -> RemotePrefillParams | None:
    """A decode engine's reading: None when the request names no remote prefill. Raises
    msgspec.ValidationError when it names one malformed (the caller then prefills locally)."""
    if not _flags(raw).do_remote_prefill:
        return None
    # Not strict: "5600" is a port, as it was when the params were read by hand.
    return msgspec.convert(raw, RemotePrefillParams, strict=False)


# -- the side channel (msgpack) -------------------------------------------------------------------


class Handshake(msgspec.Struct, tag=True):
    engine_id: str  # the asking (decode) engine, for the log


class Heartbeat(msgspec.Struct, tag=True):
    """Extend the leases of these remote request ids."""

    ids: list[str]


class Release(msgspec.Struct, tag=True):
    """The decode engine is done with a request's blocks (`num_blocks` read; 0 when it read none)."""

    request_id: str
    num_blocks: int


class Debug(msgspec.Struct, tag=True):
    pass


SideChannelRequest = Handshake | Heartbeat | Release | Debug


class HandshakeReply(msgspec.Struct, tag=True):
    """The prefill engine's agent and the layout of its registered KV pool."""

    engine_id: str
    agent_metadata: bytes
    base_addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int
    layout: str
    compat_hash: str
    mem_type: str = "DRAM"
    kv_cache_dtype: str = ""  # "bfloat16": named so a mismatch is refused in words, not only by the hash


class HeartbeatReply(msgspec.Struct, tag=True):
    expired: list[str]  # asked-about ids no longer held: the decode engine must not read them


class Ack(msgspec.Struct, tag=True):
    pass


class LeaseView(msgspec.Struct):
    blocks: int
    expires_in_s: float


class DebugView(msgspec.Struct, tag=True):
    """Held blocks per request (prefill) and loads in flight (decode)."""

    engine_id: str
    held_blocks: int
    leases: dict[str, LeaseView]
    loading: list[str]


class ErrorReply(msgspec.Struct, tag=True):
    error: str


SideChannelReply = HandshakeReply | HeartbeatReply | Ack | DebugView | ErrorReply

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(SideChannelRequest)
reply_decoder = msgspec.msgpack.Decoder(SideChannelReply)
