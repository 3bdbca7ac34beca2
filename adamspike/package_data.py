"""Fits shipped with the package, so `adamspike predict --profile llama2-70b` answers on a
fresh install without a study run (no jax needed to read them).

    adamspike/data/llama2_70b/
      MANIFEST.json           schema, version, where each file came from (the study folder
                              and the `adamspike reproduce` stage that writes it), its
                              sha256; checked on every load
      ladder/ladder.json      the width/depth ladder's spec   } stage `ladder`
      ladder/cells/ladder_rung/  its finished cells (one cell } (`adamspike simulate ladder`):
                              store, adamspike.cells: per     } simulate.ladder refits them
                              rung x seed gradient RMS rows)  }
      ladder/batch_sharpness.json  the full-data sharpness    stage `batch_sharpness`
                              reading (its summary.json)      (`adamspike simulate
                                                              batch-sharpness`), when run
      batch_sharpness/cells/  its rung-seed cells (one cell   the standard study copies them
                              store, kind batch_sharpness)    (`--cells-from`) and
                                                              summarizes them again instead
                                                              of ~55 min of core time
      spike_rate_model.json   the spike-rate GLM              stage `spike_rate_mechanism`
                                                              (`adamspike spike-rate --map`;
                                                              `spike_rate` in older folders)
      spike_rate_model_rows.csv  the rows it was fitted on    the same stage's table.csv:
                              (one per map lane and phase)    `spike-rate --table` refits
                                                              the model from them alone
      spike_rate_regime_model.json  the sweep-trained GLM     stage `spike_rate`: what a
                              (rho, b2, lr / eps, tokens)     profile without the ladder's
                                                              sharpness (a log, a run, a
                                                              JSON profile) is predicted with
      claims/cells/           the claims' calibrations and arms  stages `replication_phase`
                              (one cell store: calibration/,     and `replication_matched`
                              claims_arm/): the standard study   (`adamspike replicate`)
                              copies them (`replicate --cells-from`) instead of running
                              ~30 min of core time; `--full` recomputes and refreshes them
      phase_maps/w32/, w64/   the full phase maps the mechanism  stages `phase_map` and
                              model is trained on (map.json,     `phase_map_w64` of a
                              the tracker check, the cell store: `--full` study (the maps'
                              one `phase_map_cell` per cell, its files as written, every
                              lanes' per-step rows, and the      cell stored); a study's
                              `calibration` cells): `spike-rate  reduced map never
                              --map` reads them in place         replaces them
      predictions.json        `adamspike predict --profile llama2-70b` on the two above
                              (pre-registered when written; `adamspike assess` reads it
                              when given no predictions of its own)

The ladder is shipped as its cells (a few hundred kB), not as a fitted summary: simulate
.ladder.ladder_70b refits them (deterministic: fixed bootstrap seeds), so the shipped fit is
the one a study folder with the same cells gives, bit for bit.

`adamspike package-data --from STUDY_DIR` (a finished `make reproduce` / `adamspike
reproduce --out STUDY_DIR` folder: STUDY_DIR/ladder and STUDY_DIR/spike_rate_mechanism/
model.json, the model predictions_70b.json uses; STUDY_DIR/spike_rate/model.json when the
folder has no mechanism model)
replaces the shipped files and writes a new manifest (version + 1); `adamspike
package-data` alone prints the manifest and checks the hashes. The package must carry
adamspike/data/** as package data (an editable install reads the source tree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from adamspike.config import ConfigError, cli_main

DATA = Path(__file__).resolve().parent / "data"
PROFILES = ("llama2-70b",)
SCHEMA = "adamspike.package_data"
MODEL_FILE = "spike_rate_model.json"
MODEL_ROWS_FILE = "spike_rate_model_rows.csv"   # the mechanism model's training rows
REGIME_MODEL_FILE = "spike_rate_regime_model.json"
PREDICTIONS_FILE = "predictions.json"
BATCH_SHARPNESS_FILE = "ladder/batch_sharpness.json"   # simulate.ladder.BATCH_SHARPNESS_FILE
LADDER_KIND = "ladder_rung"   # simulate.ladder.KIND: its cells' kind in the one store
SCIENCE4 = "science4"     # study.science4's inputs: Lanczos rung cells, map lanes, claims
CLAIMS_CELLS = "claims/cells"   # the claims replications' cell store (calibration, claims_arm)
CLAIMS_STAGES = ("replication_phase", "replication_matched")   # study folders holding them
BATCH_SHARPNESS_CELLS = "batch_sharpness/cells"   # stage batch_sharpness's cell store
# the full phase maps (shipped folder -> the study folder of the stage that writes it)
PHASE_MAPS = {"phase_maps/w32": "phase_map", "phase_maps/w64": "phase_map_w64"}
MAP_FILES = ("map.json", "stability_check.csv")    # beside the map's cell store
STAGES = {"ladder": "stage `ladder` of configs/study.toml (`adamspike simulate ladder`)",
          MODEL_FILE: "stage `spike_rate_mechanism` of configs/study.toml (`adamspike "
                      "spike-rate --map`; `spike_rate` in older study folders)",
          MODEL_ROWS_FILE: "stage `spike_rate_mechanism` of configs/study.toml (its table.csv: "
                           "the rows the mechanism model was fitted on)",
          REGIME_MODEL_FILE: "stage `spike_rate` of configs/study.toml (`adamspike spike-rate`)",
          BATCH_SHARPNESS_FILE: "stage `batch_sharpness` of configs/study.toml (`adamspike "
                                "simulate batch-sharpness`: its summary.json)",
          PREDICTIONS_FILE: "`adamspike predict --profile llama2-70b` on the shipped ladder "
                            "and model (adamspike package-data)",
          SCIENCE4: "stages `phase_map_science4` and `science4` of configs/study.toml "
                    "(`adamspike science4 --compute`: its cells, map lanes and claims table)",
          CLAIMS_CELLS: "stages `replication_phase` and `replication_matched` of "
                        "configs/study.toml (`adamspike replicate`: their cell stores)",
          BATCH_SHARPNESS_CELLS: "stage `batch_sharpness` of configs/study.toml (`adamspike "
                                 "simulate batch-sharpness`: its cell store)",
          **{rel: f"stage `{stage}` of configs/study.toml at the full size (`adamspike "
                  f"phase-map`, its map file as written: map.json, the tracker check and "
                  f"the cell store)" for rel, stage in PHASE_MAPS.items()}}


class PackageDataError(ConfigError):
    """Shipped data missing or not what its manifest says."""


def profile_dir(profile: str = "llama2-70b", root: Path = DATA) -> Path:
    return Path(root) / profile.replace("-", "_")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def store_files(root: Path) -> list[Path]:
    """A cell store's cells (every kind: JSON, tables, arrays), without their provenance
    (host, time: not part of a cell) or cells set aside as corrupt."""
    return sorted(p for p in Path(root).glob("*/*") if p.is_file()
                  and not p.name.endswith(".prov.json") and ".corrupt" not in p.name)


def _ladder_cells(lad: Path) -> list[Path]:
    """A ladder folder's stored cells (its store's `ladder_rung` kind: `store_files`)."""
    return [p for p in store_files(lad / "cells") if p.parent.name == LADDER_KIND]


def map_files(m: Path) -> list[Path]:
    """A phase-map folder's files that ship: MAP_FILES (those it has) and its cell store;
    none without a map.json."""
    if not (m / "map.json").is_file():
        return []
    return [*(m / f for f in MAP_FILES if (m / f).is_file()), *store_files(m / "cells")]


def full_map(m: Path) -> bool:
    """A map folder run from its file as written (no `--set`) whose every cell is stored:
    only such a map replaces a shipped one (the standard study's map is a reduced one)."""
    from adamspike.cells import CellStore   # pandas: only when a study's map is shipped
    try:
        meta = json.loads((m / "map.json").read_text())
        grid = meta["grid"]
        want = len(grid["lr_mult"]) * len(grid["b2"]) * len(grid["batch_mult"])
        store = CellStore(m / "cells")
        return (not meta.get("sets") and len(meta["cells"]) == want > 0
                and all(store.has(c["cell"]["kind"], c["cell"]["key"]) for c in meta["cells"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _files(d: Path) -> list[Path]:
    return sorted([d / "ladder" / "ladder.json", *_ladder_cells(d / "ladder"),
                   d / MODEL_FILE, *(d / f for f in (REGIME_MODEL_FILE, PREDICTIONS_FILE,
                                                     BATCH_SHARPNESS_FILE, MODEL_ROWS_FILE)
                                     if (d / f).is_file()),
                   *(p for p in (d / SCIENCE4).rglob("*") if p.is_file()),
                   *store_files(d / CLAIMS_CELLS), *store_files(d / BATCH_SHARPNESS_CELLS),
                   *(p for rel in PHASE_MAPS for p in map_files(d / rel))],
                  key=lambda p: p.relative_to(d).as_posix())


def claims_cells(study: Path) -> list[tuple[Path, Path]]:
    """(file, path relative to the shipped claims store) of the claims replications' cells
    in a study folder (both stages' stores are one store: keys never collide)."""
    return [(f, f.relative_to(study / stage / "cells")) for stage in CLAIMS_STAGES
            for f in store_files(study / stage / "cells")]


def _ship_store(files: list[tuple[Path, Path]], shipped: Path, dest: Path) -> None:
    """A cell store (or a phase-map folder) into the new package data: a study's files
    (file, path relative to the store) when it has any, else the shipped one's (when there
    is one)."""
    if files:
        for f, rel in files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest / rel)
    elif shipped.is_dir():
        shutil.copytree(shipped, dest)


def _read_manifest(mpath: Path) -> dict:
    """MANIFEST.json as a dict; PackageDataError in one line when it is truncated, not
    UTF-8 or not a JSON object (a damaged install must not end in a traceback)."""
    try:
        m = json.loads(mpath.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PackageDataError(f"{mpath}: unreadable package-data manifest ({e}); reinstall "
                               "the package or regenerate with `adamspike package-data "
                               "--from STUDY_DIR`") from None
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        raise PackageDataError(f"{mpath}: not a package-data manifest (no 'files' table)")
    return m


def manifest(profile: str = "llama2-70b", root: Path = DATA,
             refreshing: frozenset[str] = frozenset()) -> dict:
    """The manifest of the shipped data of `profile`, after checking every file's sha256
    (PackageDataError when one is missing or differs); `refreshing`: paths relative to the
    profile folder that add_files is replacing (their old hashes are not checked)."""
    d = profile_dir(profile, root)
    mpath = d / "MANIFEST.json"
    if not mpath.is_file():
        raise PackageDataError(f"no shipped fit for profile {profile!r} ({mpath} missing); "
                               "pass --ladder DIR and --rate-model MODEL.json")
    m = _read_manifest(mpath)
    if m.get("schema") != SCHEMA:
        raise PackageDataError(f"{mpath}: not a package-data manifest")
    for rel, sha in m["files"].items():
        if rel in refreshing:
            continue
        p = d / rel
        if not p.is_file():
            raise PackageDataError(f"{p}: listed in {mpath} but missing")
        if _sha(p) != sha:
            raise PackageDataError(f"{p}: sha256 differs from {mpath} (edited or damaged; "
                                   "regenerate with `adamspike package-data --from STUDY_DIR`)")
    return m


LAW_FILE = "law.json"      # Science 4's sharpness law under the plan's QC (adamspike.sharpness_law)


def sharpness_law(profile: str = "llama2-70b", root: Path = DATA) -> dict | None:
    """The shipped sharpness law under the plan's QC (science4/law.json), None when the
    package data has none (then predict reads the ladder's batch-sharpness reading)."""
    m = manifest(profile, root)
    rel = f"{SCIENCE4}/{LAW_FILE}"
    if rel not in m["files"]:
        return None
    return json.loads((profile_dir(profile, root) / rel).read_text())


RECORD_FILE = "public_record.json"   # the shipped rate model's record on public runs (science4)


def public_record(profile: str = "llama2-70b", root: Path = DATA) -> dict | None:
    """The shipped rate model's record on the public runs (science4/public_record.json,
    study.science4.record_summary), None when the package data has none."""
    m = manifest(profile, root)
    rel = f"{SCIENCE4}/{RECORD_FILE}"
    if rel not in m["files"]:
        return None
    return json.loads((profile_dir(profile, root) / rel).read_text())


def ladder_dir(profile: str = "llama2-70b", root: Path = DATA) -> Path:
    manifest(profile, root)
    return profile_dir(profile, root) / "ladder"


def rate_model_path(profile: str = "llama2-70b", root: Path = DATA,
                    mechanism: bool = True) -> Path:
    """The shipped model: the mechanism model, or (mechanism=False) the sweep-trained regime
    model when one is shipped (a profile without the ladder's sharpness needs it)."""
    m = manifest(profile, root)
    if not mechanism and REGIME_MODEL_FILE in m["files"]:
        return profile_dir(profile, root) / REGIME_MODEL_FILE
    return profile_dir(profile, root) / MODEL_FILE


def predictions_path(profile: str = "llama2-70b", root: Path = DATA) -> Path | None:
    """The shipped predictions.json of `profile` (None when the manifest has none)."""
    m = manifest(profile, root)
    return profile_dir(profile, root) / PREDICTIONS_FILE if PREDICTIONS_FILE in m["files"] \
        else None


def add_files(profile: str, paths, note: str, root: Path = DATA,
              produced_by: dict[str, str] | None = None) -> dict:
    """Add (or refresh) files under the profile's folder in its manifest: their sha256,
    the version + 1, a note in `source` and, for new kinds of file, `produced_by` entries
    (path or folder/ -> the stage that writes it); the other files are checked as ever."""
    d = profile_dir(profile, root)
    rels = [Path(p).resolve().relative_to(d.resolve()).as_posix() for p in paths]
    m = manifest(profile, root, refreshing=frozenset(rels))
    for p in paths:
        m["files"][Path(p).resolve().relative_to(d.resolve()).as_posix()] = _sha(Path(p))
    m.setdefault("produced_by", {}).update(produced_by or {})
    m["version"] = int(m["version"]) + 1
    m["source"] = f"{m['source']}; v{m['version']}: {note}"
    m["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (d / "MANIFEST.json").write_text(json.dumps(m, indent=2) + "\n")
    return m


def describe(m: dict) -> str:
    """One line naming the shipped data and where it came from."""
    return (f"shipped fit v{m['version']} ({m['profile']}, from {m['source']}, "
            f"{m['created']})")


def write(study: str | Path, profile: str = "llama2-70b", root: Path = DATA,
          source: str | None = None, predict: Callable[[list[str]], int] | None = None) -> dict:
    """Replace the shipped files of `profile` by those of a study folder (module doc);
    returns the new manifest. The cells are those of the study's ladder spec. `predict`:
    the `adamspike predict` entry point (simulate sits above this floor, so the caller
    passes it); with it, predictions.json is written from the new files too."""
    predictions = predict is not None
    study = Path(study)
    lad = study / "ladder"
    model = study / "spike_rate_mechanism" / "model.json"
    regime = study / "spike_rate" / "model.json"
    if not model.is_file():
        model, regime = regime, None
    elif not regime.is_file():
        regime = None
    for p in (lad / "ladder.json", model):
        if not p.is_file():
            raise PackageDataError(f"{p}: missing (a finished `adamspike reproduce` folder has "
                                   "ladder/ and spike_rate_mechanism/model.json)")
    cells = _ladder_cells(lad)
    if not cells:
        raise PackageDataError(f"{lad}/cells: no finished ladder cells")
    d = profile_dir(profile, root)
    old = None
    if (d / "MANIFEST.json").is_file():
        try:
            old = _read_manifest(d / "MANIFEST.json")
        except PackageDataError:
            old = None               # a damaged manifest is replaced, not read
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "ladder" / "cells" / LADDER_KIND).mkdir(parents=True)
    shutil.copyfile(lad / "ladder.json", tmp / "ladder" / "ladder.json")
    for c in cells:
        shutil.copyfile(c, tmp / "ladder" / "cells" / LADDER_KIND / c.name)
    bs = study / "batch_sharpness" / "summary.json"
    if bs.is_file():
        shutil.copyfile(bs, tmp / BATCH_SHARPNESS_FILE)
    shutil.copyfile(model, tmp / MODEL_FILE)
    # the model's rows: the study's when it fitted the model from maps or rows, else the
    # shipped ones when it kept the shipped model (a model and its rows travel together)
    rows = model.parent / "table.csv"
    if model.parent.name == "spike_rate_mechanism" and rows.is_file():
        shutil.copyfile(rows, tmp / MODEL_ROWS_FILE)
    elif (d / MODEL_ROWS_FILE).is_file() and old is not None \
            and old["files"].get(MODEL_FILE) == _sha(model):
        shutil.copyfile(d / MODEL_ROWS_FILE, tmp / MODEL_ROWS_FILE)
    if regime is not None:
        shutil.copyfile(regime, tmp / REGIME_MODEL_FILE)
    # Science 4's cells: the study's own when it computed them (--full), else the shipped
    s4 = study / "science4"
    s4_cells = s4 / "cells" / "sharpness_rung"
    if s4_cells.is_dir() and any(s4_cells.glob("*.json")):
        (tmp / SCIENCE4 / "cells" / "sharpness_rung").mkdir(parents=True)
        for c in s4_cells.glob("*.json"):
            if not c.name.endswith(".prov.json"):
                shutil.copyfile(c, tmp / SCIENCE4 / "cells" / "sharpness_rung" / c.name)
        for f in ("claims.csv", "map_lanes.parquet", "map_cells.csv", "rate_rows.parquet",
                  LAW_FILE, "one_s.csv", RECORD_FILE):
            if (s4 / f).is_file():
                shutil.copyfile(s4 / f, tmp / SCIENCE4 / f)
    elif (d / SCIENCE4).is_dir():
        shutil.copytree(d / SCIENCE4, tmp / SCIENCE4)
    # the claims' and the batch-sharpness cells: the study's own when it computed them
    # (--full; a study that copied the shipped ones has the same files), else the shipped
    bs_store = study / "batch_sharpness" / "cells"
    _ship_store(claims_cells(study), d / CLAIMS_CELLS, tmp / CLAIMS_CELLS)
    _ship_store([(f, f.relative_to(bs_store)) for f in store_files(bs_store)],
                d / BATCH_SHARPNESS_CELLS, tmp / BATCH_SHARPNESS_CELLS)
    # the full phase maps: the study's own when it ran them at the full size, else the shipped
    for rel, stage in PHASE_MAPS.items():
        src = study / stage
        _ship_store([(f, f.relative_to(src)) for f in map_files(src)] if full_map(src) else [],
                    d / rel, tmp / rel)
    m: dict[str, Any] = {
        "schema": SCHEMA, "version": int(old["version"]) + 1 if old else 1,
        "profile": profile, "source": source or str(study.resolve()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "produced_by": {"ladder/": STAGES["ladder"], MODEL_FILE: STAGES[MODEL_FILE],
                        **({BATCH_SHARPNESS_FILE: STAGES[BATCH_SHARPNESS_FILE]}
                           if bs.is_file() else {}),
                        **({MODEL_ROWS_FILE: STAGES[MODEL_ROWS_FILE]}
                           if (tmp / MODEL_ROWS_FILE).is_file() else {}),
                        **({REGIME_MODEL_FILE: STAGES[REGIME_MODEL_FILE]} if regime else {}),
                        **({PREDICTIONS_FILE: STAGES[PREDICTIONS_FILE]} if predictions else {}),
                        **({f"{SCIENCE4}/": STAGES[SCIENCE4]} if (tmp / SCIENCE4).is_dir() else {}),
                        **({f"{CLAIMS_CELLS}/": STAGES[CLAIMS_CELLS]}
                           if (tmp / CLAIMS_CELLS).is_dir() else {}),
                        **({f"{BATCH_SHARPNESS_CELLS}/": STAGES[BATCH_SHARPNESS_CELLS]}
                           if (tmp / BATCH_SHARPNESS_CELLS).is_dir() else {}),
                        **{f"{rel}/": STAGES[rel] for rel in PHASE_MAPS
                           if (tmp / rel / "map.json").is_file()}},
        "files": {p.relative_to(tmp).as_posix(): _sha(p) for p in _files(tmp)}}
    (tmp / "MANIFEST.json").write_text(json.dumps(m, indent=2) + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    if predict is not None and profile == "llama2-70b":
        # the predictor on the files just written (by default the shipped paths, so the
        # file names no temp dir)
        argv = ["--profile", "llama2-70b", "--out", str(d / PREDICTIONS_FILE)]
        if Path(root).resolve() != DATA:
            argv += ["--ladder", str(d / "ladder"), "--rate-model", str(d / MODEL_FILE)]
        rc = predict(argv)
        if rc:
            raise PackageDataError(f"adamspike predict failed (exit {rc}) on {d}")
        m["files"] = {p.relative_to(d).as_posix(): _sha(p) for p in _files(d)}
        (d / "MANIFEST.json").write_text(json.dumps(m, indent=2) + "\n")
    return m


def main(argv: list[str] | None = None,
         predict: Callable[[list[str]], int] | None = None) -> int:
    """`adamspike package-data [--from STUDY_DIR]` (predict: as in `write`; study/cli.py
    passes simulate.predict's)."""
    ap = argparse.ArgumentParser(prog="adamspike package-data",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="study", metavar="STUDY_DIR",
                    help="replace the shipped fit by a finished study folder's")
    ap.add_argument("--profile", default="llama2-70b", choices=PROFILES)
    ap.add_argument("--source", help="provenance text for the manifest (default: the path)")
    return cli_main(ap, argv, lambda args: _main(args, predict), "adamspike package-data",
                    (ConfigError, OSError))


def _main(args, predict: Callable[[list[str]], int] | None) -> int:
    if args.study:
        m = write(args.study, args.profile, source=args.source, predict=predict)
        print(f"wrote {describe(m)}: {len(m['files'])} files -> {profile_dir(args.profile)}")
        return 0
    m = manifest(args.profile)
    print(json.dumps(m, indent=2))
    print(f"{describe(m)}: {len(m['files'])} files, sha256 ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
