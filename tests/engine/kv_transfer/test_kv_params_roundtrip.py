"""The engine's and the router's copies of `kv_transfer_params` (tandem_engine/kv_transfer/messages.py,
tandem_router/request.py) read each other's JSON, both ways, and keep the HTTP field names and order."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tandem_engine.kv_transfer import messages as engine
from tandem_router import request as router

REQUEST_FORM = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
RESPONSE_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
                 "remote_block_ids", "remote_host", "remote_port", "tp_size", "block_size", "lease_seconds"]
FULL: dict[str, Any] = dict(remote_engine_id="host-dp0-0123456789ab", remote_request_id="cmpl-7-0",
                            remote_block_ids=[4, 9, 2], remote_host="10.0.0.7", remote_port=5601, tp_size=1,
                            block_size=16, lease_seconds=30.0)


def wire(obj: Any) -> dict[str, Any]:
    """What crosses HTTP: the Struct as JSON, read back as a plain object."""
    out: dict[str, Any] = json.loads(msgspec.json.encode(obj))
    return out


@pytest.mark.parametrize("form", [engine.RemoteDecodeParams, engine.RemotePrefillParams])
def test_both_copies_have_the_same_fields_in_the_same_order(form: type[msgspec.Struct]) -> None:
    other = getattr(router, form.__name__)
    assert form.__struct_fields__ == other.__struct_fields__


def test_request_form_router_to_engine_and_back() -> None:
    body = router.prefill_body(router.parse_request("completions", b'{"prompt": "hi", "max_tokens": 9}'))
    sent = json.loads(json.dumps(body))["kv_transfer_params"]
    assert list(sent.items()) == list(REQUEST_FORM.items())  # the wire form, key order included
    assert engine.wants_remote_decode(sent) and engine.remote_prefill_params(sent) is None
    theirs = msgspec.convert(sent, engine.RemoteDecodeParams)
    assert theirs == engine.RemoteDecodeParams() and wire(theirs) == sent
    assert msgspec.convert(wire(engine.RemoteDecodeParams()), router.RemoteDecodeParams) == router.RemoteDecodeParams()


def test_full_response_form_engine_to_router_to_engine() -> None:
    made = engine.RemotePrefillParams(**FULL)
    answer = json.dumps({"id": "cmpl-7", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": wire(made)})
    got = msgspec.json.decode(answer, type=router.PrefillAnswer).kv_transfer_params
    assert got == router.RemotePrefillParams(**FULL)
    forwarded = json.loads(json.dumps(router.decode_body(router.parse_request("completions", b'{"prompt": "hi"}'),
                                                          got)))["kv_transfer_params"]
    assert list(forwarded) == RESPONSE_KEYS and forwarded == wire(made)
    assert engine.remote_prefill_params(forwarded) == made
    assert not engine.wants_remote_decode(forwarded)


def test_full_response_form_router_to_engine() -> None:
    made = router.RemotePrefillParams(**FULL)
    theirs = engine.remote_prefill_params(wire(made))
    assert theirs == engine.RemotePrefillParams(**FULL)
    assert msgspec.convert(wire(theirs), router.RemotePrefillParams) == made


def test_router_forwards_a_short_answer_without_inventing_fields() -> None:
    short = {k: v for k, v in wire(engine.RemotePrefillParams(**FULL)).items()
             if k not in ("tp_size", "block_size", "lease_seconds")}
    got = msgspec.convert(short, router.RemotePrefillParams)
    assert msgspec.to_builtins(got) == short
    parsed = engine.remote_prefill_params(short)
    assert parsed is not None and parsed.block_size == 0  # not stated: the decode engine checks nothing


def test_engine_reads_loose_numbers_and_rejects_missing_fields() -> None:
    loose = {**wire(engine.RemotePrefillParams(**FULL)), "remote_port": "5601"}
    parsed = engine.remote_prefill_params(loose)
    assert parsed is not None and parsed.remote_port == 5601
    with pytest.raises(msgspec.ValidationError, match="remote_block_ids"):
        engine.remote_prefill_params({k: v for k, v in loose.items() if k != "remote_block_ids"})
    with pytest.raises(msgspec.ValidationError):
        answer = json.dumps({"kv_transfer_params": {**loose, "remote_port": "x"}})
        msgspec.json.decode(answer, type=router.PrefillAnswer)
