import pytest

from analysis.synthetic import write_synthetic_run


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory):
    """A tiny-LLaMA run directory with spikes at 300 and 450 and a 10-step shallow-layer
    precursor (analysis.synthetic: known ground truth, not measurements)."""
    path = tmp_path_factory.mktemp("runs") / "synthetic"
    return write_synthetic_run(path, num_steps=600, spikes=(300, 450), lead=10, seed=0)
