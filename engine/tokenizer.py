"""Byte-level BPE tokenizer of the Qwen2 / Qwen3.5 family, loaded from the pack's `tokenizer.txt`.

The reference is transformers' Qwen2Tokenizer / Qwen3_5Tokenizer (HF tokenizers underneath); encode
reproduces its pipeline step by step:

    added tokens matched as whole strings (leftmost-longest) on the raw text
    -> NFC on each stretch between them
    -> the pre-tokenizer regex splits a stretch into words (`pre`: qwen2 or qwen35)
    -> each word's UTF-8 bytes become GPT-2 byte symbols, merged by BPE rank (lowest first, leftmost
       on ties), the result looked up in the vocabulary.

Token texts in the flat form are the GGUF strings: NORMAL tokens are GPT-2 byte-to-unicode strings
(" the" is stored as "Ġthe"), CONTROL and USER_DEFINED tokens are their literal text. BPE works on the
stored strings' UTF-8 bytes directly (no conversion of the 248k merges at load); only decode needs raw
bytes, converted once per NORMAL token at load.

Known divergence: the word classes \\p{L}, \\p{N}, \\p{M} follow the `regex` package's Unicode tables
(17.0 in regex 2026.x) where HF tokenizers' Oniguruma is at Unicode 16.0, so text containing
characters first assigned in Unicode 17 (2025) can split differently. Everything assigned earlier
splits identically (checked over every code point when this was written).

Chat templates (`apply_chat_template`): the pack's own template is the truth, rendered with jinja2
(a dependency) in a sandbox configured as transformers' is, with the variables transformers passes
(messages, add_generation_prompt, the special tokens, and the caller's, e.g. enable_thinking). No
built-in stand-in: plain ChatML is not faithful even for ChatML-family templates (Qwen2.5's adds a
default system prompt, Qwen3.5's trims contents and opens the answer with "<think>\\n"), so a pack
without a template is refused for chat, saying so.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

import regex

from strata.index_format.errors import FormatError, Phrase
from strata.index_format.tokenizer_flat import FlatTokenizer, read_tokenizer

# The split regexes of tokenizer.json (transformers' tokenization_qwen2.py / tokenization_qwen3_5.py),
# keyed by the GGUF `tokenizer.ggml.pre` names llama.cpp gives them. qwen35 adds \p{M} to words.
_QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN35 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
PRE_TOKENIZERS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "qwen35": _QWEN35}

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)  # GGUF token types
_STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")  # end-of-generation besides eos, as llama.cpp's EOG list
_CACHE_WORDS = 1 << 16  # BPE results kept per word; cleared when full (a server sees unbounded text)
_JINJA2_MIN = (3, 1, 6)  # older jinja2 has sandbox escapes; templates come from downloaded packs


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the
    other 68 bytes (controls, space, NBSP, soft hyphen) to U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _gpt2_byte_chars()
_BYTE_SYMBOLS = [c.encode("utf-8") for c in _BYTE_CHARS]  # the BPE start symbol of each byte
# str.translate table back to bytes (as Latin-1 chars); any character outside the 256 becomes
# U+FFFF, which Latin-1 cannot encode, so a corrupt token fails loudly instead of losing a byte.
_UNMAP = {ord(c): chr(b) for b, c in enumerate(_BYTE_CHARS)} | {b: "\uffff" for b in range(256) if _BYTE_CHARS[b] != chr(b)}
# The stdlib `re` scans a negated class about 8x faster than `regex` (18 ms for 248k tokens).
_NOT_GPT2 = re.compile("[^" + re.escape("".join(_BYTE_CHARS)) + "]")


def _gpt2_to_bytes(text: bytes) -> bytes | None:
    """The raw bytes a NORMAL token's GPT-2 text stands for; None if it is not such a text."""
    try:
        return text.decode("utf-8").translate(_UNMAP).encode("latin-1")
    except UnicodeError:
        return None


