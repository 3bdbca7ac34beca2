"""Sharpness against the evaluation batch: the chunked Hessian is the batch's, the 1/n fit
and the law across rungs recover known values, and one rung measures end to end."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simulate import batch_sharpness as BS
from simulate import ladder as LD
from simulate.program import program


def test_the_chunked_hessian_is_the_whole_batchs():
    spec = LD.LadderSpec(rungs=[], num_steps=3, seeds=1)
    # one block: the identity below does not depend on depth, and its two power iterations
    # compile in less time than two blocks' (measured CPU time of the test: 13.5 s, 21 s)
    cfg = LD.llama_config(32, 1, spec)
    rc = LD.run_config(cfg, spec, 8)
    prog = program(rc)
    params, state = prog.init(0)
    c = prog.controls(rc, [2]).at(0)
    chunks = BS.eval_batches(spec, 0, [4 * 8 * spec.seq_len])[0].reshape(4, 8, -1)
    whole = chunks.reshape(32, -1)
    u = jax.tree.map(jnp.ones_like, params)
    a, _ = prog.stability(params, state, jnp.asarray(chunks), c, u, 30, precondition=False)
    b, _ = prog.stability(params, state, jnp.asarray(whole), c, u, 30, precondition=False)
    # the mean of 4 chunk Hessians is the Hessian of the mean loss over the 32 sequences:
    # the same products summed in another order, so fp32 rounding only
    np.testing.assert_allclose(float(a), float(b), rtol=1e-4)


def test_eval_batches_are_nested():
    spec = LD.LadderSpec(rungs=[], num_steps=3, seeds=1)
    small, big = BS.eval_batches(spec, 0, [16 * spec.seq_len, 512 * spec.seq_len])
    assert small.shape == (1, 16, spec.seq_len + 1) and big.shape == (2, 256, spec.seq_len + 1)
    np.testing.assert_array_equal(small[0], big[0, :16])   # the larger contains the smaller


def test_the_noise_fit_and_the_law_recover_known_values():
    n = np.array([512, 2048, 8192, 32768])
    lam_inf, a = BS.fit_noise(n, 0.3 + 400.0 / n)
    assert math.isclose(lam_inf, 0.3, rel_tol=1e-9) and math.isclose(a, 400.0, rel_tol=1e-9)
    cells = []
    for dim, layers in [(32, 4), (64, 4), (128, 4), (64, 2), (64, 8)]:
        inf = 10 ** (-2.0 + 1.0 * math.log10(dim) + 0.5 * math.log10(layers))
        cells.append({"dim": dim, "layers": layers, "seed": 0, "lr": 1e-3, "final_loss": 1.0,
                      "eval": [{"tokens": int(t), "lambda": inf + 50.0 / t, "change": 0.0}
                               for t in n]})
    _, s = BS.summarize(cells)
    assert math.isclose(s["law"]["dim"], 1.0, abs_tol=1e-9)
    assert math.isclose(s["law"]["layers"], 0.5, abs_tol=1e-9)
    want = 10 ** (-2.0 + math.log10(8192) + 0.5 * math.log10(80))
    t = s["llama2_70b"]
    assert math.isclose(t["lambda_inf"], want, rel_tol=1e-6)
    assert math.isclose(t["pi_eps"], 15.0 * want, rel_tol=1e-6)   # lr / eps = 1.5e-4 / 1e-5
    assert all(math.isclose(r["noise_share"], 50.0 / 32768 / (r["lambda_inf"] + 50.0 / 32768),
                            rel_tol=1e-6) for r in s["rungs"])


def test_one_rung_end_to_end():
    spec = LD.LadderSpec(rungs=[], num_steps=6, seeds=1, warmup_steps=2)
    # a one-block rung: measure's path is the same at any depth, and its three compiled
    # programs (the step, then the power iteration at each of 2 batch sizes) cost less
    # than a two-block rung's (measured CPU time of the test: 28 s, 45 s, with 2 iteration
    # counts compiled apart; measure's own CPU time, one count traced: 19 s against 26 s)
    cell = BS.measure((32, 1), 0, spec, [256, 1024])
    assert cell["dim"] == 32 and cell["layers"] == 1
    assert [r["tokens"] for r in cell["eval"]] == [256, 1024]
    assert all(np.isfinite(r["lambda"]) for r in cell["eval"])
    assert cell["lr"] == spec.lr_for(32) and math.isfinite(cell["final_loss"])


def test_the_law_takes_the_lr_when_it_varies_apart_from_width():
    """`--lr-scaling both`: rungs at the ladder's two lr rules; the law gets an lr term and
    the 70B is read at LLaMA2's lr (a known law, recovered exactly)."""
    cells = []
    for (dim, layers), lr in [((32, 4), 6e-3), ((32, 4), 3e-3), ((64, 4), 3e-3),
                              ((128, 4), 1.5e-3), ((128, 4), 3e-3), ((64, 2), 3e-3),
                              ((64, 8), 3e-3)]:
        inf = 10 ** (-1.9 + 0.05 * math.log10(dim) + 0.3 * math.log10(layers)
                     - 0.45 * math.log10(lr))
        cells.append({"dim": dim, "layers": layers, "seed": 0, "lr": lr, "final_loss": 1.0,
                      "eval": [{"tokens": t, "lambda": inf + 20.0 / t, "change": 0.0}
                               for t in (512, 2048, 8192)]})
    _, s = BS.summarize(cells)
    law = s["law"]
    assert math.isclose(law["lr"], -0.45, abs_tol=1e-9) and math.isclose(law["dim"], 0.05, abs_tol=1e-9)
    want = 10 ** (-1.9 + 0.05 * math.log10(8192) + 0.3 * math.log10(80) - 0.45 * math.log10(1.5e-4))
    assert math.isclose(s["llama2_70b"]["lambda_inf"], want, rel_tol=1e-6)
    assert "log10 lr" in BS.report_md(s)


