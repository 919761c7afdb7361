"""The engine tokenizer against transformers' own Qwen2 / Qwen3.5 tokenizers.

A real byte-level BPE is trained here (HF tokenizers) on a generated corpus with CJK, Hangul,
Devanagari (combining marks), emoji, digits, punctuation and whitespace runs; its vocabulary and
merges go to the flat form the way strata-pack writes it (GGUF token strings -> UTF-8 bytes, types as
llama.cpp's converter assigns them), and transformers' Qwen2Tokenizer / Qwen3_5Tokenizer built from
the same vocabulary and merges is the reference for every id.

Text is drawn from characters assigned in this Python's Unicode tables (excluding category Cn): the
`regex` package knows Unicode 17 where HF's Oniguruma stops at 16 (see engine/tokenizer.py).
"""

import json
import random
import unicodedata

import pytest

pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AddedToken
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

import strata.engine.tokenizer as tokenizer_module
from strata.engine.tokenizer import Tokenizer
from strata.index_format.errors import FormatError
from strata.index_format.tokenizer_flat import FlatTokenizer, write_tokenizer

pytestmark = pytest.mark.reference

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
OVERLAPPING = ["<tool", "<tool_call>"]  # leftmost-longest: "<tool_call>" must win over its prefix
REFERENCE = {"qwen2": Qwen2Tokenizer, "qwen35": Qwen3_5Tokenizer}


def _corpus(seed=0, n=3000):
    rnd = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "it's", "don't", "WE'LL", "they're",
             "I'VE", "naïve", "café", "straße", "привет", "мир", "hello", "world", "token", "stream"]
    fragments = [
        lambda: rnd.choice(words),
        lambda: "".join(chr(rnd.randint(0x4E00, 0x4E00 + 120)) for _ in range(rnd.randint(1, 6))),  # CJK
        lambda: "".join(chr(rnd.randint(0xAC00, 0xAC00 + 80)) for _ in range(rnd.randint(1, 4))),  # Hangul
        lambda: rnd.choice(["😀", "🚀", "👍🏽", "👨‍👩‍👧", "🦙", "✅"]) * rnd.randint(1, 3),
        lambda: str(rnd.randint(0, 10 ** rnd.randint(1, 8))),
        lambda: rnd.choice(["...", "!!", "?!", "--", "==", "```", "()", "{}", "»", "«", "：", "，", "。", "'", '"']),
        lambda: "".join(rnd.choice("कखगमनहि्ािीु") for _ in range(rnd.randint(2, 6))),  # marks inside words
        lambda: rnd.choice(["\n", "\n\n", "\t", " \t ", "   ", "\r\n", "    \n"]),
    ]
    weights = [35, 20, 7, 6, 8, 8, 6, 10]
    for _ in range(n):
        parts = [rnd.choices(fragments, weights)[0]() for _ in range(rnd.randint(3, 15))]
        yield "".join(p + rnd.choice([" ", " ", " ", "", "  ", "\n"]) for p in parts)


@pytest.fixture(scope="module")
def trained():
    """(vocab, merges) of a byte-level BPE trained with the Qwen3.5 split, as in tokenizer.json."""
    split = pre_tokenizers.Split(Regex(tokenizer_module.PRE_TOKENIZERS["qwen35"]), behavior="isolated")
    hf = HFTokenizer(models.BPE())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(list(_corpus()), trainer)
    model = json.loads(hf.to_str())["model"]
    assert len(model["merges"]) > 2000  # the corpus is rich enough for merges to matter
    return model["vocab"], [tuple(m) for m in model["merges"]]


def _reference(trained, pre):
    vocab, merges = trained
    hf = REFERENCE[pre](vocab=dict(vocab), merges=list(merges))
    hf.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in [USER_DEFINED] + OVERLAPPING])
    return hf


def _flat(hf, pre, **overrides):
    """The flat form strata-pack writes: llama.cpp's get_vocab_base types, token strings as UTF-8."""
    by_id = {i: t for t, i in hf.get_vocab().items()}
    added = hf.added_tokens_decoder
    tokens, types = [], []
    for i in range(len(by_id)):
        tokens.append(by_id[i].encode("utf-8"))
        types.append((3 if added[i].special else 4) if i in added else 1)
    model = json.loads(hf.backend_tokenizer.to_str())["model"]
    merges = [(a.encode("utf-8"), b.encode("utf-8")) for a, b in model["merges"]]
    fields = dict(model="gpt2", pre=pre, tokens=tokens, token_types=types, merges=merges,
                  special={"eos": hf.convert_tokens_to_ids("<|im_end|>")}, add_bos=False, chat_template=None)
    return FlatTokenizer(**(fields | overrides))


