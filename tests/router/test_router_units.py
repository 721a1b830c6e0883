"""The router's pure parts: what affinity hashes, and --backend addresses."""

from __future__ import annotations

import pytest

from loom.router.backends import normalize_url
from loom.router.router import prompt_keys


def test_prompt_keys_of_each_body_shape():
    assert prompt_keys({"prompt": "hello"}) == "hello"
    assert prompt_keys({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_keys({"prompt": ["a", "b"]}) == "a\nb"
    assert prompt_keys({"prompt": [[4, 5], [6]]}) == [4, 5]
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "image_url"}]}]}
    assert prompt_keys(chat) == "system\nBe brief.\nuser\nHi\n"
    # a longer conversation starts with the shorter one: its prefix, for affinity
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "Hello."}]}
    assert prompt_keys(longer).startswith(prompt_keys(chat))
    assert prompt_keys({}) == ""


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://host:8000/", "http://host:8000"),
    ("https://host", "https://host"),
])
def test_backend_urls_are_normalized(given, expected):
    assert normalize_url(given) == expected


@pytest.mark.parametrize("bad", ["http://host:8000/v1", "ftp://host:21"])
def test_bad_backend_urls_are_refused(bad):
    with pytest.raises(ValueError):
        normalize_url(bad)
