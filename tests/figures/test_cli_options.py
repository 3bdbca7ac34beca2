"""figures CLI options the study uses: --only-theory / --no-theory, and PNG-only saving for
the analysis report's embedded figures."""

import matplotlib.pyplot as plt

from figures import cli, style


def test_only_theory_and_no_theory_exclude_each_other(tmp_path, capsys):
    assert cli.main(["--only-theory", "--no-theory", "--out", str(tmp_path)]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_only_formats_narrows_save_for_the_block_only(tmp_path):
    fig, _ = plt.subplots()
    with style.only_formats("png"):
        assert [p.name for p in style.save(fig, tmp_path, "a")] == ["a.png"]
    fig, _ = plt.subplots()
    assert [p.name for p in style.save(fig, tmp_path, "b")] == ["b.png", "b.pdf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.pdf", "b.png"]