@pytest.fixture(scope="module", params=["qwen2", "qwen35"])
def pair(request, trained):
    """(ours, reference) for one pre-tokenizer."""
    hf = _reference(trained, request.param)
    return Tokenizer(_flat(hf, request.param)), hf


CASES = [
    "",
    "Hello world",
    "a  b\n\n\t c",
    "   leading and trailing   ",
    "\n\n\n",
    " ",
    "\t\t x \r\n\r\ny",
    "我想在apple工作1314151天～",
    "数学 物理 化学 日本語のテキスト 한국어 문장",
    "😀🚀 👍🏽 👨‍👩‍👧 🦙🦙🦙 ✅",
    "12345 3.14159 1,000,000 007",
    "it's I'LL WE'VE they'Re 'd 's",
    "?!?! ... ``` ----====== «quote» ：，。",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|im_end|><|im_end|>y<|endoftext|>",
    "<|im_start <|im_end| <|im_start|",
    "<think>plan</think> answer <think>",
    "<tool_call>x<tool y <tool_cal <tool_call",
    "cafe\u0301 nai\u0308ve",  # NFC composes these
    "नमस्ते हिन्दी किताब",
    "\u00a0nbsp\u3000ideographic\u2028line",
    "the" * 400,
    "我" * 700 + "想",
    " " * 300 + "x",
]


@pytest.mark.parametrize("text", CASES, ids=range(len(CASES)))
def test_encode_matches_transformers(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_corpus_text_encodes_identically(pair):
    ours, hf = pair
    for text in _corpus(seed=1, n=300):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


_TEXT = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=20),
        st.text(st.sampled_from("the fox它们数学 \n\t\r😀'sLL0123456789.!?्ाक"), max_size=30),
        st.sampled_from(SPECIAL + OVERLAPPING + [USER_DEFINED, "<|im_", "_call>", "'S", "  ", "\r\n"]),
    ),
    max_size=8,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_generated_text_encodes_identically_and_round_trips(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    # The reference normalises to NFC before splitting, so a round trip gives the NFC form.
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_parse_special_false_spells_control_tokens_out(pair, text):
    ours, hf = pair
    assert ours.encode(text, parse_special=False) == hf.encode(text, add_special_tokens=False, split_special_tokens=True)


def test_word_cache_eviction_keeps_results(pair, monkeypatch):
    ours, hf = pair
    monkeypatch.setattr(tokenizer_module, "_CACHE_WORDS", 3)
    text = " ".join(_corpus(seed=2, n=20))
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert len(ours._cache) <= 3


def test_add_special_prepends_bos_only_when_the_pack_asks(trained):
    hf = _reference(trained, "qwen2")
    bos = hf.convert_tokens_to_ids("<|endoftext|>")
    with_bos = Tokenizer(_flat(hf, "qwen2", special={"bos": bos}, add_bos=True))
    plain = hf.encode("hi there", add_special_tokens=False)
    assert with_bos.encode("hi there") == [bos] + plain
    assert with_bos.encode("hi there", add_special=False) == plain
    assert Tokenizer(_flat(hf, "qwen2", special={"bos": bos})).encode("hi there") == plain


# -- decode ---------------------------------------------------------------------------------------


def test_decode_matches_transformers(pair):
    ours, hf = pair
    rnd = random.Random(4)
    for _ in range(200):
        ids = [rnd.randrange(ours.n_vocab) for _ in range(rnd.randint(0, 30))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_skip_special_drops_control_tokens_but_keeps_user_defined(pair):
    ours, hf = pair
    ids = ours.encode("<|im_start|>user\n<think>x<|im_end|>")
    assert ours.decode(ids, skip_special=True) == "user\n<think>x"
    assert ours.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_replaces_invalid_utf8():
    flat_tokens = _byte_level_flat()
    tok = Tokenizer(flat_tokens)
    lead = tok.encode("é")  # one token per byte in this merge-less vocabulary: 0xC3 0xA9
    assert len(lead) == 2
    assert tok.decode(lead[:1]) == "\ufffd"
    assert tok.decode(lead[:1] + tok.encode("a")) == "\ufffda"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_decoder_equals_full_decode(pair, data):
    ours, _ = pair
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, ours.n_vocab - 1), max_size=40),
        _TEXT.map(ours.encode),
    ))
    stream = ours.stream()
    out = [stream.push(i) for i in ids]
    out.append(stream.flush())
    assert "".join(out) == ours.decode(ids)


