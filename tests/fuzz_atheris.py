"""Coverage-guided fuzzing of the CommitLog decoders with atheris (optional; not collected by pytest).

    pip install atheris            # not a dependency of reputd
    python tests/fuzz_atheris.py -runs=200000 -seed=1 [CORPUS_DIR]

Each input is taken as the bytes of one segment (a BLANK is appended so the segment ends as a broker's
does) and goes through `decode_segment` and `MessageRecord.decode`. The only exception allowed is
`CorruptRecordError`; a record either decoder accepts must re-encode to its own bytes, and the two
decoders must agree on the first record. Anything else raises, and atheris reports the input. The seed
corpus is a few valid records, so mutations start from real layouts. tests/test_fuzz.py runs this
script in `make stress` (REPUTD_STRESS=1) when atheris is installed.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from indexcore.commitlog import BLANK_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2, Host, MessageRecord
    from indexcore.errors import CorruptRecordError
    from indexcore.reader import Stop, decode_segment

BLANK = struct.pack(">ii", 8, BLANK_MAGIC_CODE)


def seeds() -> list[bytes]:
    out = []
    for topic, props, body, v6, magic in [
        ("TopicA", b"KEYS\x01k1 k2\x02TAGS\x01TagA\x02UNIQ_KEY\x01C0A8010A", b"test", False, None),
        ("订单Topic", b"TAGS\x01\xe6\xa0\x87\x02", b"", True, None),
        ("SCHEDULE_TOPIC_XXXX", b"DELAY\x013\x02REAL_TOPIC\x01T", b"x" * 40, False, None),
        ("T" * 150, b"", b"b", False, MESSAGE_MAGIC_CODE_V2),
    ]:
        host = Host(bytes(range(16)), 1) if v6 else Host(bytes([10, 0, 0, 1]), 1)
        rec = MessageRecord(topic, 0, 0, 0, 0, 0x30 if v6 else 0, 1, host, 2, host, 0, 0, body, props,
                            zlib.crc32(body) & 0x7FFFFFFF, *([magic] if magic else []))
        out.append(rec.encode())
    return out


def check(data: bytes) -> None:
    buf = data + BLANK
    try:
        first = MessageRecord.decode(buf, 0)
    except CorruptRecordError:
        first = None
    if first is not None:
        assert first.encode() == buf[: first.total_size]
    res = decode_segment(buf, 0, segment_offset=0, segment_size=len(buf), max_bytes=len(buf))
    if res.stop is Stop.ERROR and (not isinstance(res.error, CorruptRecordError)
                                   or res.error.offset != res.position):
        raise AssertionError(f"untyped or misplaced error {res.error!r}")
    pos = 0
    for phy, size in zip(res.batch.phy_offset.tolist(), res.batch.msg_size.tolist(), strict=True):
        if phy != pos or size <= 0 or pos + size > len(buf):
            raise AssertionError(f"accepted record out of place: phy {phy} size {size} at {pos}")
        rec = MessageRecord.decode(buf, pos)  # what the batch path accepts, the record decoder must accept
        if rec.total_size != size:
            raise AssertionError(f"decoders disagree on the size at {pos}: {rec.total_size} != {size}")
        pos += size
    if pos != res.position:
        raise AssertionError(f"stopped at {res.position}, records end at {pos}")


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    if corpus:
        d = Path(corpus[0])
        d.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds()):
            (d / f"seed-{i}").write_bytes(seed)
    atheris.Setup(sys.argv, lambda data: check(bytes(data)))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
