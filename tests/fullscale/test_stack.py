"""fullscale.stack: the stack from faked version reports (the seed's, current MindSpeed-LLM,
Megatron-LM) and a clear refusal naming what was found."""

import pytest

from fullscale.stack import StackError, detect, gather, main

SEED = {"python": "3.8.18", "torch": "2.1.0", "torch_npu": "2.1.0", "cann": "7.0.1",
        "megatron_core": "0.4.0", "tree": "modellink"}
MINDSPEED = {"python": "3.10.14", "torch": "2.7.1", "torch_npu": "2.7.1", "cann": "8.3.RC1",
             "megatron_core": "0.12.1", "tree": "mindspeed_llm"}


def test_known_stacks():
    assert detect(SEED) == ("modellink-2024", "0.4.0")
    assert detect(MINDSPEED) == ("mindspeed-llm", "0.12.1")
    assert detect({**MINDSPEED, "cann": None}) == ("mindspeed-llm", "0.12.1")
    assert detect({"python": "3.12.3", "torch": "2.9.0", "cann": None, "megatron_core": "0.17.0",
                   "tree": "megatron"}) == ("megatron-lm", "0.17.0")


@pytest.mark.parametrize("report, words", [
    ({**MINDSPEED, "cann": "7.0.1"}, ["CANN 8 or newer", "CANN 7.0.1", "torch 2.7.1"]),
    ({**MINDSPEED, "megatron_core": "0.8.0"}, ["MindSpeed-LLM on Megatron core 0.8.0"]),
    ({**SEED, "megatron_core": "0.12.1"}, ["ModelLink on Megatron core 0.12.1"]),
    ({**SEED, "tree": "megatron"}, ["Megatron-LM core 0.4.0 is older"]),
    ({**SEED, "tree": None}, ["unknown stack", "python 3.8.18", "torch_npu 2.1.0", "CANN 7.0.1"]),
    ({**SEED, "megatron_core": None}, ["no Megatron core version found", "set MEGATRON_STACK"]),
])
def test_unknown_combinations_are_refused_naming_what_was_found(report, words):
    with pytest.raises(StackError) as e:
        detect(report)
    for w in words:
        assert w in str(e.value)


def test_gather_reads_the_checkout_and_cann(tmp_path, monkeypatch, capsys):
    (tmp_path / "mindspeed_llm").mkdir()
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 1\n")
    toolkit = tmp_path / "toolkit" / "aarch64-linux"
    toolkit.mkdir(parents=True)
    (toolkit / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.3.RC1\n")
    monkeypatch.delenv("ADAMSPIKE_CANN_VERSION", raising=False)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "toolkit"))
    r = gather(str(tmp_path))
    assert (r["tree"], r["megatron_core"], r["cann"]) == ("mindspeed_llm", "0.12.1", "8.3.RC1")
    assert main(["--dir", str(tmp_path)]) == 0 and capsys.readouterr().out == "mindspeed-llm 0.12.1\n"
    assert main(["--dir", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
