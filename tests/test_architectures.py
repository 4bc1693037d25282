"""The architecture registry (jmamba.architectures): lookup by name, config class or instance, and
registering a new architecture."""

from __future__ import annotations

import dataclasses

import pytest

import jmamba
from jmamba import architectures
from jmamba.architectures import Architecture, get_architecture, register_architecture


def test_the_two_architectures_and_their_classes():
    assert jmamba.architecture_names() == ("mamba1", "mamba3")
    a1, a3 = get_architecture("mamba1"), get_architecture("mamba3")
    assert (a1.config_cls, a1.backbone_cls, a1.mixer_cls, a1.layer_state_cls) == (
        jmamba.Mamba1Config, jmamba.Mamba1Backbone, jmamba.Mamba1Mixer, jmamba.Mamba1LayerState)
    assert (a3.config_cls, a3.backbone_cls, a3.mixer_cls, a3.layer_state_cls) == (
        jmamba.Mamba3Config, jmamba.Mamba3Backbone, jmamba.Mamba3Mixer, jmamba.Mamba3LayerState)
    assert get_architecture(jmamba.Mamba3Config) is a3 and get_architecture(jmamba.Mamba1Config(d_model=8)) is a1


def test_unknown_architectures_raise():
    with pytest.raises(ValueError, match="unknown architecture 'mamba2'"):
        get_architecture("mamba2")
    with pytest.raises(TypeError, match="expected a backbone config"):
        get_architecture(jmamba.MambaLMConfig)
    with pytest.raises(ValueError, match="already registered"):
        register_architecture(get_architecture("mamba1"))
    with pytest.raises(TypeError, match="must be an Architecture"):
        register_architecture("mamba4")


def test_registering_a_new_architecture(monkeypatch):
    monkeypatch.setattr(architectures, "_REGISTRY", dict(architectures._REGISTRY))   # restored after the test

    @dataclasses.dataclass(frozen=True)
    class ToyConfig:
        d_model: int = 4
        input_dim: int = None
        arch = "toy"

        def validate(self):
            return self

    base = get_architecture("mamba1")
    toy = register_architecture(Architecture("toy", ToyConfig, base.backbone_cls, base.mixer_cls, base.layer_state_cls))
    assert get_architecture("toy") is toy and get_architecture(ToyConfig()) is toy
    assert "toy" in jmamba.architecture_names()
    with pytest.raises(ValueError, match="ToyConfig.arch must be 'other'"):
        register_architecture(Architecture("other", ToyConfig, base.backbone_cls, base.mixer_cls, base.layer_state_cls))
