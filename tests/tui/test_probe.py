"""Reading a probe prompt: pasted ids in any of the accepted spellings, or a file of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tui.probe import parse_tokens, read_probe


@pytest.mark.parametrize("text", ["1 2 3", "1,2,3", " 1, 2,\n3 ", "[1, 2, 3]"])
def test_token_ids_in_every_spelling(text: str) -> None:
    assert parse_tokens(text) == (1, 2, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "no token ids"), ("1 -2", "entry 1 is '-2'"), ("[1, 2", "not a JSON list"), ("hello", "'hello'")],
)
def test_what_is_not_token_ids_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tokens(text)


def test_a_path_reads_the_file(tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[5, 6, 7, 8]")
    probe = read_probe(str(prompt))
    assert probe.tokens == (5, 6, 7, 8)
    assert probe.label == "file prompt.json"
    assert read_probe("9 10").label == "pasted"
