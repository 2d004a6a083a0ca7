"""Both HF sampling paths sample one distribution: ragen's temperature / top-k / top-p, never the model's own warpers.

``sampler="multinomial"`` is ``generate(do_sample=True)``, which merges the model's ``generation_config`` into the
call; ``"inverse_cdf"`` runs :class:`~ragen.models.sampling.InverseCDFSampler` (inside ``generate`` or in ragen's
decode loop), which knows only ragen's three values. A model config with min-p, typical-p, ... once made the two
sample different distributions; these tests pin them to the same one, and to the trainer's at top-k/top-p off.
"""

import pytest
import torch
import transformers.generation.utils as generation_utils

import ragen.models.backend as backend_module
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.sampling import GENERATION_CONFIG_WARPERS_OFF, InverseCDFSampler, multinomial_generate_kwargs
from ragen.train.target_logprobs import target_logprobs

from tests.models.test_sampling import assert_frequencies

#: A model config asking for every warper transformers 5 knows (no watermark: it would keep the decode loop out).
MODEL_WARPERS = dict(temperature=0.6, top_k=50, top_p=0.9, min_p=0.5, typical_p=0.5, epsilon_cutoff=3e-5,
                     eta_cutoff=1e-3, top_h=0.5)
#: Each switched-off field with a value that would add its warper (or watermark) to generate's processors.
ACTIVE = dict(min_p=0.5, typical_p=0.5, epsilon_cutoff=3e-5, eta_cutoff=1e-3, top_h=0.5, watermarking_config={})
#: transformers' warper classes by the field that adds them (ragen's own three first).
WARPER_FIELDS = {"TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p",
                 "MinPLogitsWarper": "min_p", "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff",
                 "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h"}
RAGEN_PARAMS = [dict(), dict(temperature=0.7, top_k=20, top_p=0.9)]


def tiny_with(settings: dict):
    """A fresh tiny model (not the session fixture: its config is changed) whose generation_config has ``settings``."""
    model, tokenizer = load_model("tiny")
    for name, value in settings.items():
        if name == "watermarking_config":
            from transformers import WatermarkingConfig

            value = WatermarkingConfig(**value)
        setattr(model.generation_config, name, value)
    return model, tokenizer


def first_token_distribution(sampler: str, fast: bool, params: SamplingParams, monkeypatch, settings=MODEL_WARPERS):
    """``(path, probs (V,))``: which path sampled one token of a prompt for a fresh tiny model with ``settings`` in its
    generation_config, and the distribution that path sampled from.

    Computed from the objects that really ran: the processors ``generate`` built (multinomial: all of them, then a
    softmax, as ``generate`` samples) or the :class:`InverseCDFSampler` the backend made, after any of ``generate``'s
    processors that ran before it. The tiny model is seeded: every call sees the same logits.
    """
    model, tokenizer = tiny_with(settings)
    seen = {"processors": [], "sampler": None, "path": None}
    build, generate, decode = model._get_logits_processor, model.generate, backend_module.decode

    def recording_build(*args, **kwargs):
        seen["processors"] = build(*args, **kwargs)
        return seen["processors"]

    def recording_generate(*args, **kwargs):
        seen["path"] = "generate"
        return generate(*args, **kwargs)

    def recording_decode(*args, **kwargs):
        seen.update(path="loop", sampler=kwargs["sampler"])
        return decode(*args, **kwargs)

    monkeypatch.setattr(model, "_get_logits_processor", recording_build)
    monkeypatch.setattr(model, "generate", recording_generate)
    monkeypatch.setattr(backend_module, "decode", recording_decode)
    flags = dict(transposed_gemm=fast, grow_cache=fast, decode_attention=fast, fused_decode=fast, common_prefix=fast,
                 decode_loop=fast, fused_prefill=fast, first_from_prefill=fast)
    backend = HFBackend(model, tokenizer, precision="fp32", reuse_kv=False, sampler=sampler, **flags)
    prompt = tokenizer("Which arm do you pull?")["input_ids"]
    torch.manual_seed(0)
    backend.generate([prompt], params)
    monkeypatch.undo()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        scores = model(input_ids=ids).logits[:, -1].float()  # (1, V)
    for processor in seen["processors"]:
        if isinstance(processor, InverseCDFSampler):
            seen["sampler"] = processor
            break  # what generate runs after the sampler only sees its 0 / -inf scores
        scores = processor(ids, scores)
    if seen["sampler"] is not None:
        return seen["path"], seen["sampler"].probs(ids, scores)[0]
    return seen["path"], torch.softmax(scores.double(), -1)[0]


def first_logits(settings=MODEL_WARPERS) -> torch.Tensor:
    """The tiny model's logits ``(V,)`` after the prompt :func:`first_token_distribution` uses."""
    model, tokenizer = tiny_with(settings)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokenizer("Which arm do you pull?")["input_ids"]])).logits[0, -1].float()