def test_rung_seeds_in_a_source_store_are_copied_not_measured(tmp_path, monkeypatch, capsys):
    """`--cells-from STORE` (the cells shipped with the package): the summary is re-derived
    from the stored rung-seeds, none measured; a missing store is one line and exit 2."""
    from adamspike.cells import CellStore
    sizes = {"num_steps": 6, "warmup_steps": 2}
    spec = LD.sized_spec("inverse_width", **sizes)
    stored = {"dim": 32, "layers": 1, "seed": 0, "lr": spec.lr_for(32), "final_loss": 3.0,
              "num_steps": 6, "eval": [{"tokens": 256, "lambda": 9.0, "change": 1e-3},
                                       {"tokens": 1024, "lambda": 6.0, "change": 1e-3}]}
    CellStore(tmp_path / "shipped").put(BS.cell((32, 1), 0, spec, [256, 1024]), stored)
    monkeypatch.setattr(BS, "measure", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("measured a rung-seed the source store holds")))
    summary = BS.run(tmp_path / "out", progress=False, rungs=[(32, 1)], seeds=1,
                     eval_tokens=[256, 1024], cells_from=[tmp_path / "shipped"], **sizes)
    (rung,) = summary["rungs"]
    assert (rung["lambda_first"], rung["lambda_last"]) == (9.0, 6.0)
    assert rung["lambda_inf"] == pytest.approx(5.0)     # 9 = l + a/256, 6 = l + a/1024
    assert not list((tmp_path / "out" / "cells").rglob("*.prov.json"))
    assert BS.main(["--out", str(tmp_path / "o2"), "--cells-from", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cells-from" in err[0] and "no such cell store" in err[0]


def test_the_standard_study_rederives_the_shipped_reading_from_the_shipped_cells(tmp_path, monkeypatch):
    """The standard study's `batch_sharpness` stage copies the rung-seed cells shipped with
    the package (configs/study.toml `cells-from`) instead of ~55 min of training: every key
    the current code resolves at the full size (both lr rules) is there, so nothing is
    measured (a code or spec change that moves a key fails here, not as a silently slow
    study: rerun the stage at --full and ship its cells, `adamspike package-data --from`).
    Summarized again they give the shipped full-data reading (ladder/batch_sharpness.json,
    Science 3's v4, measured on 2026-12-05 by an older build of the same float32 program;
    the shipped cells were measured again on 2026-12-06): per rung-seed lambda within 1e-4
    relative (measured: 4e-6 at most), the law's exponents and the 70B's lambda within 1e-3
    (the fit's inputs moved by that much at most)."""
    import json

    from adamspike import package_data
    shipped = package_data.profile_dir("llama2-70b")
    monkeypatch.setattr(BS, "measure", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a rung-seed is not in the shipped store: it would be measured")))
    got = BS.run(tmp_path / "out", progress=False, lr_scaling="both",
                 cells_from=[shipped / package_data.BATCH_SHARPNESS_CELLS])
    assert not list((tmp_path / "out" / "cells").rglob("*.prov.json"))     # copied, none ran
    v4 = json.loads((shipped / package_data.BATCH_SHARPNESS_FILE).read_text())
    key = lambda r: (r["dim"], r["layers"], r["lr"], r["seed"])             # noqa: E731
    want = {key(r): r for r in v4["rungs"]}
    assert sorted(want) == sorted(key(r) for r in got["rungs"])
    for r in got["rungs"]:
        for k in ("lambda_first", "lambda_last"):
            assert r[k] == pytest.approx(want[key(r)][k], rel=1e-4), (key(r), k)
    for k in ("dim", "layers", "lr"):
        assert got["law"][k] == pytest.approx(v4["law"][k], rel=1e-3, abs=1e-3)
    assert got["llama2_70b"]["lambda_inf"] == pytest.approx(v4["llama2_70b"]["lambda_inf"], rel=1e-3)