class Tokenizer:
    """encode / decode / chat template for one pack. Build with `Tokenizer.load(path)`."""

    def __init__(self, flat: FlatTokenizer, source: str | os.PathLike = "<tokenizer>"):
        self.source = os.fspath(source)
        self._refuse_unsupported(flat)
        self.n_vocab = len(flat.tokens)
        self._split = regex.compile(PRE_TOKENIZERS[flat.pre])
        self._vocab = self._normal_vocab(flat)
        self._ranks = self._merge_ranks(flat)
        self._check_normal_texts(flat)
        self._texts, self._types = flat.tokens, flat.token_types
        # Raw bytes per id, converted from the GPT-2 text on first use: decode touches few ids.
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._added = self._added_texts(flat)
        self._matchers = {
            True: _alternation(self._added),
            False: _alternation({t: i for t, i in self._added.items() if self._types[i] == USER_DEFINED}),
        }
        self._cache: dict[str, tuple[int, ...]] = {}
        self.bos_id, self.eos_id, self.pad_id = (flat.special.get(k) for k in ("bos", "eos", "pad"))
        self.add_bos = flat.add_bos and self.bos_id is not None
        stops = {self._added[t] for t in _STOP_TEXTS if t in self._added and self._types[self._added[t]] == CONTROL}
        self.stop_ids = frozenset(stops | ({self.eos_id} if self.eos_id is not None else set()))
        self.chat_template = flat.chat_template
        self._compiled_template = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        return cls(read_tokenizer(path), path)

    # -- loading ----------------------------------------------------------------------------------

    def _error(self, field: str, found: object, expected: str, hint: str | None = None) -> FormatError:
        return FormatError(self.source, None, field, found, expected, hint)

    def _refuse_unsupported(self, flat: FlatTokenizer) -> None:
        if flat.model != "gpt2":
            raise self._error("model", flat.model, "gpt2 (byte-level BPE)")
        if flat.pre not in PRE_TOKENIZERS:
            names = ", ".join(sorted(PRE_TOKENIZERS))
            raise self._error("pre", flat.pre, f"one of {names}", "the pre-tokenizers this engine implements (Qwen2 / Qwen3.5 family)")
        if BYTE in flat.token_types:
            i = flat.token_types.index(BYTE)
            raise self._error(f"token {i} type", BYTE, "1..5", "BYTE tokens belong to SentencePiece vocabularies, not byte-level BPE")

    def _normal_vocab(self, flat: FlatTokenizer) -> dict[bytes, int]:
        normal = [i for i, kind in enumerate(flat.token_types) if kind == NORMAL]
        vocab = {flat.tokens[i]: i for i in normal}
        if len(vocab) != len(normal):
            first = next(i for i in normal if vocab[flat.tokens[i]] != i)
            raise self._error(f"token {vocab[flat.tokens[first]]}", flat.tokens[first].decode("utf-8", "replace"), f"a text no other NORMAL token has (token {first} has it too)")
        for b, symbol in enumerate(_BYTE_SYMBOLS):
            if symbol not in vocab:
                # Every byte must have a token, or some text has no encoding at all.
                raise self._error(f"byte 0x{b:02x}", Phrase("no NORMAL token"), f"a token {_BYTE_CHARS[b]!r} for every one of the 256 bytes")
        return vocab

    def _merge_ranks(self, flat: FlatTokenizer) -> dict[tuple[bytes, bytes], int]:
        # A repeated merge keeps its last rank, as HF tokenizers' merge map does.
        ranks = dict(zip(flat.merges, range(len(flat.merges))))
        vocab = self._vocab
        for k, (a, b) in enumerate(flat.merges):
            if a + b not in vocab:
                raise self._error(f"merge {k}", f"{a.decode('utf-8', 'replace')} {b.decode('utf-8', 'replace')}", "a pair whose concatenation is a NORMAL token")
        return ranks

    def _check_normal_texts(self, flat: FlatTokenizer) -> None:
        """Every NORMAL token must be a GPT-2 byte string; checked in one pass over all of them."""
        normal = [text for text, kind in zip(flat.tokens, flat.token_types) if kind == NORMAL]
        try:
            ok = _NOT_GPT2.search(b"".join(normal).decode("utf-8")) is None
        except UnicodeDecodeError:
            ok = False
        if not ok:
            for i, (text, kind) in enumerate(zip(flat.tokens, flat.token_types)):
                if kind == NORMAL and _gpt2_to_bytes(text) is None:
                    raise self._error(f"token {i}", text.decode("utf-8", "replace"), "a GPT-2 byte-level string (NORMAL tokens)")

    def _added_texts(self, flat: FlatTokenizer) -> dict[str, int]:
        """text -> id of the tokens matched as whole strings in text (CONTROL, USER_DEFINED)."""
        added = {}
        for i, (text, kind) in enumerate(zip(flat.tokens, flat.token_types)):
            if kind in (CONTROL, USER_DEFINED) and text:
                try:
                    added[text.decode("utf-8")] = i
                except UnicodeDecodeError:
                    raise self._error(f"token {i}", text, "UTF-8 text (CONTROL and USER_DEFINED tokens are matched in text)") from None
        return added

    # -- encode -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_special: prepend BOS when the pack says the model wants one (Qwen: never).
        parse_special: CONTROL tokens written in the text (<|im_start|>, ...) become their ids; with
        False only USER_DEFINED ones do (<think>, ...), so untrusted text cannot forge a turn.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode: found {type(text).__name__}, expected str")
        ids = [self.bos_id] if add_special and self.add_bos else []
        matcher, pos = self._matchers[parse_special], 0
        if matcher is not None:
            for m in matcher.finditer(text):
                self._encode_plain(text[pos : m.start()], ids)
                ids.append(self._added[m.group()])
                pos = m.end()
        self._encode_plain(text[pos:], ids)
        return ids

    def _encode_plain(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        cache = self._cache
        for word in self._split.findall(unicodedata.normalize("NFC", text)):
            got = cache.get(word)
            if got is None:
                if len(cache) >= _CACHE_WORDS:
                    cache.clear()
                got = cache[word] = self._bpe(word.encode("utf-8"))
            ids.extend(got)

    def _bpe(self, raw: bytes) -> tuple[int, ...]:
        """BPE of one word: repeatedly merge the adjacent pair of lowest rank, leftmost first.

        Symbols live in a linked list (nxt/prv by start index) with a heap of candidate merges, so a
        long word (a run of CJK letters is one word) costs n log n, not n^2. A heap entry is stale
        once either side has changed; it is then skipped (ranks are unique per pair, so the current
        pair's rank equal to the entry's means the entry is still that pair).
        """
        sym: list[bytes | None] = [_BYTE_SYMBOLS[b] for b in raw]
        n, ranks = len(sym), self._ranks
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        heap = [(r, i) for i in range(n - 1) if (r := ranks.get((sym[i], sym[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = nxt[i]
            if sym[i] is None or j >= n or ranks.get((sym[i], sym[j])) != r:
                continue
            sym[i], sym[j] = sym[i] + sym[j], None
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
            for left in (prv[i], i):
                right = nxt[left] if left >= 0 else n
                if left >= 0 and right < n and (r2 := ranks.get((sym[left], sym[right]))) is not None:
                    heapq.heappush(heap, (r2, left))
        vocab = self._vocab
        return tuple(vocab[s] for s in sym if s is not None)

    # -- decode -----------------------------------------------------------------------------------

    def piece(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes token `token_id` stands for (a piece of UTF-8, not always a whole character)."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} outside the vocabulary 0..{self.n_vocab - 1}")
        kind = self._types[token_id]
        if skip_special and kind in (CONTROL, UNKNOWN):
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            text = self._texts[token_id]
            piece = self._pieces[token_id] = _gpt2_to_bytes(text) if kind == NORMAL else b"" if kind == UNUSED else text
        return piece

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.piece(i, skip_special) for i in ids).decode("utf-8", "replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True, **template_vars) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]), as transformers'
        apply_chat_template(tokenize=False) renders it; encode it with parse_special=True.
        `template_vars` (e.g. enable_thinking=False) reach the template."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the pack has no chat template (its GGUF has no tokenizer.chat_template), "
                             "so chat turns cannot be rendered; give the prompt already formatted, without --chat")
        import jinja2

        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        specials = {k: self.piece(i).decode("utf-8", "replace") for k, i in names.items() if i is not None}
        try:
            if self._compiled_template is None:
                self._compiled_template = _compile_jinja2(self.chat_template)
            return self._compiled_template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **specials, **template_vars
            )
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a template that does not parse
            raise ValueError(f"{self.source}: chat template: {e}") from None


class StreamDecoder:
    """Decodes generated tokens one at a time, returning text only once its UTF-8 is complete.

    A character split over tokens (CJK, emoji: 3-4 bytes, often 2 tokens) is held back until its last
    byte arrives. `push` texts then `flush` concatenate to exactly `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer, self._skip = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.piece(token_id, self._skip))

    def flush(self) -> str:
        """The held-back tail, at the end of generation: an incomplete character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _alternation(texts: Mapping[str, int]):
    # Longest first: at one position the longest token wins, as HF's leftmost-longest matcher does.
    if not texts:
        return None
    return regex.compile("|".join(regex.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _compile_jinja2(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(x) for x in regex.findall(r"\d+", jinja2.__version__)[:3])
    if version < _JINJA2_MIN:
        raise ValueError(f"chat template: jinja2 {jinja2.__version__} has known sandbox escapes; install jinja2>=3.1.6")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(*args, **kwargs):
        # Only tool schemas and tool-call arguments use it; the engine serialises no JSON (the layering rule).
        raise jinja2.exceptions.TemplateError("chat template: tojson (tools, tool-call arguments) is not supported by the engine")

    # As transformers renders chat templates: trimmed blocks, loop controls, raise_exception.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