def test_stream_decoder_holds_back_a_split_character():
    tok = Tokenizer(_byte_level_flat())
    ids = tok.encode("😀!")  # 4 byte tokens for the emoji, then '!'
    stream = tok.stream()
    assert [stream.push(i) for i in ids] == ["", "", "", "😀", "!"]
    assert stream.flush() == ""
    cut = tok.stream()
    assert [cut.push(i) for i in ids[:2]] == ["", ""]
    assert cut.flush() == "\ufffd"


def test_stop_ids_are_eos_and_the_end_of_turn_tokens(pair):
    ours, hf = pair
    assert ours.stop_ids == {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}


# -- loading --------------------------------------------------------------------------------------


def _byte_level_flat(**overrides):
    """256 byte tokens, no merges, ChatML control tokens."""
    tokens = [c.encode("utf-8") for c in tokenizer_module._BYTE_CHARS] + [t.encode() for t in SPECIAL]
    fields = dict(model="gpt2", pre="qwen35", tokens=tokens, token_types=[1] * 256 + [3] * 3, merges=[],
                  special={"eos": 258}, add_bos=False, chat_template=None)
    return FlatTokenizer(**(fields | overrides))


def test_load_from_the_flat_file(tmp_path, pair):
    ours, hf = pair
    flat = _flat(hf, "qwen35" if isinstance(hf, Qwen3_5Tokenizer) else "qwen2")
    write_tokenizer(tmp_path / "tokenizer.txt", flat)
    loaded = Tokenizer.load(tmp_path / "tokenizer.txt")
    text = "数学 it's 😀 <|im_start|>x"
    assert loaded.encode(text) == ours.encode(text) == hf.encode(text, add_special_tokens=False)


def _bad(field_match, **overrides):
    with pytest.raises(FormatError, match=field_match) as err:
        Tokenizer(_byte_level_flat(**overrides), "pack/tokenizer.txt")
    assert "pack/tokenizer.txt" in str(err.value)


def test_unknown_pre_tokenizer_is_refused():
    _bad("field pre: found 'llama-bpe', expected one of deepseek-r1-qwen, qwen2, qwen35", pre="llama-bpe")


def test_a_missing_byte_token_is_refused():
    tokens = [c.encode("utf-8") for c in tokenizer_module._BYTE_CHARS]
    tokens[0x41] = b"<|A|>"  # 'A' no longer has a token
    _bad("byte 0x41", tokens=tokens + [t.encode() for t in SPECIAL])


def test_a_merge_without_its_token_is_refused():
    _bad("field merge 0: found 'a b'", merges=[(b"a", b"b")])


def test_a_normal_token_that_is_not_gpt2_text_is_refused():
    tokens = [c.encode("utf-8") for c in tokenizer_module._BYTE_CHARS] + [t.encode() for t in SPECIAL] + [b"a b"]
    # A raw space is not a GPT-2 character (space is stored as U+0120), so this token is corrupt.
    _bad("field token 259: found 'a b'", tokens=tokens, token_types=[1] * 256 + [3] * 3 + [1])


def test_a_normal_text_held_by_two_tokens_is_refused():
    tokens = [c.encode("utf-8") for c in tokenizer_module._BYTE_CHARS] + [t.encode() for t in SPECIAL] + [b"a"]
    _bad(r"field token 259: found 'a', expected a text no other NORMAL token has \(token 97 has it too\)", tokens=tokens, token_types=[1] * 256 + [3] * 3 + [1])


def test_byte_tokens_are_refused():
    _bad("BYTE tokens belong to SentencePiece", token_types=[1] * 256 + [3, 3, 6])


