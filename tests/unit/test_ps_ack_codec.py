"""The push ack's short path: the same bytes as the general codec, and nothing it would refuse."""

import pytest

from trainmesh.ps.ack_codec import AckWriter, read_ack
from trainmesh.ps.protocol import Message, MessageType, ProtocolError, _check_secret, encode
from trainmesh.ps.frame_decode import decode

pytestmark = pytest.mark.timeout(60)

SENDERS = ["ps", "ps-0", "tcp://127.0.0.1:5555", "host_1.example:80", "", "é-server", 'q"uote']
SEQS = [0, 1, 7, 8, 123, 99999, 10**17 - 1, 10**18, 2**62]


@pytest.mark.parametrize("secret", [None, b"k3y", "another secret"])
@pytest.mark.parametrize("sender", SENDERS)
def test_writer_matches_the_general_encoder_and_reader_matches_the_general_decoder(sender, secret):
    writer = AckWriter(sender, secret)
    for seq in SEQS:
        general = bytes(encode(Message(MessageType.ACK, sender, seq, meta={"seq": seq}), secret))
        fast = writer.encode(seq)
        assert fast == general, (sender, seq)
        expected = decode(general, secret)
        read = read_ack(fast, _check_secret(secret))
        plain = sender.isascii() and '"' not in sender and seq < 10**18
        if plain:  # a plain sender and an 18-digit seq: the short path reads it, to the same message
            assert read == expected
        else:  # anything else is left to the general decoder
            assert read is None


def test_frames_of_another_shape_are_left_to_the_general_decoder():
    key = _check_secret(b"secret")
    ack = AckWriter("ps-0", b"secret").encode(41)
    assert read_ack(ack, key).seq == 41
    # a tampered byte (seq digit), a wrong secret, no secret, a truncated or extended frame
    tampered = ack.replace(b'"seq":41,', b'"seq":42,')
    for frame, secret in [
        (tampered, b"secret"),
        (ack, b"other"),
        (ack, None),
        (ack[:-1], b"secret"),
        (ack + b"\0", b"secret"),
    ]:
        assert read_ack(frame, _check_secret(secret)) is None
        with pytest.raises(ProtocolError):
            decode(frame, secret)
    # the two seqs disagree (a frame the server never writes): refused by the short path, and the
    # general decoder reads it as what it says
    unsigned = AckWriter("ps-0").encode(5).replace(b'"meta":{"seq":5}', b'"meta":{"seq":6}')
    assert read_ack(unsigned, None) is None
    assert decode(unsigned).seq == 5 and decode(unsigned).meta == {"seq": 6}
    # other message types, a bytearray and a list of parts go the general way
    ok = bytes(encode(Message(MessageType.OK, "ps-0", 3)))
    assert read_ack(ok, None) is None
    plain = AckWriter("ps-0").encode(3)
    assert read_ack(bytearray(plain), None) is None and read_ack([plain], None) is None
    assert read_ack(plain, None).seq == 3
