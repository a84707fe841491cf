import numpy as np
import pytest

from llmscale.data.corpus import is_val_file, list_files, load_corpus, stdlib_source_dir
from llmscale.data.stream import PackedStream
from llmscale.data.tokenizer import ByteTokenizer
from llmscale.errors import ConfigError


def test_tokenizer_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' + x  # ünïcode"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    assert len(tok.encode(text)) == len(text.encode())


def test_stdlib_corpus_is_present_and_split_by_file(tmp_path) -> None:
    assert (stdlib_source_dir() / "os.py").is_file()
    c = load_corpus("", "**/*.py", 0.2, max_files=30)
    assert c.n_train_files + c.n_val_files == 30
    assert c.n_val_files > 0 and len(c.val) > 0
    assert c.train.dtype == np.uint16
    # The split is by file name (CRC32), so it is the same on every machine: checked against
    # a CRC-32 written out bit by bit here (the standard's check value 0xCBF43926 first).
    assert _crc32(b"123456789") == 0xCBF43926
    names = ["abc.py", "os.py", "json/__init__.py", "a.py", "re.py", "x.py", "ünï.py"]
    split = [_crc32(n.encode()) % 10_000 < 2_000 for n in names]
    assert [is_val_file(n, 0.2) for n in names] == split
    assert split == [False, True, False, True, True, False, False]
    files = list_files(c.root, "**/*.py", 30)
    hand = sum(_crc32(str(f.relative_to(c.root)).encode()) % 10_000 < 2_000 for f in files)
    assert c.n_val_files == hand


def _crc32(data: bytes) -> int:
    """CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_missing_folder_and_empty_glob_name_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.path"):
        load_corpus(str(tmp_path / "nope"), "**/*.py", 0.1)
    with pytest.raises(ConfigError, match="data.glob"):
        load_corpus(str(tmp_path), "**/*.xyz", 0.1)


def _tokens(n: int) -> np.ndarray:
    return (np.arange(n) % 250).astype(np.uint16)


def test_stream_windows_are_next_token_pairs_and_cover_an_epoch() -> None:
    toks = _tokens(1 + 16 * 10)
    s = PackedStream(toks, seq_len=16, seed=3)
    assert s.n_windows == 10
    rows = [s.next_batch(2) for _ in range(5)]
    starts = sorted(int(r[0]) for b in rows for r in b)
    assert starts == [int(toks[i * 16]) for i in range(10)]  # every window exactly once
    assert s.state.epoch == 1 and s.state.cursor == 0


def test_stream_is_seeded_and_resumable() -> None:
    toks = _tokens(5000)
    a = PackedStream(toks, 32, seed=7)
    first = [a.next_batch(8) for _ in range(3)]
    state = a.state.to_dict()
    rest = [a.next_batch(8) for _ in range(30)]  # crosses an epoch boundary
    b = PackedStream(toks, 32, seed=7)
    assert all(
        (x == y).all() for x, y in zip(first, [b.next_batch(8) for _ in range(3)], strict=True)
    )
    c = PackedStream(toks, 32, seed=7)
    c.state = type(c.state).from_dict(state)
    assert all(
        (x == y).all() for x, y in zip(rest, [c.next_batch(8) for _ in range(30)], strict=True)
    )
    d = PackedStream(toks, 32, seed=8)
    assert not (d.next_batch(8) == first[0]).all()


def test_dp_ranks_split_each_global_batch() -> None:
    toks = _tokens(5000)
    whole = PackedStream(toks, 32, seed=1).next_batch(8)
    parts = [PackedStream(toks, 32, seed=1, dp_rank=r, dp_size=4).next_batch(8) for r in range(4)]
    assert all(p.shape == (2, 33) for p in parts)
    assert (np.concatenate(parts) == whole.numpy()).all()


def test_corpus_too_small_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        PackedStream(_tokens(10), 32, seed=0)
