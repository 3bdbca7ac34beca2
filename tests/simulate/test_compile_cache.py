"""JAX's persistent compilation cache: one per user, jaxlib version and CPU kind, set by
simulate/__init__.py for every process that runs JAX programs (issue 37 item 4)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from adamspike.cells import jax_cache_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_cache_folder_names_the_jaxlib_and_the_cpu_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMSPIKE_CACHE_HOME", str(tmp_path))
    d = jax_cache_dir()
    assert d.parent == tmp_path / "jax"
    version, kind = d.name.rsplit("-", 1)
    assert version == importlib.metadata.version("jaxlib") and len(kind) == 12
    assert jax_cache_dir() == d                      # the same machine: the same folder


def test_a_process_importing_simulate_gets_the_cache_unless_it_names_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(ADAMSPIKE_CACHE_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    code = ("import jax, simulate, jax.numpy as jnp; "      # jax first: told through its config
            "print(jax.config.jax_compilation_cache_dir); jax.jit(lambda x: x + 1)(jnp.ones(3))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    want = subprocess.run([sys.executable, "-c", "from adamspike.cells import jax_cache_dir; "
                           "print(jax_cache_dir())"], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert out == [want] and any(Path(want).iterdir())      # the program was written there
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(tmp_path / "mine")]
