"""Complex activations (an FFT mixer's) crossing a cut: they travel as their real view
(torch.view_as_real) and are received as a complex view of that buffer, forward and backward, under
both message transports; the profile records them as carrying gradients, at their own bytes."""
import pytest
import torch

from runtime.comm import DescribedLayout, MessageLayout, PresenceLayout
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state

ENTRY = "tests.models:complex_mixer"  # units a, fft, mix, ifft, b: complex between fft and ifft
CPU = torch.device("cpu")
COMPLEX = [torch.complex64, torch.complex128, torch.complex32]


def _same(a, b):
    """Equal values and dtype (torch.equal has no complex32 kernel: compare the real views)."""
    return a.dtype == b.dtype and torch.equal(torch.view_as_real(a), torch.view_as_real(b))


def _values(dtype):
    value = torch.randn(2, 3, dtype=dtype.to_real()) if dtype != torch.complex32 else torch.randn(2, 3).half()
    return torch.complex(value, -value).to(dtype)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_one_complex_tensor_travels_as_its_real_view(dtype):
    layout = MessageLayout([((2, 3), dtype)], "test")
    sent = _values(dtype)
    wire, copied = layout.pack([sent], CPU)
    assert not wire.is_complex() and wire.shape == (2, 3, 2) and not copied  # a view, the same bytes
    received = layout.empty(CPU)
    assert received.shape == wire.shape and received.dtype == wire.dtype
    received.copy_(wire)
    (back,) = layout.unpack(received)
    assert _same(back, sent)


def test_a_conjugated_complex_tensor_is_sent_resolved():
    # `conj()` is lazy, a flag view_as_real refuses: the message carries the conjugated values (a copy)
    value = _values(torch.complex64)
    wire, copied = MessageLayout([((2, 3), torch.complex64)], "test").pack([value.conj()], CPU)
    assert copied and _same(torch.view_as_complex(wire), value.conj().resolve_conj())


@pytest.mark.parametrize("dtype", COMPLEX)
def test_complex_tensors_in_a_byte_buffer(dtype):
    layout = MessageLayout([((2, 3), torch.float32), ((2, 3), dtype)], "test")
    sent = [torch.randn(2, 3), _values(dtype)]
    wire, _ = layout.pack(sent, CPU)
    assert wire.dtype == torch.uint8 and wire.numel() == layout.nbytes
    received = layout.unpack(wire)
    assert torch.equal(received[0], sent[0]) and _same(received[1], sent[1])
    framed = PresenceLayout(layout)  # a gradient message's first: flags, then the same layout
    grads, present = framed.unpack(framed.pack(sent, [False, True], CPU))
    assert present == (False, True) and _same(grads[1], sent[1])


def test_a_described_message_has_room_for_complex128():
    # the first message under autocast says its dtypes: each tensor's room is 16 bytes an element here
    planned = MessageLayout([((2, 3), torch.complex128), ((2, 3), torch.float32)], "test")
    described = DescribedLayout(planned)
    sent = [_values(torch.complex128), torch.randn(2, 3).bfloat16()]
    wire, _ = described.pack(sent, CPU)
    assert wire.numel() == described.nbytes
    received, exact = described.unpack(wire)
    assert _same(received[0], sent[0]) and torch.equal(received[1], sent[1])
    assert [d for _, d in exact.tensors] == [torch.complex128, torch.bfloat16]


def test_the_profile_records_complex_values_with_gradients():
    cuts = {c.before_unit: c.values for c in profile_of(ENTRY, {}, sizes=(2,)).cuts}
    (fft,) = cuts[2]
    assert fft.dtype == "complex64" and fft.requires_grad and fft.bytes[2] == 2 * 8 * 8  # 8 bytes each


@pytest.mark.parametrize("args, cut, p2p", [
    ({}, 2, "auto"),  # the FFT's output alone crosses: one complex64 tensor a message, as its real view,
    ({}, 2, "gloo"),  # through shared memory or gloo
    ({"dtype": "complex128", "skip": True}, 3, "auto"),  # complex128 beside a real skip: in a byte buffer
])
def test_complex_activations_train_like_one_process(tmp_path, args, cut, p2p):
    plan = plan_with(profile_of(ENTRY, args, sizes=(2,)), [cut], 2, 8)
    assert any(v.get("dtype", "").startswith("complex") and v["requires_grad"] for v in plan.stages[0].send)
    state = execute(plan, tmp_path, steps=2, extra=["--p2p", p2p])
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5
