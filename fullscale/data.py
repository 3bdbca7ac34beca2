"""Megatron `.bin/.idx` indexed token data: reader, writer, and GPT-style training samples.

Byte-compatible with megatron-core's IndexedDatasetBuilder / IndexedDataset (checked
against megatron-core 0.16.1 in tests). The `.idx` file, little-endian:

    offset          size  content
    0               9     magic b"MMIDIDX\\x00\\x00"
    9               8     u64 version = 1
    17              1     u8 dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                          6 float64, 7 float32, 8 uint16 (token data: 1-5 and 8)
    18              8     u64 S, number of sequences
    26              8     u64 D, length of document_indices (= documents + 1)
    34              4S    int32 sequence lengths (tokens)
    34+4S           8S    int64 sequence pointers (byte offsets into .bin)
    34+12S          8D    int64 document indices (0, ..., S: sequence index ending each doc)
    34+12S+8D       S     int8 modes (multimodal datasets only; ignored here)

The `.bin` file is the sequences' tokens back to back, no header. Megatron's builder always
writes contiguous pointers (pointer[i] = sum(lengths[:i]) * itemsize) and a .bin of exactly
the described size; this reader insists on both, because anything else means a truncated
file or a .bin/.idx pair that does not belong together.

GPT samples (`GPTSamples`): the sequences are read as one token stream in file order (no
document shuffling; the data order comes from adamspike.order.sample_indices, as for the
synthetic data), and sample i is stream[i*T : i*T + T + 1] with T = seq_len: consecutive
samples share one token, as in Megatron's GPTDataset, and the T + 1 tokens give inputs
x[:-1] and targets x[1:]. Document boundaries are not marked (Megatron's default too).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from adamspike.synthdata import SyntheticTokens

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
TOKEN_CODES = (1, 2, 3, 4, 5, 8)
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
CHECK_MODES = ("open", "sample")
_CHUNK = 1 << 24          # tokens per chunk of the vectorised vocab check


class DataFormatError(ValueError):
    """A data file is missing, malformed, or holds token ids outside the vocabulary."""


def split_prefix(path: str | Path) -> str:
    """`data/x_text_document`, `.../x.bin` or `.../x.idx` -> the prefix `data/x_text_document`."""
    s = str(path)
    return s[:-4] if s.endswith((".bin", ".idx")) else s


# ----------------------------------------------------------------------------- reader

class IndexedTokens:
    """Read-only view of `PREFIX.bin` + `PREFIX.idx` (numpy memmaps; nothing is loaded).

    `ds[i]` is sequence i (native dtype), `ds.tokens` the whole token stream, `ds.documents`
    the number of documents. Every structural problem raises DataFormatError naming the file.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = split_prefix(prefix)
        self.idx_path, self.bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                other = self.bin_path if p == self.idx_path else self.idx_path
                raise DataFormatError(f"{p}: file not found (an indexed dataset needs both "
                                      f"{p.name} and {other.name})")
        self._read_index()
        self._check_bin()
        self._vocab_checked: set[int] = set()

    # -- index
    def _read_index(self) -> None:
        path = self.idx_path
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(HEADER_SIZE)
        if head.startswith(LEGACY_MAGIC):
            raise DataFormatError(f"{path}: legacy fairseq/Megatron 'TNTIDX' index (lazy/cached "
                                  "format), not the mmap MMIDIDX format; re-preprocess the data "
                                  "with Megatron's preprocess_data.py")
        if not head.startswith(MAGIC):
            raise DataFormatError(f"{path}: not a Megatron mmap index (magic {head[:9]!r}, "
                                  f"expected {MAGIC!r})")
        if len(head) < HEADER_SIZE:
            raise DataFormatError(f"{path}: truncated header ({size} bytes, need {HEADER_SIZE})")
        version, = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise DataFormatError(f"{path}: unsupported index version {version} (only {VERSION})")
        code = head[17]
        if code not in DTYPES:
            raise DataFormatError(f"{path}: unknown dtype code {code} (known: "
                                  + ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPES.items()) + ")")
        if code not in TOKEN_CODES:
            raise DataFormatError(f"{path}: dtype code {code} ({np.dtype(DTYPES[code]).name}) "
                                  "is not an integer token dtype")
        num_seq, num_doc_idx = struct.unpack("<QQ", head[18:34])
        expected = HEADER_SIZE + 12 * num_seq + 8 * num_doc_idx
        # A multimodal index carries one extra int8 mode per sequence; tokens read the same.
        if size not in (expected, expected + num_seq):
            raise DataFormatError(f"{path}: {size} bytes, but its header ({num_seq} sequences, "
                                  f"{num_doc_idx} document indices) implies {expected} "
                                  "(truncated or corrupt index)")
        self.dtype_code, self.dtype = code, np.dtype(DTYPES[code])
        self.multimodal = size != expected
        self.num_sequences = int(num_seq)
        if num_seq + num_doc_idx:
            mm = np.memmap(path, mode="r", dtype=np.uint8)
            o = HEADER_SIZE
            self.sequence_lengths = np.frombuffer(mm, np.int32, num_seq, o)
            self.sequence_pointers = np.frombuffer(mm, np.int64, num_seq, o + 4 * num_seq)
            self.document_indices = np.frombuffer(mm, np.int64, num_doc_idx, o + 12 * num_seq)
        else:
            self.sequence_lengths = np.zeros(0, np.int32)
            self.sequence_pointers = np.zeros(0, np.int64)
            self.document_indices = np.zeros(0, np.int64)
        self._check_index()

    def _check_index(self) -> None:
        path, lengths, ptrs, docs = self.idx_path, self.sequence_lengths, self.sequence_pointers, self.document_indices
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise DataFormatError(f"{path}: sequence {i} has negative length {int(lengths[i])}")
        ends = np.cumsum(lengths, dtype=np.int64) * self.dtype.itemsize
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        if len(ptrs) and (np.diff(ptrs) < 0).any():
            i = int(np.argmax(np.diff(ptrs) < 0)) + 1
            raise DataFormatError(f"{path}: sequence pointers are not monotonic: pointer[{i}]="
                                  f"{int(ptrs[i])} < pointer[{i - 1}]={int(ptrs[i - 1])}")
        if (ptrs != starts).any():
            i = int(np.argmax(ptrs != starts))
            raise DataFormatError(f"{path}: sequence {i} starts at byte {int(ptrs[i])}, but the "
                                  f"lengths before it put it at byte {int(starts[i])} (pointers "
                                  "must be contiguous, as Megatron writes them)")
        self.num_tokens = int(ends[-1] // self.dtype.itemsize) if len(ends) else 0
        if len(docs) == 0:
            raise DataFormatError(f"{path}: empty document index (need at least [0])")
        if docs[0] != 0 or docs[-1] != self.num_sequences or (np.diff(docs) < 0).any():
            raise DataFormatError(f"{path}: document indices must rise from 0 to the sequence "
                                  f"count {self.num_sequences}; got {_preview(docs)}")
        self.num_documents = len(docs) - 1

    def _check_bin(self) -> None:
        size = self.bin_path.stat().st_size
        need = self.num_tokens * self.dtype.itemsize
        if size < need:
            last = int(np.searchsorted(np.cumsum(self.sequence_lengths, dtype=np.int64) * self.dtype.itemsize,
                                       size, side="right"))
            raise DataFormatError(f"{self.bin_path}: truncated: {size} bytes, but the index describes "
                                  f"{need} ({self.num_tokens} {self.dtype.name} tokens); sequence "
                                  f"{last} and later point beyond the end of the file")
        if size > need:
            raise DataFormatError(f"{self.bin_path}: {size} bytes, but {self.idx_path.name} describes "
                                  f"only {need}: the .bin and .idx do not belong together")
        self.tokens = (np.memmap(self.bin_path, mode="r", dtype=self.dtype) if self.num_tokens
                       else np.zeros(0, self.dtype))

    # -- access
    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range [0, {self.num_sequences})")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def sequence_of_token(self, position: int) -> int:
        """Index of the sequence holding stream position `position`."""
        return int(np.searchsorted(np.cumsum(self.sequence_lengths, dtype=np.int64), position, side="right"))

    def token_range(self, progress: bool = False) -> tuple[int, int] | None:
        """(min, max) token id over the whole file, chunked; None if empty."""
        if not self.num_tokens:
            return None
        lo, hi = None, None
        for a in _chunks(self.num_tokens, progress, f"scan {self.bin_path.name}"):
            chunk = self.tokens[a:a + _CHUNK]
            cmin, cmax = int(chunk.min()), int(chunk.max())
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
        return lo, hi

    def check_vocab(self, vocab_size: int, progress: bool = False) -> None:
        """Every token id in [0, vocab_size), vectorised over the whole file (chunked);
        DataFormatError names the file, the sequence, the position and the bad id."""
        if vocab_size in self._vocab_checked:
            return
        for a in _chunks(self.num_tokens, progress, f"check {self.bin_path.name}"):
            chunk = self.tokens[a:a + _CHUNK]
            bad = (chunk >= vocab_size) if self.dtype.kind == "u" else ((chunk < 0) | (chunk >= vocab_size))
            if bad.any():
                pos = a + int(np.argmax(bad))
                self._bad_token(pos, vocab_size)
        self._vocab_checked.add(vocab_size)

    def _bad_token(self, position: int, vocab_size: int):
        seq = self.sequence_of_token(position)
        within = position - int(self.sequence_pointers[seq]) // self.dtype.itemsize
        raise DataFormatError(f"{self.bin_path}: token id {int(self.tokens[position])} at sequence "
                              f"{seq}, position {within} is outside the vocabulary [0, {vocab_size})")

    def summary(self) -> dict:
        lengths = self.sequence_lengths
        return {"prefix": self.prefix, "dtype": self.dtype.name, "dtype_code": self.dtype_code,
                "num_sequences": self.num_sequences, "num_documents": self.num_documents,
                "num_tokens": self.num_tokens, "multimodal": self.multimodal,
                "min_sequence_length": int(lengths.min()) if len(lengths) else None,
                "max_sequence_length": int(lengths.max()) if len(lengths) else None,
                "idx_bytes": self.idx_path.stat().st_size, "bin_bytes": self.bin_path.stat().st_size}


def _preview(a: np.ndarray, n: int = 6) -> str:
    vals = ", ".join(str(int(v)) for v in a[:n])
    return f"[{vals}{', ...' if len(a) > n else ''}] (length {len(a)})"


def _chunks(total: int, progress: bool, desc: str) -> Iterable[int]:
    starts = range(0, total, _CHUNK)
    if progress and total > 4 * _CHUNK:
        return tqdm(starts, desc=desc, unit="chunk", leave=False)
    return starts


# ----------------------------------------------------------------------------- writer

class IndexedWriter:
    """Writes PREFIX.bin / PREFIX.idx exactly as megatron-core's IndexedDatasetBuilder does.

        with IndexedWriter("out/corpus_text_document", np.uint16) as w:
            for doc in docs:
                w.add_document(doc)            # one sequence per document

    Files are written under temporary names and renamed on a clean exit; existing files are
    never overwritten, and an exception leaves nothing behind.
    """

    def __init__(self, prefix: str | Path, dtype=np.uint16):
        self.prefix = split_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES or CODES[self.dtype] not in TOKEN_CODES:
            raise DataFormatError(f"dtype {self.dtype.name}: not a token dtype (use one of "
                                  + ", ".join(np.dtype(DTYPES[c]).name for c in TOKEN_CODES) + ")")
        self.bin_path, self.idx_path = Path(self.prefix + ".bin"), Path(self.prefix + ".idx")
        for p in (self.bin_path, self.idx_path):
            if p.exists():
                raise DataFormatError(f"{p}: already exists; refusing to overwrite")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + f".tmp{os.getpid()}")
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + f".tmp{os.getpid()}")
        self._fh = self._tmp_bin.open("wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self._info = np.iinfo(self.dtype)

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """One sequence (call end_document() after a document's sequences)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataFormatError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iub":
            raise DataFormatError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < self._info.min or int(arr.max()) > self._info.max):
            raise DataFormatError(f"sequence {len(self.sequence_lengths)}: token ids "
                                  f"[{int(arr.min())}, {int(arr.max())}] do not fit {self.dtype.name}")
        self._fh.write(arr.astype(self.dtype).tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> tuple[Path, Path]:
        self._fh.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise DataFormatError("a sequence longer than 2^31-1 tokens cannot be indexed (int32 lengths)")
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * self.dtype.itemsize
        with self._tmp_idx.open("wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODES[self.dtype]))
            fh.write(struct.pack("<QQ", len(lengths), len(self.document_indices)))
            fh.write(lengths.astype(np.int32).tobytes())
            fh.write(pointers[:len(lengths)].tobytes())
            fh.write(np.asarray(self.document_indices, dtype=np.int64).tobytes())
        for tmp, final in ((self._tmp_bin, self.bin_path), (self._tmp_idx, self.idx_path)):
            if final.exists():
                raise DataFormatError(f"{final}: appeared while writing; refusing to overwrite")
            os.replace(tmp, final)
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        self._fh.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed(prefix: str | Path, documents: Iterable[Sequence[int] | np.ndarray],
                  dtype=np.uint16) -> tuple[Path, Path]:
    """Write documents (one sequence each) to PREFIX.bin/.idx; returns the two paths."""
    with IndexedWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)
    return w.bin_path, w.idx_path


# ----------------------------------------------------------------------------- samples

class GPTSamples:
    """Fixed-length training samples cut from an indexed dataset's token stream.

    `samples[i]` is an int64 array of seq_len + 1 tokens, stream[i*seq_len : (i+1)*seq_len + 1]
    (same interface as adamspike.synthdata.SyntheticTokens). Token ids are validated against
    `vocab_size`: `check="open"` scans the whole file once, vectorised, when constructed
    (default); `check="sample"` skips that scan (for huge files) and checks each sample as it
    is read instead. Either way a bad id is an error naming the file, sequence and id.
    """

    def __init__(self, indexed: IndexedTokens, seq_len: int, vocab_size: int, check: str = "open",
                 progress: bool = False):
        if seq_len < 1:
            raise DataFormatError(f"seq_len must be >= 1, got {seq_len}")
        if vocab_size < 1:
            raise DataFormatError(f"vocab_size must be >= 1, got {vocab_size}")
        if check not in CHECK_MODES:
            raise DataFormatError(f"check must be one of {CHECK_MODES}, got {check!r}")
        self.indexed, self.seq_len, self.vocab_size, self.check = indexed, int(seq_len), int(vocab_size), check
        self.num_samples = (indexed.num_tokens - 1) // self.seq_len if indexed.num_tokens else 0
        if self.num_samples < 1:
            raise DataFormatError(f"{indexed.bin_path}: {indexed.num_tokens} tokens, fewer than one "
                                  f"sample of seq_len + 1 = {self.seq_len + 1}")
        if check == "open":
            indexed.check_vocab(self.vocab_size, progress=progress)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        out = np.asarray(self.indexed.tokens[start:start + self.seq_len + 1], dtype=np.int64)
        if self.check == "sample" and (out.max() >= self.vocab_size or out.min() < 0):
            bad = (out >= self.vocab_size) | (out < 0)
            self.indexed._bad_token(start + int(np.argmax(bad)), self.vocab_size)
        return out

    def batch(self, indices) -> np.ndarray:
        """Stack samples: int64 array (len(indices), seq_len + 1)."""
        return np.stack([self[i] for i in indices])


def build_source(data, seq_len: int, vocab_size: int, seed: int, check: str = "open"):
    """The object the trainer indexes with adamspike.order.sample_indices, from a
    adamspike.train_config.DataSection: SyntheticTokens or GPTSamples."""
    if data.source == "synthetic":
        return SyntheticTokens(task=data.task, vocab_size=vocab_size, seq_len=seq_len,
                               num_samples=data.num_samples, seed=seed, alpha=data.alpha)
    if data.source == "indexed":
        if not data.path:
            raise DataFormatError("data.path: required when data.source = 'indexed' "
                                  "(the Megatron prefix, without .bin/.idx)")
        return GPTSamples(IndexedTokens(data.path), seq_len, vocab_size, check=check)
    raise DataFormatError(f"data.source: unknown source {data.source!r}")
