"""Config layering, YAML loading and validation: every mistake is one ConfigError sentence naming the option."""


import pytest

from copes.config.options import ConfigError, TrainConfig, build_config, config_with_preset, read_yaml

from helpers.paths import REPO

CONFIGS = REPO / "configs"


def test_defaults_are_the_papers_hyperparameters():
    cfg = TrainConfig()
    assert (cfg.population, cfg.subspaces, cfg.sigma, cfg.lr, cfg.prompt_batch) == (40, 4, 1e-3, 5e-4, 64)


def test_later_layers_win_and_none_means_unset(tmp_path):
    cfg = build_config({"population": 8, "subspaces": 2}, {"population": 12, "sigma": None}, {"lr": "0.01"})
    assert (cfg.population, cfg.subspaces, cfg.sigma, cfg.lr) == (12, 2, 1e-3, 0.01)


def test_es_is_copes_with_one_subspace():
    assert build_config({"algorithm": "es", "subspaces": 4}).num_subspaces == 1


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"algorithm": "sgd"}, "unknown algorithm 'sgd'"),
        ({"population": 10, "subspaces": 4}, "not divisible by --subspaces 4"),
        ({"sigma": 0}, "--sigma must be > 0"),
        ({"lr": -1}, "--lr must be > 0"),
        ({"rank": 0}, "--rank must be >= 1"),
        ({"population": "many"}, "option population must be int"),
        ({"budget_hours": -2}, "--budget-hours must be > 0"),
        ({"antithetic": True, "population": 12, "subspaces": 4}, r"--antithetic pairs .* gives 3 per subspace \(odd\)"),
        ({"workers": 0}, "--workers must be >= 1"),
    ],
)
def test_invalid_settings_raise_one_sentence(layer, message):
    with pytest.raises(ConfigError, match=message):
        build_config(layer)


def test_yaml_unknown_keys_and_syntax_errors_name_the_file(tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("population: 8\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) in .*unknown.yaml: learning_rate"):
        read_yaml(unknown)
    broken = tmp_path / "broken.yaml"
    broken.write_text("population: [8\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*broken.yaml at line"):
        read_yaml(broken)
    with pytest.raises(ConfigError, match="cannot read config"):
        read_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid_and_names_its_command(path):
    assert path.read_text().splitlines()[0] == f"# copes-run --config configs/{path.name}"
    build_config(read_yaml(path))


@pytest.mark.parametrize("algorithm", ["copes", "eggroll"])
def test_the_tiny_config_spells_out_the_embedded_models_preset(algorithm):
    from copes.modeling import read_preset

    preset = read_yaml(read_preset("tiny", algorithm))
    spelled_out = read_yaml(CONFIGS / f"tiny-arithmetic-{algorithm}.yaml")
    assert {k: v for k, v in spelled_out.items() if k not in ("model", "output_dir")} == preset


def test_eggroll_on_the_embedded_model_gets_its_own_preset_under_config_files_and_flags(tmp_path):
    from copes.cli import _config
    from copes.modeling import EMBEDDED_MODEL_DIR

    copes_preset, eggroll_preset = (read_yaml(EMBEDDED_MODEL_DIR / name)
                                    for name in ("copes.yaml", "copes.eggroll.yaml"))
    assert copes_preset["algorithm"] == "copes" and eggroll_preset["algorithm"] == "eggroll"
    eggroll = _config(None, {"algorithm": "eggroll"})
    assert {k: getattr(eggroll, k) for k in eggroll_preset} == eggroll_preset
    config = tmp_path / "run.yaml"
    config.write_text("algorithm: eggroll\npopulation: 8\n")
    from_file = _config(str(config), {"prompt_batch": 4})
    assert (from_file.population, from_file.prompt_batch, from_file.sigma) == (8, 4, eggroll_preset["sigma"])
    for flags in ({}, {"algorithm": "es"}, {"algorithm": "copes-lowrank"}):  # no preset of their own: copes.yaml's
        assert (_config(None, flags).sigma, _config(None, flags).lr) == (copes_preset["sigma"], copes_preset["lr"])


def test_task_options_and_tool_budgets_are_reachable_from_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("task: hotpotqa\ntask_options: {qa_metric: em}\ntool_budgets: {search: '3', python: 0}\n"
                    "template_kwargs: {enable_thinking: false}\n")
    cfg = build_config(read_yaml(path))
    assert cfg.task_options == {"qa_metric": "em"} and cfg.tool_budgets == {"search": 3, "python": 0}
    assert cfg.template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="option tool_budgets.search must be int"):
        build_config({"tool_budgets": {"search": "many"}})


@pytest.mark.parametrize("layer, message", [
    ({"restore": "disk"}, "unknown restore 'disk'; choose one of: device, host, subtract"),
    ({"fitness": "rank"}, "unknown fitness 'rank'; choose one of: joint, per_subspace"),
    ({"tool_format": "xml"}, "unknown tool_format 'xml'"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'; choose one of: sgd, adam"),
])
def test_choices_come_from_the_field(layer, message):
    with pytest.raises(ConfigError, match=message):
        build_config(layer)


def test_antithetic_and_adam_reach_the_strategy():
    from transformers import AutoModelForCausalLM

    from copes.config.components import build_strategy
    from copes.modeling import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"))
    strategy = build_strategy(build_config({"antithetic": True, "optimizer": "adam"}), model)
    assert (strategy.antithetic, strategy.optimizer) == (True, "adam")


def test_options_the_algorithm_does_not_use_are_named():
    asked = {"subspaces", "rank", "restore", "chunk_size", "sigma"}
    assert build_config({"algorithm": "eggroll"}).ignored_options(asked) == ["subspaces", "restore", "chunk_size"]
    assert build_config({"algorithm": "copes"}).ignored_options(asked) == ["rank"]
    assert build_config({"algorithm": "copes-lowrank"}).ignored_options(asked) == ["restore", "chunk_size"]


def test_copes_run_and_copes_train_read_the_same_model_preset():
    """The embedded model's copes.yaml (its ES settings and time budget) lies under the user's settings for both
    entry points; copes.train ignored it, running the tiny model at the paper's 4B settings."""
    from copes.cli import _config

    through_cli = _config(None, {"task": "arithmetic", "steps": 3})
    through_python = config_with_preset({"task": "arithmetic", "steps": 3})
    assert through_cli == through_python
    assert (through_python.sigma, through_python.population, through_python.budget_hours) == (0.01, 40, 2)
    assert config_with_preset({"budget_hours": 1.0}).budget_hours == 1.0
