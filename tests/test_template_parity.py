"""pipeline.builder.template renders byte-identical to transformers' apply_chat_template(tokenize=False)."""

import dataclasses
import datetime
import enum
import hashlib
from pathlib import Path

import jinja2
import pytest

from pipeline.builder import template as template_module
from pipeline.builder.template import check_pin, render, template_sha256, uses_date
from pipeline.format.errors import TemplateError

transformers = pytest.importorskip("transformers", minversion="5.0")
chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATES = Path(__file__).parent / "templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
PINNED = datetime.date(2024, 7, 23)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. Zürich; 'units' < 5 & \"quoted\".",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                    "city": {"type": "string", "description": "City name"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Full-text search ☃ over the manual.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]
DOCUMENTS = [
    {"title": "Tall penguins", "text": "Emperor penguins are the tallest.", "url": "a.example"},
    {"title": "Penguin habitats", "text": "Emperor penguins only live in Antarctica."},
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}

CHAT = [
    {"role": "system", "content": "You are terse.\n"},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": 'Grüße <b>& "quotes"</b>'},
]
QWEN_TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning": "Call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"rain": false}', "name": None},
    {"role": "assistant", "content": "<think>\nWarm, dry.\n</think>\n\nIt is 21 °C and dry."},
]
LLAMA_TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "content": {"temp": 21}},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks"},
]
GEMMA_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is it? "}]},
    {"role": "assistant", "content": "A penguin."},
    {"role": "user", "content": "How tall?"},
]
PHI_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "One"},
    {"role": "user", "content": "   "},
    {"role": "user", "content": "Two"},
    {"role": "assistant", "content": None, "tool_calls": None},
    {"role": "assistant", "content": "Three"},
    {"role": "tool", "content": "stops the loop"},
    {"role": "user", "content": "never rendered"},
]
TOJSON_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [CALL, CALL]},
    {"role": "user", "content": "And tomorrow?"},
]

# id, template file, messages, tools, documents, extra
CASES = [
    ("qwen3-plain", "qwen3_chatml_tools_think", CHAT, None, None, {}),
    ("qwen3-tools", "qwen3_chatml_tools_think", QWEN_TOOL_CHAT, TOOLS, None, {}),
    ("qwen3-nothink", "qwen3_chatml_tools_think", CHAT, TOOLS, None, {"enable_thinking": False}),
    ("llama3-plain", "llama3_date_header", CHAT, None, None, {}),
    ("llama3-tools", "llama3_date_header", LLAMA_TOOL_CHAT, TOOLS, None, {}),
    ("llama3-sys-tools", "llama3_date_header", CHAT, TOOLS, None, {"tools_in_user_message": False}),
    ("llama3-datestr", "llama3_date_header", CHAT, None, None, {"date_string": "01 Jan 2030"}),
    ("gemma-fold", "gemma_system_in_user", GEMMA_CHAT, None, None, {}),
    ("gemma-nosys", "gemma_system_in_user", CHAT[1:], None, None, {}),
    ("mistral", "mistral_strict_roles", CHAT, None, None, {}),
    ("llama2-bos", "llama2_bos_eos", CHAT, None, None, {}),
    ("smol-generation", "smol_generation_blocks", CHAT[1:], None, None, {}),
    ("phi-loop", "phi_loop_namespace", PHI_CHAT, None, None, {}),
    ("tojson-tools", "tojson_options_tools", TOJSON_CHAT, TOOLS, None, {}),
    ("command-r-docs", "command_r_documents", CHAT, None, DOCUMENTS, {}),
    ("command-r-acc", "command_r_documents", CHAT, None, DOCUMENTS, {"citation_mode": "accurate"}),
]


def template(name: str) -> str:
    """Return the text of tests/templates/<name>.jinja."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


class FrozenDatetime(datetime.datetime):
    """A datetime whose now() is the pinned date at 09:41, so only the date part may show."""

    @classmethod
    def now(cls, tz=None):
        return cls.combine(PINNED, datetime.time(9, 41, 7))


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny in-memory fast tokenizer with bos/eos/unk/pad set."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "hi": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL)


@pytest.fixture
def frozen_clock(monkeypatch):
    """Freeze transformers' strftime_now clock at PINNED."""
    monkeypatch.setattr(chat_template_utils, "datetime", FrozenDatetime)


def hf_render(tokenizer, text, messages, **kwargs):
    """Render with transformers, the reference."""
    return tokenizer.apply_chat_template(messages, chat_template=text, tokenize=False, **kwargs)


def test_tokenizer_special_tokens_are_the_ones_we_pass(tokenizer):
    assert tokenizer.special_tokens_map == SPECIAL


