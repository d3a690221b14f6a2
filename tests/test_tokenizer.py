"""The tokenizer read without transformers gives transformers' ids, text and chat renderings."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvserve.model.loader import load_tokenizer, resolve_model_path
from kvserve.model.tokenizer import INFO_FILE, Tokenizer

TEXTS = ["Hello world", "  leading and trailing spaces  ", "def f(x):\n\treturn x**2  # square\n",
         "naïve café 日本語 🤖", "<|im_start|>user\nhi<|im_end|>", "I can't, you're . , !?", "", "\n\n\n",
         "1234567890 3.14159"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_same_ids_text_and_chat_as_transformers(model: str) -> None:
    """Against transformers' own tokenizer over the same converted files: ids with and without
    special tokens, decoded text with and without them, the vocabulary, the special ids, and the
    chat template with and without a generation prompt and tools (Qwen's template reads them)."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(resolve_model_path(model))
    assert ours is not None and ours.source is not None
    hf = AutoTokenizer.from_pretrained(str(ours.source))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == list(hf.encode(text, add_special_tokens=special)), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == hf.get_vocab()
    assert (ours.eos_token_id, ours.bos_token_id, ours.unk_token_id) == \
        (hf.eos_token_id, hf.bos_token_id, hf.unk_token_id)
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            for tools in (None, TOOLS):
                assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt) == \
                    hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    if model.startswith("qwen"):
        rendered = ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, add_generation_prompt=True)
        assert "get_weather" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_loads_without_transformers() -> None:
    """Once converted, a model's tokenizer loads and encodes in a process that never imports
    transformers (it cost seconds of every start-up)."""
    assert load_tokenizer(resolve_model_path("smollm2-135m")) is not None  # converted here if not yet
    code = ("import sys\nfrom kvserve.model.loader import load_tokenizer, resolve_model_path\n"
            "tok = load_tokenizer(resolve_model_path('smollm2-135m'))\n"
            "assert tok.decode(tok.encode('Hello world')) == 'Hello world'\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_hf_folder_is_converted_once_and_a_damaged_copy_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_tokenizer(resolve_model_path("smollm2-135m"))
    assert first is not None and first.source is not None
    folder = tmp_path / "model"
    first.save_pretrained(folder)  # an HF folder as transformers writes one
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    converted = load_tokenizer(folder)
    assert converted is not None and converted.source is not None
    assert converted.source.is_relative_to(tmp_path / "cache") and (converted.source / INFO_FILE).exists()
    expected = first.encode("The cache holds a converted copy.")
    read_back = load_tokenizer(folder)
    assert read_back is not None and read_back.encode("The cache holds a converted copy.") == expected
    (converted.source / "tokenizer.json").write_text("{ not json")
    again = load_tokenizer(folder)
    assert again is not None and again.encode("The cache holds a converted copy.") == expected
    assert load_tokenizer(tmp_path) is None  # no tokenizer files: the model has none


def test_saved_folder_carries_the_template_in_use(tmp_path: Path) -> None:
    """A template set after loading (Gemma's fallback, where the file has none) is the one a
    saved folder gives transformers (and vLLM, which exports through it)."""
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    assert tokenizer is not None
    tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages) == "[hi]"


def test_threads_share_one_tokenizer() -> None:
    """The engine thread and the server's handlers use one instance: concurrent encodes and
    decodes give what one thread alone gets."""
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    assert isinstance(tokenizer, Tokenizer)
    texts = [f"request {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(200)]
    expected = [(tokenizer.encode(t), tokenizer.decode(tokenizer.encode(t))) for t in texts]
    results: list[list[tuple[list[int], str]]] = [[], []]

    def work(slot: int) -> None:
        results[slot] = [(tokenizer.encode(t), tokenizer.decode(tokenizer.encode(t))) for t in texts]

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected, expected]
