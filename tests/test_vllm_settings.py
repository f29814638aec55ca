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


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"tbo": "sometimes"}, "tbo='sometimes' is not one of off, prefill, decode, all"),
        ({"tbo": True}, "tbo must be a string"),
        (
            {"tbo": "all", "tbo_decode_min_requests": 0},
            "tbo_decode_min_requests must be a positive",
        ),
        (
            {"tbo": "all", "tbo_prefill_min_tokens": 1.5},
            "tbo_prefill_min_tokens must be a positive",
        ),
        ({"tbo": "all", "tbo_decode_min_requests": 2}, "decode_min_requests must be an int >= 3"),
        ({"tbo_decode_min_requests": "64"}, "must be a positive integer, not '64'"),
    ],
)
def test_bad_tbo_settings_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_vllm_config(config(atom_plugin=raw))


def test_tbo_modes_map_to_the_steps_that_split():
    def tbo(mode):
        return PluginSettings.from_dict({"tbo": mode}).tbo_config()

    assert tbo("off") is None
    assert (tbo("prefill").prefill, tbo("prefill").decode) == (True, False)
    assert (tbo("decode").prefill, tbo("decode").decode) == (False, True)
    assert (tbo("all").prefill, tbo("all").decode) == (True, True)
    assert tbo("all").decode_min_requests == PluginSettings().tbo_decode_min_requests
