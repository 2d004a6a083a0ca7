"""docs/configuration.md is `ragen config --list`'s output, and every config key has a one-line meaning."""

from pathlib import Path

from ragen.config import RunConfig
from ragen.config_reference import reference_markdown, rows
from ragen.sft.config import SFTConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_reference_page_matches_the_code():
    assert DOC.read_text() == reference_markdown() + "\n", "regenerate it: ragen config --list > docs/configuration.md"


def test_every_key_says_what_it_does():
    for cls in (RunConfig, SFTConfig):
        missing = [key for key, _, _, meaning in rows(cls) if not meaning]
        assert not missing, f"{cls.__name__}: add a #: comment above {missing}"
