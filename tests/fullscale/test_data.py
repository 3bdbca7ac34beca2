"""fullscale.data: byte-compatible with megatron-core 0.16.1 both ways; bad files get clear errors."""

from __future__ import annotations

import struct
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fullscale.data import (DataFormatError, GPTSamples, IndexedTokens, IndexedWriter,
                            build_source, write_indexed)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # megatron-core is the test oracle only; fullscale never imports it.
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

# megatron's builder trips a numpy-2 copy= deprecation on torch tensors; not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _docs(seed=0, num_docs=40, vocab=32000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 60))) for _ in range(num_docs)]


def _megatron_write(prefix, docs, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_item(torch.from_numpy(np.asarray(d, dtype=np.int64)))
        b.end_document()
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_ours_is_byte_identical_to_megatron_builder_and_reads_back(tmp_path, dtype):
    vocab = 250 if dtype == np.uint8 else 32000
    docs = _docs(num_docs=40, vocab=vocab)
    ours, theirs = str(tmp_path / "ours_text_document"), str(tmp_path / "theirs_text_document")
    write_indexed(ours, docs, dtype)
    _megatron_write(theirs, docs, dtype)
    for ext in (".idx", ".bin"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
    ds = IndexedDataset(ours)                                   # their reader on our files
    assert len(ds) == len(docs)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    assert DType.dtype_from_code(open(ours + ".idx", "rb").read()[17]) == dtype


def test_megatron_multi_sequence_documents_read_with_ours(tmp_path):
    """Their builder, several sequences per document (add_document with lengths) -> our reader."""
    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "m_text_document")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    seqs_per_doc = [3, 1, 2, 0, 4]
    all_seqs = []
    for n in seqs_per_doc:
        seqs = [rng.integers(0, 32000, size=int(rng.integers(1, 9))) for _ in range(n)]
        all_seqs += seqs
        lengths = [len(s) for s in seqs]
        b.add_document(torch.from_numpy(np.concatenate(seqs) if seqs else np.zeros(0, np.int64)), lengths)
    b.finalize(prefix + ".idx")
    ds = IndexedTokens(prefix + ".bin")          # a .bin/.idx path works as the prefix too
    assert (ds.num_sequences, ds.num_documents, ds.dtype.name) == (10, 5, "uint16")
    assert list(ds.document_indices) == [0, 3, 4, 6, 6, 10]
    for i, s in enumerate(all_seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds.tokens, np.concatenate(all_seqs))
    theirs = IndexedDataset(prefix)
    np.testing.assert_array_equal(theirs.sequence_lengths, ds.sequence_lengths)
    np.testing.assert_array_equal(theirs.index.sequence_pointers, ds.sequence_pointers)
    k = int(np.argmax([len(x) for x in all_seqs]))
    np.testing.assert_array_equal(theirs.get(k, offset=1, length=2), all_seqs[k][1:3])


def test_notes_example_126_byte_index(tmp_path):
    """5 sequences [3,2,4,1,2] in 3 documents -> 126-byte .idx, doc indices [0,2,3,5]."""
    prefix = str(tmp_path / "n")
    with IndexedWriter(prefix, np.uint16) as w:
        for group in ([3, 2], [4], [1, 2]):
            for n in group:
                w.add_item(np.arange(n))
            w.end_document()
    assert (tmp_path / "n.idx").stat().st_size == 126
    ds = IndexedTokens(prefix)
    assert list(ds.document_indices) == [0, 2, 3, 5] and ds.num_tokens == 12
    assert list(ds.sequence_pointers) == [0, 6, 10, 18, 20]


def test_gpt_samples_cut_the_stream_with_one_token_overlap(tmp_path):
    docs = [np.arange(0, 10), np.arange(10, 17), np.arange(17, 30)]
    prefix = str(tmp_path / "g")
    write_indexed(prefix, docs)
    s = GPTSamples(IndexedTokens(prefix), seq_len=8, vocab_size=64)
    assert len(s) == (30 - 1) // 8 == 3
    np.testing.assert_array_equal(s[0], np.arange(0, 9))
    np.testing.assert_array_equal(s[1], np.arange(8, 17))    # crosses a document boundary
    np.testing.assert_array_equal(s[2], np.arange(16, 25))
    assert s[2].dtype == np.int64 and s.batch([2, 0]).shape == (2, 9)
    with pytest.raises(IndexError, match="out of range"):
        s[3]
    with pytest.raises(DataFormatError, match="fewer than one sample"):
        GPTSamples(IndexedTokens(prefix), seq_len=40, vocab_size=64)


def test_build_source_synthetic_and_indexed(tmp_path):
    from adamspike.order import sample_indices
    from adamspike.synthdata import SyntheticTokens
    from adamspike.train_config import DataSection

    syn = build_source(DataSection(), seq_len=16, vocab_size=64, seed=3)
    assert isinstance(syn, SyntheticTokens)
    np.testing.assert_array_equal(syn[5], SyntheticTokens("markov", 64, 16, 1 << 20, 3, 0.1)[5])
    prefix = str(tmp_path / "c_text_document")
    write_indexed(prefix, _docs(num_docs=30, vocab=64))
    src = build_source(DataSection(source="indexed", path=prefix), seq_len=16, vocab_size=64, seed=0)
    idx = sample_indices(1, 4, len(src), seed=0)
    assert src.batch(idx).shape == (4, 17) and src.batch(idx).max() < 64
    with pytest.raises(DataFormatError, match="data.path: required"):
        build_source(DataSection(source="indexed"), 16, 64, 0)


# ----------------------------------------------------------------------------- bad data

@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good_text_document")
    write_indexed(prefix, [np.arange(5), np.arange(3), np.arange(7)], np.uint16)
    return prefix


def _patch(path, offset, data):
    b = bytearray(open(path, "rb").read())
    b[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(b))


def test_missing_files(tmp_path, good):
    with pytest.raises(DataFormatError, match=r"nope\.idx: file not found"):
        IndexedTokens(str(tmp_path / "nope"))
    (tmp_path / "good_text_document.bin").unlink()
    with pytest.raises(DataFormatError, match=r"good_text_document\.bin: file not found"):
        IndexedTokens(good)


def test_bad_magic_and_legacy_format(good):
    idx = good + ".idx"
    data = open(idx, "rb").read()
    open(idx, "wb").write(b"TNTIDX\x00\x00" + data[8:])
    with pytest.raises(DataFormatError, match="legacy .*TNTIDX"):
        IndexedTokens(good)
    open(idx, "wb").write(b"GARBAGE!!" + data[9:])
    with pytest.raises(DataFormatError, match="not a Megatron mmap index"):
        IndexedTokens(good)


def test_bad_version_and_dtype_codes(good):
    idx = good + ".idx"
    _patch(idx, 9, struct.pack("<Q", 2))
    with pytest.raises(DataFormatError, match="unsupported index version 2"):
        IndexedTokens(good)
    _patch(idx, 9, struct.pack("<Q", 1))
    _patch(idx, 17, bytes([9]))
    with pytest.raises(DataFormatError, match="unknown dtype code 9"):
        IndexedTokens(good)
    _patch(idx, 17, bytes([7]))
    with pytest.raises(DataFormatError, match="float32.*not an integer token dtype"):
        IndexedTokens(good)


def test_index_size_inconsistent_with_header(good):
    idx = good + ".idx"
    data = open(idx, "rb").read()
    open(idx, "wb").write(data[:-5])
    with pytest.raises(DataFormatError, match="implies 102 .*truncated or corrupt"):
        IndexedTokens(good)
    open(idx, "wb").write(data[:18] + struct.pack("<Q", 4) + data[26:])   # S=4, sizes say 3
    with pytest.raises(DataFormatError, match="header \\(4 sequences"):
        IndexedTokens(good)


def test_truncated_and_mismatched_bin(good):
    b = good + ".bin"
    data = open(b, "rb").read()
    open(b, "wb").write(data[:14])           # 7 tokens of 15
    with pytest.raises(DataFormatError, match="truncated: 14 bytes.*30.*sequence 1 and later"):
        IndexedTokens(good)
    open(b, "wb").write(data + b"\x00\x00")
    with pytest.raises(DataFormatError, match="do not belong together"):
        IndexedTokens(good)


def test_non_monotonic_and_non_contiguous_pointers(good):
    idx = good + ".idx"
    ptr_off = 34 + 4 * 3
    _patch(idx, ptr_off, struct.pack("<qqq", 0, 16, 10))
    with pytest.raises(DataFormatError, match=r"not monotonic: pointer\[2\]=10 < pointer\[1\]=16"):
        IndexedTokens(good)
    _patch(idx, ptr_off, struct.pack("<qqq", 0, 12, 20))
    with pytest.raises(DataFormatError, match="sequence 1 starts at byte 12.*contiguous"):
        IndexedTokens(good)


def test_bad_document_indices_and_negative_lengths(good):
    idx = good + ".idx"
    _patch(idx, 34 + 12 * 3, struct.pack("<qqqq", 0, 2, 1, 3))
    with pytest.raises(DataFormatError, match="document indices must rise"):
        IndexedTokens(good)
    _patch(idx, 34 + 12 * 3, struct.pack("<qqqq", 0, 1, 2, 3))
    _patch(idx, 34, struct.pack("<i", -5))
    with pytest.raises(DataFormatError, match="sequence 0 has negative length -5"):
        IndexedTokens(good)


def test_token_ids_outside_vocab_open_and_per_sample(tmp_path):
    prefix = str(tmp_path / "v")
    docs = [np.arange(10), np.array([1, 2, 3, 99, 4]), np.arange(12)]
    write_indexed(prefix, docs, np.int32)
    ds = IndexedTokens(prefix)
    with pytest.raises(DataFormatError, match=r"v\.bin: token id 99 at sequence 1, position 3 .*\[0, 64\)"):
        GPTSamples(ds, seq_len=4, vocab_size=64)
    s = GPTSamples(ds, seq_len=4, vocab_size=64, check="sample")   # no scan at open
    np.testing.assert_array_equal(s[0], np.arange(5))
    with pytest.raises(DataFormatError, match="token id 99 at sequence 1, position 3"):
        s[3]                                                         # tokens 12..16 hold the 99
    write_indexed(str(tmp_path / "neg"), [np.array([3, -1, 2])], np.int16)
    with pytest.raises(DataFormatError, match="token id -1 at sequence 0, position 1"):
        GPTSamples(IndexedTokens(str(tmp_path / "neg")), 2, 64)
    assert ds.token_range() == (0, 99)


def test_writer_never_overwrites_and_cleans_up_on_error(tmp_path, good):
    with pytest.raises(DataFormatError, match="already exists; refusing to overwrite"):
        IndexedWriter(good)
    before = open(good + ".bin", "rb").read()
    prefix = tmp_path / "partial"
    with pytest.raises(DataFormatError, match="do not fit uint8"):
        with IndexedWriter(prefix, np.uint8) as w:
            w.add_document([1, 2, 3])
            w.add_document([1, 300])
    assert not list(tmp_path.glob("partial*"))           # no temp or half-written files
    assert open(good + ".bin", "rb").read() == before
    with pytest.raises(DataFormatError, match="not a token dtype"):
        IndexedWriter(tmp_path / "f", np.float32)
