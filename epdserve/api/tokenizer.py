"""The front end's tokenizer: Hugging Face ``tokenizers`` plus the checkpoint's jinja chat template.

The front end only renders, encodes and decodes; importing transformers for that costs seconds of
startup, so this reads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, template) and
renders the template the way transformers does (sandboxed jinja, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``tojson``, ``strftime_now``). tests/test_tokenizer.py holds it to
transformers' ``AutoTokenizer`` on the same checkpoint.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from epdserve.models.config import check_model_dir

CHUNK_CHARS = 1 << 14  # text per tokenizer call while a long prompt is counted (each call holds the GIL)
CUT_MARGIN = 8  # tokens one cut between chunks may add to their sum over the whole text's count
# normalizers that can shorten text, and by at most what factor in UTF-8 bytes (composition merges a
# few code points into one; case folding maps e.g. the Kelvin sign to ``k``)
_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 4, "Prepend": 1}


class TemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or could not render."""


class TooManyTokens(ValueError):
    """The text holds at least ``at_least`` tokens, more than the ``limit`` it was encoded under."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"at least {at_least} tokens, over the limit of {limit}")
        self.at_least, self.limit = at_least, limit


class FastTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        check_model_dir(d, tokenizer=True)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template = self._template(d)
        specials = [
            t for t in json.loads((d / "tokenizer.json").read_text()).get("added_tokens", []) if t.get("special")
        ]
        self.all_special_ids = sorted({int(t["id"]) for t in specials})
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token = eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.bytes_per_token = _bytes_per_token(json.loads((d / "tokenizer.json").read_text()), self._tok)

    def _template(self, d: Path) -> str | None:
        t = self.config.get("chat_template")
        if isinstance(t, str):
            return t
        if (d / "chat_template.jinja").exists():
            return (d / "chat_template.jinja").read_text()
        return None

    @cached_property
    def _compiled(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        if self.chat_template is None:
            raise TemplateError("the checkpoint has no chat template")
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template does not compile: {e}") from e

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any
    ) -> str:
        """The rendered prompt text (``tokenize`` must be False: encode it with ``encode``)."""
        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only")
        import jinja2

        specials = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in self.config.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        try:
            return str(
                self._compiled.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **specials, **kwargs
                )
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_within(self, text: str, limit: int) -> list[int]:
        """``encode(text)``, or ``TooManyTokens`` without encoding it all when it holds more than
        ``limit`` tokens: the cost of refusing a long text is that of ``limit`` tokens, not of the text.

        First a bound from the length alone: no token covers more than ``bytes_per_token`` bytes of
        the text. Then a long text is counted chunk by chunk, each call short (other threads get
        the GIL between them), stopping once the count passes the limit: chunks are cut where the
        pre-tokenizer splits (a line break or a space before a word), so their counts add up to the
        whole text's; ``CUT_MARGIN`` per cut keeps a cut elsewhere from refusing a text that fits.
        Only a text found to fit is encoded whole."""
        if self.bytes_per_token:
            at_least = -(-len(text.encode("utf-8", "surrogatepass")) // self.bytes_per_token)
            if at_least > limit:
                raise TooManyTokens(at_least, limit)
        if len(text) > CHUNK_CHARS:
            count, cuts, start = 0, 0, 0
            while start < len(text):
                end = _cut(text, start + CHUNK_CHARS)
                count += len(self._tok.encode(text[start:end], add_special_tokens=False).ids)
                if count > limit + CUT_MARGIN * cuts:
                    raise TooManyTokens(max(limit + 1, count - CUT_MARGIN * cuts), limit)
                start, cuts = end, cuts + 1
        ids = self.encode(text)
        if len(ids) > limit:
            raise TooManyTokens(len(ids), limit)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return str(self._tok.id_to_token(token_id))


def _cut(text: str, at: int) -> int:
    """Where to end a chunk near ``at``: after a line break, else before a space that starts a
    word, else at ``at`` (within the next ``CHUNK_CHARS // 4`` characters)."""
    if at >= len(text):
        return len(text)
    stop = min(len(text) - 1, at + CHUNK_CHARS // 4)
    nl = text.find("\n", at, stop)
    while nl != -1 and text[nl + 1].isspace():
        nl = text.find("\n", nl + 1, stop)
    if nl != -1:
        return nl + 1
    sp = text.find(" ", at, stop)
    while sp != -1 and not (text[sp + 1].isalpha() and not text[sp - 1].isspace()):
        sp = text.find(" ", sp + 1, stop)
    return sp if sp != -1 else at


def _bytes_per_token(spec: dict[str, Any], tok: Tokenizer) -> int:
    """The most bytes of input text one token can stand for; 0 when it cannot be bounded.

    A BPE token's text is at least as long in UTF-8 as what it covers (byte-level symbols, ``▁``
    for a space and ``<0x..>`` byte fallbacks are all longer); added tokens match their own text.
    A fused unknown token or a shortening normalizer we do not know could cover any length."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token")):
        return 0
    norm = spec.get("normalizer")
    steps = norm.get("normalizers", []) if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm]
    factor = 1
    for step in steps:
        if step is None:
            continue
        shrink = _SHRINK.get(str(step.get("type")))
        if shrink is None:
            return 0
        factor *= shrink
    longest = max((len(t.encode("utf-8")) for t in tok.get_vocab(with_added_tokens=True)), default=0)
    return longest * factor
