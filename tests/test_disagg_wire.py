"""Small, model-free checks of what the prefill and decode workers trust each other with (wire.py: the
shared secret, signed metadata, tensor specs and digests) and of the first token the prefill worker
samples for the decode worker (first_token.py). Each test names the wrong behaviour it would catch;
the end-to-end versions of these paths (real workers, a corrupted layer, a wrong secret) live in
test_disagg_faults.py and test_disagg_workers.py and take a model and seconds each."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sparsekv import SamplingParams
from sparsekv.disagg.first_token import (first_token_of, first_token_params, first_token_wire,
                                         first_tokens_from_wire, plain_greedy)
from sparsekv.disagg.wire import (SECRET_MIN_BYTES, TransferError, as_bytes, check_received, digest,
                                  load_secret, pages_to_tensors, parse_dtype, sign, tensor_specs,
                                  tensors_to_pages, verify)
from sparsekv.outputs import FirstToken

SECRET = b"k" * 32
OTHER = b"j" * 32


def _write_secret(tmp_path, data: bytes, mode: int = 0o600) -> str:
    path = os.path.join(str(tmp_path), "secret")
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


# --- the shared secret ------------------------------------------------------------------------------


def test_a_secret_of_exactly_the_minimum_length_is_taken_and_one_byte_less_refused(tmp_path):
    """SECRET_MIN_BYTES is the least a secret may have: an off-by-one refused the documented minimum
    (or took a secret one byte short of it)."""
    assert load_secret(_write_secret(tmp_path, b"x" * SECRET_MIN_BYTES)) == b"x" * SECRET_MIN_BYTES
    with pytest.raises(ValueError, match=f"has {SECRET_MIN_BYTES - 1} bytes, fewer than {SECRET_MIN_BYTES}"):
        load_secret(_write_secret(tmp_path, b"x" * (SECRET_MIN_BYTES - 1)))


def test_a_secret_files_trailing_newline_is_not_part_of_the_secret(tmp_path):
    """`openssl rand -hex 32 > file` ends the file with a newline; one worker's file written with
    `printf` has none. Both must hold the same secret, or every message fails authentication."""
    assert load_secret(_write_secret(tmp_path, b"  " + b"y" * 32 + b"\n")) == b"y" * 32


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602])
def test_a_secret_file_any_other_user_may_read_or_write_is_refused(tmp_path, mode):
    """Group or others reading the secret could forge KV; writing it could swap it: each of the four
    bits refuses the file (a check of only some of them let the others through)."""
    with pytest.raises(ValueError, match=f"other users may read or write it \\(mode {mode:04o}\\)"):
        load_secret(_write_secret(tmp_path, b"z" * 32, mode))


# --- signed metadata --------------------------------------------------------------------------------


def test_a_signed_message_verifies_only_under_its_own_secret_and_unaltered():
    """A peer with another secret, or a message altered on the way (a body field changed, the MAC
    changed, the MAC gone), must never be acted on."""
    body = {"room": "r1", "names": ["aa", "bb"], "pages": [2], "last": True}
    raw = sign(SECRET, body)
    assert verify(SECRET, raw, "metadata") == body
    with pytest.raises(TransferError, match="the metadata failed authentication"):
        verify(OTHER, raw, "metadata")
    message = json.loads(raw)
    altered = json.dumps({"body": {**message["body"], "room": "r2"}, "mac": message["mac"]}).encode()
    flipped = json.dumps({"body": message["body"], "mac": message["mac"][::-1]}).encode()
    unsigned = json.dumps({"body": message["body"]}).encode()
    for bad in (altered, flipped, unsigned, b"not json", b"[1, 2]"):
        with pytest.raises(TransferError, match="failed authentication"):
            verify(SECRET, bad, "metadata")


# --- tensors: specs, digests, size checks -----------------------------------------------------------


def _pages() -> list:
    """Three pages of two kinds of rows, of two dtypes (as a latent row in bf16 and an int32 index row)."""
    return [(bytes([i]) * 16, [torch.full((4, 6), float(i), dtype=torch.bfloat16) + torch.arange(6),
                               torch.full((1, 3), i, dtype=torch.int32)]) for i in range(3)]


def test_tensors_round_trip_through_their_specs_and_bytes():
    """What a prefill worker announces (`tensor_specs`) lets the decode worker rebuild each tensor from
    its flat bytes: nbytes counts bytes, not elements (a bf16 or int32 tensor has 2 or 4 per element),
    the dtype and shape come back, and the pages come apart as they went in."""
    pages = _pages()
    tensors = pages_to_tensors(pages)
    specs = tensor_specs(SECRET, tensors)
    assert [s["nbytes"] for s in specs] == [3 * 4 * 6 * 2, 3 * 1 * 3 * 4]
    assert [s["dtype"] for s in specs] == ["bfloat16", "int32"]
    received = [check_received(SECRET, spec, as_bytes(t).clone(), i) for i, (spec, t) in enumerate(zip(specs, tensors))]
    for got, want in zip(received, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for (name, rows), (want_name, want_rows) in zip(tensors_to_pages([n for n, _ in pages], received), pages):
        assert name == want_name and all(torch.equal(a, b) for a, b in zip(rows, want_rows))


def test_a_tensor_whose_bytes_changed_in_transfer_is_refused():
    """One flipped byte, same size: the digest must catch it (the size check cannot)."""
    t = torch.arange(24, dtype=torch.float32)
    spec = tensor_specs(SECRET, [t])[0]
    data = as_bytes(t).clone()
    data[5] ^= 0xFF
    with pytest.raises(TransferError, match="tensor 3: its bytes do not match their digest"):
        check_received(SECRET, spec, data, 3)


def test_a_tensor_of_another_size_than_announced_is_refused_as_such():
    """Bytes missing (a short transfer) or extra: refused naming the sizes, before any digest."""
    t = torch.arange(24, dtype=torch.float32)
    spec = tensor_specs(SECRET, [t])[0]
    for data in (as_bytes(t)[:-4].clone(), torch.cat([as_bytes(t), torch.zeros(4, dtype=torch.uint8)])):
        with pytest.raises(TransferError, match=f"tensor 0: {data.numel()} bytes received, 96 announced"):
            check_received(SECRET, spec, data, 0)


def test_a_tensor_digest_is_keyed_by_the_secret():
    """The digest is an HMAC under a key derived from the secret: the same bytes digest differently under
    another secret, so a tensor and a spec made without the secret are refused."""
    data = as_bytes(torch.arange(24, dtype=torch.float32)).clone()
    assert digest(SECRET, data) != digest(OTHER, data)
    forged = tensor_specs(OTHER, [torch.arange(24, dtype=torch.float32)])[0]
    with pytest.raises(TransferError, match="do not match their digest"):
        check_received(SECRET, forged, data, 0)


@pytest.mark.parametrize("name", ["nn", "Tensor", "cuda", 5, None, "no_such_dtype"])
def test_a_dtype_that_names_no_torch_dtype_is_a_transfer_error(name):
    """An attribute of torch that is no dtype (a module, a class) is refused as a transfer error, not
    handed to `Tensor.view` (which raised a TypeError the worker does not expect)."""
    with pytest.raises(TransferError, match="unknown dtype"):
        parse_dtype(name)
    assert parse_dtype("float8_e4m3fn") is torch.float8_e4m3fn


def _int8_spec(**change) -> tuple[dict, torch.Tensor]:
    """A 6-byte int8 tensor's spec, with fields changed (a prefill worker's bug, or another version's)."""
    t = torch.arange(6, dtype=torch.int8)
    return {**tensor_specs(SECRET, [t])[0], **change}, as_bytes(t).clone()


