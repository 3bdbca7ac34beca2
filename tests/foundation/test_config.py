import pytest

from adamspike.config import ConfigError, load_config, parse_overrides, to_dict, from_dict
from adamspike.train_config import RunConfig


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[optim]\neps = 1e-6\nb2 = 0.99\n[train]\nnum_steps = 7\n')
    cfg = load_config(RunConfig, p, ["--optim.lr", "1e-2", "--seed=3", "--data.skip_batches", "4,5"])
    assert cfg.optim.eps == 1e-6 and cfg.optim.b2 == 0.99 and cfg.optim.lr == 1e-2
    assert cfg.train.num_steps == 7 and cfg.train.seed == 3 and cfg.data.skip_batches == [4, 5]
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("text,match", [
    ("[optim]\nbeta2 = 0.9\n", "unknown config key: optim.beta2"),
    ("[optim]\nb2 = 1.0\n", "optim.b2: must be < 1.0"),
    ("[optim]\neps = -1e-8\n", "optim.eps: must be >= 0.0"),
    ("[optim]\nlr = nan\n", "optim.lr: must be finite"),
    ("[train]\nnum_steps = 'ten'\n", "train.num_steps: expected an integer"),
    ("[optim]\nschedule = 'step'\n", "optim.schedule: must be one of"),
    ("[model]\npreset = 'gpt5'\n", "model.preset"),
    ("[train]\nglobal_batch_size = 10\nmicro_batch_size = 4\n", "micro_batch_size"),
    ("[[optim]]\n", "optim: expected a table"),
    ("[optim\n", "invalid TOML"),
])
def test_bad_configs_name_the_key(tmp_path, text, match):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match.replace("[", r"\[")):
        load_config(RunConfig, p)


def test_bad_override():
    with pytest.raises(ConfigError, match="unknown config key: optim.bogus"):
        parse_overrides(RunConfig, ["--optim.bogus", "1"])
    with pytest.raises(ConfigError, match="missing value"):
        parse_overrides(RunConfig, ["--optim.lr"])
    with pytest.raises(ConfigError, match="ambiguous"):
        parse_overrides(RunConfig, ["--every", "3"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config(RunConfig, "/nonexistent/x.toml")


def test_lr_schedule():
    from adamspike.train_config import OptimSection
    o = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert o.lr_at(5, 110) == 0.5 and o.lr_at(10, 110) == 1.0
    assert abs(o.lr_at(60, 110) - 0.55) < 1e-12 and abs(o.lr_at(110, 110) - 0.1) < 1e-12
    assert OptimSection(lr=2.0, schedule="constant").lr_at(7, 10) == 2.0


def test_data_order_resumes_and_shards():
    import numpy as np
    from adamspike.order import rank_slice, sample_indices
    a = np.concatenate([sample_indices(s, 8, 20, seed=3) for s in range(1, 11)])
    # every epoch of 20 samples is a permutation; deterministic; offset = skipped batches
    assert sorted(a[:20]) == list(range(20)) and sorted(a[20:40]) == list(range(20))
    np.testing.assert_array_equal(sample_indices(4, 8, 20, 3), a[24:32])
    np.testing.assert_array_equal(sample_indices(2, 8, 20, 3, offset=2), a[24:32])
    parts = [rank_slice(a[:8], r, 2) for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), a[:8])


def test_run_config_from_dict_of_dotted_keys():
    """RunConfig.from_dict: dotted keys over a base, validated as a whole; moved keys and
    bad values name the key; overrides() gives back the dotted differences."""
    base = RunConfig.from_dict({"optim.lr": 1e-3})
    cfg = RunConfig.from_dict({"optim.eps": "1e-6", "mitigation": {"update_clip": True}}, base=base)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.mitigation.update_clip) == (1e-3, 1e-6, True)
    assert cfg.overrides(base) == {"optim.eps": 1e-6, "mitigation.update_clip": True}
    for bad, msg in [({"optim.update_clip": True}, "optim.update_clip: moved to mitigation.update_clip"),
                     ({"model.embed_grad_shrink": 0.1}, "moved to mitigation.embed_grad_shrink"),
                     ({"optim.b2": 1.0}, "optim.b2: must be < 1.0"),
                     ({"optim.eps": 1e-6, "optim": {"eps": 1e-5}}, "optim.eps: given twice"),
                     ({"mitigation.v_reset_steps": [0]}, r"mitigation.v_reset_steps\[0\]: must be >= 1")]:
        with pytest.raises(ConfigError, match=msg):
            RunConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="moved to mitigation.update_clip"):
        parse_overrides(RunConfig, ["--optim.update_clip", "true"])


def test_bias_correction_offset_setting_and_ids_of_configs_without_it():
    """optim.bias_correction_offset: an int >= 0 (0, torch's AdamW, by default); at 0 it is
    left out of the dotted config that cell / arm ids hash (id_settings), at 1 it is kept."""
    from adamspike.config import flatten
    from adamspike.train_config import id_settings

    assert RunConfig().optim.bias_correction_offset == 0
    assert RunConfig.from_dict({"optim.bias_correction_offset": 1}).optim.bias_correction_offset == 1
    with pytest.raises(ConfigError, match="optim.bias_correction_offset"):
        RunConfig.from_dict({"optim.bias_correction_offset": -1})
    flat = flatten(to_dict(RunConfig()))
    assert set(flat) - set(id_settings(flat)) == {"optim.bias_correction_offset", "telemetry.wandb"}
    seed = flatten(to_dict(RunConfig.from_dict({"optim.bias_correction_offset": 1})))
    assert id_settings(seed) == {k: v for k, v in seed.items() if k != "telemetry.wandb"}
    assert id_settings(seed)["optim.bias_correction_offset"] == 1        # kept when set


def test_apply_sets_replaces_one_key_of_a_section_in_place():
    """`--set SECTION.KEY=VALUE` (the study's size table's explicit sizes): TOML values,
    dotted keys inside a section (quoted or nested alike), a table replaced whole, the
    section's key order kept; a bad one is one ConfigError naming it."""
    from adamspike.config import apply_sets
    data = {"map": {"overrides": {"train.num_steps": 600, "optim.warmup_steps": 200},
                    "seeds": 10, "check": {"steps": 300, "lr_mult": [1, 64]}},
            "targets": {"embed": 0.7}}
    got = apply_sets(data, ["map.overrides.train.num_steps=200", "map.seeds=4",
                            "map.check={steps = 60}", "map.lr_mult=[1, 256]"], {"map"})
    assert got["map"] == {"overrides": {"train": {"num_steps": 200}, "optim": {"warmup_steps": 200}},
                          "seeds": 4, "check": {"steps": 60}, "lr_mult": [1, 256]}
    assert got["targets"] is data["targets"] and data["map"]["seeds"] == 10   # not mutated
    for bad, needle in (("map.seeds", "KEY=VALUE"), ("targets.embed=1", "SECTION.KEY"),
                        ("map.seeds=[1,", "not a TOML value")):
        with pytest.raises(ConfigError, match=needle):
            apply_sets(data, [bad], {"map"})
