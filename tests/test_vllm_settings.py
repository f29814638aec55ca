"""The plugin's `--additional-config` settings: accepted values and clear refusals."""

from types import SimpleNamespace

import pytest

from atom_plugin.vllm.settings import PluginSettings


def config(**additional):
    return SimpleNamespace(additional_config=additional)


def test_defaults_without_additional_config():
    assert PluginSettings.from_vllm_config(config()) == PluginSettings()
    assert PluginSettings.from_vllm_config(SimpleNamespace(additional_config=None)) == (
        PluginSettings()
    )


def test_opt_in_is_read():
    cfg = config(atom_plugin={"v1_logits_processors": True})
    assert PluginSettings.from_vllm_config(cfg).v1_logits_processors is True


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"v1_logit_processors": True}, "unknown atom_plugin setting.*valid settings: v1_"),
        ({"v1_logits_processors": "yes"}, "must be true or false, not 'yes'"),
        ([1], "must be an object"),
    ],
)
def test_bad_settings_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_vllm_config(config(atom_plugin=raw))