@pytest.mark.parametrize("ragen", RAGEN_PARAMS, ids=["defaults", "T0.7_k20_p0.9"])
def test_both_samplers_compute_one_distribution_whatever_the_models_warpers(ragen, monkeypatch):
    """Same logits, every path: the same support and probabilities, ragen's warpers only (the model's are ignored)."""
    params = SamplingParams(max_new_tokens=1, **ragen)
    out = {}
    for sampler, fast, path in [("multinomial", True, "generate"), ("inverse_cdf", False, "generate"),
                                ("inverse_cdf", True, "loop")]:
        ran, out[sampler, fast] = first_token_distribution(sampler, fast, params, monkeypatch)
        assert ran == path, (sampler, fast)
    reference = out["inverse_cdf", True]
    for key, probs in out.items():
        assert torch.equal(probs > 0, reference > 0), key
        torch.testing.assert_close(probs, reference, rtol=1e-5, atol=1e-9)
    support = int((reference > 0).sum())
    if ragen:  # ragen's top-k (and top-p) only: the model's min-p / typical-p would have cut more
        assert 1 < support <= ragen["top_k"]
    else:  # nothing truncated: every token of the vocabulary can be drawn
        assert support == reference.numel()


def test_at_ragens_defaults_both_samplers_sample_the_trainers_distribution(monkeypatch):
    """The trainer's old log-probs (log softmax(z / T)) are those of what either sampler draws, min-p in the model or not."""
    params = SamplingParams(max_new_tokens=1, temperature=0.7)
    logits = first_logits()
    targets = torch.cat([torch.topk(logits, 8).indices, torch.arange(0, logits.numel(), 4099)])  # head and tail tokens
    trainer_logp, _ = target_logprobs(logits.expand(len(targets), -1).clone(), targets, temperature=0.7)
    for sampler in HFBackend.SAMPLERS:
        _, probs = first_token_distribution(sampler, True, params, monkeypatch)
        torch.testing.assert_close(probs[targets].log().float(), trainer_logp, rtol=0, atol=1e-4)


@pytest.mark.parametrize("field", sorted(ACTIVE))
@pytest.mark.parametrize("ragen", RAGEN_PARAMS, ids=["defaults", "T0.7_k20_p0.9"])
def test_the_multinomial_path_builds_only_ragens_warpers(field, ragen, monkeypatch):
    """Each field the sampler cannot honour, set in the model's config, adds nothing to generate(do_sample=True)."""
    model, tokenizer = tiny_with({field: ACTIVE[field], "temperature": 0.6, "top_k": 50, "top_p": 0.9})
    built = []
    build = model._get_logits_processor
    monkeypatch.setattr(model, "_get_logits_processor", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    backend = HFBackend(model, tokenizer, precision="fp32", reuse_kv=False, sampler="multinomial")
    backend.generate([tokenizer("Hi")["input_ids"]], SamplingParams(max_new_tokens=1, **ragen))
    names = [type(p).__name__ for p in built[-1]]
    assert names == (["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"] if ragen else [])


def test_every_transformers_warper_is_ragens_or_switched_off():
    """A transformers release with a new warper fails here, before it could split the two samplers' distributions."""
    warpers = {name for name in dir(generation_utils) if name.endswith("LogitsWarper")}
    assert warpers <= set(WARPER_FIELDS), warpers - set(WARPER_FIELDS)
    handled = {"temperature", "top_k", "top_p"} | set(GENERATION_CONFIG_WARPERS_OFF)
    assert {WARPER_FIELDS[name] for name in warpers} <= handled


def test_multinomial_kwargs_keep_transformers_default_top_k_out():
    """top_k=0 is passed as None: generate's global default (top_k=50) would otherwise truncate the distribution."""
    model, _ = load_model("tiny")
    kwargs = multinomial_generate_kwargs(model.generation_config, 0.7, 0, 1.0)
    assert kwargs["top_k"] is None and kwargs["do_sample"] is True and kwargs["min_p"] is None
    assert set(GENERATION_CONFIG_WARPERS_OFF) <= set(kwargs)


def test_probs_is_the_distribution_draw_samples_from():
    """:meth:`InverseCDFSampler.probs` (what the tests above compare) against draw's frequencies, top-p and T on."""
    torch.manual_seed(5)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    sampler = InverseCDFSampler(temperature=0.8, top_p=0.95)
    probs = sampler.probs(torch.zeros((1, 1), dtype=torch.long), logits[None].clone())[0]
    n = 40_000
    tokens = InverseCDFSampler(temperature=0.8, top_p=0.95).draw(torch.zeros((n, 1), dtype=torch.long),
                                                                 logits.expand(n, -1).clone())
    assert_frequencies(torch.bincount(tokens[:, 0], minlength=6), probs)
    assert probs[-1] == 0 and probs[-2] == 0  # top-p cut the tail (and -inf stays out)
