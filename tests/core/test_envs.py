"""loom.envs: every LOOM_* switch read once into a frozen Settings."""

import dataclasses
from pathlib import Path

import pytest

from loom.envs import Settings, settings


def test_defaults_when_nothing_is_set():
    defaults = Settings.from_environ({})
    assert defaults == Settings()
    assert defaults.cpu_packed_weights and defaults.native_layers and defaults.native_kernels
    assert defaults.cache_dir == Path.home() / ".cache" / "loom"
    assert defaults.test_stall_worker_at_step is None
    assert defaults.test_stall_engine_at_step is None


def test_every_field_names_a_loom_variable():
    names = [spec.metadata["env"] for spec in dataclasses.fields(Settings)]
    assert all(name.startswith("LOOM_") for name in names)
    assert len(set(names)) == len(names)


def test_values_are_parsed_into_their_types(tmp_path):
    read = Settings.from_environ({
        "LOOM_NATIVE_LAYERS": "0", "LOOM_NATIVE_KERNELS": "false", "LOOM_CPU_PACKED_WEIGHTS": "1",
        "LOOM_CACHE_DIR": str(tmp_path), "LOOM_TEST_STALL_WORKER_AT_STEP": "3",
        "LOOM_TEST_STALL_ENGINE_AT_STEP": "0", "LOOM_LOG_STATS_INTERVAL": "0.5"})
    assert (read.native_layers, read.native_kernels, read.cpu_packed_weights) == (False, False, True)
    assert read.cache_dir == tmp_path
    assert read.test_stall_worker_at_step == 3
    assert read.test_stall_engine_at_step is None  # 0: off
    assert read.log_stats_interval_s == 0.5 and Settings().log_stats_interval_s == 10.0
    assert Settings.from_environ({"LOOM_NATIVE_LAYERS": ""}).native_layers  # empty: unset


@pytest.mark.parametrize("name, value", [("LOOM_NATIVE_LAYERS", "maybe"),
                                         ("LOOM_TEST_STALL_ENGINE_AT_STEP", "three"),
                                         ("LOOM_LOG_STATS_INTERVAL", "0"),
                                         ("LOOM_LOG_STATS_INTERVAL", "soon")])
def test_a_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        Settings.from_environ({name: value})


def test_settings_are_read_once_and_frozen(monkeypatch):
    settings.cache_clear()
    monkeypatch.setenv("LOOM_NATIVE_LAYERS", "0")
    first = settings()
    monkeypatch.setenv("LOOM_NATIVE_LAYERS", "1")
    assert settings() is first and not first.native_layers
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.native_layers = True
    settings.cache_clear()
    assert settings().native_layers
    monkeypatch.undo()
    settings.cache_clear()
