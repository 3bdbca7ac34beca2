import pytest

from analysis.synthetic import write_synthetic_run


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """A short synthetic run (analysis.synthetic) with one spike at step 200."""
    path = tmp_path_factory.mktemp("figruns") / "small"
    return write_synthetic_run(path, num_steps=320, spikes=(200,), lead=8, seed=1)


@pytest.fixture(scope="session")
def small_analysis(small_run, tmp_path_factory):
    """`adamspike analyze` of small_run: the tables the run figures read (OUT/small/)."""
    from analysis.cli import main as analyze
    out = tmp_path_factory.mktemp("figanalysis") / "analysis"
    assert analyze([str(small_run), "--out", str(out)]) == 0
    return out