def test_corpus_has_every_template_in_a_case():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted({c[1] for c in CASES})


@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["nogen", "gen"])
@pytest.mark.parametrize(
    ("name", "messages", "tools", "documents", "extra"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_render_matches_transformers(
    tokenizer, frozen_clock, name, messages, tools, documents, extra, add_generation_prompt
):
    text = template(name)
    kwargs = {
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
    }
    ours = render(text, messages, special_tokens=SPECIAL, date=PINNED, extra=extra, **kwargs)
    assert ours == hf_render(tokenizer, text, messages, **kwargs, **extra)
    assert "<unk>" not in ours and len(ours) > 40


USER = [{"role": "user", "content": "x"}]
P = pytest.param


class Color(str, enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Message:
    role: str
    content: str
    name: str | None = None


def rich_values():
    """Values transformers rebuilds from plain types: enums, numpy, dataclasses, other objects."""
    np = pytest.importorskip("numpy")
    return {
        "color": Color.RED,
        "n": np.int64(3),
        "flag": np.bool_(False),
        "arr": np.zeros(2),
        "point": Message("a", "b"),
        "obj": object(),
    }


RICH = (
    "{{ color }}|{{ color | tojson }}|{{ n + 1 }}|{{ 'yes' if flag else 'no' }}|{{ arr }}|"
    "{{ point | tojson }}|{{ obj }}|{{ messages | tojson }}"
)
INLINE = [
    P("{{ messages | tojson }}", [{**CHAT[2], "reasoning": "r", "name": None}], {}, id="key-order"),
    P(
        "{{ messages[0] | tojson }}",
        [{**CHAT[2], "thinking": "t", "reasoning_content": "r"}],
        {},
        id="thinking",
    ),
    P(
        "{{ messages[0].content | tojson }}",
        [{"role": "user", "content": "<a>é</a>&'"}],
        {},
        id="no-escape",
    ),
    P("{{ bos_token }}|{{ eos_token }}", USER, {"bos_token": "<BOS>"}, id="extra-overrides-token"),
    P("{{ pair | tojson }}{{ pair is sequence }}", USER, {"pair": (1, "a")}, id="tuple-extra"),
    P("{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys('ab', 0) | tojson }}", USER, {}, id="dict"),
    P("[{{ nothing }}][{{ messages[0].missing }}]", USER, {}, id="undefined-is-empty"),
    P("{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n", USER, {}, id="trim-lstrip"),
    P(
        "{% for m in messages %}{% break %}{% endfor %}{{ range(3) | list }}",
        USER,
        {},
        id="loopcontrols",
    ),
]


def test_rich_values_match_transformers(tokenizer):
    messages = [Message("user", "x")]
    ours = render(RICH, messages, extra=rich_values())
    assert ours == hf_render(tokenizer, RICH, messages, **rich_values())
    assert ours == (
        'red|"red"|4|no|<ndarray>|{"role": "a", "content": "b", "name": null}|<object>|'
        '[{"role": "user", "content": "x"}]'
    )


@pytest.mark.parametrize(("text", "messages", "extra"), INLINE)
def test_inline_render_matches_transformers(tokenizer, text, messages, extra):
    ours = render(text, messages, special_tokens=SPECIAL, extra=extra)
    assert ours == hf_render(tokenizer, text, messages, **extra)


EXACT = [
    P(
        "llama3_date_header",
        CHAT[:2],
        {"add_generation_prompt": True},
        "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 23 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        id="llama3",
    ),
    P(
        "qwen3_chatml_tools_think",
        CHAT[1:2],
        {"add_generation_prompt": True, "extra": {"enable_thinking": False}},
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        id="qwen3-nothink",
    ),
    P(
        "smol_generation_blocks",
        CHAT[1:3],
        {},
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n",
        id="generation",
    ),
    P("llama2_bos_eos", CHAT[1:3], {}, "<s>[INST] Hi there [/INST] Hello. </s>", id="bos-eos"),
]


@pytest.mark.parametrize(("name", "messages", "kwargs", "expected"), EXACT)
def test_render_exact_text(name, messages, kwargs, expected):
    assert (
        render(template(name), messages, special_tokens=SPECIAL, date=PINNED, **kwargs) == expected
    )


def test_default_date_is_today_like_transformers(tokenizer):
    text = template("llama3_date_header")
    before = render(text, CHAT, special_tokens=SPECIAL)
    reference = hf_render(tokenizer, text, CHAT)
    after = render(text, CHAT, special_tokens=SPECIAL)  # guards against crossing midnight
    assert reference in (before, after)
    assert f"Today Date: {datetime.date.today():%d %b %Y}" in after


@pytest.mark.parametrize(
    "day", [datetime.date(1999, 12, 31), datetime.datetime(1999, 12, 31, 23, 59)]
)
def test_strftime_now_renders_the_pinned_date_at_midnight(day):
    text = "{{ strftime_now('%Y-%m-%d %H:%M:%S %a') }}"
    assert render(text, CHAT, date=day) == "1999-12-31 00:00:00 Fri"


REFUSE = "chat template refused the input at line {}: {}; change the messages to fit the template"
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
MISTRAL_ALTERNATE = (
    "After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant..."
)
MISTRAL_ROLES = (
    "Only user and assistant roles are supported, "
    "with the exception of an initial optional system message!"
)
TWO_CALLS = [CHAT[1], {"role": "assistant", "tool_calls": [CALL, CALL]}]
REFUSED = [
    P("gemma_system_in_user", [CHAT[1], CHAT[1]], REFUSE.format(15, ALTERNATE), id="gemma"),
    P("mistral_strict_roles", [CHAT[2]], REFUSE.format(11, MISTRAL_ALTERNATE), id="mistral-order"),
    P(
        "mistral_strict_roles",
        [CHAT[1], {"role": "tool"}],
        REFUSE.format(22, MISTRAL_ROLES),
        id="role",
    ),
    P("llama2_bos_eos", [CHAT[1], CHAT[1]], REFUSE.format(1, ALTERNATE), id="llama2"),
    P(
        "llama3_date_header",
        TWO_CALLS,
        REFUSE.format(72, "This model only supports single tool-calls at once!"),
        id="llama3",
    ),
]


@pytest.mark.parametrize(("name", "messages", "expected"), REFUSED)
def test_raise_exception_becomes_template_error(tokenizer, name, messages, expected):
    with pytest.raises(TemplateError) as caught:
        render(template(name), messages, special_tokens=SPECIAL)
    assert str(caught.value) == expected
    with pytest.raises(jinja2.TemplateError) as reference:  # transformers refuses the same input
        hf_render(tokenizer, template(name), messages)
    assert f": {reference.value};" in expected


COMPILE = (
    "chat template does not compile at line {}: {}; "
    "fix the template, or use only the jinja2 features transformers supports"
)
FAILED = "chat template failed at line {}: {}; fix the template or the inputs it reads"
UNDERSCORE = (
    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
    "but got '_x'. Please rename the attribute."
)
UNSUPPORTED = [
    P("{{ 1 | shout }}", COMPILE.format(1, "No filter named 'shout'."), id="unknown-filter"),
    P("{{ 1 is chatty }}", COMPILE.format(1, "No test named 'chatty'."), id="unknown-test"),
    P(
        "{% do messages.append(1) %}",
        COMPILE.format(1, "Encountered unknown tag 'do'."),
        id="unknown-tag",
    ),
    P(
        "a\n{% for m in messages %}{{ m }}",
        COMPILE.format(
            2,
            "Unexpected end of template. Jinja was looking for the following tags: 'endfor' or "
            "'else'. The innermost block that needs to be closed is 'for'.",
        ),
        id="unclosed-for",
    ),
    P(
        "x\n{% if messages %}{{ 1 | shout }}{% endif %}",
        FAILED.format(2, "TemplateRuntimeError: No filter named 'shout' found."),
        id="filter-in-branch",
    ),
    P(
        "{% if 1 is chatty %}x{% endif %}",
        FAILED.format(1, "TemplateRuntimeError: No test named 'chatty' found."),
        id="test-in-if",
    ),
    P(
        "{{ messages.append(1) }}",
        FAILED.format(1, "SecurityError: access to attribute 'append' of 'list' object is unsafe."),
        id="sandbox-mutation",
    ),
    P(
        "{% set ns = namespace(_x=1) %}",
        FAILED.format(1, f"SecurityError: {UNDERSCORE}"),
        id="namespace-underscore",
    ),
    P(
        "\n\n{{ messages[0].content.shout() }}",
        FAILED.format(3, "UndefinedError: 'str object' has no attribute 'shout'"),
        id="undefined-call",
    ),
    P(
        "{{ nothing | tojson }}",
        FAILED.format(1, "TypeError: Object of type Undefined is not JSON serializable"),
        id="tojson-undefined",
    ),
    P(
        "{% include 'other.jinja' %}",
        FAILED.format(1, "TypeError: no loader for this environment specified"),
        id="include",
    ),
]


@pytest.mark.parametrize(("text", "expected"), UNSUPPORTED)
def test_unsupported_template_raises_template_error(tokenizer, text, expected):
    with pytest.raises(TemplateError) as caught:
        render(text, CHAT)
    assert str(caught.value) == expected
    with pytest.raises((jinja2.TemplateError, TypeError)):  # transformers refuses it too
        hf_render(tokenizer, text, CHAT)


RUNAWAY = [
    P(
        "{{ 'a' * 1000000000 }}",
        "chat template asks for 1,000,000,000 items in one `*`, over 67,108,864; fix the template",
        id="string-times-a-billion",
    ),
    P(
        "{% set l = [1] * 30000 %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
        "chat template took over 1 s to render (a runaway loop?); fix the template",
        id="nested-loops",
    ),
    P(
        "{{ 7 ** 100000000 }}",
        "chat template asks for a number of over 65,536 bits in `**`; fix the template",
        id="huge-power",
    ),
    P(
        "{% for i in range(9000) %}{{ 'x' * 9000 }}{% endfor %}",
        "chat template rendered 81,000,000 characters, over the 67,108,864 a prefix may have; "
        "fix the template",
        id="huge-output",
    ),
]


@pytest.mark.parametrize(("text", "expected"), RUNAWAY)
def test_a_runaway_template_is_one_error_not_a_hang_or_all_memory(text, expected, monkeypatch):
    """A template is code from a model repo: a render that would run for hours or take
    gigabytes is one TemplateError (before: `build` hung, 6.4 GB resident for 'a' * 10**9)."""
    monkeypatch.setattr(template_module, "RENDER_SECONDS", 1)
    with pytest.raises(TemplateError) as caught:
        render(text, CHAT)
    assert str(caught.value) == expected


BATCH = "messages[0] is " + repr(CHAT)[:80] + "; pass message dicts"
BAD_INPUTS = [
    P([], {}, "messages is []; pass a non-empty list of message dicts", id="no-messages"),
    P([CHAT, CHAT], {}, BATCH, id="batch"),
    P(
        CHAT,
        {"tools": [print]},
        "tools[0] is builtin_function_or_method, not a JSON-schema dict; "
        'pass {"type": "function", "function": {...}} dicts',
        id="callable-tool",
    ),
    P(
        CHAT,
        {"documents": ["text"]},
        "documents[0] is a str; pass dicts with 'title', 'text'",
        id="str-document",
    ),
    P(
        CHAT,
        {"extra": {"messages": []}},
        "extra variable 'messages' is not allowed; "
        "pass messages, tools, documents, add_generation_prompt as args",
        id="reserved-extra",
    ),
    P(
        CHAT,
        {"special_tokens": {"bos_token": 1}},
        "special token bos_token=1 is not a string; pass its text",
        id="token-not-str",
    ),
]


@pytest.mark.parametrize(("messages", "kwargs", "expected"), BAD_INPUTS)
def test_bad_inputs_raise_template_error(messages, kwargs, expected):
    with pytest.raises(TemplateError) as caught:
        render("{{ messages }}", messages, **kwargs)
    assert str(caught.value) == expected


@pytest.mark.parametrize(
    ("text", "digest"),
    [
        ("", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        ("é", "4a99557e4033c3539de2eb65472017cad5f9557f7a0625a09f1c3f6e2ba69c4c"),
    ],
)
def test_template_sha256(text, digest):
    assert template_sha256(text) == digest


def test_check_pin_accepts_matching_hash_in_any_case():
    text = template("llama2_bos_eos")
    check_pin(text, template_sha256(text), "tests/templates/llama2_bos_eos.jinja")
    check_pin(text, template_sha256(text).upper(), "tests/templates/llama2_bos_eos.jinja")


def test_check_pin_mismatch_shows_both_hashes_and_source():
    text = "{{ bos_token }}"
    actual = hashlib.sha256(text.encode("utf-8")).hexdigest()
    expected = "0" * 64
    with pytest.raises(TemplateError) as caught:
        check_pin(text, expected, "model/tokenizer_config.json")
    assert str(caught.value) == (
        f"chat template model/tokenizer_config.json: sha256 mismatch (expected {expected}, "
        f'got {actual}); review the template change, then pin sha256 = "{actual}" '
        "or restore the old template"
    )


USES_DATE = [
    P("llama3_date_header", {}, True, id="llama3"),
    P("llama3_date_header", {"extra": {"date_string": "26 Jul 2024"}}, False, id="llama3-datestr"),
    P("qwen3_chatml_tools_think", {"tools": TOOLS}, False, id="chatml"),
    P("gemma_system_in_user", {"date": PINNED}, False, id="gemma"),
]


@pytest.mark.parametrize(("name", "kwargs", "expected"), USES_DATE)
def test_uses_date(name, kwargs, expected):
    assert uses_date(template(name), CHAT, special_tokens=SPECIAL, **kwargs) is expected


def test_uses_date_sees_a_clock_that_only_reads_the_time():
    assert uses_date("{{ strftime_now('%H:%M') }}", CHAT) is True