@pytest.mark.parametrize("change, match", [
    ({"shape": [5]}, "6 bytes hold no int8 tensor of shape \\[5\\]"),
    ({"shape": "6"}, "hold no int8 tensor of shape '6'"),
    ({"shape": None}, "hold no int8 tensor of shape None"),
    ({"dtype": "float32"}, "6 bytes hold no float32 tensor"),
    ({"digest": None}, "do not match their digest"),
    ({"digest": "\u00e9" * 64}, "do not match their digest"),
], ids=["shape-of-other-size", "shape-no-list", "no-shape", "dtype-not-dividing-the-bytes", "no-digest",
        "digest-not-ascii"])
def test_a_tensor_spec_that_does_not_describe_its_bytes_is_a_transfer_error(change, match):
    """A signed spec whose shape or dtype does not fit the bytes announced and received, or whose digest
    is no hex string, fails the room with a TransferError (the decode worker answers 503, tells the
    prefill worker its verdict and counts a failed transfer), never a RuntimeError, TypeError or
    KeyError, which the decode worker does not expect: the prefill worker would wait for a verdict
    until its timeout."""
    spec, data = _int8_spec(**change)
    with pytest.raises(TransferError, match=f"tensor 2: .*{match}"):
        check_received(SECRET, spec, data, 2)
    good, data = _int8_spec()
    assert torch.equal(check_received(SECRET, good, data, 2), torch.arange(6, dtype=torch.int8))


def test_a_tensor_spec_of_no_dimension_is_a_transfer_error():
    """A one-byte tensor announced with shape [] fits its bytes, but every tensor a room carries has
    rows: a 0-dim tensor would fail later code that reads its first dimension with an IndexError, which
    the decode worker does not expect (no verdict, the prefill worker waits until its timeout)."""
    t = torch.ones(1, dtype=torch.int8)
    spec = {**tensor_specs(SECRET, [t])[0], "shape": []}
    with pytest.raises(TransferError, match="tensor 0: its 1 bytes hold no int8 tensor of shape \\[\\]"):
        check_received(SECRET, spec, as_bytes(t).clone(), 0)


