"""Deterministic Qwen-style byte-level BPE tokenizer and chat template for test models."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
from tokenizers import pre_tokenizers as pre

# Added after the BPE merges, in this order, as in Qwen. Only SPECIAL is skipped on decode;
# the markup tokens stay visible in decoded text.
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
PAD, EOS = SPECIAL[0], SPECIAL[2]
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3-like ChatML template with tools; every tag trims whitespace, so layout here is free.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {%- if not loop.first or message.content %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will can more
about out up them some could what into than then its only other new time these two may first any my
now such like our over me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very make
world still own see work long get here between both life being under never day same another know
while last might us great old year off come since against go came right used take three model cache
prefix token server request bundle weight layer build deploy memory user assistant system tool value
function number string data file folder answer question error result list order price city weather
search email""".split()
SYLLABLES = (
    "ka ri to ne mo la shi ven dor pel qua zin tha bro gle mar sen tiv ox um ar el in on".split()
)
UNICODE_WORDS = (
    "café naïve Grüße señor façade 日本語 東京 こんにちは Привет مرحبا Ελληνικά 한국어 "
    "😀 🚀 👍 🎉 ✓ → € £ °C — … « »"
).split()


def _word(r: random.Random) -> str:
    if r.random() < 0.75:
        return r.choice(WORDS)
    return "".join(r.choice(SYLLABLES) for _ in range(r.randint(1, 4)))


def _sentence(r: random.Random) -> str:
    words = [_word(r) for _ in range(r.randint(4, 16))]
    if r.random() < 0.2:
        words.insert(r.randrange(len(words)), r.choice(UNICODE_WORDS))
    if r.random() < 0.3:
        words.insert(r.randrange(len(words)), str(r.randint(0, 10 ** r.randint(1, 7))))
    text = " ".join(words)
    return text[0].upper() + text[1:] + r.choice(".!?;:,.")


def _code(r: random.Random) -> str:
    name = "_".join(_word(r) for _ in range(r.randint(1, 3)))
    args = ", ".join(_word(r) for _ in range(r.randint(0, 3)))
    body = f"    {_word(r)} = {_word(r)}({args})\n    return {_word(r)} + {r.randint(0, 99)}\n"
    return f'def {name}({args}):\n    """{_sentence(r)}"""\n{body}'


def _json(r: random.Random) -> str:
    values = [None, True, r.randint(-999, 99999), round(r.uniform(-100, 100), 3), _word(r)]
    values.append({"type": r.choice(["string", "integer", "object"]), "description": _sentence(r)})
    obj = {_word(r): r.choice(values) for _ in range(r.randint(1, 5))}
    return json.dumps(obj, ensure_ascii=r.random() < 0.3, indent=r.choice([None, 2]))


def corpus(documents: int) -> Iterator[str]:
    """Yield a fixed mix of English-like prose, code, JSON, digits and non-ASCII text."""
    r = random.Random(20240601)
    for _ in range(documents):
        kind = r.random()
        if kind < 0.55:
            yield _sentence(r)
        elif kind < 0.75:
            yield _code(r)
        elif kind < 0.92:
            yield _json(r)
        else:
            yield " ".join(r.choice(UNICODE_WORDS) for _ in range(5))


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with Qwen's pre-tokenizer; special tokens come after the merges."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre.Sequence(
        [split, pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL) - len(MARKUP),
        min_frequency=2,
        initial_alphabet=pre.ByteLevel.alphabet(),  # all 256 bytes: any text tokenizes
        show_progress=False,
    )
    # Training was measured byte-identical across processes; the corpus grows with the vocab.
    tok.train_from_iterator(corpus(max(5000, vocab_size * 5 // 2)), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    return tok


def tokenizer_config() -> dict:
    """The tokenizer_config.json of the test model: Qwen2 tokenizer, no BOS, ChatML template."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "errors": "replace",
        "model_max_length": 40960,
        "pad_token": PAD,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
