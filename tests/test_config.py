"""Config composition, overrides, interpolation and every error path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdcli.config import load_config, load_resolved
from pdcli.errors import ConfigError, UserError


def write(path: Path, obj: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else yaml.safe_dump(obj))
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path / "configs/model/small.yaml", {"name": "mlp", "kwargs": {"hidden": 16}})
    write(tmp_path / "configs/model/big.yaml", {"name": "mlp", "kwargs": {"hidden": 512}})
    write(tmp_path / "configs/optim/fast.yaml", {"name": "adam", "lr": 0.01})
    write(
        tmp_path / "recipes/exp.yaml",
        {
            "defaults": [{"model": "small"}, {"optim": "fast"}],
            "optim": {"lr": 0.002},
            "run": {"name": "${model.name}-${schedule.name}-${data.batch_size}"},
            "data": {"batch_size": 16},
        },
    )
    return tmp_path


def test_composition_precedence_and_interpolation(tree: Path) -> None:
    loaded = load_config(tree / "recipes/exp.yaml", ["schedule.name=gpipe"])
    cfg = loaded.config
    assert cfg.model.kwargs == {"hidden": 16}  # from the group file
    assert cfg.optim.name == "adam"  # group file
    assert cfg.optim.lr == 0.002  # recipe body beats group file
    assert cfg.schedule.name == "gpipe"  # command line beats everything
    assert cfg.run.name == "mlp-gpipe-16"  # interpolation after overrides
    assert cfg.train.steps == 50  # schema default
    assert loaded.sources["optim.lr"].endswith("exp.yaml")
    assert loaded.sources["optim.name"].endswith("fast.yaml")
    assert loaded.sources["schedule.name"] == "command line"


def test_group_override_and_delete(tree: Path) -> None:
    cfg = load_config(tree / "recipes/exp.yaml", ["model=big", "~optim.lr"]).config
    assert cfg.model.kwargs == {"hidden": 512}
    assert cfg.optim.lr == 0.05  # deleted from the composed config: the schema default applies
    assert cfg.optim.name == "adam"  # the rest of the group is untouched


def test_deletes_and_sets_apply_in_command_line_order(tree: Path) -> None:
    recipe = tree / "recipes/exp.yaml"
    loaded = load_config(recipe, ["~optim.lr", "optim.lr=0.3"])
    assert loaded.config.optim.lr == 0.3 and loaded.sources["optim.lr"] == "command line"
    loaded = load_config(recipe, ["optim.lr=0.3", "~optim.lr"])
    assert loaded.config.optim.lr == 0.05 and "optim.lr" not in loaded.sources  # deleted last: the schema default
    # a whole section: deleted, then one key set again; the rest falls back to the defaults
    cfg = load_config(recipe, ["~optim", "optim.momentum=0.5"]).config
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.momentum) == ("sgd", 0.05, 0.5)
    cfg = load_config(recipe, ["optim.momentum=0.5", "~optim"]).config
    assert (cfg.optim.name, cfg.optim.momentum) == ("sgd", 0.0)


@pytest.mark.parametrize("value", ["-0.1", "0", "nan", "inf", "-inf"])
def test_learning_rate_must_be_a_finite_positive_number(value: str) -> None:
    with pytest.raises(ConfigError, match=r"command line: optim.lr: must be a finite number > 0, got"):
        load_config(None, [f"optim.lr={value}"])


def test_no_recipe_gives_defaults() -> None:
    cfg = load_config(None, ["train.steps=3"]).config
    assert cfg.train.steps == 3 and cfg.schedule.name == "pipedream"


def test_all_problems_reported_together(tree: Path) -> None:
    write(
        tree / "recipes/bad.yaml",
        {"defaults": [{"model": "smal"}], "train": {"stpes": 3, "seed": "abc"}, "optim": {"lr": "???"}},
    )
    with pytest.raises(ConfigError) as info:
        load_config(tree / "recipes/bad.yaml", ["schedule.num_microbatches=x"])
    problems = info.value.problems
    text = str(info.value)
    assert len(problems) == 5, problems
    assert "model/smal.yaml" in text and "did you mean small" in text
    assert "train.stpes: unknown key (did you mean train.steps?)" in text
    assert "train.seed: expected int, got 'abc'" in text
    assert "optim.lr: missing required value" in text
    assert "command line: schedule.num_microbatches: expected int" in text
    assert all("bad.yaml" in p or "command line" in p for p in problems)


def test_value_checks_name_key_and_fix(tree: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tree / "recipes/exp.yaml", ["schedule.name=pipe", "data.batch_size=10", "schedule.num_microbatches=4"])
    text = str(info.value)
    assert "schedule.name: 'pipe' is not one of pipedream, 1f1b, gpipe, 2bw" in text
    assert "data.batch_size: 10 is not divisible by schedule.num_microbatches=4" in text


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="recipe not found"):
        load_config(tmp_path / "nope.yaml")
    bad = write(tmp_path / "bad.yaml", "train:\n  steps: [1, 2\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+:\d+: malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="unknown group 'modle'; did you mean model"):
        load_config(write(tmp_path / "g.yaml", {"defaults": [{"modle": "x"}]}))
    with pytest.raises(ConfigError, match=r"train.lr: unknown key \(did you mean optim.lr\?\)"):
        load_config(None, ["train.lr=0.1"])
    with pytest.raises(ConfigError, match="is not `key=value`"):
        load_config(None, ["train.steps"])


def test_resolved_config_round_trips(tree: Path, tmp_path: Path) -> None:
    loaded = load_config(tree / "recipes/exp.yaml", ["train.steps=7"])
    out = write(tmp_path / "resolved.yaml", loaded.to_yaml())
    assert load_resolved(out) == loaded.config


def test_list_items_are_overridden_by_index(tree: Path) -> None:
    # the recipe sets no cluster.levels: the index reaches into the schema's default list
    cfg = load_config(tree / "recipes/exp.yaml", ["cluster.levels.0.devices=3"]).config
    assert cfg.cluster.levels[0].devices == 3 and cfg.cluster.levels[0].bandwidth_bytes_per_s > 0
    write(tree / "recipes/two.yaml", {"cluster": {"levels": [{"devices": 2}, {"devices": 4, "bandwidth_bytes_per_s": 1e9}]}})
    loaded = load_config(tree / "recipes/two.yaml", ["cluster.levels.1={devices: 8}", "cluster.levels.0.devices=4"])
    assert [level.devices for level in loaded.config.cluster.levels] == [4, 8]
    assert loaded.config.cluster.levels[1].bandwidth_bytes_per_s == 1e9  # a dict value merges
    assert loaded.sources["cluster.levels.0.devices"] == "command line"
    with pytest.raises(ConfigError) as err:
        load_config(tree / "recipes/two.yaml", ["cluster.levels.5.devices=3", "cluster.levels.x=1"])
    text = str(err.value)
    assert "cluster.levels.5.devices: cannot set it (list index out of range)" in text
    assert "cluster.levels.x: cannot set it" in text and "cluster.levels.0.devices=4" in text


def test_cuts_on_the_command_line_outrank_a_recipes_stage_count(tree: Path) -> None:
    recipe = write(tree / "recipes/two.yaml", {"plan": {"num_stages": 2}})
    loaded = load_config(recipe, ["plan.split_points=[layer2,layer4]"])
    assert loaded.config.plan.num_stages is None and loaded.config.plan.split_points == ["layer2", "layer4"]
    assert loaded.notes == [f"plan.split_points makes 3 stages: {recipe}'s plan.num_stages: 2 is not used"]
    assert "plan.num_stages" not in loaded.sources
    # cuts that fit the count leave it; a count set on the command line stays (the planner names the conflict)
    for overrides in (["plan.boundaries=[5]"], ["plan.split_points=[layer2,layer4]", "plan.num_stages=2"]):
        loaded = load_config(recipe, overrides)
        assert loaded.config.plan.num_stages == 2 and loaded.notes == []
    # cuts from a file do not override a count from a file
    both = write(tree / "recipes/both.yaml", {"plan": {"num_stages": 2, "boundaries": [3, 6]}})
    assert load_config(both, []).config.plan.num_stages == 2