def test_pages_named_and_pages_received_must_agree():
    """Two names for tensors of three pages (or four for three): refused, not zipped short."""
    tensors = pages_to_tensors(_pages())
    for names in ([b"a", b"b"], [b"a", b"b", b"c", b"d"]):
        with pytest.raises(TransferError, match=f"{len(names)} pages named but tensors of \\[3, 3\\] pages"):
            tensors_to_pages(names, tensors)


# --- the prefill worker's first token ---------------------------------------------------------------


def test_first_token_params_keep_the_requests_own_sampling_for_one_token():
    """The prefill samples one token with the request's parameters: min_tokens of one or more must still
    hold EOS and the stop tokens back from it (0 let the prefill end a request whose colocated run could
    not); no stop strings (the decode worker applies them to the whole text) and no prompt logprobs."""
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=3, min_tokens=5, stop=["x"], prompt_logprobs=2,
                            logprobs=2, logit_bias={4: 1.0})
    first = first_token_params(params)
    assert (first.max_tokens, first.min_tokens, first.stop, first.prompt_logprobs) == (1, 1, None, None)
    assert (first.temperature, first.seed, first.logprobs, first.logit_bias) == (0.7, 3, 2, {4: 1.0})
    assert first_token_params(SamplingParams(max_tokens=9)).min_tokens == 0
    assert params.max_tokens == 9 and params.min_tokens == 5  # the request's own are untouched


@pytest.mark.parametrize("change", [{"logit_bias": {3: 2.0}}, {"min_tokens": 1}, {"repetition_penalty": 1.2},
                                    {"structured_output": {"type": "json_object"}},
                                    {"return_routed_experts": True}, {"temperature": 0.5}])
def test_only_a_plain_greedy_request_is_plain_greedy(change):
    """A first token a drafting prefill engine takes as the argmax of the raw logits must be one: a
    bias, penalty, min_tokens, grammar, routed experts or any temperature makes it something else."""
    assert plain_greedy(SamplingParams(temperature=0.0))
    assert not plain_greedy(SamplingParams(**{"temperature": 0.0, **change}))


def test_a_first_token_carries_logprobs_and_experts_only_when_asked_and_survives_the_wire():
    from types import SimpleNamespace
    out = SimpleNamespace(token_ids=[7, 8], logprobs=[{7: -0.5, 2: -1.5}, {}], routed_experts=[[[1, 2]], [[3]]])
    asked = first_token_of(out, SamplingParams(logprobs=1, return_routed_experts=True))
    assert asked == FirstToken(7, {7: -0.5, 2: -1.5}, [[1, 2]])
    assert first_token_of(out, SamplingParams()) == FirstToken(7, None, None)
    assert first_token_of(SimpleNamespace(token_ids=[]), SamplingParams()) is None
    wire = json.loads(json.dumps([first_token_wire(asked), first_token_wire(None)]))
    assert first_tokens_from_wire(wire, 2) == [asked, None]



def test_a_first_token_asked_for_with_logprobs_0_carries_the_sampled_tokens_logprob():
    """logprobs=0 asks for the sampled token's logprob and no alternatives (OpenAI's and vLLM's): it is
    asked for, so the first token must carry it, or the decode worker refuses the first token (its
    logprobs must come exactly when the request asks for them) and the request fails."""
    from types import SimpleNamespace
    out = SimpleNamespace(token_ids=[7], logprobs=[{7: -0.5}], routed_experts=None)
    assert first_token_of(out, SamplingParams(logprobs=0)) == FirstToken(7, {7: -0.5}, None)

@pytest.mark.parametrize("entries, num_choices", [
    ([[7, None, None]], 2),                       # fewer first tokens than choices
    ([[7, None, None]] * 3, 2),                   # more
    ({"0": [7, None, None]}, 1),                  # no list
    ([[7.0, None, None]], 1),                     # a token that is no int
    ([[True, None, None]], 1),                    # a JSON boolean, which Python counts as an int
    ([[7, [[7, "-0.5"]], None]], 1),              # a logprob that is no float
    ([[7, [["7", -0.5]], None]], 1),              # a logprob's token that is no int
    ([[7, None, [[1, "2"]]]], 1),                 # an expert id that is no int
    ([[7, [[True, -0.5]], None]], 1),             # a logprob's token that is a boolean
    ([[7, None, [[1, False]]]], 1),               # an expert id that is a boolean
    ([[7, None]], 1),                             # a short entry
])
def test_malformed_first_tokens_from_the_wire_are_a_transfer_error(entries, num_choices):
    """The decode worker starts each choice from the token it is sent: a count that does not match the
    choices, or a field of the wrong type, fails the request rather than starting a choice from it. A
    JSON true or false is no id, though Python's bool is an int (an isinstance check took it as 1 or 0)."""
    with pytest.raises(TransferError, match="first token"):
        first_tokens_from_wire(entries, num_choices)