# -- chat template --------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A reduced Qwen3-style template: default system prompt, reasoning stripped from past turns, thinking switch.
QWEN_LIKE = """{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""
# Written here in the shape of Qwen3.5's template (a content macro, a namespace found by a reversed
# loop, |trim, raise_exception, reasoning kept only after the last user turn, the thinking switch),
# so CI exercises the same jinja2 features; the released templates themselves are compared below
# when STRATA_CHAT_TEMPLATES names a folder of them.
QWEN35_SHAPED = """{%- macro text(content) %}
    {%- if content is string %}{{- content }}{%- elif content is none %}{{- '' }}{%- else %}{{- raise_exception('Unexpected content type.') }}{%- endif %}
{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + text(messages[0].content)|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
    {%- if ns.last_user < 0 and message.role == 'user' %}{%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = text(message.content)|trim %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1]|trim %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != 'system' or not loop.first %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "数学?"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n是的 "}, {"role": "user", "content": " 😀 again\n"}],
]


def _chat_pair(trained, template):
    hf = _reference(trained, "qwen35")
    hf.chat_template = template
    return Tokenizer(_flat(hf, "qwen35", chat_template=template)), hf


@pytest.mark.parametrize("template", [CHATML, QWEN_LIKE, QWEN35_SHAPED], ids=["chatml", "qwen-like", "qwen35-shaped"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja2_rendering_matches_transformers(trained, template, conversation, add_generation_prompt):
    ours, hf = _chat_pair(trained, template)
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_template_variables_reach_the_template(trained):
    ours, hf = _chat_pair(trained, QWEN_LIKE)
    messages = CONVERSATIONS[0]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert ours.apply_chat_template(messages, enable_thinking=False) == expected
    assert expected.endswith("<think>\n\n</think>\n\n")


def _released_templates():
    """Released chat templates: Qwen3's and Qwen3.5's (llama.cpp keeps copies of the models'
    tokenizer_config.json chat_template in models/templates/, taken from the llama-cpp-python sdist
    that tests/reference/convert.py fetches), or the *.jinja files of the folder STRATA_CHAT_TEMPLATES
    names. They are the models' files, not ours, so the repository does not carry them."""
    import os
    from pathlib import Path

    from reference.convert import ConverterError, converter_dir

    folder = os.environ.get("STRATA_CHAT_TEMPLATES")
    if folder:
        paths = sorted(Path(folder).glob("*.jinja"))
        assert paths, f"STRATA_CHAT_TEMPLATES={folder}: no *.jinja files"
    else:
        try:
            templates = converter_dir() / "models" / "templates"
        except ConverterError as e:
            return [pytest.param(None, marks=pytest.mark.skip(reason=f"no released chat templates: {e}"))]
        paths = [templates / name for name in RELEASED_TEMPLATES]
    return [pytest.param(p.read_text(encoding="utf-8"), id=p.stem) for p in paths]


RELEASED_TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja")


CHAT_CASES = [  # (messages, add_generation_prompt, template variables)
    ([{"role": "user", "content": "Hi"}], True, {}),
    ([{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Why is the sky blue?"}], True, {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "数学?"}], True, {"enable_thinking": False}),
    ([{"role": "user", "content": "Hi"}], True, {"enable_thinking": True}),
    (CONVERSATIONS[1], False, {}),
    (CONVERSATIONS[1], True, {"enable_thinking": False}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], True, {}),
]


@pytest.mark.parametrize("template", [pytest.param(QWEN35_SHAPED, id="qwen35-shaped"), *_released_templates()])
@pytest.mark.parametrize("case", range(len(CHAT_CASES)))
def test_chat_templates_render_as_transformers_does(trained, template, case):
    messages, gen, variables = CHAT_CASES[case]
    ours, hf = _chat_pair(trained, template)
    expected = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **variables)
    assert ours.apply_chat_template(messages, gen, **variables) == expected


def test_a_pack_without_a_template_is_refused_for_chat():
    tok = Tokenizer(_byte_level_flat(chat_template=None))
    with pytest.raises(ValueError, match="has no chat template .* without --chat"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_a_template_that_raises_says_so_as_an_input_error(trained):
    ours, _ = _chat_pair(trained, QWEN35_SHAPED)
    with pytest.raises(ValueError, match="chat template: Unexpected message role"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])


def test_a_template_that_needs_json_is_refused(trained):
    ours, _ = _chat_pair(trained, "{{ messages | tojson }}")
    with pytest.raises(Exception, match="tojson"):
        ours.apply_chat_template(CONVERSATIONS[0])
