"""Generation engines behind one interface (:mod:`ragen.engines.base`); :func:`build_engine` makes one from a config."""

from ragen.engines.base import Generation, GenerationEngine, SamplingParams, engine_session

__all__ = ["Generation", "GenerationEngine", "SamplingParams", "engine_session", "build_engine"]


def build_engine(model, tokenizer, config, **kwargs):
    """The engine ``config.rollout.engine`` names, on ``model`` (imported here: this package stays light)."""
    from ragen.engines.factory import build_engine as build

    return build(model, tokenizer, config, **kwargs)
