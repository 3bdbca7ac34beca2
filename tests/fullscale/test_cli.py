"""adamspike data inspect / convert and model info argument handling (fullscale.cli)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fullscale.cli import data_main, model_main
from fullscale.data import IndexedTokens


def _inspect(capsys, *args) -> dict:
    assert data_main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_convert_jsonl_then_inspect(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("[1, 2, 3]\n\n{\"tokens\": [4, 5]}\n[]\n[31999, 0, 7, 7]\n")
    prefix = tmp_path / "out" / "corpus_text_document"
    assert data_main(["convert", "--input", str(src), "--out", str(prefix)]) == 0
    assert "4 documents, 9 tokens, uint16" in capsys.readouterr().out
    ds = IndexedTokens(prefix)
    assert [list(ds[i]) for i in range(4)] == [[1, 2, 3], [4, 5], [], [31999, 0, 7, 7]]
    info = _inspect(capsys, str(prefix) + ".idx", "--vocab-size", "32000")
    assert (info["num_sequences"], info["num_documents"], info["num_tokens"]) == (4, 4, 9)
    assert (info["dtype"], info["dtype_code"], info["token_min"], info["token_max"]) == ("uint16", 8, 0, 31999)
    assert info["vocab_check"] == "ok" and info["bin_bytes"] == 18
    assert data_main(["inspect", str(prefix), "--vocab-size", "32000"]) == 0
    assert "num_documents" in capsys.readouterr().out
    # a smaller vocabulary: the bad id, its sequence and position are named
    assert data_main(["inspect", str(prefix), "--vocab-size", "1000"]) == 2
    err = capsys.readouterr().err
    assert "token id 31999 at sequence 3, position 0" in err and "corpus_text_document.bin" in err


def test_convert_npy_rows_and_dtype(tmp_path, capsys):
    arr = np.arange(12, dtype=np.int64).reshape(3, 4) * 1000
    np.save(tmp_path / "t.npy", arr)
    assert data_main(["convert", "--input", str(tmp_path / "t.npy"), "--out", str(tmp_path / "p"),
                      "--dtype", "int32"]) == 0
    ds = IndexedTokens(tmp_path / "p")
    assert ds.dtype == np.int32 and ds.num_documents == 3
    np.testing.assert_array_equal(ds.tokens, arr.ravel())


@pytest.mark.parametrize("content, message", [
    ("[1, 2]\n[1, \"x\"]\n", "docs.jsonl:2: expected a list of integer token ids"),
    ("[1, 2]\n{oops\n", "docs.jsonl:2: invalid JSON"),
    ("{\"text\": \"hello\"}\n", "docs.jsonl:1: expected a list"),
    ("[1, 70000]\n", "do not fit uint16"),
])
def test_convert_bad_input_leaves_nothing(tmp_path, capsys, content, message):
    (tmp_path / "docs.jsonl").write_text(content)
    assert data_main(["convert", "--input", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_convert_refuses_to_overwrite_and_bad_paths(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("[1]\n")
    assert data_main(["convert", "--input", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o")]) == 0
    before = (tmp_path / "o.bin").read_bytes()
    assert data_main(["convert", "--input", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err and (tmp_path / "o.bin").read_bytes() == before
    assert data_main(["convert", "--input", str(tmp_path / "x.csv"), "--out", str(tmp_path / "q")]) == 2
    assert "file not found" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("1,2")
    assert data_main(["convert", "--input", str(tmp_path / "x.csv"), "--out", str(tmp_path / "q")]) == 2
    assert ".npy or .jsonl" in capsys.readouterr().err
    np.save(tmp_path / "f.npy", np.ones(3))
    assert data_main(["convert", "--input", str(tmp_path / "f.npy"), "--out", str(tmp_path / "q")]) == 2
    assert "must be integers" in capsys.readouterr().err
    assert data_main(["inspect", str(tmp_path / "missing")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert data_main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_model_main_arguments(tmp_path, capsys):
    assert model_main(["info", "--config", "tiny", "--no-meta-check"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "FLOPs/token" in out and "memory per card" in out
    assert model_main(["info", "--config", "tiny", "--json", "--world-size", "2",
                       "--sharding", "hsdp:2", "--peak-tflops", "100", "--no-meta-check"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["assumptions"]["peak_flops"] == 100e12 and info["cost"]["shard_group"] == 2
    for argv, message in [(["describe"], "unknown subcommand 'describe'"),
                          (["info"], "--config"),
                          (["info", "--config", "tiny", "--mfu", "1.5"], "--mfu: must be <= 1"),
                          (["info", "--config", "tiny", "--device-name", "TPUv9"], "pass --peak-tflops"),
                          (["info", "--config", "tiny", "--sharding", "hsdp:3", "--world-size", "4"],
                           "shard group size 3"),
                          (["info", "--config", str(tmp_path / "x.toml")], "config file not found")]:
        assert model_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
